"""Optimizer offload (`app/optim/offload.py`): the NVMe store keeps what the optimizer wrote
through its bounded buffers, and an offloaded run is the same run.

The 1-rank runs are compared bit for bit: the offloaded update is torch's same element-wise
arithmetic on the same fp32 values, only chunked and on host tensors, so any difference is a
bug (a chunk written to the wrong offset, a stale slot, a lost moment)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from app.optim.multi_tensor import complement
from app.optim.offload import SLOTS, STATE_TENSORS, HostStore, NvmeStore
from conftest import REPO, app_env, read_metrics, run_app


def _masters() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) for n in (1000, 37, 2500)]


def test_the_nvme_store_streams_through_its_bounded_buffers(tmp_path):
    masters = _masters()
    store = NvmeStore(masters, tmp_path / "rank0.bin", buffer_bytes=SLOTS * STATE_TENSORS * 4 * 2500)
    # Chunks of whole 4 KiB blocks (O_DIRECT): 2500 elements' worth of buffer gives chunks of 2048.
    assert store.chunk == 2048 and store.host_bytes() <= SLOTS * STATE_TENSORS * 4 * 2500
    assert store.direct  # ext4 here: the stream bypasses the page cache
    # The file holds the masters and zero moments, each region padded to whole blocks; nothing of it
    # is mapped into this process.
    padded = sum(-(-m.numel() // 1024) * 1024 for m in masters)
    assert os.path.getsize(tmp_path / "rank0.bin") == padded * STATE_TENSORS * 4
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
        assert chunks == [
            (b, lo, min(lo + 2048, n)) for b, n in enumerate((1000, 37, 2500)) for lo in range(0, n, 2048)
        ]
    for b, m in enumerate(masters):
        assert torch.equal(store.read(0, b, 0, m.numel()), m * 4)
        assert torch.equal(store.read(1, b, 0, m.numel()), torch.full_like(m, 2.0))
        assert torch.equal(store.read(2, b, 0, m.numel()), m * 2 + m * 4)
    # A checkpoint load writes a range; the next stream reads it.
    store.write(1, 2, 10, torch.full((5,), 7.0))
    assert torch.equal(store.read(1, 2, 9, 16), torch.tensor([2.0] + [7.0] * 5 + [2.0]))
    # The stream (O_DIRECT) sees what the checkpoint's buffered descriptor wrote, and the other way.
    for c in store.stream([2]):
        if c.lo == 0:
            assert torch.equal(c.exp_avg[9:16], torch.tensor([2.0] + [7.0] * 5 + [2.0]))
            c.exp_avg[9] = 5.0
    assert store.read(1, 2, 9, 10).item() == 5.0
    store.close()
    assert not (tmp_path / "rank0.bin").exists()  # scratch: the checkpoints hold the durable state


def test_a_truncated_offload_file_is_named(tmp_path):
    """This rank's fatal error (the job ends on every rank), naming optim.offload_dir and the file."""
    from app.errors import RankFatal

    store = NvmeStore(_masters(), tmp_path / "rank0.bin", buffer_bytes=4096)
    os.truncate(tmp_path / "rank0.bin", 100)
    with pytest.raises(RankFatal, match=f"optim.offload_dir {tmp_path}: .*rank0.bin failed: short read .* truncated"):
        list(store.stream([0]))
    store.close()


def test_jobs_sharing_an_offload_dir_get_files_of_their_own(tmp_path):
    """Found in review (2026-11-30): the file was named by rank only, so two jobs with one
    optim.offload_dir (a node's scratch drive) wrote each other's state, silently. Named by the run
    directory too: two runs differ, the same run (one job at a time: its lock) takes its file over."""
    from app.optim.offload import offload_path

    scratch = tmp_path / "scratch"
    a, b = offload_path(scratch, 0, tmp_path / "run_a"), offload_path(scratch, 0, tmp_path / "run_b")
    assert a != b and a.parent == b.parent == scratch
    assert offload_path(scratch, 0, tmp_path / "run_a") == a != offload_path(scratch, 1, tmp_path / "run_a")
    assert offload_path(scratch, 0, tmp_path / "x" / ".." / "run_a") == a  # resolved


def test_a_drive_too_small_or_that_fills_ends_the_job_naming_offload_dir(tmp_path, monkeypatch):
    """Found in review: a full optim.offload_dir ended in an internal error's traceback and left the
    files behind. Too little free space for the node's ranks is refused at the start; a write that
    fails later (the drive filled meanwhile) ends the job as this rank's fatal error; both name
    optim.offload_dir, the bytes, the fix, and remove the file."""
    import errno
    import shutil
    from collections import namedtuple

    from app.errors import RankFatal

    usage = namedtuple("usage", "total used free")
    masters = _masters()
    need = sum(-(-m.numel() // 1024) * 1024 for m in masters) * STATE_TENSORS * 4
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 0, 2 * need - 1))
    with pytest.raises(
        RankFatal, match=rf"optim.offload_dir {tmp_path}: needs .* of the 2 rank\(s\) of this node.*free space there"
    ):
        NvmeStore(masters, tmp_path / "rank0.bin", 4096, sharing=2)
    assert not (tmp_path / "rank0.bin").exists()
    NvmeStore(masters, tmp_path / "rank0.bin", 4096, sharing=1).close()  # one rank's fits
    monkeypatch.undo()
    store = NvmeStore(masters, tmp_path / "rank0.bin", 4096)

    def full(*_):  # noqa: ANN002, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(RankFatal, match="writing this rank's optimizer state failed: No space left on device"):
        for chunk in store.stream([0, 1, 2]):
            chunk.master.add_(1)
    assert not (tmp_path / "rank0.bin").exists()
    monkeypatch.undo()
    store.close()


def test_the_buffers_are_no_larger_than_the_largest_bucket(tmp_path):
    """Found in review: optim.offload_buffer_mb up to 10^6 is accepted, and the three slots were
    allocated at that size whatever the state (1 TB: an internal error; 20 GB: reported as optimizer
    state for 1.3 MB). The slots hold at most the largest bucket's shard."""
    store = NvmeStore(_masters(), tmp_path / "rank0.bin", buffer_bytes=10**12)
    assert store.chunk == 3072  # 2500 elements padded to whole 4 KiB blocks
    assert store.host_bytes() == SLOTS * STATE_TENSORS * 4 * 3072
    chunks = [(c.bucket, c.lo, c.hi) for c in store.stream([0, 1, 2])]
    assert chunks == [(0, 0, 1000), (1, 0, 37), (2, 0, 2500)]
    store.close()


def test_the_host_store_hands_out_whole_bucket_shards():
    masters = _masters()
    store = HostStore(masters)
    chunks = list(store.stream([2, 0]))
    assert [(c.bucket, c.lo, c.hi) for c in chunks] == [(2, 0, 2500), (0, 0, 1000)]
    chunks[0].master.add_(1)
    assert torch.equal(store.read(0, 2, 0, 2500), masters[2] + 1)
    assert store.host_bytes() == sum(m.numel() for m in masters) * STATE_TENSORS * 4


# The offloaded AdamW (HostAdamW, torch's fused CPU kernel) against the device run on CPU ranks (the
# eager passes of ShardedOptimizer._update): the same formula, rounded in another order, about 1 ulp
# apart per element and step. Measured over these 4 steps: losses equal, gradient norms 3e-8
# relative apart (fp32); bf16 rounds the parameters, where an fp32 ulp can flip one element's bf16
# rounding. A wrong offset, a stale slot or a lost moment moves the loss by 1e-3 or more.
OFFLOAD_RTOL = {"fp32": 1e-6, "bf16": 1e-4}


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.full)])
def test_offloaded_runs_equal_each_other_bit_for_bit_and_the_device_run(tmp_path, precision):
    """One rank, 4 steps: optim.offload host (whole bucket shards) and nvme (a 0.05 MB buffer, so
    every bucket is streamed in several chunks) log the same losses and gradient norms to the bit
    (an element's host update does not depend on how its chunk is cut), and those of none within
    OFFLOAD_RTOL."""
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
        # The host update's own time is logged (4 steps, 2 of them the timing warm-up), only when offloaded.
        said = re.search(r"gridlm: offloaded update on the host: ([\d.]+) ms a step \(median of 2; after the backward",
                         out.stdout)  # fmt: skip
        assert (said is not None and float(said[1]) > 0) == (offload != "none"), out.stdout[-2000:]
    assert len(logged["none"]) == 4
    assert logged["host"] == logged["nvme"], logged
    rtol = OFFLOAD_RTOL[precision]
    assert logged["host"] == [pytest.approx(pair, rel=rtol) for pair in logged["none"]], logged
    assert not list((tmp_path / "nvme" / "offload").iterdir())  # the scratch file went at the end


def test_host_adamw_is_torch_fused_adamw_and_the_same_however_its_tensors_are_cut():
    """HostAdamW over a tensor whole and cut into chunks of 997 elements (weight decay on three
    runs): bit for bit the same after 5 steps; and within 1e-6 of torch.optim.AdamW(fused=True)
    over the same runs as parameters (torch's kernel rounds the tail of each tensor in scalar code,
    1 ulp from its vector body: HostAdamW puts every element through the body). torch's kernel
    itself on the chunks' views is not the same as on the whole tensor (the reason for HostAdamW)."""
    from app.deck import OptimConfig
    from app.optim.host_adamw import HostAdamW

    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    n, decay = 10007, ((0, 3001), (3050, 7000), (7013, 9999))
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(5)]

    def chunked(size: int, fused_views: bool = False) -> torch.Tensor:
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        cuts = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
        runs = [tuple((max(a, lo) - lo, min(z, hi) - lo) for a, z in decay if a < hi and z > lo) for lo, hi in cuts]
        updates = [HostAdamW((p[lo:hi], m[lo:hi], v[lo:hi]), r) for (lo, hi), r in zip(cuts, runs)]
        for step, g in enumerate(grads, 1):
            t = torch.tensor(float(step))
            for (lo, hi), r, update in zip(cuts, runs, updates):
                if not fused_views:
                    update.step(cfg, cfg.lr, t, g[lo:hi].clone())
                    continue
                for sub, wd in ((r, cfg.weight_decay), (complement(r, hi - lo), 0.0)):
                    if not sub:
                        continue
                    views = [[x[lo:hi][a:z] for a, z in sub] for x in (p, g.clone(), m, v)]
                    torch._fused_adamw_(*views, [], [t] * len(sub), lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2,
                                        weight_decay=wd, eps=cfg.eps, amsgrad=False, maximize=False)  # fmt: skip
        return p

    whole = chunked(n)
    assert torch.equal(whole, chunked(997))
    assert not torch.equal(chunked(n, fused_views=True), chunked(997, fused_views=True))
    ref = torch.nn.Parameter(p0.clone())
    runs = [*decay, *complement(decay, n)]
    pieces = [torch.nn.Parameter(p0[a:z].clone()) for a, z in runs]
    opt = torch.optim.AdamW([{"params": pieces[:3], "weight_decay": cfg.weight_decay}, {"params": pieces[3:],
                             "weight_decay": 0.0}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)  # fmt: skip
    for g in grads:
        for piece, (a, z) in zip(pieces, runs):
            piece.grad = g[a:z].clone()
        opt.step()
    for piece, (a, z) in zip(pieces, runs):
        ref.data[a:z] = piece.data
    torch.testing.assert_close(whole, ref.data, rtol=1e-6, atol=1e-8)


def test_pinned_host_buffers_are_pinned_at_their_size_unless_the_user_says_otherwise():
    """Found in review (2026-11-30, by reading torch 2.13's CachingHostAllocator): every pinned block is
    rounded up to a power of two unless above pinned_max_round_threshold_mb, which has no limit by
    default, so GPT 6.1B's offloaded state would pin 155 GiB for 90. `pin_exactly` sets the threshold
    (the GPU paths call it before they pin); a threshold the user set in PYTORCH_ALLOC_CONF stays.
    In fresh processes: the setting is the process's."""
    code = ("import torch; from app.optim.offload import pin_exactly; pin_exactly(); "
            "print(torch._C._accelerator_getAllocatorSettings())")  # fmt: skip
    env = {k: v for k, v in app_env().items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    ours = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert ours.stdout.strip() == "pinned_max_round_threshold_mb:64", ours.stdout + ours.stderr
    env["PYTORCH_ALLOC_CONF"] = "pinned_max_round_threshold_mb:8"
    theirs = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert theirs.stdout.strip() == "pinned_max_round_threshold_mb:8", theirs.stdout + theirs.stderr


def test_a_gradient_copy_to_the_host_waits_for_the_stream_that_wrote_it(monkeypatch):
    """GPU path, with torch.cuda's stream semantics as documented (inside `torch.cuda.stream(s)` the
    current stream is s): a bucket without a reduction (dp 1, the late buckets whose tp or pp sums
    ran after backward) is copied on the d2h stream after it waits for the compute stream. Found in
    review: the wait was taken inside the context, so d2h waited for itself and the copy raced the
    kernels writing the gradients (silently stale updates; no GPU here to show it)."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from app.optim.transfer import HostTransfer

    compute, d2h, waits = "compute", SimpleNamespace(name="d2h"), []
    d2h.wait_stream = lambda stream: waits.append(stream)
    current = [compute]

    @contextmanager
    def stream(s):
        current.append(s)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda s: None))
    transfer = HostTransfer.__new__(HostTransfer)
    grads = torch.arange(4.0)
    transfer.dp = SimpleNamespace(grads=lambda k: grads, device=torch.device("cpu"))
    transfer.cuda, transfer.d2h, transfer.filling, transfer.early = True, d2h, 0, 0
    transfer.host_grads, transfer.shipped, transfer.events = [[torch.zeros(4)]], [False], [[None]]
    transfer._ship(0, None, early=False)
    assert waits == [compute]
    assert torch.equal(transfer.host_grads[0][0], grads)


def test_the_delayed_update_s_thread_works_on_the_rank_s_gpu(monkeypatch):
    """Found in review: the delayed update's thread made CUDA calls (an event's synchronize) with
    the new thread's current device, 0: a context on GPU 0 for every rank of a node whose ranks see
    every GPU. Its thread now sets the rank's device first (no GPU here: the call is recorded)."""
    from app.optim.optimizer import device_thread

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(device))
    worker = device_thread(torch.device("cuda", 3), "test")
    worker.submit(lambda: None).result()
    worker.shutdown()
    assert calls == [torch.device("cuda", 3)]
    plain = device_thread(torch.device("cpu"), "test")
    plain.submit(lambda: None).result()
    plain.shutdown()
    assert calls == [torch.device("cuda", 3)]  # CPU ranks: no CUDA call
