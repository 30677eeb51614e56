"""app.data: tokenizer, synthetic and memmapped datasets, prepare CLI, global batch sampler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app.data import (
    ByteTokenizer,
    GlobalBatchSampler,
    MemmapTokens,
    SyntheticTokens,
    build_dataset,
    get_batch,
)
from app.data.memmap import SAMPLE_TOKENS, sample_ranges
from app.data.prepare import prepare
from app.errors import DataError
from conftest import run_app

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["hello world, this is gridlm.\n", "naïve café — 日本語 ✓\n" * 3, "x", "the end\n" * 5]


def run_prepare(*args):
    cmd = [sys.executable, "-m", "app.data.prepare", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)


@pytest.fixture
def dataset_prefix(tmp_path):
    paths = []
    for i, text in enumerate(DOCS):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(text, encoding="utf-8")
        paths.append(str(p))
    prefix = str(tmp_path / "out" / "tokens")
    prepare(paths, prefix)
    return prefix


def test_tokenizer_round_trips_unicode_text():
    tok = ByteTokenizer()
    text = "héllo, wörld — 日本語 🙂"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.EOS not in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.EOS] + tok.encode("!")) == text + "!"
    assert tok.vocab_size == 257 and tok.EOS == 256


def test_synthetic_sample_is_a_pure_function_of_seed_and_index():
    a = SyntheticTokens(vocab_size=97, seq_len=16, seed=3)
    b = SyntheticTokens(vocab_size=97, seq_len=16, seed=3)
    forward = [a.sample(i) for i in range(10)]
    backward = [b.sample(i) for i in reversed(range(10))][::-1]
    for x, y in zip(forward, backward):
        assert x.dtype == np.int64 and x.shape == (17,)
        np.testing.assert_array_equal(x, y)
    other = SyntheticTokens(vocab_size=97, seq_len=16, seed=4)
    assert any(not np.array_equal(a.sample(i), other.sample(i)) for i in range(10))
    assert a.num_samples is None


def test_synthetic_tokens_are_in_range():
    ds = SyntheticTokens(vocab_size=13, seq_len=64, seed=0, noise=0.5)
    samples = np.stack([ds.sample(i) for i in range(50)])
    assert samples.min() >= 0 and samples.max() < 13


def test_synthetic_without_noise_is_an_arithmetic_progression():
    v = 101
    ds = SyntheticTokens(vocab_size=v, seq_len=32, seed=1, noise=0.0)
    strides = set()
    for i in range(40):
        s = ds.sample(i)
        stride = (s[1] - s[0]) % v
        np.testing.assert_array_equal(s[1:], (s[:-1] + stride) % v)
        strides.add(int(stride))
    assert strides <= {1, 2, 3, 5, 7, 11, 13, 17} and len(strides) > 1


def test_prepare_writes_the_documented_metadata(dataset_prefix):
    meta = json.loads(Path(dataset_prefix + ".json").read_text())
    n = sum(len(d.encode()) + 1 for d in DOCS)
    assert meta == {
        "format": "gridlm-tokens",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": 257,
        "num_tokens": n,
        "num_documents": len(DOCS),
        "tokenizer": "byte",
        "eos": 256,
        "max_token_id": 256,
    }
    assert os.path.getsize(dataset_prefix + ".bin") == 2 * n
    idx = np.load(dataset_prefix + ".idx.npy")
    assert idx.dtype == np.int64 and idx[0] == 0 and idx[-1] == n and len(idx) == len(DOCS) + 1
    assert not [f for f in os.listdir(os.path.dirname(dataset_prefix)) if f.endswith(".tmp")]


def test_memmap_window_equals_the_slice_of_documents_plus_eos(dataset_prefix):
    tok = ByteTokenizer()
    stream = [t for d in DOCS for t in tok.encode(d) + [tok.EOS]]
    seq_len = 8
    ds = MemmapTokens(dataset_prefix, seq_len=seq_len, vocab_size=257, seed=0)
    assert ds.num_samples == (len(stream) - 1) // seq_len
    for i in range(ds.num_samples):
        s = ds.sample(i)
        assert s.dtype == np.int64 and s.shape == (seq_len + 1,)
        w = int(ds._perm[i])  # the window this epoch visits at position i
        expected = stream[w * seq_len : w * seq_len + seq_len + 1]
        assert s.tolist() == expected and tok.decode(s) == tok.decode(expected)


def test_memmap_epochs_are_seeded_permutations_covering_every_window(dataset_prefix):
    ds = MemmapTokens(dataset_prefix, seq_len=8, vocab_size=300, seed=5)
    n = ds.num_samples
    windows = sorted(tuple(ds.window(w)) for w in range(n))
    epochs = [[tuple(ds.sample(e * n + i)) for i in range(n)] for e in range(3)]
    for seen in epochs:
        assert sorted(seen) == windows  # every window exactly once per epoch
    assert epochs[0] != epochs[1]  # each epoch has its own order
    again = MemmapTokens(dataset_prefix, seq_len=8, vocab_size=300, seed=5)
    assert tuple(again.sample(2 * n + 1)) == epochs[2][1]  # call order does not matter


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 2)


def unsort_index(path):
    idx = np.load(path)
    np.save(path, idx[[0, 2, 1, *range(3, len(idx))]])


DAMAGE = {
    "missing-bin": (lambda p: os.remove(p + ".bin"), ".bin", "app.data.prepare"),
    "missing-json": (lambda p: os.remove(p + ".json"), ".json", "app.data.prepare"),
    "missing-idx": (lambda p: os.remove(p + ".idx.npy"), ".idx.npy", "app.data.prepare"),
    "truncated-bin": (lambda p: truncate(p + ".bin"), ".bin", "truncated"),
    "bad-json": (lambda p: Path(p + ".json").write_text("{not"), ".json", "not valid JSON"),
    "wrong-format": (lambda p: Path(p + ".json").write_text("[1]"), ".json", "gridlm token"),
    "unsorted-idx": (lambda p: unsort_index(p + ".idx.npy"), ".idx.npy", "monotone"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_memmap_damaged_files_raise_data_error_naming_file_and_fix(dataset_prefix, case):
    damage, ext, says = DAMAGE[case]
    damage(dataset_prefix)
    with pytest.raises(DataError, match=says) as e:
        MemmapTokens(dataset_prefix, seq_len=8, vocab_size=257, seed=0)
    assert dataset_prefix + ext in str(e.value) and "fix" in str(e.value)


def test_memmap_vocab_larger_than_model_says_set_model_vocab_size(dataset_prefix):
    with pytest.raises(DataError, match=r"set model.vocab_size >= 257") as e:
        MemmapTokens(dataset_prefix, seq_len=8, vocab_size=256, seed=0)
    assert dataset_prefix + ".json" in str(e.value)


def test_memmap_too_few_tokens_for_seq_len_is_reported(dataset_prefix):
    n = json.loads(Path(dataset_prefix + ".json").read_text())["num_tokens"]
    with pytest.raises(DataError, match="seq_len") as e:
        MemmapTokens(dataset_prefix, seq_len=n, vocab_size=257, seed=0)
    assert dataset_prefix + ".bin" in str(e.value)


def test_prepare_uint32_round_trips(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("abcdefghij")
    meta = prepare([str(p)], str(tmp_path / "t"), dtype="uint32")
    assert meta["dtype"] == "uint32" and os.path.getsize(tmp_path / "t.bin") == 4 * 11
    ds = MemmapTokens(str(tmp_path / "t"), seq_len=10, vocab_size=257, seed=0)
    assert ByteTokenizer().decode(ds.sample(0)) == "abcdefghij"


def test_prepare_cli_on_missing_file_exits_2_without_traceback(tmp_path):
    missing = str(tmp_path / "nope.txt")
    r = run_prepare(missing, "--out", tmp_path / "t")
    assert r.returncode == 2
    assert missing in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert not os.listdir(tmp_path)


def test_prepare_cli_prints_a_summary(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("hello")
    r = run_prepare(p, "--out", tmp_path / "t")
    assert r.returncode == 0, r.stderr
    assert "1 documents, 6 tokens" in r.stdout and str(tmp_path / "t.bin") in r.stdout


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_sampler_union_over_dp_ranks_is_the_global_batch(dp_size):
    global_batch, micro_batch = 16, 2
    samplers = [GlobalBatchSampler(global_batch, micro_batch, r, dp_size) for r in range(dp_size)]
    seen = []
    for step in range(3):
        step_indices = []
        for s in samplers:
            mbs = s.next_step()
            assert len(mbs) == s.num_micro_batches == global_batch // (micro_batch * dp_size)
            assert all(len(mb) == micro_batch for mb in mbs)
            step_indices += [i for mb in mbs for i in mb]
        assert sorted(step_indices) == list(range(step * global_batch, (step + 1) * global_batch))
        seen += step_indices
    assert sorted(seen) == list(range(3 * global_batch)) and len(seen) == len(set(seen))


def test_sampler_rank_takes_its_contiguous_chunk_in_order():
    s = GlobalBatchSampler(global_batch=8, micro_batch=2, dp_rank=1, dp_size=2)
    assert s.next_step() == [[4, 5], [6, 7]]
    assert s.next_step() == [[12, 13], [14, 15]]


def test_sampler_resumes_from_state_dict():
    a = GlobalBatchSampler(12, 2, dp_rank=1, dp_size=3)
    a.next_step()
    state = a.state_dict()
    assert state == {"consumed_samples": 12}
    b = GlobalBatchSampler(12, 2, dp_rank=1, dp_size=3)
    b.load_state_dict(state)
    assert b.next_step() == a.next_step()
    c = GlobalBatchSampler(12, 2, dp_rank=1, dp_size=3, consumed_samples=24)
    assert c.next_step() == b.next_step()


@pytest.mark.parametrize("args", [(10, 4, 0, 1), (12, 2, 0, 4), (8, 2, 2, 2), (8, 0, 0, 1)])
def test_sampler_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        GlobalBatchSampler(*args)


def test_build_dataset_and_get_batch_give_shifted_int64_tensors(dataset_prefix):
    model = SimpleNamespace(vocab_size=257, seq_len=8)
    synth = build_dataset(SimpleNamespace(kind="synthetic", path=None, noise=0.0, split=0.0), model, seed=0)
    assert isinstance(synth, SyntheticTokens)
    x, y = get_batch(synth, [0, 1, 2])
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous() and x.device.type == "cpu"
    assert torch.equal(x[:, 1:], y[:, :-1])
    mm = build_dataset(SimpleNamespace(kind="memmap", path=dataset_prefix, noise=0.0, split=0.0), model, 0)
    assert isinstance(mm, MemmapTokens)
    x, y = get_batch(mm, [0, 5])
    assert torch.equal(torch.cat([x[0], y[0, -1:]]), torch.from_numpy(mm.sample(0)))
    with pytest.raises(DataError, match="data.path"):
        build_dataset(SimpleNamespace(kind="memmap", path=None, noise=0.0), model, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_context_parallel_rank_reads_its_chunks_only_and_gets_the_split_of_the_whole_batch(dataset_prefix, cp):
    """get_batch with a cp rank's spans (`ContextParallel.spans`) equals the rank's split of the
    whole batch, for synthetic, memmap and blended data; the memmap rows read hold only the spans'
    tokens (the chunks and each one's next token)."""
    from app.data import BlendedTokens
    from app.tensor_parallel.context import ContextParallel, Ring

    seq = 16
    datasets = {
        "synthetic": SyntheticTokens(257, seq, 3, 0.2),
        "memmap": MemmapTokens(dataset_prefix, seq, 257, 0),
        "blend": BlendedTokens([(0.5, dataset_prefix), (0.5, dataset_prefix)], seq, 257, 1),
    }
    for name, ds in datasets.items():
        whole = get_batch(ds, [0, 3, 7])
        for rank in range(cp):
            split = ContextParallel(Ring(cp, rank))
            positions = split.spans(seq)
            assert sum(b - a for a, b in positions) == seq // cp
            x, y = get_batch(ds, [0, 3, 7], positions)
            assert torch.equal(x, split.split(whole[0], 1)), (name, rank)
            assert torch.equal(y, split.split(whole[1], 1)), (name, rank)
    read = datasets["memmap"].sample(3, [(a, b + 1) for a, b in ContextParallel(Ring(cp, 0)).spans(seq)])
    assert len(read) == seq // cp + 2  # two chunks, each with the token after it


def test_an_id_above_the_vocab_in_a_cp_rank_s_chunk_is_named_at_its_token(tmp_path):
    """The batch check of a rank that reads spans names the token's place in the file, not its
    column in the rank's rows."""
    from app.tensor_parallel.context import ContextParallel, Ring

    seq = 16
    tokens = np.random.default_rng(1).integers(0, 257, 4 * seq + 1).astype(np.uint16)
    ds_tokens = write_tokens(tmp_path / "cp", tokens, max_token_id=256)
    ds = MemmapTokens(ds_tokens, seq_len=seq, vocab_size=512, seed=2)
    window = ds.window_of(0)
    positions = ContextParallel(Ring(2, 0)).spans(seq)  # chunks 0 and 3: positions 0..3 and 12..15
    position = window * seq + 13
    patch_token(ds_tokens, position, 5000)
    with pytest.raises(DataError, match=f"token id 5000 at token {position} \\(sample 0\\)"):
        get_batch(ds, [0], positions)
    x, _ = get_batch(ds, [0], ContextParallel(Ring(2, 1)).spans(seq))  # chunks 1 and 2: not read
    assert x.shape == (1, seq // 2)


# Token ids >= model.vocab_size: refused at open (recorded max, then a sample of the .bin), and
# per batch for what the sample missed; every message names the file and the fix.


def write_tokens(prefix: Path, tokens: np.ndarray, **meta_overrides) -> str:
    """A token dataset in the documented format, written directly (one document)."""
    tokens = tokens.astype(np.uint16)
    tokens.tofile(f"{prefix}.bin")
    np.save(f"{prefix}.idx.npy", np.array([0, len(tokens)], dtype=np.int64))
    meta = {"format": "gridlm-tokens", "version": 1, "dtype": "uint16", "vocab_size": 257,
            "num_tokens": len(tokens), "num_documents": 1, "tokenizer": "byte", "eos": 256,
            "max_token_id": int(tokens.max())}  # fmt: skip
    meta.update(meta_overrides)
    Path(f"{prefix}.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))
    return str(prefix)


def patch_token(prefix: str, position: int, value: int) -> None:
    with open(prefix + ".bin", "r+b") as f:
        f.seek(2 * position)
        f.write(np.array([value], dtype="<u2").tobytes())


def drop_max_token_id(prefix: str) -> None:
    """Make the .json look like one written by a prepare from before max_token_id."""
    path = Path(prefix + ".json")
    meta = json.loads(path.read_text())
    del meta["max_token_id"]
    path.write_text(json.dumps(meta))


def test_prepare_records_the_largest_token_id(dataset_prefix):
    meta = json.loads(Path(dataset_prefix + ".json").read_text())
    assert meta["max_token_id"] == int(np.fromfile(dataset_prefix + ".bin", dtype="<u2").max()) == 256


def test_recorded_max_id_at_or_above_model_vocab_is_refused_at_open_naming_the_file(tmp_path):
    prefix = write_tokens(tmp_path / "t", np.arange(500) % 257, max_token_id=400)
    with pytest.raises(DataError) as e:
        MemmapTokens(prefix, seq_len=8, vocab_size=300, seed=0)
    message = str(e.value)
    assert prefix + ".bin" in message and "token ids up to 400" in message
    assert "re-tokenize with a vocabulary of at most 300, or set model.vocab_size >= 401" in message
    MemmapTokens(prefix, seq_len=8, vocab_size=401, seed=0)  # fits


def test_old_metadata_without_max_id_is_sampled_and_refused_at_open(dataset_prefix):
    drop_max_token_id(dataset_prefix)
    MemmapTokens(dataset_prefix, seq_len=8, vocab_size=257, seed=0)  # old files still open
    patch_token(dataset_prefix, 10, 999)
    with pytest.raises(DataError, match="found by sampling") as e:
        MemmapTokens(dataset_prefix, seq_len=8, vocab_size=300, seed=0)
    message = str(e.value)
    assert dataset_prefix + ".bin" in message and "token id 999 at token 10" in message
    assert "set model.vocab_size >= 1000" in message


def test_sample_finds_ids_above_the_recorded_max_as_corruption(dataset_prefix):
    patch_token(dataset_prefix, 3, 300)  # below model.vocab_size, but prepare never wrote it
    with pytest.raises(DataError, match="corrupt") as e:
        MemmapTokens(dataset_prefix, seq_len=8, vocab_size=512, seed=0)
    assert dataset_prefix + ".bin" in str(e.value) and "token id 300 at token 3" in str(e.value)


def test_sample_is_about_a_million_tokens_spread_over_the_file():
    assert sample_ranges(1000) == [(0, 1000)]
    ranges = sample_ranges(100 * SAMPLE_TOKENS)
    assert sum(b - a for a, b in ranges) == SAMPLE_TOKENS
    assert ranges[0][0] == 0 and ranges[-1][1] == 100 * SAMPLE_TOKENS
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(ranges, ranges[1:]))


def test_corrupt_id_the_sample_misses_is_caught_by_the_batch_check_naming_file_and_sample(tmp_path):
    seq_len, n = 64, 3 * SAMPLE_TOKENS + 1
    tokens = np.random.default_rng(0).integers(0, 257, n).astype(np.uint16)
    ranges = sample_ranges(n)
    position = (ranges[4][1] + ranges[5][0]) // 2 | 1  # between two sampled chunks, not a window edge
    assert not any(a <= position < b for a, b in ranges)
    tokens[position] = 5000
    prefix = write_tokens(tmp_path / "big", tokens, max_token_id=256)  # the .bin changed after prepare
    ds = MemmapTokens(prefix, seq_len=seq_len, vocab_size=512, seed=7)  # the sample misses it
    bad = int(np.flatnonzero(np.random.default_rng([7, 0]).permutation(ds.num_samples) == position // seq_len)[0])
    x, _ = get_batch(ds, [bad + 1, bad + 2])  # clean samples pass
    assert x.shape == (2, seq_len)
    with pytest.raises(DataError) as e:
        get_batch(ds, [bad + 1, bad])  # the second row is the bad one
    message = str(e.value)
    assert prefix + ".bin" in message and f"token id 5000 at token {position} (sample {bad})" in message
    assert "set model.vocab_size >= 5001" in message


def refused_on_two_ranks(prefix: str, tmp_path: Path) -> str:
    """gpt_tiny on 2 ranks reading token file `prefix`: exit 2, one gridlm line, no traceback; its stderr."""
    out = run_app(
        2, "inputs/gpt_tiny.yaml", "--set", "data.kind=memmap", "--set", f"data.path={prefix}",
        "--set", "train.steps=2", "--set", f"run.dir={tmp_path / 'run'}", timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("gridlm:") == 1 and "Traceback" not in out.stdout + out.stderr, out.stderr
    return out.stderr


def test_app_refuses_a_token_file_above_the_vocab_with_status_2_and_no_traceback(tmp_path):
    # gpt_tiny has model.vocab_size 512; an old-format file (no recorded max) holds id 700.
    prefix = write_tokens(tmp_path / "corpus", np.arange(4000) % 257, max_token_id=None)
    patch_token(prefix, 2000, 700)
    stderr = refused_on_two_ranks(prefix, tmp_path)
    assert prefix + ".bin" in stderr and "token id 700 at token 2000" in stderr


def test_the_document_index_stays_mapped_and_its_order_is_checked_a_chunk_at_a_time(tmp_path):
    """Found in review (2026-11-30): the index was copied whole on every rank (8 bytes a document: 1.6 GB
    for 200M documents) for one lookup at the split point. It stays a memory map; the monotone
    check reads it in chunks and still finds a decrease across a chunk's edge."""
    from app.data.memmap import MemmapTokens, _monotone

    ds = MemmapTokens(write_tokens(tmp_path / "docs", np.arange(200) % 256), 8, 257, seed=0)
    assert isinstance(ds.doc_offsets, np.memmap)
    offsets = np.arange(3000)
    assert _monotone(offsets, chunk=7) and _monotone(offsets[:0], chunk=7)
    offsets[7] = 3  # the first of a chunk below the last of the one before
    assert not _monotone(offsets, chunk=7)


# The document index's order: read whole on one rank of a job (found in review: every rank read all
# of it, 800 MB for 100M documents, every node from the same file-system server).


def write_documents(prefix: Path, documents: int, swap: int = -1) -> str:
    """A token file of `documents` one-token documents; with `swap` >= 1, offsets swap and swap + 1
    exchanged (a decrease there)."""
    prefix = write_tokens(prefix, np.arange(documents) % 256, num_documents=documents)
    idx = np.arange(documents + 1, dtype=np.int64)
    if swap >= 1:
        idx[[swap, swap + 1]] = idx[[swap + 1, swap]]
    np.save(f"{prefix}.idx.npy", idx)
    return prefix


def count_whole_checks(monkeypatch) -> list:
    """Make memmap's whole-index check count its calls (the list's length)."""
    from app.data import memmap

    calls, whole = [], memmap._monotone
    monkeypatch.setattr(memmap, "_monotone", lambda offsets, *a: calls.append(len(offsets)) or whole(offsets, *a))
    return calls


DOCUMENTS = 1 << 14  # the split point 0.25 of them from the end: 12,288 offsets past memmap.NEAR_SPLIT


def test_a_rank_other_than_0_reads_the_ends_and_the_split_point_s_neighbourhood_of_the_index(tmp_path, monkeypatch):
    documents = DOCUMENTS
    calls = count_whole_checks(monkeypatch)
    MemmapTokens(write_documents(tmp_path / "good", documents), 8, 257, seed=0, split=0.25, whole_index=False)
    assert calls == []  # the whole index is not read
    far = write_documents(tmp_path / "far", documents, swap=10)
    MemmapTokens(far, 8, 257, seed=0, split=0.25, whole_index=False)  # the decrease is rank 0's to find
    near = write_documents(tmp_path / "near", documents, swap=documents * 3 // 4 - 5)
    with pytest.raises(DataError, match="not a monotone list") as e:
        MemmapTokens(near, 8, 257, seed=0, split=0.25, whole_index=False)
    assert near + ".idx.npy" in str(e.value) and calls == []
    with pytest.raises(DataError, match="not a monotone list"):  # rank 0, or a process alone (the default)
        MemmapTokens(far, 8, 257, seed=0, split=0.25)
    assert calls == [documents + 1]


@pytest.mark.mpi(min_size=2)
def test_a_job_reads_each_token_file_s_whole_index_once_and_refuses_a_decrease_on_every_rank(
    runtime, grids, shared_tmp, monkeypatch
):
    """A trainer on a blend of two files with a held-out file: the whole-index check ran once per
    file in the job (on its rank 0), not once per rank; a decrease far from the split point (the
    neighbourhood the other ranks read) ends every rank with one message."""
    from conftest import grid_trainer

    documents = DOCUMENTS
    size = 2
    sub = grids.runtime(size)
    copy = shared_tmp / str(runtime.rank // size)
    if sub.rank == 0:
        copy.mkdir(parents=True, exist_ok=True)
        for name in ("a", "b", "held"):
            write_documents(copy / name, documents)
        write_documents(copy / "bad", documents, swap=10)
    sub.comm.Barrier()
    calls = count_whole_checks(monkeypatch)

    def trainer(*names):
        blend = ", ".join(f"{{path: {copy / n}, weight: 1.0}}" for n in names)
        sets = ("data.kind=memmap", f"data.paths=[{blend}]", f"eval.path={copy / 'held'}", "eval.every=10",
                "model.vocab_size=257", "model.seq_len=8", f"run.dir={copy / 'run'}", "run.resume=none")  # fmt: skip
        return grid_trainer(grids, 1, 1, size, sets)

    trainer("a", "b").close()
    assert sub.comm.allreduce(len(calls)) == 3  # a, b and the held-out file, each once
    try:
        trainer("a", "bad")
        message = None
    except DataError as err:
        message = str(err)
    messages = sub.comm.allgather(message)
    assert messages[0] is not None and "not a monotone list" in messages[0], messages[0]
    assert str(copy / "bad") + ".idx.npy" in messages[0] and messages == [messages[0]] * size


def test_app_refuses_an_index_with_a_decrease_only_rank_0_reads_with_status_2_on_every_rank(tmp_path):
    prefix = write_documents(tmp_path / "corpus", DOCUMENTS, swap=10)
    stderr = refused_on_two_ranks(prefix, tmp_path)
    assert prefix + ".idx.npy" in stderr and "not a monotone list" in stderr
