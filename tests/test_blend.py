"""Blended datasets (data.paths): the slot table (proportions, spread, each file read in its own
order), the deck's form and its refusals, tokenizer agreement, independence of the grid, and an
exact resume from a checkpoint (MPI)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app.data import BlendedTokens, GlobalBatchSampler, MemmapTokens, build_dataset, get_batch
from app.data.blend import PERIOD, slot_counts, slot_table
from app.data.prepare import prepare
from app.deck import load_deck
from app.deck_paths import check_paths
from app.errors import DataError, DeckError
from conftest import grid_trainer, train_steps

SEQ = 8


def token_file(directory: Path, letter: str, docs: int = 30) -> str:
    """A byte token file whose every document is `letter` repeated (so a sample shows its file)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(docs):
        p = directory / f"{letter}{i:03d}.txt"
        p.write_text(letter * (5 + i % 11))
        paths.append(str(p))
    prefix = str(directory / letter)
    prepare(paths, prefix)
    return prefix


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    return {letter: token_file(tmp_path / letter, letter) for letter in "abc"}


def letter_of(sample: np.ndarray) -> str:
    return chr(int(next(t for t in sample if t != 256)))


# ---- the slot table -----------------------------------------------------------------------


def test_slot_counts_are_the_weights_in_65536ths_summing_to_the_period():
    assert slot_counts([0.7, 0.3]).tolist() == [45875, 19661]
    assert slot_counts([7, 3]).tolist() == [45875, 19661]  # relative weights
    rng = np.random.default_rng(1)
    for _ in range(20):
        w = rng.random(int(rng.integers(1, 9))) + 1e-3
        counts = slot_counts(list(w))
        assert counts.sum() == PERIOD and np.all(np.abs(counts - PERIOD * w / w.sum()) < 1)


def test_every_prefix_of_a_period_holds_each_file_within_1_5_samples_of_its_share():
    rng = np.random.default_rng(2)
    for _ in range(10):
        counts = slot_counts(list(rng.random(int(rng.integers(2, 9))) + 0.01))
        owner, _ = slot_table(counts)
        m = np.arange(1, PERIOD + 1)
        for k, n in enumerate(counts):
            assert np.abs(np.cumsum(owner == k) - m * n / PERIOD).max() <= 1.5


def test_each_file_is_read_in_its_own_sample_order_without_gaps_or_repeats(files):
    blend = BlendedTokens([(0.5, files["a"]), (0.3, files["b"]), (0.2, files["c"])], SEQ, 257, seed=0)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for i in range(2 * PERIOD + 100):
        k, j = blend.locate(i)
        seen[k].append(j)
    for js in seen.values():
        assert js == list(range(len(js)))
    assert [len(seen[k]) for k in range(3)] == [
        2 * n + int((blend.owner[:100] == k).sum()) for k, n in enumerate(blend.counts)
    ]


def test_samples_come_from_the_files_in_proportion(files):
    blend = BlendedTokens([(0.7, files["a"]), (0.3, files["b"])], SEQ, 257, seed=3)
    letters = [letter_of(blend.sample(i)) for i in range(1000)]
    assert abs(letters.count("a") - 700) <= 1.5 and letters.count("a") + letters.count("b") == 1000
    for i in (0, 17, 999):
        k, j = blend.locate(i)
        np.testing.assert_array_equal(blend.sample(i), blend.datasets[k].sample(j))


def test_a_blend_of_one_file_reads_what_data_path_reads(files):
    blend = BlendedTokens([(0.25, files["a"])], SEQ, 257, seed=5)
    single = MemmapTokens(files["a"], SEQ, 257, seed=5)
    for i in [*range(50), 3 * single.num_samples + 1, PERIOD + 7]:
        np.testing.assert_array_equal(blend.sample(i), single.sample(i))


def test_the_batches_are_the_same_for_every_dp_size_and_call_order(files):
    blend = [(0.6, files["a"]), (0.4, files["c"])]
    model = SimpleNamespace(vocab_size=257, seq_len=SEQ)
    data = SimpleNamespace(kind="memmap", path=None, paths=[{"path": p, "weight": w} for w, p in blend], blend=blend)
    steps = {}
    for dp in (1, 2, 4):
        ds = build_dataset(data, model, seed=9)  # a fresh dataset per dp, as each job opens its own
        assert isinstance(ds, BlendedTokens)
        samplers = [GlobalBatchSampler(16, 2, r, dp) for r in reversed(range(dp))]  # ranks in any order
        batches = []
        for _ in range(3):
            per_rank = [torch.cat([get_batch(ds, mb)[0] for mb in s.next_step()]) for s in samplers]
            batches.append(torch.cat(per_rank[::-1]))
        steps[dp] = torch.stack(batches)
    assert torch.equal(steps[1], steps[2]) and torch.equal(steps[1], steps[4])


def test_files_of_different_tokenizers_cannot_be_blended(files, tmp_path):
    meta_path = Path(files["b"] + ".json")
    meta = json.loads(meta_path.read_text())
    meta.update(tokenizer="huggingface", tokenizer_path="/x/tokenizer.json", tokenizer_sha256="ab" * 32)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError) as e:
        BlendedTokens([(0.5, files["a"]), (0.5, files["b"])], SEQ, 257, seed=0)
    message = str(e.value)
    assert files["a"] + ".json" in message and files["b"] + ".json" in message
    assert "tokenizer: 'byte' vs 'huggingface'" in message and "fix: prepare every file" in message


def test_a_weight_too_small_for_a_slot_is_refused(files):
    with pytest.raises(DataError, match=r"data.paths\[1\].weight = 1e-06 is below 1/65536.*never be read"):
        BlendedTokens([(1.0, files["a"]), (1e-6, files["b"])], SEQ, 257, seed=0)


def test_a_bad_id_in_a_blend_names_the_file_it_came_from(files):
    blend = BlendedTokens([(0.5, files["a"]), (0.5, files["b"])], SEQ, 257, seed=0)
    with open(files["b"] + ".bin", "r+b") as f:  # corrupted after the checks at open (the .bin is mapped)
        f.write(np.full(40, 300, dtype="<u2").tobytes())
    bad = next(i for i in range(200) if blend.locate(i)[0] == 1 and blend.sample(i).max() == 300)
    assert blend.locate(0)[0] == 0 and get_batch(blend, [0])[0].shape == (1, SEQ)  # a's rows pass
    with pytest.raises(DataError) as e:
        get_batch(blend, [0, bad])
    assert files["b"] + ".bin" in str(e.value) and "token id 300" in str(e.value)


# ---- the deck -------------------------------------------------------------------------------


def test_the_deck_takes_a_list_of_path_and_weight(files):
    blend = f"[{{path: {files['a']}, weight: 0.7}}, {{path: {files['b']}, weight: 0.3}}]"
    deck = load_deck(None, ("data.kind=memmap", f"data.paths={blend}"))
    assert deck.data.blend == [(0.7, files["a"]), (0.3, files["b"])]
    check_paths(deck)
    assert load_deck(None, ("data.kind=memmap", f"data.path={files['a']}")).data.blend == [(1.0, files["a"])]


REFUSED = {
    "both": (("data.path=x", "data.paths=[{path: a, weight: 1}]"), "data.paths", "data.path is set as well"),
    "neither": ((), "data.path", "or a blend of several as data.paths"),
    "synthetic": (("data.kind=synthetic", "data.paths=[{path: a, weight: 1}]"), "data.paths", "only used with"),
    "empty": (("data.paths=[]",), "data.paths", "an empty blend"),
    "pair-form": (("data.paths=[[0.7, a]]",), "data.paths[0]", "expected a mapping of the keys path, weight"),
    "no-weight": (("data.paths=[{path: a}]",), "data.paths[0]", "missing key(s) weight"),
    "zero-weight": (("data.paths=[{path: a, weight: 0}]",), "data.paths[0].weight", "must be > 0.0"),
    "typo": (("data.paths=[{path: a, wieght: 1}]",), "data.paths[0].wieght", "did you mean 'weight'"),
    "twice": (("data.paths=[{path: a, weight: 1}, {path: a, weight: 2}]",), "data.paths[1].path", "listed twice"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_bad_blends_are_deck_errors_naming_the_entry(case):
    sets, key, says = REFUSED[case]
    kind = () if any(s.startswith("data.kind") for s in sets) else ("data.kind=memmap",)
    with pytest.raises(DeckError) as e:
        load_deck(None, (*kind, *sets))
    assert e.value.key == key and says in str(e.value)


def test_a_missing_file_of_a_blend_is_named_by_its_entry(files, tmp_path):
    blend = f"[{{path: {files['a']}, weight: 1}}, {{path: {tmp_path / 'gone'}, weight: 1}}]"
    with pytest.raises(DeckError) as e:
        check_paths(load_deck(None, ("data.kind=memmap", f"data.paths={blend}", f"run.dir={tmp_path / 'run'}")))
    assert e.value.key == "data.paths[1].path" and "gone.json does not exist" in str(e.value)


# ---- MPI: resume ------------------------------------------------------------------------------

GRIDS = {1: (1, 1, 1), 2: (1, 1, 2), 4: (2, 1, 2)}
SMALL = (
    "model.vocab_size=260", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
    "train.steps=5", "train.global_batch=8", "train.micro_batch=2", "optim.lr=3.0e-3", "run.log_every=100",
    "run.resume=none", "checkpoint.at_exit=false", "data.kind=memmap",
)  # fmt: skip


@pytest.mark.mpi
def test_a_blended_run_resumed_from_a_checkpoint_reads_and_trains_exactly_as_the_straight_run(
    runtime, grids, shared_tmp
):
    from app.checkpoint.io import load

    if runtime.is_root:
        for letter in "ab":
            token_file(shared_tmp / letter, letter, docs=60)
    runtime.comm.Barrier()
    blend = f"[{{path: {shared_tmp / 'a' / 'a'}, weight: 0.7}}, {{path: {shared_tmp / 'b' / 'b'}, weight: 0.3}}]"

    def trainer(name: str):
        sets = (*SMALL, f"data.paths={blend}", f"run.dir={shared_tmp / name}")
        return grid_trainer(grids, *GRIDS[grids.world.world_size], sets)

    straight = trainer("straight")
    expected = train_steps(straight, 5)
    first = trainer("first")
    train_steps(first, 3)
    saved = first.save("test")
    resumed = trainer("resumed")
    load(resumed, saved.path)
    assert resumed.sampler.consumed_samples == 24
    s = resumed.sampler
    probe = GlobalBatchSampler(8, 2, s.dp_rank, s.dp_size)
    probe.load_state_dict(s.state_dict())
    fresh = GlobalBatchSampler(8, 2, s.dp_rank, s.dp_size)
    for _ in range(3):
        fresh.next_step()
    upcoming = probe.next_step()
    assert upcoming == fresh.next_step()  # the indices of the straight run's step 4 ...
    for mb in upcoming:  # ... read the same tokens from the resumed job's files as from the straight one's
        assert torch.equal(get_batch(resumed.dataset, mb)[0], get_batch(straight.dataset, mb)[0])
    assert train_steps(resumed, 2) == expected[3:]  # bitwise: the same batches, the same floats
