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
from app.data.prepare import prepare
from app.errors import DataError

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
    synth = build_dataset(SimpleNamespace(kind="synthetic", path=None, noise=0.0), model, seed=0)
    assert isinstance(synth, SyntheticTokens)
    x, y = get_batch(synth, [0, 1, 2])
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous() and x.device.type == "cpu"
    assert torch.equal(x[:, 1:], y[:, :-1])
    mm = build_dataset(SimpleNamespace(kind="memmap", path=dataset_prefix, noise=0.0), model, 0)
    assert isinstance(mm, MemmapTokens)
    x, y = get_batch(mm, [0, 5])
    assert torch.equal(torch.cat([x[0], y[0, -1:]]), torch.from_numpy(mm.sample(0)))
    with pytest.raises(DataError, match="data.path"):
        build_dataset(SimpleNamespace(kind="memmap", path=None, noise=0.0), model, 0)
