"""The input deck: defaults, every kind of bad value, overrides, world-size checks."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time

import pytest

from app.deck import (
    MAX_RANKS,
    SECTIONS,
    Deck,
    TrainConfig,
    deck_reference,
    key_name,
    load_deck,
    replaced,
    resolve_for_world,
)
from app.deck_paths import check_paths
from app.errors import DeckError
from conftest import REPO

TINY = REPO / "inputs" / "gpt_tiny.yaml"


def write(tmp_path, text: str):
    path = tmp_path / "deck.yaml"
    path.write_text(text)
    return path


def test_tiny_deck_loads_and_resolves_for_four_ranks():
    deck = resolve_for_world(load_deck(TINY), 4)
    assert deck.parallel.dp == 4 and deck.dp == 4
    assert deck.num_micro_batches == deck.train.global_batch // (deck.train.micro_batch * 4)
    assert deck.run.dir == "runs/gpt_tiny"


def test_missing_keys_take_defaults_and_run_dir_from_file_stem(tmp_path):
    deck = load_deck(write(tmp_path, "train:\n  steps: 5\n"))
    assert deck.model == Deck().model and deck.optim == Deck().optim
    assert deck.run.dir == "runs/deck"
    assert deck.model.ffn == 4 * deck.model.hidden


def test_the_arch_sets_the_defaults_of_the_head_and_the_mlp_width():
    gpt2, llama = load_deck(TINY).model, load_deck(TINY, ("model.arch=llama",)).model
    assert (gpt2.tie_embeddings, gpt2.ffn, gpt2.kv) == (True, 4 * gpt2.hidden, gpt2.heads)
    # 8/3 x 256 = 682.7, rounded up to a multiple of 64: 704; untied; kv_heads null = heads.
    assert (llama.tie_embeddings, llama.ffn, llama.kv, llama.fc_rows) == (False, 704, llama.heads, 1408)
    assert load_deck(TINY, ("model.arch=llama", "model.tie_embeddings=true")).model.tie_embeddings is True
    gqa = load_deck(TINY, ("model.arch=llama", "model.kv_heads=2")).model
    assert gqa.qkv_rows == (gqa.heads + 2 * 2) * gqa.head_dim


def test_deck_is_frozen():
    deck = load_deck(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        deck.train.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "text, key, fragment",
    [
        ("model:\n  hiden: 64\n", "model.hiden", "unknown key"),
        ("modle:\n  hidden: 64\n", "modle", "unknown section"),
        ("model: 3\n", "model", "mapping"),
        ("train:\n  steps: ten\n", "train.steps", "expected int"),
        ("train:\n  steps: 2.5\n", "train.steps", "expected int"),
        ("train:\n  steps: true\n", "train.steps", "expected int"),
        ("train:\n  micro_batch: 0\n", "train.micro_batch", ">= 1"),
        ("optim:\n  lr: fast\n", "optim.lr", "expected float"),
        ("optim:\n  schedule: step\n", "optim.schedule", "accepted: cosine, linear, constant"),
        ("model:\n  tie_embeddings: 1\n", "model.tie_embeddings", "expected bool"),
        ("model:\n  dropout: 1.5\n", "model.dropout", "<= 0.99"),
        ("model:\n  hidden: 100\n  heads: 3\n", "model.heads", "must divide model.hidden = 100"),
        ("parallel:\n  order: tp-dp\n", "parallel.order", "permutation of tp, pp, dp"),
        ("model:\n  arch: llama\n  kv_heads: 3\n", "model.kv_heads", "must divide model.heads = 4"),
        ("model:\n  kv_heads: 2\n", "model.kv_heads", "set model.arch: llama"),
        ("model:\n  arch: llama\n  kv_heads: 2\nparallel:\n  tp: 4\n", "model.kv_heads", "must divide kv_heads"),
        ("model:\n  arch: llama\nparallel:\n  tp: 2\n  tensor: [2, 1, 1]\n", "model.arch", "set parallel.tensor: null"),
        ("model:\n  arch: bert\n", "model.arch", "accepted: gpt2, llama"),
        (
            "parallel:\n  tp: 2\n  tensor: [2, 1, 1]\n  tensor_order: xxz\n",
            "parallel.tensor_order",
            "permutation of x, y, z",
        ),
        ("parallel:\n  tensor_order: zyx\n", "parallel.tensor_order", "only used with parallel.tensor"),
        ("parallel:\n  dp: many\n", "parallel.dp", "'auto'"),
        ("train:\n  global_batch: 10\n  micro_batch: 4\n", "train.global_batch", "multiple of train.micro_batch"),
        ("optim:\n  lr: 1.0e-4\n  min_lr: 1.0e-3\n", "optim.min_lr", "<= optim.lr"),
        ("optim:\n  offload: nvme\n  name: lamb\n", "optim.offload", "LAMB's trust ratio needs two"),
        ("optim:\n  offload: nvme\ncheckpoint:\n  async: true\n", "optim.offload", "set checkpoint.async = false"),
        ("optim:\n  offload_dir: /tmp/x\n", "optim.offload_dir", "only used with optim.offload = nvme"),
        ("optim:\n  offload: disk\n", "optim.offload", "accepted: none, host, nvme"),
        ("data:\n  kind: memmap\n", "data.path", "app.data.prepare"),
        ("run:\n  device: tpu\n", "run.device", "accepted: auto, cpu, cuda"),
    ],
)
def test_bad_deck_raises_deck_error_naming_key_value_and_fix(tmp_path, text, key, fragment):
    with pytest.raises(DeckError) as err:
        load_deck(write(tmp_path, text))
    assert err.value.key == key
    assert str(err.value).startswith(f"deck error: {key} = ")
    assert fragment in str(err.value)


def test_missing_deck_file_names_the_path(tmp_path):
    with pytest.raises(DeckError, match="file not found"):
        load_deck(tmp_path / "nope.yaml")


def test_float_without_dot_is_accepted():
    # PyYAML reads 3e-4 as a string; users write it anyway.
    deck = load_deck(TINY, ("optim.lr=3e-4",))
    assert deck.optim.lr == pytest.approx(3e-4)


@pytest.mark.parametrize(
    "assignment, attr, expected",
    [
        ("train.steps=7", ("train", "steps"), 7),
        ("train.global_batch=64", ("train", "global_batch"), 64),
        ("train.micro_batch=2", ("train", "micro_batch"), 2),
        ("train.seed=99", ("train", "seed"), 99),
        ("parallel.tp=1", ("parallel", "tp"), 1),
        ("parallel.pp=1", ("parallel", "pp"), 1),
        ("parallel.order=dp-tp-pp", ("parallel", "order"), "dp-tp-pp"),
        ("run.dir=/tmp/x", ("run", "dir"), "/tmp/x"),
        ("run.log_every=3", ("run", "log_every"), 3),
        ("model.ffn_hidden=null", ("model", "ffn_hidden"), None),
    ],
)
def test_set_overrides_each_key_scripts_rely_on(assignment, attr, expected):
    deck = load_deck(TINY, (assignment,))
    assert getattr(getattr(deck, attr[0]), attr[1]) == expected


@pytest.mark.parametrize(
    "assignment, key",
    [
        ("train.steps=-1", "train.steps"),
        ("train.stepz=5", "train.stepz"),
        ("steps=5", "steps"),
        ("train.steps", "--set"),
    ],
)
def test_set_is_validated_like_the_deck(assignment, key):
    with pytest.raises(DeckError) as err:
        load_deck(TINY, (assignment,))
    assert err.value.key == key


def test_world_size_must_equal_tp_pp_dp():
    deck = load_deck(TINY, ("parallel.dp=2",))
    assert resolve_for_world(deck, 2).dp == 2
    with pytest.raises(DeckError, match=r"tp x pp x dp = 1 x 1 x 2 = 2 must equal the world size 4") as err:
        resolve_for_world(deck, 4)
    assert err.value.key == "parallel.dp"


def test_global_batch_must_divide_by_micro_batch_times_dp():
    deck = load_deck(TINY, ("train.global_batch=12", "train.micro_batch=4"))
    assert resolve_for_world(deck, 3).num_micro_batches == 1
    with pytest.raises(DeckError, match=r"micro_batch x dp = 4 x 2 = 8") as err:
        resolve_for_world(deck, 2)
    assert err.value.key == "train.global_batch"


def test_a_3d_grid_resolves_dp_from_the_world_size():
    deck = load_deck(TINY, ("parallel.tp=2", "parallel.pp=2", "train.global_batch=16"))
    resolved = resolve_for_world(deck, 8)
    assert (resolved.parallel.tp, resolved.parallel.pp, resolved.dp, resolved.num_micro_batches) == (2, 2, 2, 2)
    with pytest.raises(
        DeckError,
        match=r"tp x pp = 2 x 2 = 4 \(the ranks of one replica\) must divide the world size 6: "
        r"launch 4 or 8 ranks",
    ) as err:
        resolve_for_world(deck, 6)
    assert err.value.key == "parallel.tp"  # the largest factor (tp first among equals)
    # Found in review (2026-12-02): pp's mistake was named parallel.tp = 1, without a fix.
    with pytest.raises(DeckError, match=r"launch 2 or 4 ranks \(a multiple of 2\), or change tp x pp") as err:
        resolve_for_world(load_deck(TINY, ("parallel.pp=2",)), 3)
    assert err.value.key == "parallel.pp"


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (("parallel.tp=3",), "model.heads", "multiple of 3"),
        (("parallel.tp=16",), "model.heads", "choose a tp that divides 8"),
        (("parallel.tp=2", "model.ffn_hidden=1001"), "model.ffn_hidden", "MLP columns"),
        (("parallel.tp=2", "model.vocab_size=257"), "model.vocab_size", "e.g. 258"),
        (("parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=63"), "model.seq_len", "multiple of 2"),
        (("parallel.virtual_stages=2",), "parallel.virtual_stages", "set parallel.pp > 1"),
        (("parallel.pp=8",), "model.layers", "8 model chunks need at least 8 layers"),
        (
            ("parallel.pp=2", "parallel.virtual_stages=4"),
            "model.layers",
            "lower parallel.pp or parallel.virtual_stages",
        ),
        (("parallel.pp=2", "parallel.stage_layers=[1, 2]"), "parallel.stage_layers", "summing to model.layers = 4"),
        (("parallel.pp=2", "parallel.stage_layers=[4]"), "parallel.stage_layers", "needs pp x virtual_stages = 2"),
        (("parallel.stage_layers=[0, 4]", "parallel.pp=2"), "parallel.stage_layers[0]", "must be >= 1"),
        (("parallel.stage_layers=3",), "parallel.stage_layers", "expected list of int"),
    ],
)
def test_the_model_must_split_evenly_over_the_grid(overrides, key, message):
    with pytest.raises(DeckError, match=message) as err:
        load_deck(TINY, overrides)
    assert err.value.key == key


@pytest.mark.parametrize("eps", ["0", "1e-300"])
def test_adam_epsilon_is_at_least_float32_s_smallest_normal(eps):
    """Found in review: optim.eps = 0 (or one that is 0 in fp32, where the update runs) divided an
    element without a gradient yet by 0, and the run ended non-finite blaming optim.lr."""
    with pytest.raises(DeckError, match=r"must be >= 1\.1754944e-38") as err:
        load_deck(TINY, (f"optim.eps={eps}",))
    assert err.value.key == "optim.eps"


def test_stage_layers_and_virtual_stages_are_accepted():
    deck = load_deck(TINY, ("parallel.pp=2", "parallel.virtual_stages=2", "parallel.stage_layers=[1, 1, 1, 1]"))
    assert deck.parallel.stage_layers == [1, 1, 1, 1] and deck.parallel.virtual_stages == 2


def test_interleaving_needs_micro_batches_divisible_by_pp():
    deck = load_deck(
        TINY, ("parallel.pp=2", "parallel.virtual_stages=2", "train.global_batch=12", "train.micro_batch=2")
    )
    assert resolve_for_world(deck, 2).num_micro_batches == 6  # dp = 1: 6 micro-batches, a multiple of pp
    with pytest.raises(DeckError, match=r"= 3\) to be a multiple of pp = 2: e.g. global_batch = 16") as err:
        resolve_for_world(deck, 4)  # dp = 2: 3 micro-batches per dp rank
    assert err.value.key == "train.global_batch"


def test_deck_reference_doc_is_the_code_s_reference_row_for_row():
    """docs/DECK.md's table holds every key in the code's order, with the code's type, default and
    meaning (the help a deck error prints): a key's help and its row cannot drift apart."""
    table = {}
    for line in (REPO / "docs" / "DECK.md").read_text().splitlines():
        row = re.match(r"\| `([a-z_]+\.[a-z_0-9]+)` \| (.*?) \| `(.*?)` \| .*? \| (.*) \|$", line)
        if row:
            table[row[1]] = row.groups()[1:]
    rows = deck_reference()
    assert {key.split(".")[0] for key, *_ in rows} == set(SECTIONS)
    assert list(table) == [key for key, *_ in rows], "docs/DECK.md's keys differ from app.deck's, or their order"

    def same(doc: tuple[str, str, str], kind: str, default: object, help: str) -> bool:
        doc_kind, doc_default, meaning = doc
        # `int | str` is an int or the word `auto` (parallel.dp, the one such key)
        kind = kind.replace(" | ", " or ").replace("int or str", "int or `auto`")
        if default is None or isinstance(default, (bool, str)):
            shown = {None: "null", True: "true", False: "false"}.get(default, default)  # type: ignore[arg-type]
            same_default = doc_default == shown
        else:  # numbers as the doc writes them: 3e-4 is 0.0003
            same_default = type(default)(doc_default) == default
        plain = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", meaning).replace("`", "")  # the doc's markdown, as text
        return doc_kind == kind and same_default and plain == help.replace("`", "")

    differ = [
        (key, table[key], (kind, default, help))
        for key, kind, default, help in rows
        if not same(table[key], kind, default, help)
    ]
    assert not differ, "docs/DECK.md rows that differ from app.deck (doc, code): " + repr(differ)


# ---- decks that cannot hurt (issue 14): every bad deck is a DeckError, found at load ----


def keys_of(kind: str) -> list[tuple[str, dict]]:
    """(key, metadata) of every deck key whose type names `kind` (int, float, str)."""
    rows = []
    for section, cls in SECTIONS.items():
        types = dict((k.split(".")[1], t) for k, t, *_ in deck_reference() if k.startswith(section + "."))
        for f in dataclasses.fields(cls):
            if kind in types[key_name(f)].replace("list of ", "").split(" | "):
                rows.append((f"{section}.{key_name(f)}", dict(f.metadata)))
    return rows


def refusal(overrides=(), path=TINY) -> DeckError:
    with pytest.raises(DeckError) as err:
        load_deck(path, tuple(overrides))
    return err.value


LIST_KEYS = ("parallel.stage_layers", "parallel.tensor")  # the list-of-int keys


def set_value(key: str, text: str) -> str:
    """`--set` for `key`; list keys get a one-entry list."""
    return f"{key}=[{text}]" if key in LIST_KEYS else f"{key}={text}"


@pytest.mark.parametrize("text", ["nan", ".nan", ".NaN", "inf", ".inf", "-.inf", "1e999", "-1e999", "Infinity"])
def test_nan_and_inf_rejected_for_every_float_key(text):
    for key, _ in keys_of("float"):
        err = refusal([set_value(key, text)])
        assert err.key == key and "must be a finite number" in str(err), str(err)


def test_nan_in_a_yaml_deck_is_rejected(tmp_path):
    err = refusal(path=write(tmp_path, "optim:\n  lr: .nan\n"))
    assert err.key == "optim.lr" and "finite" in str(err)


def test_every_numeric_key_has_an_upper_bound():
    keys = keys_of("int") + keys_of("float")
    assert len(keys) > 40
    assert [key for key, meta in keys if "max" not in meta] == []


@pytest.mark.parametrize("value", [2**63, 2**64, 2**70, 10**30])
def test_huge_ints_are_refused_for_every_int_key(value):
    for key, meta in keys_of("int"):
        err = refusal([set_value(key, str(value))])
        shown = f"{key}[0]" if key in LIST_KEYS else key
        assert err.key == shown and f"must be <= {meta['max']}" in str(err), str(err)


@pytest.mark.parametrize("text", ["1.0e300", "1e300", str(10**99)])
def test_huge_numbers_are_refused_for_every_float_key(text):
    for key, meta in keys_of("float"):
        err = refusal([set_value(key, text)])
        assert err.key == key and f"must be <= {meta['max']}" in str(err), str(err)


def test_alignment_interval_of_2_to_the_70_is_refused_at_load():
    err = refusal([f"checkpoint.alignment_interval={2**70}"])
    assert err.key == "checkpoint.alignment_interval" and "must be <= 1073741824" in str(err)
    assert load_deck(TINY, (f"checkpoint.alignment_interval={2**30}",)).checkpoint.alignment_interval == 2**30


def test_the_largest_seed_is_a_valid_torch_and_numpy_seed():
    import numpy as np
    import torch

    from app.sharding.init import _key as stream_key

    top = next(f.metadata["max"] for f in dataclasses.fields(TrainConfig) if f.name == "seed")
    assert load_deck(TINY, (f"train.seed={top}",)).train.seed == top
    torch.manual_seed(top + 1_000_003 * MAX_RANKS)  # train.py's per-stage generator seed, largest grid
    np.random.default_rng([top, 10**9 * 2**24])  # the synthetic data's (seed, sample index)
    stream_key(top, "blocks.0.attn.qkv.weight")


def test_not_utf8_names_file_and_byte_offset(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  steps: 5\nrun:\n  dir: caf\u00e9\n".encode("latin-1"))
    err = refusal(path=path)
    assert err.key == "DECK" and err.value == str(path)
    assert "not UTF-8" in str(err) and "0xe9 at byte offset 33 (line 4)" in str(err)


# "Billion laughs": nine levels of nine aliases, 413 bytes that would expand to 9^9 strings.
LAUGHS = "\n".join(
    ["a: &a [" + ", ".join(['"lol"'] * 9) + "]"]
    + [f"{b}: &{b} [" + ", ".join([f"*{a}"] * 9) + "]" for a, b in zip("abcdefgh", "bcdefghi")]
)


def test_alias_bomb_refused_quickly(tmp_path):
    start = time.perf_counter()
    err = refusal(path=write(tmp_path, LAUGHS))
    assert time.perf_counter() - start < 1.0
    assert err.key == "DECK" and "line 1: YAML anchors (&name) and aliases (*name) are not accepted" in str(err)


@pytest.mark.parametrize(
    "text, line",
    [
        ("train:\n  steps: &n 5\n", 2),
        ("train:\n  steps: 5\n  log: *n\n", 3),
        ("run:\n  dir: !!str &d x\n", 2),
    ],
)
def test_anchors_and_aliases_are_refused_with_their_line(tmp_path, text, line):
    err = refusal(path=write(tmp_path, text))
    assert f"line {line}: YAML anchors" in str(err)


@pytest.mark.parametrize("tagged", ["!!bool x", "!!int ''", "!!float ''", "!!timestamp x", "!!int +", "!!str 5", "! x"])
def test_yaml_tags_are_refused_not_a_constructor_crash(tmp_path, tagged):
    # PyYAML itself raises KeyError, IndexError or AttributeError on the first five.
    err = refusal(path=write(tmp_path, f"run:\n  study: {tagged}\n"))
    assert err.key == "DECK" and "line 2: YAML tags (" in str(err)
    err = refusal([f"run.study={tagged}"])
    assert err.key == "run.study" and "YAML tags" in str(err)


def test_aliases_in_set_are_refused():
    err = refusal(["run.dir=[&a x, *a]"])
    assert err.key == "run.dir" and "aliases" in str(err)


def test_every_yaml_file_of_the_repository_reads_as_pyyamls_safe_loader_reads_it():
    """The bounded loader parses with libyaml where PyYAML has it, under PyYAML's own composer and
    resolver: every deck, machine file and study of inputs/ reads to the same value as through
    yaml.SafeLoader (pure Python), ints, floats, nulls and booleans included, and so does a deck
    written back by dump_yaml."""
    import yaml

    from app.deck_yaml import dump_yaml, parse_yaml

    files = sorted((REPO / "inputs").rglob("*.yaml"))
    assert len(files) > 20
    for path in files:
        text = path.read_text()
        assert parse_yaml(text, ("DECK", str(path))) == yaml.load(text, Loader=yaml.SafeLoader), path
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", ("run.dir=/tmp/ü x", "optim.lr=1e-3")).to_dict()
    assert yaml.load(dump_yaml(deck, sort_keys=False), Loader=yaml.SafeLoader) == deck


@pytest.mark.parametrize(
    "value",
    [
        "[" * 200 + "1",  # flow lists
        "{a: " * 200 + "1",  # flow mappings
        "\n    " + "- " * 200 + "1",  # block lists
        "".join(f"\n{' ' * (4 + i)}k:" for i in range(200)) + " 1",  # block mappings
    ],
)
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path, value):
    err = refusal(path=write(tmp_path, "train:\n  steps: " + value + "\n"))
    assert err.key == "DECK" and "nested more than 16 levels deep" in str(err)
    assert "nested" in str(refusal(["train.steps=" + "[" * 100_000]))


def test_a_deck_too_large_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * 30_000)
    assert "the deck is 300,000 bytes; a deck is at most 262,144 bytes" in str(refusal(path=path))
    assert "the deck is more than 262,144 bytes" in str(refusal(path="/dev/zero"))


def test_too_many_values_are_refused(tmp_path):
    err = refusal(path=write(tmp_path, "parallel:\n  stage_layers: [" + ", ".join(["1"] * 20_000) + "]\n"))
    assert "more than 10,000 YAML values" in str(err)


@pytest.mark.parametrize("literal", ["1" * 5000, ":".join(["1"] * 30_000), "0x" + "f" * 20_000])
def test_giant_int_literals_are_refused_without_converting_them(tmp_path, literal):
    err = refusal(path=write(tmp_path, f"train:\n  seed: {literal}\n"))
    assert err.key == "DECK" and "line 2: an integer of" in str(err)


def test_duplicate_key_names_the_key_and_both_lines(tmp_path):
    err = refusal(path=write(tmp_path, "train:\n  steps: 3\n  micro_batch: 2\n  steps: 4\n"))
    assert err.key == "train.steps" and err.value == "4"
    assert f"given twice, at lines 2 and 4 of {tmp_path / 'deck.yaml'}" in str(err)


def test_duplicate_section_is_refused(tmp_path):
    err = refusal(path=write(tmp_path, "train:\n  steps: 3\nmodel:\n  layers: 2\ntrain:\n  seed: 1\n"))
    assert err.key == "train" and "lines 1 and 5" in str(err)


@pytest.mark.parametrize("text", ["", "\n\n", "# only\n# comments\n", "---\n", "null\n", "~\n"])
def test_empty_deck(tmp_path, text):
    err = refusal(path=write(tmp_path, text))
    assert err.key == "DECK" and "the deck is empty; see inputs/gpt_tiny.yaml" in str(err)


@pytest.mark.parametrize("bad", ["\x00", "\n", "\t", "\x1b[31m", "\x7f", "\x85"])
def test_control_characters_are_refused_in_every_string_key(tmp_path, bad):
    for key, _ in keys_of("str"):
        section, name = key.split(".")
        escaped = bad.encode("unicode_escape").decode()  # YAML's double-quoted escapes are the same
        err = refusal(path=write(tmp_path, f'{section}:\n  {name}: "a{escaped}b"\n'))
        assert err.key == key, str(err)


def test_nul_and_surrogates_in_set_are_refused():
    err = refusal(["run.dir=runs/a\x00b"])
    assert err.key == "run.dir" and "control character '\\x00' at position 6" in str(err)
    err = refusal(["checkpoint.dir=runs/\udcff"])  # an undecodable byte of the command line
    assert err.key == "checkpoint.dir" and "not valid UTF-8" in str(err)


def test_empty_and_overlong_strings_are_refused():
    assert "an empty path" in str(refusal(["run.dir=''"]))
    assert "an empty path" in str(refusal(["run.resume='  '"]))
    err = refusal(["run.study=" + "x" * 5000])
    assert err.key == "run.study" and "5,000 characters; at most 4096" in str(err)


def test_world_size_beyond_the_bound_is_refused():
    deck = load_deck(TINY, ("train.global_batch=4", "train.micro_batch=1"))
    with pytest.raises(DeckError, match="gridlm runs on 1 .. 1,048,576"):
        resolve_for_world(deck, MAX_RANKS * 2)
    with pytest.raises(DeckError, match="at most 1,048,576"):
        load_deck(TINY, ("parallel.tp=8", "parallel.pp=4", f"parallel.dp={MAX_RANKS}"))


def test_nul_in_run_dir_refused_by_dry_run(tmp_path):
    path = write(tmp_path, TINY.read_text().replace("dir: runs/gpt_tiny", 'dir: "runs/gpt\\0tiny"'))
    out = subprocess.run(
        [sys.executable, "-m", "app", str(path), "--dry-run", "--world-size", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "deck error: run.dir = 'runs/gpt\\x00tiny': contains the control character" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr


# ---- check_paths: the file system at the start of a real run ----


def paths_deck(tmp_path, *overrides: str):
    return load_deck(TINY, (f"run.dir={tmp_path / 'run'}", *overrides))


def test_check_paths_accepts_a_new_run_dir_and_creates_nothing(tmp_path):
    check_paths(paths_deck(tmp_path))
    check_paths(load_deck(TINY, (f"run.dir={tmp_path / 'a/b/c'}", f"checkpoint.dir={tmp_path / 'ck'}")))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["tb", "profile.txt", "metrics.jsonl.tmp", "deck.yaml.tmp", "profile.txt.tmp"])
def test_check_paths_refuses_a_symlink_where_tensorboard_profile_or_the_metrics_rewrite_write(tmp_path, name):
    """Found in review (2026-11-30): the guard listed `tensorboard`, but TensorBoard writes `<run.dir>/tb`,
    and profile.txt was not listed: a link planted there was written through."""
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DeckError, match=f"holds {run / name}, a symbolic link"):
        check_paths(paths_deck(tmp_path))


def test_check_paths_device_file():
    with pytest.raises(DeckError) as err:
        check_paths(load_deck(TINY, ("run.dir=/dev/null",)))
    assert err.value.key == "run.dir" and "exists and is a device file, not a directory" in str(err.value)


def test_check_paths_checkpoint_dir_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DeckError) as err:
        check_paths(paths_deck(tmp_path, f"checkpoint.dir={tmp_path / 'file'}"))
    assert err.value.key == "checkpoint.dir" and "a regular file, not a directory" in str(err.value)
    # The default <run.dir>/checkpoints is checked too.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("x")
    with pytest.raises(DeckError) as err:
        check_paths(paths_deck(tmp_path))
    assert err.value.key == "checkpoint.dir" and err.value.value == str(tmp_path / "run" / "checkpoints")


def test_check_paths_run_dir_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DeckError) as err:
        check_paths(load_deck(TINY, (f"run.dir={tmp_path / 'file' / 'run'}",)))
    assert err.value.key == "run.dir"
    assert f"cannot be created: {tmp_path / 'file'} is a regular file, not a directory" in str(err.value)


def test_check_paths_unwritable_directory(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(DeckError, match="cannot write in"):
        check_paths(load_deck(TINY, (f"run.dir={locked / 'run'}",)))


def test_check_paths_names_a_read_only_file_system_as_such():
    """Found in review (2026-11-30): a directory on a read-only mount was 'a directory this user cannot
    write in', which sends the user to its permissions. Any read-only mount of this machine will do."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f if "ro" in line.split()[3].split(",")]
    readonly = [m for m in mounts if os.path.isdir(m) and not os.access(m, os.W_OK)]
    if not readonly:
        pytest.skip("no read-only mount on this machine")
    with pytest.raises(DeckError, match="on a read-only file system"):
        check_paths(load_deck(TINY, (f"run.dir={readonly[0]}",)))
    with pytest.raises(DeckError, match=rf"cannot be created: {readonly[0]} is a directory on a read-only file system"):
        check_paths(load_deck(TINY, (f"run.dir={readonly[0]}/run",)))


def test_check_paths_memmap_files(tmp_path):
    prefix = tmp_path / "corpus"
    deck = paths_deck(tmp_path, "data.kind=memmap", f"data.path={prefix}", "model.vocab_size=512")
    with pytest.raises(DeckError) as err:
        check_paths(deck)
    assert err.value.key == "data.path" and f"{prefix}.json does not exist" in str(err.value)
    for suffix in (".json", ".bin"):
        prefix.with_name("corpus" + suffix).write_text("{}")
    with pytest.raises(DeckError, match=r"corpus\.idx\.npy does not exist"):
        check_paths(deck)
    (tmp_path / "corpus.idx.npy").mkdir()
    with pytest.raises(DeckError, match=r"corpus\.idx\.npy is a directory, not a file"):
        check_paths(deck)


def test_check_paths_resume_path_must_exist(tmp_path):
    with pytest.raises(DeckError) as err:
        check_paths(paths_deck(tmp_path, f"run.resume={tmp_path / 'nope.h5'}"))
    assert err.value.key == "run.resume" and "does not exist" in str(err.value)
    check_paths(paths_deck(tmp_path, "run.resume=none"))
    check_paths(paths_deck(tmp_path, f"run.resume={tmp_path}"))


def reference_forms(bound: float) -> set[str]:
    """How the deck reference (docs/DECK.md) may write a bound: 4096, 0.99, 2^24, 10^9, 2^63 - 1."""
    forms = {str(bound), f"{bound:g}"}
    n = int(bound)
    if n == bound and n >= 1024:
        forms |= {f"2^{n.bit_length() - 1}"} if n & (n - 1) == 0 else set()
        forms |= {f"10^{len(str(n)) - 1}"} if str(n).strip("0") == "1" else set()
        forms |= {"2^63 - 1"} if n == 2**63 - 1 else set()
    return forms


def test_deck_reference_doc_shows_every_upper_bound():
    lines = (REPO / "docs" / "DECK.md").read_text().splitlines()
    cells = [line.split(" | ") for line in lines if line.startswith("| `")]
    rows = {row[0][3:-1]: row[3] for row in cells if len(row) == 5}
    for key, meta in keys_of("int") + keys_of("float"):
        accepted = rows[key]
        shown = [f"{sep} {form}" for form in reference_forms(meta["max"]) for sep in ("..", ",")]
        assert any(text in accepted for text in shown), (key, meta["max"], accepted)


def test_named_pipe_as_the_deck_is_refused_without_blocking(tmp_path):
    pipe = tmp_path / "deck.yaml"
    os.mkfifo(pipe)
    with pytest.raises(DeckError, match="is not a file"):
        load_deck(pipe)  # no writer: a plain open() would wait forever (pytest-timeout ends it)
    # A directory: named so, with the fix (found in review, 2026-12-01: "cannot be read ([Errno 21] Is a
    # directory: 3)", the file descriptor's number and no fix).
    with pytest.raises(DeckError, match="is not a file; pass the path of a YAML deck"):
        load_deck(tmp_path)


def test_replaced_equals_dataclasses_replace_and_refuses_unknown_fields():
    """The search's fast copy (`replaced`) gives what dataclasses.replace gives, for every section and
    the deck, leaves the original alone, and refuses a field the class lacks."""
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml")
    changes = {"parallel": {"tp": 2, "dp": "auto"}, "train": {"micro_batch": 4}, "optim": {"lr": 1e-3},
               "model": {"layers": 2}}  # fmt: skip
    for name in SECTIONS:
        section = getattr(deck, name)
        kv = changes.get(name, {})
        assert replaced(section, **kv) == dataclasses.replace(section, **kv)
    new = replaced(deck, train=replaced(deck.train, micro_batch=8))
    assert new == dataclasses.replace(deck, train=dataclasses.replace(deck.train, micro_batch=8))
    assert deck.train.micro_batch == 4 and new.train.micro_batch == 8
    assert hash(new.train) == hash(dataclasses.replace(deck.train, micro_batch=8))
    with pytest.raises(TypeError, match="no field"):
        replaced(deck.train, micro_batches=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.train.micro_batch = 8  # still frozen


def test_context_parallelism_takes_its_ranks_from_the_world_and_refuses_what_it_cannot_split():
    """parallel.cp: world = tp x cp x pp x dp; the sequence splits into 2 cp chunks (cp x tp shards
    under SP); the all-to-all splits each tp rank's heads over cp; what cp does not combine with
    yet is refused by name, with the way out."""
    deck = load_deck(TINY, ("parallel.cp=2", "parallel.tp=2", "model.seq_len=16"))
    assert resolve_for_world(deck, 8).dp == 2 and resolve_for_world(deck, 8).stage_message[1] == 8
    with pytest.raises(
        DeckError, match=r"tp x cp x pp = 2 x 2 x 1 = 4 \(the ranks of one replica\) must divide the world size 6"
    ):
        resolve_for_world(deck, 6)
    with pytest.raises(DeckError, match=r"tp x cp x pp x dp = 2 x 2 x 1 x 3 = 12 must equal the world size 8"):
        resolve_for_world(load_deck(TINY, ("parallel.cp=2", "parallel.tp=2", "model.seq_len=16", "parallel.dp=3")), 8)
    sp = load_deck(TINY, ("parallel.cp=2", "parallel.tp=2", "model.seq_len=16", "parallel.sequence_parallel=true"))
    assert resolve_for_world(sp, 4).stage_message[1] == 4  # 16 / cp / tp
    for overrides, key, words in (
        (("parallel.cp=3", "model.seq_len=16"), "model.seq_len", "use a multiple of 6"),
        (("parallel.cp=2", "parallel.tp=4", "model.seq_len=20", "parallel.sequence_parallel=true"), "model.seq_len",
         "use a multiple of 8"),
        (("parallel.cp=4", "model.seq_len=16", "parallel.tp=2", "model.heads=4", "parallel.cp_kind=all_to_all"),
         "parallel.cp_kind",
         "splits each tp rank's 2 heads over cp = 4"),
        (("parallel.cp=2", "model.seq_len=16", "model.moe_experts=4", "model.moe_capacity_factor=1.0"),
         "model.moe_capacity_factor", "set parallel.cp: 1"),
        (("parallel.cp=2", "model.seq_len=16", "parallel.tensor=[1, 1, 2]", "parallel.tp=2"), "parallel.tensor",
         "not yet with context parallelism"),
        (("parallel.order=tp-dp-pp-ep",), "parallel.order", "and cp"),
    ):  # fmt: skip
        with pytest.raises(DeckError, match=words) as err:
            load_deck(TINY, overrides)
        assert err.value.key == key, (overrides, err.value.key)
    assert load_deck(TINY, ("parallel.order=dp-cp-tp-pp",)).parallel.order == "dp-cp-tp-pp"
    assert load_deck(TINY, ("parallel.cp=2", "model.seq_len=16", "model.dropout=0.1")).model.dropout == 0.1
    assert load_deck(TINY, ("parallel.cp=2", "model.seq_len=16", "train.goldfish_k=4")).train.goldfish_k == 4
    assert load_deck(TINY, ("parallel.cp=2", "model.seq_len=16", "model.moe_experts=4")).model.moe_experts == 4


@pytest.mark.parametrize(
    "sets, key",
    [
        (("run.peak_tflops=0",), "run.peak_tflops"),  # MFU divides by it: a ZeroDivisionError at the first log
        (("train.precision=fp16", "train.min_loss_scale=1e6"), "train.min_loss_scale"),  # above loss_scale 65536
    ],
)
def test_values_that_failed_at_run_time_are_refused_at_load(sets, key):
    """Found in review (2026-11-30): run.peak_tflops = 0 passed the deck and crashed the run at its first
    logged step (MFU = TFLOP/s / 0); a min_loss_scale above the initial loss scale made the first fp16
    overflow abort as 'training has diverged'. Both are deck errors naming the key now."""
    with pytest.raises(DeckError) as refused:
        load_deck(REPO / "inputs/gpt_tiny.yaml", sets)
    assert refused.value.key == key


def test_the_interleaved_schedules_suggested_batch_counts_the_3d_batch_split():
    """Found in review (2026-11-30): under 3D tensor parallelism (z splits the batch too) the refusal's
    example global_batch left z out and suggested the very value it refused (8); the suggestion now
    resolves."""
    sets = ("parallel.tensor=[1,1,2]", "parallel.tp=2", "parallel.pp=2", "parallel.virtual_stages=2",
            "model.layers=4", "train.micro_batch=4")  # fmt: skip
    with pytest.raises(DeckError, match=r"/ \(micro_batch x dp x z\) = 1\) to be a multiple of pp = 2") as refused:
        resolve_for_world(load_deck(TINY, (*sets, "train.global_batch=8")), 4)
    good = int(re.search(r"e\.g\. global_batch = (\d+)", str(refused.value)).group(1))
    assert good != 8
    resolve_for_world(load_deck(TINY, (*sets, f"train.global_batch={good}")), 4)


@pytest.mark.parametrize(
    "assignment, said",
    [
        ("run.dir=runs/sweep #2", "YAML reads '#2' as a comment, which would leave 'runs/sweep'"),
        ("data.path=/data/c #v2", "YAML reads '#v2' as a comment, which would leave '/data/c'"),
        ("run.study=#weak", "YAML reads '#weak' as a comment, which would leave None"),
        ("train.steps=5 # five", "YAML reads '# five' as a comment, which would leave 5"),
        ("parallel.stage_layers=[2, 2] #x", "YAML reads '#x' as a comment"),
        ("run.dir=~", "YAML reads ~ as null (the default)"),
        ("train.seed=0123", "0123 reads as an octal number (YAML 1.1), 83"),
        ("train.micro_batch=010", "010 reads as an octal number (YAML 1.1), 8"),
        ("checkpoint.every=1:40", "1:40 reads as a base-60 number (YAML 1.1), 100"),
        ("optim.lr=1:0.5", "1:0.5 reads as a base-60 number (YAML 1.1), 60.5"),
        ("run.dir=~/runs/x", "~ and $VARIABLE are not expanded in a deck"),
        ("checkpoint.dir=$HOME/ck", "~ and $VARIABLE are not expanded in a deck"),
        ("data.path=${SCRATCH}/corpus", "~ and $VARIABLE are not expanded in a deck"),
    ],
)
def test_set_values_yaml_would_silently_change_are_refused(assignment, said):
    """Found in review (2026-12-02): `--set 'run.dir=runs/sweep #2'` ran in runs/sweep (YAML's comment),
    resuming and overwriting another run; `train.seed=0123` seeded 83 (YAML 1.1's octal); `1:40` was 100
    (base 60); `run.dir=~/x` and `$HOME/ck` went to ./~/x and ./$HOME/ck (nothing expands them)."""
    with pytest.raises(DeckError, match=re.escape(said)):
        load_deck(TINY, (assignment,))


def test_values_that_only_look_like_those_are_accepted(tmp_path):
    deck = load_deck(TINY, ("run.dir=runs/#2", 'run.study="#weak"', "train.seed=0", "checkpoint.every=0x10",
                            "run.init_from=/data/a$1", "train.steps=1_000", "optim.lr=3e-4"))  # fmt: skip
    assert (deck.run.dir, deck.run.study, deck.train.seed, deck.checkpoint.every) == ("runs/#2", "#weak", 0, 16)
    assert (deck.run.init_from, deck.train.steps, deck.optim.lr) == ("/data/a$1", 1000, 3e-4)
    # ~ is null, the default, where the key is not a path; 07 is 7 in octal and decimal alike.
    deck = load_deck(TINY, ("model.ffn_hidden=~", "train.seed=07"))
    assert (deck.model.ffn_hidden, deck.train.seed) == (None, 7)
    # A deck file: the same refusal, with its line; its comments are its writer's.
    bad = write(tmp_path, "train:\n  steps: 10  # ten\n  seed: 0123\n")
    with pytest.raises(DeckError, match=r"line 3: 0123 reads as an octal number"):
        load_deck(bad)
    assert load_deck(write(tmp_path, "train:\n  steps: 10  # ten\n")).train.steps == 10


def test_gradient_accumulation_fusion_asked_for_under_3d_tensor_parallelism_is_refused():
    """Found in review (2026-12-02): accepted and silently not done (no 3D Linear is fusable)."""
    sets = ("parallel.tensor=[1, 1, 2]", "parallel.tp=2")
    with pytest.raises(DeckError, match="nothing is fused under parallel.tensor") as err:
        load_deck(TINY, (*sets, "train.fuse_grad_accumulation=true"))
    assert err.value.key == "train.fuse_grad_accumulation"
    for value in ("null", "false"):
        assert load_deck(TINY, (*sets, f"train.fuse_grad_accumulation={value}")).parallel.tensor == [1, 1, 2]
