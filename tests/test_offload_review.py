"""Review of the optimizer offload (`app/optim/offload.py`) and of evaluating an offloaded run's
checkpoint (`python -m app.eval`): faults found and fixed.

The NVMe store owns one file per run and rank (`offload_path`): it must never change or remove a file
that another job holds, one a link points through, or a killed job's it refuses to take over; its
failures on any rank end the job with one line naming optim.offload_dir. `app.eval` builds no
optimizer state and evaluates the masters (W_N) of a delayed update's checkpoint, whatever the
deck's offload keys. Tiny GPTs (2 layers of 64, vocab 128) on the synthetic stream."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import uuid
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from app.errors import RankFatal
from app.optim.offload import STATE_TENSORS, HostStore, NvmeStore, memory_filesystem, offload_path
from conftest import REPO, read_metrics, run_app, run_mpi

TINY = "inputs/gpt_tiny.yaml"
SMALL = (
    "model.layers=2", "model.hidden=64", "model.vocab_size=128", "model.heads=4", "model.seq_len=32",
    "train.global_batch=4", "train.micro_batch=2", "run.log_every=1", "parallel.dp_bucket_mb=0.05",
    "eval.batches=2",
)  # fmt: skip
DELAYED_STEPS, SAVED_AT = 5, 4


def _sets(*sets: str) -> list[str]:
    return [a for s in (*SMALL, *sets) for a in ("--set", s)]


def _masters() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) for n in (1000, 37, 2500)]


def _file_bytes(masters: list[torch.Tensor]) -> int:
    """The NVMe file of `masters`: three fp32 regions per bucket, each padded to 4 KiB."""
    return sum(-(-m.numel() // 1024) * 1024 for m in masters) * STATE_TENSORS * 4


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- app.eval of an offloaded run's checkpoint ----


@pytest.fixture(scope="module")
def delayed(tmp_path_factory):
    """A 1-rank delayed-update run (host offload, optim.offload_delay 1) of DELAYED_STEPS steps, a
    checkpoint at step SAVED_AT (its update not yet published: offload_pending) and an evaluation at
    the last step, which sees the parameters of update SAVED_AT (PARALLELISM.md: one update behind).
    Its run directory and the metrics by step."""
    run_dir = tmp_path_factory.mktemp("delayed") / "run"
    out = run_app(1, TINY, *_sets(
        "optim.offload=host", "optim.offload_delay=1", f"train.steps={DELAYED_STEPS}", f"run.dir={run_dir}",
        f"checkpoint.every={SAVED_AT}", "checkpoint.at_exit=false", "checkpoint.keep=0",
        f"eval.every={DELAYED_STEPS}",
    ))  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return run_dir, {r["step"]: r for r in read_metrics(run_dir)}


def _app_eval(run_dir: Path, checkpoint: Path, out_file: Path, *sets: str):
    return run_mpi(
        1, sys.executable, "-m", "app.eval", TINY, *_sets(f"run.dir={run_dir}", *sets),
        "--checkpoint", str(checkpoint), "--out", str(out_file), timeout=120,
    )  # fmt: skip


def test_app_eval_of_a_delayed_update_checkpoint_evaluates_the_masters_whatever_the_offload_keys(delayed, tmp_path):
    """Found in review: the eval deck's optim.offload_delay 1 made the load keep /model, the
    parameters one update behind (W_{N-1}), and the masters it staged were never published: 4.8515
    where the same file with optim.offload_delay=0 gave 4.8511. Now every deck gives W_N, the value
    the training's own evaluation of update N reports."""
    from app.checkpoint.io import read_header

    run_dir, records = delayed
    checkpoint = run_dir / "checkpoints" / f"step_{SAVED_AT:07d}.h5"
    assert read_header(checkpoint)["offload_pending"] == 1  # /model is W_{N-1}, the masters W_N
    losses = {}
    for name, sets in {
        "as trained": ("optim.offload=host", "optim.offload_delay=1"),
        "nvme, delayed": ("optim.offload=nvme", "optim.offload_delay=1"),
        "no delay": ("optim.offload=host", "optim.offload_delay=0"),
        "no offload": ("optim.offload=none",),
    }.items():
        out_file = tmp_path / f"{name.replace(' ', '_')}.json"
        out = _app_eval(tmp_path / "eval", checkpoint, out_file, *sets)
        assert out.returncode == 0, (name, out.stderr[-3000:])
        losses[name] = json.loads(out_file.read_text())["loss"]
    assert len(set(losses.values())) == 1, losses
    assert losses["as trained"] == pytest.approx(records[DELAYED_STEPS]["val_loss"], rel=1e-6), (losses, records)


def test_app_eval_beside_a_training_leaves_its_nvme_state_file_alone(delayed, tmp_path):
    """Found in review (the worst): `python -m app.eval` with an nvme deck built the whole offloaded
    optimizer, opened the training's per-rank file (named from run.dir and rank) with O_TRUNC and
    removed it at the end: the training's moments read zeros from then on (its losses changed
    silently). The evaluation now builds no optimizer state; the training's file, held locked as
    a training holds it, is byte for byte what it was and still there."""
    run_dir, _ = delayed
    held = offload_path(run_dir / "offload", 0, run_dir)
    held.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(held, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the training's NvmeStore holds it
        os.write(fd, os.urandom(64 * 1024))
        before = _digest(held)
        out_file = tmp_path / "eval.json"
        checkpoint = run_dir / "checkpoints" / f"step_{SAVED_AT:07d}.h5"
        out = _app_eval(run_dir, checkpoint, out_file, "optim.offload=nvme", "optim.offload_delay=1")
        assert out.returncode == 0, out.stderr[-3000:]
        assert held.exists() and _digest(held) == before
        assert sorted(p.name for p in held.parent.iterdir()) == [held.name]  # no file of its own either
    finally:
        os.close(fd)
        held.unlink()


@pytest.mark.mpi
def test_an_evaluation_trainer_builds_no_optimizer_state(runtime, grids, shared_tmp):
    """Found in review: Trainer(evaluate_only=True) built the offloaded optimizer (host: 12 bytes an
    element of masters and moments it never read) and, in bf16, kept the fp32 masters on the device.
    It now builds the parameters alone, and the checkpoint's optimizer groups are not read."""
    from app.deck import load_deck, resolve_for_world
    from app.train import Trainer

    world = runtime.world_size
    sets = (*SMALL, f"train.global_batch={2 * world}", "optim.zero=1", "optim.offload=host", "train.precision=bf16",
            f"run.dir={shared_tmp / 'eval'}")  # fmt: skip
    deck = resolve_for_world(load_deck(REPO / TINY, sets), world)
    trainer = Trainer(deck, runtime, grids.grid(1, 1, world), evaluate_only=True)
    try:
        assert getattr(trainer.optimizer, "store", None) is None
        assert trainer.optimizer.shard_states() == [] and trainer.optimizer.delay == 0
        assert trainer.dp.master == [] and {s.group for s in trainer.dp.shard_states()} == {"model"}
    finally:
        trainer.close()


# ---- the NVMe store's file ----


def test_a_file_another_job_holds_is_refused_and_left_as_it_is(tmp_path):
    """Found in review: the file was opened with O_TRUNC and no lock, and removed at close, so a second
    job on the same run.dir and rank (app.eval beside the training did) zeroed and then deleted the
    first one's state. A store now holds the file's flock; another is refused, naming the file."""
    masters = _masters()
    path = tmp_path / "rank0.bin"
    first = NvmeStore(masters, path, 4096)
    before = _digest(path)
    with pytest.raises(RankFatal, match=rf"{path} is in use by another job"):
        NvmeStore(masters, path, 4096)
    assert path.exists() and _digest(path) == before
    for b, m in enumerate(masters):
        assert torch.equal(first.read(0, b, 0, m.numel()), m)
    first.close()
    assert not path.exists()
    NvmeStore(masters, path, 4096).close()  # free again once the first is closed


def test_a_symbolic_link_at_the_file_s_path_is_refused(tmp_path):
    """Found in review: the file was opened through a link planted at its predictable path: the run
    overwrote the link's target with its state, and removed the link at the end. Refused now, the
    target and the link as they were."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "offload" / "rank0.bin"
    link.parent.mkdir()
    link.symlink_to(target)
    with pytest.raises(RankFatal, match=rf"{link} is a symbolic link.*remove the link"):
        NvmeStore(_masters(), link, 4096)
    assert target.read_text() == "keep me" and link.is_symlink()


def test_a_killed_job_s_files_count_as_free_space_and_a_refusal_keeps_them(tmp_path, monkeypatch):
    """Found in review: after a killed job, the free-space check counted the run's own leftover files
    (which the new job empties) as used and refused a run that fits, and the refusal removed the
    file as a side effect. The leftover files of the run's ranks count as free; a refusal removes only
    a file the store created."""
    masters, run_dir = _masters(), tmp_path / "run"
    need = _file_bytes(masters)
    paths = [offload_path(tmp_path / "offload", rank, run_dir) for rank in (0, 1)]
    paths[0].parent.mkdir()
    for path in paths:  # what the killed job's two ranks left, every block written
        path.write_bytes(os.urandom(need))
    usage = namedtuple("usage", "total used free")
    # Two ranks need 2 x need; need is free besides the leftovers' 2 x need.
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 0, need))
    store = NvmeStore(masters, paths[0], 4096, sharing=2)
    assert torch.equal(store.read(1, 0, 0, 1000), torch.zeros(1000))  # the leftover's moments are gone
    store.close()
    # Four ranks would need 4 x need: refused, and rank 1's leftover stays.
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 0, 0))
    left = _digest(paths[1])
    with pytest.raises(RankFatal, match="needs .* of the 4 rank\\(s\\).*free space there"):
        NvmeStore(masters, paths[1], 4096, sharing=4)
    assert _digest(paths[1]) == left


def test_offload_dir_failures_end_the_job_naming_the_key(tmp_path, monkeypatch):
    """Found in review: a directory that cannot be made, a file that cannot be opened and a read that
    fails raised plain OSErrors ("internal error", a traceback): only rank 0's directory is checked
    before the run (check_paths), and optim.offload_dir is node-local. Each is RankFatal now, naming
    optim.offload_dir, what failed and the fix, as a failed write was."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RankFatal, match=r"optim.offload_dir .*a_file/sub: cannot create the directory.*writable"):
        NvmeStore(_masters(), tmp_path / "a_file" / "sub" / "rank0.bin", 4096)
    (tmp_path / "rank0.bin").mkdir()
    with pytest.raises(RankFatal, match=r"cannot open this rank's optimizer state file .*rank0.bin: Is a directory"):
        NvmeStore(_masters(), tmp_path / "rank0.bin", 4096)
    store = NvmeStore(_masters(), tmp_path / "rank1.bin", 4096)

    def failing(*_):  # noqa: ANN002, ANN202
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(RankFatal, match=r"reading this rank's optimizer state .*rank1.bin failed: Input/output error"):
        list(store.stream([0]))
    monkeypatch.undo()
    store.close()


def test_an_offload_dir_that_fails_on_another_rank_than_0_ends_every_rank_with_one_line(tmp_path):
    """The same end to end: rank 1's file cannot be opened (a directory at its name; on a cluster, a
    node whose scratch is missing or full): exit 2 with one `gridlm:` line naming optim.offload_dir and
    rank 1's file, no traceback (was: rank 1's internal error)."""
    run_dir = tmp_path / "run"
    blocked = offload_path(run_dir / "offload", 1, run_dir)
    blocked.mkdir(parents=True)
    out = run_app(2, TINY, *_sets("optim.offload=nvme", "train.steps=2", f"run.dir={run_dir}"), timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    lines = [line for line in out.stderr.splitlines() if line.startswith("gridlm: ")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"optim.offload_dir {blocked.parent}: cannot open" in lines[0] and blocked.name in lines[0], lines


@pytest.mark.skipif(memory_filesystem(Path("/dev/shm")) != "tmpfs", reason="no tmpfs at /dev/shm here")
def test_nvme_state_on_a_memory_file_system_is_warned_about(tmp_path, capsys):
    """Found in review: optim.offload_dir on tmpfs (/dev/shm) was taken silently: this kernel's tmpfs
    takes O_DIRECT, and the "nvme" state sat in host memory (the docstring said tmpfs refuses it). The
    store warns, once (rank 0; no job here), naming the directory and the file system."""
    assert memory_filesystem(tmp_path) == ""
    NvmeStore(_masters(), tmp_path / "rank0.bin", 4096).close()
    assert "warning" not in capsys.readouterr().out
    shm = Path("/dev/shm") / f"gridlm-test-{uuid.uuid4().hex}"
    try:
        NvmeStore(_masters(), shm / "rank0.bin", 4096).close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    said = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(said) == 1 and f"optim.offload_dir {shm} is on tmpfs" in said[0] and "host memory" in said[0], said


# ---- the host store's memory ----


def test_the_host_store_is_one_allocation_cut_into_views():
    """Found in review (by reading torch's CachingHostAllocator): three pinned tensors per bucket shard,
    each rounded up to a power of two below 64 MB (most ZeRO shards): up to twice the planned
    memory pinned (Frontier 25.4B ZeRO-3 dp 8: 61 GiB for 47.4). The state is now one allocation of
    the planned size (12 bytes an element), the same layout on CPU ranks, where nothing is pinned."""
    masters = _masters()
    store = HostStore(masters)
    tensors = [t for ts in store.tensors for t in ts]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1
    assert tensors[0].untyped_storage().nbytes() == store.host_bytes() == sum(m.numel() for m in masters) * 12
    for (master, exp_avg, exp_avg_sq), m in zip(store.tensors, masters):
        assert torch.equal(master, m) and not exp_avg.any() and not exp_avg_sq.any()
    ends = sorted((t.storage_offset(), t.storage_offset() + t.numel()) for t in tensors)
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))  # views that tile it, none overlapping
