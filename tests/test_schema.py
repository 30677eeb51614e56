"""The declared-keys engine (app/schema.py, serial): one `check` for the deck, machine files
and study files, and the same message for the same mistake in any of them."""

from __future__ import annotations

import ast
import math
import re
import sys
from typing import Optional, Union

import pytest
import yaml

from app.deck import KEYS, load_deck
from app.errors import DeckError, InputError
from app.plan import machine
from app.plan.machine import MachineError, load_machine
from app.schema import REQUIRED, Key, Problem, check, check_value, shown, type_name
from conftest import REPO
from launch import study
from launch.study import StudyError, load_study

pytestmark = pytest.mark.timeout(120)

KEYS_OF_A_FILE = {
    "steps": Key(int, 100, "optimizer steps", min=1, max=10**9),
    "lr": Key(float, 3e-4, "peak learning rate", min=0.0, max=10.0),
    "name": Key(str, help="the run's name"),
    "kind": Key(str, "weak", "weak or strong", choices=("weak", "strong")),
    "gbs": Key(float, None, "bandwidth, GB/s", min=0, exclusive_min=True),
    "dp": Key(Union[int, str], "auto", "data-parallel degree", min=1, max=64, words=("auto",)),
    "stages": Key(Optional[list[int]], None, "layers per stage", min=1, max=8),
    "extra": Key(dict, None, "anything"),
}


def problem(raw: dict, **options) -> Problem:
    with pytest.raises(Problem) as err:
        check(raw, KEYS_OF_A_FILE, "test file f.yaml", **options)
    return err.value


# ---- the engine ---------------------------------------------------------------------------------


def test_a_good_mapping_comes_back_converted_with_only_the_keys_it_gives():
    out = check({"name": "a", "lr": 1, "steps": 5, "stages": [1, 2]}, KEYS_OF_A_FILE, "f")
    assert out == {"name": "a", "lr": 1.0, "steps": 5, "stages": [1, 2]}
    assert type(out["lr"]) is float  # an int is accepted for a float, as a float


def test_a_problem_names_the_file_the_key_the_value_and_what_is_expected():
    bad = problem({"name": "a", "steps": 0})
    assert (bad.file, bad.key, bad.value, bad.expected) == ("test file f.yaml", "steps", 0, "must be >= 1")
    assert str(bad) == "test file f.yaml: steps = 0: must be >= 1"
    assert str(problem({"name": "a", "steps": 0}, prefix="train.")) == "test file f.yaml: train.steps = 0: must be >= 1"


def test_unknown_keys_name_the_accepted_ones_and_a_close_match():
    bad = problem({"name": "a", "step": 5})
    assert bad.key == "step"
    assert "unknown key 'step'; accepted: steps, lr, name, kind, gbs, dp, stages, extra; did you mean 'steps'?" in str(
        bad
    )
    assert "did you mean" not in str(problem({"name": "a", "colour": 5}))
    assert "unknown section 'colour'" in str(problem({"colour": 5}, noun="section"))


def test_unknown_keys_come_before_missing_ones_and_missing_before_bad_values():
    assert "unknown key 'colour'" in str(problem({"colour": 1, "steps": -1}))
    bad = problem({"steps": -1})
    assert bad.key == "name" and str(bad) == "test file f.yaml: missing key(s) name (name: the run's name)"


def test_null_is_a_value_unless_the_file_kind_says_it_means_left_out():
    assert "a value is required (int)" in str(problem({"name": "a", "steps": None}))
    assert check({"name": "a", "stages": None}, KEYS_OF_A_FILE, "f") == {"name": "a", "stages": None}
    assert check({"name": "a", "steps": None}, KEYS_OF_A_FILE, "f", null_is_absent=True) == {"name": "a"}
    assert "missing key(s) name" in str(problem({"name": None}, null_is_absent=True))


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("steps", True, "expected int (optimizer steps)"),  # a bool is not an int
        ("steps", 2.0, "expected int"),
        ("steps", "5", "expected int"),
        ("lr", False, "expected float (peak learning rate)"),
        ("lr", "fast", "expected float"),
        ("name", 5, "expected str (the run's name)"),
        ("extra", [1], "expected mapping (anything)"),
        ("dp", "many", "expected int or 'auto'"),
        ("stages", 3, "expected list of int | null"),
    ],
)
def test_the_type_is_checked(key, value, expected):
    bad = problem({"name": "a", key: value})
    assert bad.key == key and bad.expected.startswith(expected), str(bad)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "Infinity", "1e999"])
def test_nan_and_inf_are_not_numbers(value):
    assert problem({"name": "a", "lr": value}).expected == "must be a finite number, 0.0 .. 10.0"
    assert problem({"name": "a", "gbs": value}).expected.startswith("must be")


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("steps", 10**9 + 1, "must be <= 1000000000"),
        ("steps", 2**70, "must be <= 1000000000"),
        ("lr", 10**400, "must be <= 10.0"),  # too large even to be a float
        ("lr", -0.1, "must be >= 0.0"),
        ("gbs", 0, "must be > 0"),
        ("gbs", 0.0, "must be > 0"),
        ("dp", 0, "must be >= 1"),
        ("kind", "medium", "accepted: weak, strong"),
    ],
)
def test_bounds_and_accepted_values(key, value, expected):
    assert problem({"name": "a", key: value}).expected == expected


def test_bounds_apply_to_each_item_of_a_list_named_by_its_index():
    bad = problem({"name": "a", "stages": [1, 9]})
    assert bad.key == "stages[1]" and bad.expected == "must be <= 8"
    assert problem({"name": "a", "stages": [1, "x"]}).key == "stages[1]"


def test_words_and_floats_written_without_a_dot_are_accepted():
    out = check({"name": "a", "dp": "auto", "lr": "3e-4", "gbs": 2}, KEYS_OF_A_FILE, "f")
    assert out == {"name": "a", "dp": "auto", "lr": 3e-4, "gbs": 2.0}
    assert check_value(KEYS_OF_A_FILE["dp"], 4, "dp") == 4


def test_text_keys_are_printable_and_paths_are_not_empty():
    key = Key(Optional[str], None, "a directory", text=True, path=True)
    assert check_value(key, "runs/é", "run.dir") == "runs/é"
    for value, expected in [
        ("a\x00b", "contains the control character '\\x00' at position 1"),
        ("x" * 5000, "5,000 characters; at most 4096"),
        ("runs/\udcff", "not valid UTF-8 text at position 5"),
        ("  ", "an empty path"),
    ]:
        with pytest.raises(Problem) as err:
            check_value(key, value, "run.dir", "f")
        assert expected in err.value.expected, err.value
    assert check_value(Key(str), "two\nlines\x00", "notes") == "two\nlines\x00"  # only `text` keys are held to it


def test_a_key_may_say_how_to_fix_a_value_of_the_wrong_type():
    key = Key(str, None, "job time limit", fix='quote it, e.g. "01:30:00"')
    with pytest.raises(Problem, match='time = 5400: quote it, e.g. "01:30:00"'):
        check_value(key, 5400, "time")


def test_messages_stay_one_short_line_whatever_the_file_held():
    assert shown("x" * 1000) == repr("x" * 1000)[:200] + "..."
    assert shown(10**5000) == f"<an int of {(10**5000).bit_length():,} bits>"
    # null, true and false as the YAML file spells them (not Python's None, True, False)
    assert (shown(None), shown(True), shown(False), shown(0), shown("null")) == ("null", "true", "false", "0", "'null'")
    assert len(str(problem({"name": "a", "k" * 10_000: "v" * 10_000}))) < 1000
    bad = problem({"name": "a", "n\x00" * 80: 1})
    assert "\x00" not in str(bad).split(":")[0] and len(str(bad).split(": ")[0]) < 200


def test_not_a_mapping():
    assert str(problem(["a"])) == "test file f.yaml: expected a mapping of the keys " + ", ".join(KEYS_OF_A_FILE)


def test_type_names():
    assert [type_name(t) for t in (int, float, str, bool, dict, list, list[int])] == [
        "int", "float", "str", "bool", "mapping", "list", "list of int"
    ]  # fmt: skip
    assert type_name(Optional[int]) == "int | null" and type_name(Union[int, str]) == "int | str"
    assert type_name(Optional[list[int]]) == "list of int | null" and type_name(float | None) == "float | null"
    assert Key(int).required and not Key(int, None).required and repr(REQUIRED) == "REQUIRED"


def test_the_engine_imports_only_the_standard_library():
    tree = ast.parse((REPO / "app" / "schema.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


# ---- the three file kinds go through it ---------------------------------------------------------


def test_every_file_kind_declares_its_keys_as_schema_keys():
    assert all(isinstance(key, Key) for keys in KEYS.values() for key in keys.values())
    assert all(isinstance(key, Key) for key in machine.FIELDS.values())
    assert all(isinstance(key, Key) for key in study.FIELDS.values())
    assert issubclass(DeckError, InputError) and issubclass(MachineError, InputError)
    assert issubclass(StudyError, InputError)


def deck_file(tmp_path, key: str, value) -> tuple:
    """A deck with `key` (section.name) set to `value`: (path, the key as the error names it)."""
    section, name = key.split(".")
    path = tmp_path / "deck.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 3}, section: {name: value}}))
    return path, key


def machine_file(tmp_path, key: str, value) -> tuple:
    raw = yaml.safe_load((REPO / "inputs" / "machines" / "local.yaml").read_text())
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump({**raw, key: value}))
    return path, key


def study_file(tmp_path, key: str, value) -> tuple:
    raw = {"name": "mini", "kind": "strong", "base": str(REPO / "inputs" / "gpt_tiny.yaml"), "machine": "local",
           "points": [1], "scale": {}, "description": "a test study"}  # fmt: skip
    path = tmp_path / "mini.yaml"
    path.write_text(yaml.safe_dump({**raw, key: value}))
    return path, key


def refusal(kind: str, path) -> InputError:
    load, error = {"deck": (load_deck, DeckError), "machine": (load_machine, MachineError),
                   "study": (load_study, StudyError)}[kind]  # fmt: skip
    with pytest.raises(error) as err:
        load(path)
    return err.value


# The same mistakes in the three kinds: (kind, how to write the file, unknown key, a key of another type).
KINDS = [
    ("deck", deck_file, "model.colour", "model.layers", "int"),
    ("machine", machine_file, "colour", "devices_per_node", "int"),
    ("study", study_file, "colour", "points", "list"),
]


@pytest.mark.parametrize("kind, write, unknown, typed, type_", KINDS, ids=[k[0] for k in KINDS])
def test_an_unknown_key_reads_the_same_in_a_deck_a_machine_and_a_study_file(
    tmp_path, kind, write, unknown, typed, type_
):
    path, key = write(tmp_path, unknown, "red")
    message = str(refusal(kind, path))
    assert str(path) in message, message
    assert f"{key} = 'red': unknown key 'colour'; accepted: " in message, message


@pytest.mark.parametrize("kind, write, unknown, typed, type_", KINDS, ids=[k[0] for k in KINDS])
def test_a_value_of_the_wrong_type_reads_the_same_in_every_file_kind(tmp_path, kind, write, unknown, typed, type_):
    path, key = write(tmp_path, typed, "many")
    message = str(refusal(kind, path))
    assert str(path) in message, message
    assert re.search(rf"(^|: ){re.escape(key)} = 'many': expected {type_} \(", message), message


@pytest.mark.parametrize(
    "kind, write, key", [("deck", deck_file, "optim.lr"), ("machine", machine_file, "inter_node_gbs")]
)
def test_nan_is_refused_in_every_file_kind_with_numbers(tmp_path, kind, write, key):
    path, key = write(tmp_path, key, math.nan)
    message = str(refusal(kind, path))
    assert str(path) in message and f"{key} = nan: must be a finite number" in message, message


def test_a_deck_error_says_whether_the_value_came_from_the_file_or_from_set(tmp_path):
    path, _ = deck_file(tmp_path, "model.colour", "red")
    assert str(refusal("deck", path)).endswith(f"[deck file {path}]")
    with pytest.raises(DeckError) as err:
        load_deck(REPO / "inputs" / "gpt_tiny.yaml", ("train.steps=0",))
    assert str(err.value).startswith("deck error: train.steps = 0: must be >= 1") and err.value.file == "--set"
    with pytest.raises(DeckError) as err:
        load_deck(REPO / "inputs" / "gpt_tiny.yaml", ("parallel.stage_layers=[0]",))
    assert err.value.key == "parallel.stage_layers[0]" and err.value.file == "--set"
