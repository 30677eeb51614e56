"""Optimizer offload (`app/optim/offload.py`): the NVMe store keeps what the optimizer wrote
through its bounded buffers, and an offloaded run is the same run.

The 1-rank runs are compared bit for bit: the offloaded update is torch's same element-wise
arithmetic on the same fp32 values, only chunked and on host tensors, so any difference is a
bug (a chunk written to the wrong offset, a stale slot, a lost moment)."""

from __future__ import annotations

import os

import pytest
import torch

from app.optim.offload import SLOTS, STATE_TENSORS, HostStore, NvmeStore
from conftest import read_metrics, run_app


def _masters() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) for n in (1000, 37, 2500)]


def test_the_nvme_store_streams_through_its_bounded_buffers(tmp_path):
    masters = _masters()
    store = NvmeStore(masters, tmp_path / "rank0.bin", buffer_bytes=SLOTS * STATE_TENSORS * 4 * 300)
    assert store.chunk == 300 and store.host_bytes() <= SLOTS * STATE_TENSORS * 4 * 300
    # The file holds the masters and zero moments; nothing of it is mapped into this process.
    assert os.path.getsize(tmp_path / "rank0.bin") == sum(m.numel() for m in masters) * STATE_TENSORS * 4
    for step in (1, 2):
        chunks = []
        for c in store.stream([0, 1, 2]):
            chunks.append((c.bucket, c.lo, c.hi))
            assert c.hi - c.lo <= store.chunk
            assert torch.equal(c.exp_avg, torch.full_like(c.exp_avg, step - 1.0))  # last step's write came back
            c.master.mul_(2)
            c.exp_avg.add_(1)
            c.exp_avg_sq.add_(c.master)
        # Every element of every bucket once, in order.
        assert chunks == [(b, lo, min(lo + 300, n)) for b, n in enumerate((1000, 37, 2500)) for lo in range(0, n, 300)]
    for b, m in enumerate(masters):
        assert torch.equal(store.read(0, b, 0, m.numel()), m * 4)
        assert torch.equal(store.read(1, b, 0, m.numel()), torch.full_like(m, 2.0))
        assert torch.equal(store.read(2, b, 0, m.numel()), m * 2 + m * 4)
    # A checkpoint load writes a range; the next stream reads it.
    store.write(1, 2, 10, torch.full((5,), 7.0))
    assert torch.equal(store.read(1, 2, 9, 16), torch.tensor([2.0] + [7.0] * 5 + [2.0]))
    store.close()
    assert not (tmp_path / "rank0.bin").exists()  # scratch: the checkpoints hold the durable state


def test_a_truncated_offload_file_is_named(tmp_path):
    store = NvmeStore(_masters(), tmp_path / "rank0.bin", buffer_bytes=4096)
    os.truncate(tmp_path / "rank0.bin", 100)
    with pytest.raises(OSError, match="rank0.bin: short read .* truncated"):
        list(store.stream([0]))
    store.close()


def test_the_host_store_hands_out_whole_bucket_shards():
    masters = _masters()
    store = HostStore(masters)
    chunks = list(store.stream([2, 0]))
    assert [(c.bucket, c.lo, c.hi) for c in chunks] == [(2, 0, 2500), (0, 0, 1000)]
    chunks[0].master.add_(1)
    assert torch.equal(store.read(0, 2, 0, 2500), masters[2] + 1)
    assert store.host_bytes() == sum(m.numel() for m in masters) * STATE_TENSORS * 4


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_runs_equal_the_device_run_bit_for_bit(tmp_path, precision):
    """One rank, 4 steps: optim.offload host and nvme (a 0.05 MB buffer, so every bucket is
    streamed in several chunks) log the same losses and gradient norms as none, to the bit."""
    sets = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32", "train.steps=4",
            "train.global_batch=4", "train.micro_batch=2", "run.log_every=1", "run.resume=none",
            "checkpoint.at_exit=false", f"train.precision={precision}", "parallel.dp_bucket_mb=0.05"]  # fmt: skip
    logged = {}
    for offload in ("none", "host", "nvme"):
        extra = [f"optim.offload={offload}", f"run.dir={tmp_path / offload}"]
        extra += ["optim.offload_buffer_mb=0.05"] if offload == "nvme" else []
        out = run_app(1, "inputs/gpt_tiny.yaml", *[a for s in (*sets, *extra) for a in ("--set", s)], timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        logged[offload] = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / offload) if "loss" in r]
    assert len(logged["none"]) == 4
    assert logged["host"] == logged["none"] and logged["nvme"] == logged["none"], logged
    assert not list((tmp_path / "nvme" / "offload").iterdir())  # the scratch file went at the end
