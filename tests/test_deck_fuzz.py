"""Property: no deck can hurt gridlm.

Hypothesis writes thousands of decks and `--set` lists: the real keys with valid and
invalid values (huge, negative and boundary ints, NaN/Inf, wrong types, nested lists and
mappings, strings with control characters), unknown keys and sections, and the YAML text
itself mutated (random bytes, truncation, anchors and aliases, deep nesting, duplicate
keys, tabs). Each one goes through the dry run's path (`load_deck`, `world_for`,
`make_plan` and its text and JSON reports) for a world of 1..64 ranks and no machine, and
must end in a GridlmError (a DeckError naming the key) or a plan; never another exception.
A hang or a blow-up shows as the per-test timeout (no time is asserted: a loaded shared
machine failed a 10 s ceiling per deck in CI, 2026-11-25). Derandomized: CI runs the same
examples every time.
"""

from __future__ import annotations

import dataclasses
import random
import typing

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.deck import SECTIONS, key_name, load_deck
from app.errors import GridlmError
from app.parallel.schedule import build_schedule
from app.plan.dryrun import dump_json, format_text, make_plan, world_for
from app.plan.estimate import in_flight
from conftest import REPO

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# A small, valid deck: random changes to it keep many decks plannable.
BASE = {
    "model": {"vocab_size": 64, "seq_len": 16, "layers": 4, "hidden": 32, "heads": 4},
    "parallel": {"tp": 1, "pp": 1, "dp": "auto"},
    "train": {"steps": 3, "global_batch": 8, "micro_batch": 2},
    "run": {"dir": "runs/fuzz"},
}
KEYS = [
    (section, key_name(f), typing.get_type_hints(cls)[f.name], dict(f.metadata))
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
]
HUGE = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63), -(2**70), 10**30]
NONFINITE = [float("nan"), float("inf"), float("-inf"), "nan", ".inf", "-.inf", "1e999", "NaN", "Infinity"]
# Any UTF-8 character, and more often control characters and the ones YAML treats specially.
ALPHABET = st.characters(codec="utf-8") | st.sampled_from(list("\x00\x01\t\n\r\x1b\x7f\x85\u2028:#&*!|>'\"%@`{}[],-"))
TEXT = st.text(ALPHABET, max_size=16)
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=4,
)


def valid_value(tp: typing.Any, meta: dict) -> st.SearchStrategy:
    """A value the key accepts on its own (rules between keys may still refuse it)."""
    want = next(a for a in (*typing.get_args(tp), tp) if a is not type(None) and a is not typing.Union)
    lo, hi = meta.get("min", 0), meta.get("max", 2**64)
    if typing.get_origin(want) is list:
        return st.lists(st.integers(lo, min(hi, 8)), min_size=1, max_size=8)
    if want is bool:
        return st.booleans()
    if want is int:
        return st.integers(lo, min(hi, 64)) | st.integers(lo, hi) | st.sampled_from(meta.get("words", [lo]))
    if want is float:
        return st.floats(lo, hi)
    choices = list(meta.get("choices", ()))
    return st.sampled_from(choices) if choices else st.sampled_from(["runs/x", "résumé/中", "none"])


def invalid_value(meta: dict) -> st.SearchStrategy:
    """Out of range, non-finite, huge, of the wrong type, or anything at all."""
    lo, hi = meta.get("min", 0), meta.get("max", 2**64)
    edges = [lo - 1, hi + 1, -1, hi * 2, *HUGE, *NONFINITE] if "max" in meta else [*HUGE, *NONFINITE]
    return st.sampled_from(edges) | TEXT | JUNK


def value_for(tp: typing.Any, meta: dict) -> st.SearchStrategy:
    """Values for one key: three in four valid on their own."""
    return st.one_of(valid_value(tp, meta), valid_value(tp, meta), valid_value(tp, meta), invalid_value(meta))


# BASE plans on 1, 2 or 4 ranks (dp divides global_batch / micro_batch = 4).
WORLD = st.sampled_from([1, 2, 4]) | st.integers(1, 64)
KEY_VALUE = st.one_of([st.tuples(st.just(s), st.just(k), value_for(tp, meta)) for s, k, tp, meta in KEYS])
UNKNOWN = st.tuples(st.sampled_from([*SECTIONS, "modle", "", "1"]), TEXT, JUNK)


@st.composite
def raw_decks(draw: st.DrawFn) -> dict:
    """BASE with a few keys changed, sometimes unknown keys or a whole section replaced."""
    deck = {section: dict(keys) for section, keys in BASE.items()}
    changes = st.lists(st.one_of(KEY_VALUE, KEY_VALUE, KEY_VALUE, UNKNOWN), max_size=4)
    for section, key, value in draw(changes):
        place = deck.setdefault(section, {})
        if isinstance(place, dict):
            place[key] = value
    if draw(st.integers(0, 9)) == 0:
        deck[draw(st.sampled_from([*SECTIONS, "extra"]))] = draw(JUNK)
    return deck


def to_yaml(value: typing.Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...")


@st.composite
def overrides(draw: st.DrawFn, malformed: bool = False) -> tuple[str, ...]:
    """`--set` assignments: real keys with YAML-written values; with `malformed`, raw text too."""
    out = []
    for section, key, value in draw(st.lists(KEY_VALUE, max_size=3)):
        text = draw(st.sampled_from([to_yaml(value), str(value)]))
        out.append(f"{section}.{key}={text}")
    for text in draw(st.lists(TEXT, max_size=2 if malformed else 0)):
        out.append(draw(st.sampled_from([text, f"train.{text}", f"run.dir={text}", f"model.layers={text}"])))
    return tuple(out)


MUTATIONS = [
    "truncate",
    "flip",
    "insert",
    "anchor",
    "alias",
    "tag",
    "nest",
    "duplicate",
    "tab",
    "bom",
    "latin1",
    "empty",
]


@st.composite
def mutated_text(draw: st.DrawFn) -> bytes:
    """The YAML of a deck, with up to three byte-level or YAML-level mutations."""
    return mutate(draw, yaml.safe_dump(draw(raw_decks()), sort_keys=False).encode())


def mutate(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` (YAML or JSON text) with up to three byte-level or YAML-level mutations (MUTATIONS)."""
    for kind in draw(st.lists(st.sampled_from(MUTATIONS), max_size=3)):
        at = draw(st.integers(0, len(data)))
        lines = data.split(b"\n")
        row = draw(st.integers(0, max(0, len(lines) - 1)))
        if kind == "truncate":
            data = data[:at]
        elif kind == "flip" and data:
            data = data[: at - 1] + bytes([draw(st.integers(0, 255))]) + data[at:]
        elif kind == "insert":
            data = data[:at] + draw(st.binary(max_size=8)) + data[at:]
        elif kind == "anchor":
            data = data[:at] + b"&a " + data[at:]
        elif kind == "alias":
            data = data[:at] + b"*a" + data[at:]
        elif kind == "tag":
            tag = draw(st.sampled_from([b"!!bool ", b"!!int ", b"!!float ", b"!!timestamp ", b"!!binary ", b"! "]))
            data = data[:at] + tag + data[at:]
        elif kind == "nest":
            depth = draw(st.integers(1, 40))
            data += b"\ntrain:\n  seed: " + draw(st.sampled_from([b"[", b"{k: ", b"- "])) * depth + b"1\n"
        elif kind == "duplicate":
            lines.insert(row, lines[row])
            data = b"\n".join(lines)
        elif kind == "tab":
            lines[row] = lines[row].replace(b"  ", b"\t", 1)
            data = b"\n".join(lines)
        elif kind == "bom":
            data = b"\xef\xbb\xbf" + data
        elif kind == "latin1":
            data = data[:at] + b"caf\xe9" + data[at:]
        elif kind == "empty":
            data = draw(st.sampled_from([b"", b"# nothing\n", b"---\n", b"...\n", b"~\n"]))
    return data


@st.composite
def decks_within_the_rules(draw: st.DrawFn) -> tuple[dict, int]:
    """A deck that keeps every rule between keys, with values up to the bounds, and its world."""
    tp = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    pp = draw(st.integers(1, 64 // tp))
    dp = draw(st.integers(1, 64 // (tp * pp)))
    virtual = draw(st.integers(1, 8)) if pp > 1 else 1
    heads = tp * draw(st.integers(1, 8))
    hidden = heads * 2 * draw(st.integers(1, 2**16 // heads))
    chunks = pp * virtual
    layers = draw(st.integers(chunks, 4096))
    cuts = (
        sorted(draw(st.sets(st.integers(1, layers - 1), min_size=chunks - 1, max_size=chunks - 1)))
        if chunks > 1
        else []
    )
    stage_layers = [b - a for a, b in zip([0, *cuts], [*cuts, layers])]
    sp = draw(st.booleans())
    group = pp if virtual > 1 else 1  # interleaving takes micro-batches in groups of pp
    micro_batch = draw(st.integers(1, 64) | st.integers(1, 2**24 // (dp * group)))
    accumulation = group * draw(st.integers(1, 2**24 // (micro_batch * dp * group)))
    deck = {
        "model": {
            "vocab_size": tp * draw(st.integers(max(1, 2 // tp), 2**24 // tp)),
            "seq_len": tp * draw(st.integers(1, 2**20 // tp)) if sp else draw(st.integers(1, 2**20)),
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "ffn_hidden": draw(st.none() | st.integers(1, 2**20 // tp).map(lambda f: f * tp)),
            "tie_embeddings": draw(st.booleans()),
        },
        "parallel": {
            "tp": tp,
            "pp": pp,
            "dp": draw(st.sampled_from([dp, "auto"])),
            "order": draw(st.sampled_from(["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"])),
            "sequence_parallel": sp,
            "virtual_stages": virtual,
            "stage_layers": draw(st.sampled_from([None, stage_layers])),
            "gpus_per_node": draw(st.none() | st.integers(1, 1024)),
        },
        "train": {
            "global_batch": micro_batch * dp * accumulation,
            "micro_batch": micro_batch,
            "precision": draw(st.sampled_from(["fp32", "bf16", "fp16"])),
            "recompute": draw(st.sampled_from(["none", "full", "selective"])),
            "steps": draw(st.integers(1, 10**9)),
            "seed": draw(st.integers(0, 2**63 - 1)),
        },
        "optim": {"zero": draw(st.integers(0, 1))},
    }
    return deck, tp * pp * dp


def dry_run(path, sets: tuple[str, ...], world: int, nodes: bool) -> str:
    """The dry run of `python -m app PATH --set ... --dry-run --world-size N` (or --nodes), no machine."""
    try:
        deck = load_deck(path, sets)
        world_size, rpn = world_for(deck, None if nodes else world, world if nodes else None, None)
        plan = make_plan(deck, world_size, None, rpn)
        format_text(plan, str(path), all_ranks=world_size <= 64)
        dump_json(plan)
        outcome = "planned"
    except GridlmError:
        outcome = "refused"
    return outcome


@pytest.fixture(scope="module")
def deck_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "deck.yaml"


@settings(FUZZ, max_examples=300)
@given(deck_and_world=decks_within_the_rules())
@pytest.mark.full
def test_every_deck_within_the_rules_plans(deck_file, deck_and_world):
    """What the deck accepts, the dry run plans: no bound lets a value through that the plan cannot take."""
    deck, world = deck_and_world
    deck_file.write_text(yaml.safe_dump(deck, sort_keys=False))
    assert dry_run(deck_file, (), world, False) == "planned"


@settings(FUZZ, max_examples=700)
@given(raw=raw_decks(), sets=overrides(), world=WORLD, by_nodes=st.integers(0, 9).map(lambda n: n == 0))
def test_any_deck_of_the_real_keys_is_refused_or_planned(deck_file, raw, sets, world, by_nodes):
    deck_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    dry_run(deck_file, sets, world, by_nodes)


@settings(FUZZ, max_examples=700)
@given(data=mutated_text(), world=WORLD)
def test_any_mutated_deck_text_is_refused_or_planned(deck_file, data, world):
    deck_file.write_bytes(data)
    dry_run(deck_file, (), world, False)


@settings(FUZZ, max_examples=300)
@given(sets=overrides(malformed=True), world=WORLD)
def test_any_set_list_over_the_tiny_deck_is_refused_or_planned(sets, world):
    dry_run(REPO / "inputs" / "gpt_tiny.yaml", sets, world, False)


@pytest.mark.full
def test_valid_extreme_decks_plan_quickly():
    """Decks at the bounds the deck accepts: the plan must stay fast (no per-micro-batch walk)."""
    extreme = (
        "model.layers=4096", "model.hidden=64", "model.heads=2", "model.vocab_size=16777216",
        "model.seq_len=1048576", "parallel.pp=64", "parallel.virtual_stages=64", "parallel.gpus_per_node=1024",
        "train.global_batch=16777216", "train.micro_batch=1", "train.steps=1000000000",
    )  # fmt: skip
    for world in (64, 1024):
        assert dry_run(None, (*extreme, f"parallel.dp={world // 64}"), world, False) == "planned"


@settings(FUZZ, max_examples=300)
@given(
    pp=st.integers(1, 6),
    virtual=st.integers(1, 4),
    groups=st.integers(1, 7),
    seed=st.integers(0, 2**32),
)
def test_dry_run_in_flight_equals_walking_the_schedule(pp, virtual, groups, seed):
    """`estimate.in_flight` reads the peak off the schedule's structure; the walk is the truth."""
    micro = groups * pp if virtual > 1 else groups
    rng = random.Random(seed)
    chunk_layers = [rng.randint(1, 5) for _ in range(pp * virtual)]
    for stage in range(pp):
        live = peak = 0
        for action in build_schedule(pp, stage, micro, virtual):
            layers = chunk_layers[stage + action.virtual * pp]
            live += layers if action.kind == "F" else -layers
            peak = max(peak, live)
        assert in_flight(pp, stage, micro, virtual, chunk_layers) == peak
