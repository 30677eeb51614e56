"""The checkpoint checksum (`app/checkpoint/slabs.py`): it sees every simple corruption
pattern in float32, bf16 (stored as uint16) and float16 tensors, including the two sign
flips the v1 sum missed; partial sums over any split add up to the whole; format-version-1
checkpoints still load, inspect and export, verified with the v1 sum (MPI test)."""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest
import torch

from app.checkpoint import slabs
from app.checkpoint.slabs import V1_NOTE, as_unsigned, checksum, checksum_v1, dataset_checksum, global_boxes
from app.errors import CheckpointError
from conftest import REPO, grid_trainer, train_steps

MASK64 = 2**64 - 1
SHAPE = (256, 256)  # 65536 elements: enough for the 16-bit sign-flip pair that cancels in v1


def _data(dtype: str) -> np.ndarray:
    """A SHAPE tensor of normal values as stored in a checkpoint: float32, bf16 as uint16, float16."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(SHAPE, generator=gen)
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
    return t.numpy().astype(dtype)


DTYPES = ("float32", "bfloat16", "float16")


def _bits(x: np.ndarray) -> int:
    return x.dtype.itemsize * 8


def _caught(original: np.ndarray, corrupt: np.ndarray) -> bool:
    assert not np.array_equal(as_unsigned(original), as_unsigned(corrupt)), "the pattern changed nothing"
    return dataset_checksum(corrupt) != dataset_checksum(original)


def _flip(x: np.ndarray, flips: list[tuple[int, int]]) -> np.ndarray:
    """A copy of `x` with bit b of flat element i flipped for each (i, b)."""
    y = x.copy()
    u = as_unsigned(y).reshape(-1)
    for i, b in flips:
        u[i] ^= u.dtype.type(1 << b)
    return y


def _mix64(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_checksum_is_the_documented_definition_and_v1_is_kept():
    """Pins C = sum_i mix64(mix64(K + i G) ^ u_i) mod 2^64 (CHECKSUM_DOC): changing it breaks
    every written checkpoint. The v1 sum stays as it was for old files."""
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    u = [int(v) for v in x.view(np.uint32).reshape(-1)]
    want = sum(_mix64(_mix64((0x6A09E667F3BCC909 + i * 0x9E3779B97F4A7C15) & MASK64) ^ v) for i, v in enumerate(u))
    assert dataset_checksum(x) == want & MASK64
    assert isinstance(checksum(x, [((0, 0), (3, 5))], (3, 5)), np.uint64)
    assert dataset_checksum(x, format_version=1) == sum((2 * i + 1) * v for i, v in enumerate(u)) % 2**32
    assert dataset_checksum(x, format_version=2) == dataset_checksum(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_single_bit_flip_is_caught(dtype):
    x = _data(dtype)
    rng = np.random.default_rng(2)
    positions = [0, 1, 255, 256, x.size - 1, *rng.integers(0, x.size, 6).tolist()]
    for i, b in itertools.product(positions, range(_bits(x))):  # every bit of a few elements
        assert _caught(x, _flip(x, [(i, b)])), (i, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_sign_bit_flips_are_caught_where_the_v1_sum_missed_them(dtype):
    x = _data(dtype)
    sign = _bits(x) - 1
    # v1 misses two sign flips of float32 anywhere ((2i + 1) 2^31 = 2^31 mod 2^32); of 16-bit
    # values when both go the same way and i + j + 1 = 0 mod 2^16: elements 0 and 65535.
    i, j = (3, 40_000) if dtype == "float32" else (0, x.size - 1)
    u = as_unsigned(x).reshape(-1)
    u[[i, j]] &= u.dtype.type((1 << sign) - 1)  # both positive, so both flips add 2^sign
    corrupt = _flip(x, [(i, sign), (j, sign)])
    whole = [((0, 0), SHAPE)]
    assert checksum_v1(corrupt, whole, SHAPE) == checksum_v1(x, whole, SHAPE)  # the old failure is real
    assert _caught(x, corrupt)
    rng = np.random.default_rng(3)
    for i, j in rng.choice(x.size, size=(50, 2), replace=False):
        assert _caught(x, _flip(x, [(int(i), sign), (int(j), sign)])), (i, j)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_bit_flips_in_different_elements_are_caught(dtype):
    x = _data(dtype)
    rng = np.random.default_rng(4)
    for _ in range(200):  # arbitrary bits
        i, j = rng.choice(x.size, 2, replace=False).tolist()
        assert _caught(x, _flip(x, [(i, int(rng.integers(_bits(x)))), (j, int(rng.integers(_bits(x))))]))
    for b in range(_bits(x)):  # the same bit in two elements, near and far
        for i, j in ((10, 11), (0, 256), (5, x.size - 7)):
            assert _caught(x, _flip(x, [(i, b), (j, b)])), (b, i, j)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_elements_are_caught(dtype):
    x = _data(dtype)
    flat = x.reshape(-1)
    rng = np.random.default_rng(5)
    pairs = [(0, 1), (300, 301), (255, 256), (0, x.size - 1), *rng.choice(x.size, (30, 2), replace=False).tolist()]
    for i, j in pairs:
        if as_unsigned(flat[i : i + 1]) == as_unsigned(flat[j : j + 1]):
            continue  # equal values (bf16 has few): swapping them changes nothing
        y = flat.copy()
        y[[i, j]] = y[[j, i]]
        assert _caught(flat, y), (i, j)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeroed_duplicated_and_shifted_blocks_are_caught(dtype):
    x = _data(dtype)
    zeroed = x.copy()
    zeroed[10:20, 32:96] = 0
    assert _caught(x, zeroed)
    tail = x.copy()
    tail.reshape(-1)[-1000:] = 0  # a torn write: the end never reached the disk
    assert _caught(x, tail)
    duplicated = x.copy()
    duplicated[101] = x[100]  # a row copied over the next
    assert _caught(x, duplicated)
    block = x.copy()
    block[128:192] = x[64:128]  # a block of rows written twice, at the wrong offset
    assert _caught(x, block)
    shifted = x.copy()
    shifted[7, 1:] = x[7, :-1]  # a row shifted by one element
    assert _caught(x, shifted)
    rolled = x.copy()
    rolled[7] = np.roll(x[7], 1)  # ... with the last element wrapped around: the same values
    assert _caught(x, rolled)
    everything = np.roll(x.reshape(-1), 1).reshape(SHAPE)  # the whole tensor one element off
    assert _caught(x, everything)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_or_reshaped_tensors_of_the_same_shape_are_caught(dtype):
    x = _data(dtype)
    assert _caught(x, np.ascontiguousarray(x.T))
    interleaved = x.reshape(2, 128, 256).transpose(1, 0, 2).reshape(SHAPE)  # rows in another order
    assert _caught(x, np.ascontiguousarray(interleaved))
    columns = x.reshape(256, 2, 128).transpose(0, 2, 1).reshape(SHAPE)  # tp shards joined wrongly
    assert _caught(x, np.ascontiguousarray(columns))


def _kernel(kernel: str, monkeypatch) -> None:
    """Use the C kernel (skipped where it is not built: a failure under --strict-skips, as CI runs
    after setup built it) or the NumPy one."""
    if kernel == "numpy":
        monkeypatch.setattr(slabs, "_compiled", None)
    elif slabs._compiled is None:
        pytest.skip("the C checksum kernel is not built (app/checkpoint/_checksum.c): run launch/setup.sh")


@pytest.mark.parametrize("kernel", ["c", "numpy"])
@pytest.mark.parametrize("chunk", [3, 16, slabs.CHUNK])
@pytest.mark.parametrize("dtype", ("float32", "uint16", "float16", "uint8"))
def test_partial_sums_over_any_split_add_up_to_the_whole(dtype, chunk, kernel, monkeypatch):
    """A tensor cut into a grid of shards (tp), each shard's flat elements cut into ranges
    (dp slices), as ranks write: the uint64 partials add up (mod 2^64, as MPI SUM) to the
    whole tensor's checksum, by either kernel. Small chunks exercise the row-splitting path
    (NumPy's elements per pass, and the rows per call of both)."""
    monkeypatch.setattr(slabs, "CHUNK", chunk)
    monkeypatch.setattr(slabs, "ROWS", chunk)
    _kernel(kernel, monkeypatch)
    rng = np.random.default_rng(6)
    for _ in range(40):
        shape = tuple(int(n) for n in rng.integers(1, 10, size=rng.integers(1, 4)))
        full = rng.integers(0, 2**16, size=shape).astype(dtype) if dtype.startswith("uint") else None
        if full is None:
            full = rng.standard_normal(shape).astype(dtype)
        cuts = [sorted({0, n, *rng.integers(0, n + 1, 2).tolist()}) for n in shape]
        partials = []
        for block in itertools.product(*(zip(c[:-1], c[1:]) for c in cuts)):
            offset = tuple(lo for lo, _ in block)
            local = np.ascontiguousarray(full[tuple(slice(lo, hi) for lo, hi in block)]).reshape(-1)
            ranges = sorted({0, local.size, *rng.integers(0, local.size + 1, 3).tolist()})
            for lo, hi in zip(ranges[:-1], ranges[1:]):
                boxes = global_boxes(tuple(hi - lo for lo, hi in block), offset, lo, hi)
                partials.append(checksum(local[lo:hi], boxes, shape))
        assert int(np.sum(np.array(partials, dtype=np.uint64), dtype=np.uint64)) == dataset_checksum(full), shape


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16", "uint8", "float64"))
def test_the_c_kernel_equals_numpy_on_boxes_of_every_shape(dtype, monkeypatch):
    """The C kernel (built by setup) gives NumPy's partial sums bit for bit: whole tensors, a shard's
    flat range (partial first and last rows), narrow columns, 0-d and 3-d boxes, every width."""
    _kernel("c", monkeypatch)
    rng = np.random.default_rng(7)
    for shape in [(), (1,), (70001,), (3, 5), (300, 7), (9, 2, 301), (2, 130000)]:
        full = np.asarray(rng.standard_normal(shape))
        full = (full * 1e3).astype(np.uint8) if dtype == "uint8" else full.astype(dtype.replace("bfloat16", "float32"))
        if dtype == "bfloat16":
            full = as_unsigned(full)[..., None].view(np.uint16)[..., 1].copy()  # the high half: bf16 bits
        size = full.size
        for lo, hi in {(0, size), (size // 3, size - size // 5), (1, max(size - 1, 1))}:
            boxes = global_boxes(shape, (0,) * len(shape), lo, hi)
            part = full.reshape(-1)[lo:hi]
            assert slabs.checksum(part, boxes, shape) == slabs.checksum_numpy(part, boxes, shape), (shape, lo, hi)
    column = np.ascontiguousarray(full[:, 5:7])  # (2, 2) of a (2, 130000) tensor
    boxes = [((0, 5), (2, 2))]
    assert slabs.checksum(column, boxes, full.shape) == slabs.checksum_numpy(column, boxes, full.shape)


# ---- MPI: format-version-1 checkpoints -------------------------------------------------

SMALL = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
    "train.global_batch=8", "train.micro_batch=2", "run.log_every=100", "parallel.dp_bucket_mb=0.02",
    "run.resume=none", "checkpoint.at_exit=false", "train.precision=bf16",
)  # fmt: skip
GRIDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 1, 2)}


def _state(trainer) -> list[torch.Tensor]:
    opt = trainer.optimizer
    return [trainer.dp.param_buffer.clone(), *(t.clone() for t in trainer.dp.master + opt.exp_avg + opt.exp_avg_sq)]


def _as_v1(path) -> None:
    """Rewrite a checkpoint in place as gridlm wrote format version 1: the v1 sums, no header digest."""
    import h5py

    with h5py.File(path, "r+") as f:
        del f.attrs["header_sha256"]  # version 1 files predate it
        f.attrs["format_version"] = 1
        f.attrs["checksum_algorithm"] = "sum over row-major element index i of (2i+1) * (element bits), mod 2^32"
        datasets = []
        f.visititems(lambda name, obj: datasets.append(obj) if isinstance(obj, h5py.Dataset) else None)
        for dset in datasets:
            dset.attrs["checksum"] = np.uint32(dataset_checksum(dset[()], format_version=1))


@pytest.mark.mpi
def test_a_v1_checkpoint_loads_inspects_and_exports_with_a_note_and_v2_sees_two_sign_flips(
    runtime, grids, shared_tmp, capsys
):
    import h5py

    from app.checkpoint.__main__ import format_report, inspect_file
    from app.checkpoint.export import export_hf
    from app.checkpoint.io import load, read_header
    from app.shards import EXP_AVG

    trainer = grid_trainer(grids, *GRIDS[grids.world.world_size], (*SMALL, f"run.dir={shared_tmp}"))
    train_steps(trainer, 2)
    path = trainer.save("test").path
    v1, flipped = shared_tmp / "v1.h5", shared_tmp / "flipped.h5"
    victim = f"{EXP_AVG}/blocks.1.mlp.fc.weight"
    if runtime.is_root:
        assert read_header(path)["format_version"] == 2
        shutil.copy(path, v1)
        _as_v1(v1)
        shutil.copy(path, flipped)
        with h5py.File(flipped, "r+") as f:  # the v1 sum's blind spot, on disk
            values = f[victim][()]
            before = values.copy()
            values.reshape(-1)[[17, 2000]] *= -1
            f[victim][...] = values
        assert dataset_checksum(values, format_version=1) == dataset_checksum(before, format_version=1)
    runtime.comm.Barrier()
    capsys.readouterr()

    resumed = grid_trainer(grids, *GRIDS[grids.world.world_size], (*SMALL, f"run.dir={shared_tmp / 'resumed'}"))
    info = load(resumed, v1)
    assert info["step"] == 2 and info["note"] == V1_NOTE
    logged = capsys.readouterr().out
    assert logged.count(V1_NOTE) == (1 if runtime.is_root else 0)  # said once, by rank 0
    problems = [f"rank {runtime.rank}: state tensor {i} differs"
                for i, (a, b) in enumerate(zip(_state(trainer), _state(resumed))) if not torch.equal(a, b)]  # fmt: skip
    assert load(resumed, path)["note"] is None
    with pytest.raises(CheckpointError, match=f"checksum mismatch in dataset /{victim}:"):
        load(resumed, flipped)
    problems = sum(runtime.comm.allgather(problems), [])
    assert not problems, "\n".join(problems)

    if runtime.is_root:  # the serial tools, last: no rank waits for rank 0 in a collective
        report = inspect_file(v1)
        assert report["note"] == V1_NOTE and f"note        {V1_NOTE}" in format_report(report)
        assert report["total"]["ok"] == len(report["datasets"]) and not report["damaged"]
        assert inspect_file(path)["note"] is None
        assert inspect_file(flipped)["damaged"] == ["/" + victim]
        assert export_hf(v1, shared_tmp / "hf").parameters > 0
        with h5py.File(v1, "r+") as f:
            f.attrs["format_version"] = 3
        with pytest.raises(CheckpointError, match="format version 3; this gridlm reads versions 1, 2: update"):
            read_header(v1)


HEADER_RUN = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=16", "train.steps=2",
              "train.global_batch=4", "train.micro_batch=2"]  # fmt: skip


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """One 2-step run's checkpoint, which `python -m app.checkpoint inspect` passes: the untouched
    file every header case below changes a copy of."""
    import subprocess
    import sys

    from conftest import app_env, run_app

    run_dir = tmp_path_factory.mktemp("header") / "run"
    out = run_app(1, "inputs/gpt_tiny.yaml", *(a for s in (*HEADER_RUN, f"run.dir={run_dir}") for a in ("--set", s)))
    assert out.returncode == 0, out.stderr[-2000:]
    good = run_dir / "checkpoints" / "step_0000002.h5"
    inspect = [sys.executable, "-m", "app.checkpoint", "inspect", str(good)]
    ok = subprocess.run(inspect, cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    return good


@pytest.mark.parametrize(
    "attr, change",
    [("step", lambda v: v + 1), pytest.param("optimizer_steps", lambda v: v + 2, marks=pytest.mark.full),
     pytest.param("sampler", lambda v: v.replace(str(json.loads(v)["consumed_samples"]), "330"),
                  marks=pytest.mark.full)],
)  # fmt: skip
def test_a_changed_header_attribute_is_caught_by_load_and_inspect(good_checkpoint, tmp_path, attr, change):
    """The header's digest (app/checkpoint/io.py `header_digest`): a checkpoint whose step, optimizer
    steps or sampler position was changed after it was written (a bit flip resumed at step 21 with
    the wrong learning rate, or at the wrong data) is refused by a resume (exit 2, one line) and by
    `python -m app.checkpoint inspect` (exit 2); the untouched file loads (the fixture)."""
    import subprocess
    import sys

    import h5py

    from conftest import app_env, run_app

    bad = tmp_path / "changed.h5"
    shutil.copy(good_checkpoint, bad)
    with h5py.File(bad, "r+") as f:
        value = f.attrs[attr]
        value = value.item() if hasattr(value, "item") else value
        new = change(value)
        assert new != value
        f.attrs.modify(attr, new) if isinstance(new, int) else f.attrs.__setitem__(attr, new)
    inspect = [sys.executable, "-m", "app.checkpoint", "inspect"]
    found = subprocess.run([*inspect, str(bad)], cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=120)
    assert found.returncode == 2 and "does not match its checksum" in found.stderr, found.stdout + found.stderr
    sets = (*HEADER_RUN, f"run.dir={tmp_path / 'run'}", f"run.resume={bad}", "train.steps=4")
    resumed = run_app(1, "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s)))
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    assert "header (step, optimizer steps, sampler" in resumed.stderr and "Traceback" not in resumed.stderr


def test_checkpoint_files_are_opened_with_data_sieving_off(tmp_path):
    """`open_mpio` (every checkpoint save and load) hands ROMIO its hints: the file's MPI-IO info
    as HDF5 keeps it has data sieving disabled for writes and reads."""
    from mpi4py import MPI

    with slabs.open_mpio(tmp_path / "f.h5", "w", MPI.COMM_SELF) as f:
        info = f.id.get_access_plist().get_fapl_mpio()[1]
        assert {k: info.Get(k) for k in slabs.MPIO_HINTS} == {"romio_ds_write": "disable", "romio_ds_read": "disable"}


def test_attributes_made_at_the_low_level_are_those_h5py_makes(tmp_path):
    """`new_attributes` (the save's per-dataset `dtype` and `checksum`) gives the HDF5 types and the
    values that `attrs[name] = value` gives, so readers see the same file."""
    import h5py

    with h5py.File(tmp_path / "f.h5", "w") as f:
        high, low = f.create_dataset("high", (2,), "f4"), f.create_dataset("low", (2,), "f4")
        high.attrs["dtype"], high.attrs["checksum"] = "bfloat16", np.uint64(2**64 - 1)
        slabs.new_attributes(low, {"dtype": "bfloat16", "checksum": np.uint64(2**64 - 1)})
        low.attrs.modify("checksum", np.uint64(7))  # in place, as the save does after the writes
        high.attrs.modify("checksum", np.uint64(7))
    with h5py.File(tmp_path / "f.h5", "r") as f:
        for key in ("dtype", "checksum"):
            a, b = f["high"].attrs.get_id(key).get_type(), f["low"].attrs.get_id(key).get_type()
            assert a.equal(b), key
            assert f["high"].attrs[key] == f["low"].attrs[key] and type(f["high"].attrs[key]) is type(
                f["low"].attrs[key]
            )
