"""The input deck: defaults, every kind of bad value, overrides, world-size checks."""

from __future__ import annotations

import dataclasses

import pytest

from app.deck import SECTIONS, Deck, deck_reference, load_deck, resolve_for_world
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


def test_empty_deck_takes_defaults_and_run_dir_from_file_stem(tmp_path):
    deck = load_deck(write(tmp_path, ""))
    assert deck.model == Deck().model and deck.optim == Deck().optim
    assert deck.run.dir == "runs/deck"
    assert deck.model.ffn == 4 * deck.model.hidden


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
        ("parallel:\n  dp: many\n", "parallel.dp", "'auto'"),
        ("train:\n  global_batch: 10\n  micro_batch: 4\n", "train.global_batch", "multiple of train.micro_batch"),
        ("optim:\n  lr: 1.0e-4\n  min_lr: 1.0e-3\n", "optim.min_lr", "<= optim.lr"),
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
    with pytest.raises(DeckError, match=r"tp x pp = 4 must divide the world size 6"):
        resolve_for_world(deck, 6)


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


def test_readme_documents_every_deck_key():
    readme = (REPO / "README.md").read_text()
    rows = deck_reference()
    assert {key.split(".")[0] for key, *_ in rows} == set(SECTIONS)
    missing = [key for key, *_ in rows if f"`{key}`" not in readme]
    assert not missing, f"README.md deck reference lacks {missing}"
