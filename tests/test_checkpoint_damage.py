"""A damaged checkpoint is refused, never loaded wrong: with one line naming the file, the damaged
dataset and the fix, the same on every rank, without a hang or a traceback.

Serial (the app and the tools run as processes): a flipped bit in a dataset's HDF5 datatype (the
earliest file format checksums no metadata; new files are written in HDF5 1.10's, which does), a
dataset without its checksum attribute, values decoded by their bits, not converted. MPI (2 ranks):
every checkpoint.io mode writes the checksummed format and loads it; a dataset one rank cannot
decode or checksum is named on every rank instead of leaving its peers in the next all-gather.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import app.checkpoint.io as checkpoint_io
from app.checkpoint.__main__ import run as checkpoint_cli
from app.checkpoint.export import export_hf
from app.checkpoint.io import RESUME, dataset_damage, decode, load, read_header
from app.errors import CheckpointError
from conftest import REPO, grid_trainer, run_app, train_steps

TINY = "inputs/gpt_tiny.yaml"
SMALL = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
    "train.global_batch=4", "train.micro_batch=2", "run.log_every=100", "parallel.dp_bucket_mb=0.02",
    "run.resume=none", "checkpoint.at_exit=false",
)  # fmt: skip
# Written by gridlm e69f108 in HDF5's earliest file format (superblock 0, no metadata checksums), bf16
# with fp32 masters: tests/test_checkpoint.py's OLD_FILE.
OLD_FILE = REPO / "tests/data/checkpoint_v2_e69f108.h5"
OLD_DECK = ("model.vocab_size=64", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
            "train.precision=bf16", "train.global_batch=16", "train.micro_batch=2")  # fmt: skip
# An IEEE float32 little-endian datatype message (version 1, class 1: float; 4 bytes); bit 0 of its
# first byte makes it class 0, an unsigned 32-bit integer: the flip the review's fuzzing found.
FLOAT32_TYPE = b"\x11\x20\x1f\x00\x04\x00\x00\x00"
VICTIM = "optimizer/master/blocks.0.attn.proj.bias"


def _sets(*keys: str) -> tuple[str, ...]:
    return tuple(arg for key in keys for arg in ("--set", key))


def flip_datatype(src: Path, dst: Path, key: str) -> None:
    """A copy of `src` whose dataset `key` has bit 0 of its datatype class flipped (float32 -> uint32),
    in its object header: the bytes of the data and every attribute unchanged."""
    from h5py import h5o

    with h5py.File(src, "r") as f:
        header = h5o.get_info(f[key].id).addr
    data = bytearray(src.read_bytes())
    at = data.find(FLOAT32_TYPE, header, header + 512)
    assert at > 0, f"no float32 datatype message in the object header of /{key}"
    data[at] ^= 0x01
    dst.write_bytes(bytes(data))


def one_line_refusal(out, *words: str) -> str:
    """A run or tool that refused a file: status 2, no traceback, the last line `gridlm: ...` with `words`."""
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text, text[-3000:]
    line = next(line for line in reversed(text.splitlines()) if line.startswith("gridlm: "))
    assert all(word in line for word in words), (line, words)
    return line


@pytest.fixture(scope="module")
def fresh_ckpt(tmp_path_factory) -> Path:
    """A checkpoint of 3 steps written by this gridlm (1 rank, fp32, checkpoint.io posix)."""
    run_dir = tmp_path_factory.mktemp("fresh") / "run"
    out = run_app(1, TINY, *_sets(*SMALL, "train.steps=3", "checkpoint.at_exit=true", f"run.dir={run_dir}"))
    assert out.returncode == 0, out.stdout + out.stderr
    return run_dir / "checkpoints" / "step_0000003.h5"


def resume(path: Path, run_dir: Path, *keys: str):
    """`python -m app` (1 rank) resuming from `path` for one more step."""
    return run_app(1, TINY, *_sets(*SMALL, *keys, "train.steps=4", f"run.dir={run_dir}", f"run.resume={path}"))


# ---- values are decoded by their bits ----------------------------------------------------------


def test_decode_reinterprets_the_stored_bits_and_never_converts_numbers():
    """Found in review: decode converted the values it was given (np.asarray(values, float32)), so
    float32 bits read as uint32 (a flipped datatype bit) became numbers of 1e9; the checksum, over the
    bits, still matched. Bits of the stored width are reinterpreted; another width is refused."""
    weights = np.array([1e-3, -2.5, 0.0, 7.0], dtype=np.float32)
    assert torch.equal(decode(weights.view(np.uint32), "float32"), torch.from_numpy(weights))
    assert torch.equal(decode(weights, "float32"), torch.from_numpy(weights))
    half = weights.astype(np.float16)
    assert torch.equal(decode(half.view(np.uint16), "float16"), torch.from_numpy(half.astype(np.float32)))
    bf16 = torch.from_numpy(weights).bfloat16()
    assert torch.equal(decode(bf16.view(torch.int16).numpy().view(np.uint16), "bfloat16"), bf16.float())
    for values, logical in ((weights.astype(np.float64), "float32"), (weights, "bfloat16"), (weights, "int8")):
        with pytest.raises(ValueError, match="cannot hold"):
            decode(values, logical)


# ---- the stored datatype is the one the dtype attribute implies ---------------------------------


def test_a_flipped_bit_in_a_datasets_hdf5_datatype_is_refused_by_a_resume_inspect_and_export(tmp_path, capsys):
    """Found in review: one flipped bit in a dataset's datatype (float32 -> uint32) of a file in the
    earliest format: inspect said ok, a resume trained from masters of 1e9 (the bits converted as
    integers). Now the stored type must be the one its `dtype` attribute is stored as: a resume, inspect
    and export refuse the file with one line naming the dataset and what to do."""
    flipped = tmp_path / "step_0000003.h5"
    flip_datatype(OLD_FILE, flipped, VICTIM)
    with h5py.File(flipped, "r") as f:
        assert f.id.get_create_plist().get_version()[0] == 0  # the earliest format: nothing checksums it
        assert f[VICTIM].dtype == np.uint32 and f[VICTIM].attrs["dtype"] == "float32"

    with pytest.raises(CheckpointError, match=f"dataset /{VICTIM} is damaged: its HDF5 datatype is <u4"):
        read_header(flipped)
    with pytest.raises(CheckpointError, match=f"/{VICTIM} is damaged"):
        export_hf(flipped, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()

    assert checkpoint_cli(["inspect", str(flipped)]) == 1
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and f"gridlm: {flipped}: 1 damaged dataset(s): /{VICTIM}" in out.err, out.err
    assert "use an older checkpoint" in out.err
    row = next(
        line for line in out.out.splitlines() if line.startswith("  blocks.0.attn.proj.bias") and "DAMAGED" in line
    )
    assert "<u4" in row, row

    refused = resume(flipped, tmp_path / "run", *OLD_DECK)
    one_line_refusal(refused, str(flipped), f"dataset /{VICTIM} is damaged", RESUME.damaged)
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


def test_new_checkpoints_checksum_their_metadata_so_a_flipped_datatype_bit_is_an_error(fresh_ckpt, tmp_path, capsys):
    """New files are written in HDF5 1.10's format (superblock 3, object headers with checksums): the
    same flip is HDF5's checksum error, named for its dataset, by inspect (exit 1) and a resume (exit 2)."""
    with h5py.File(fresh_ckpt, "r") as f:
        assert f.id.get_create_plist().get_version()[0] == 3
    flipped = tmp_path / "step_0000003.h5"
    victim = "model/blocks.0.attn.proj.bias"
    flip_datatype(fresh_ckpt, flipped, victim)
    with pytest.raises(CheckpointError, match=f"dataset /{victim} is damaged: its metadata cannot be read .*checksum"):
        read_header(flipped)
    assert checkpoint_cli(["inspect", str(flipped), "--no-verify"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"1 damaged dataset(s): /{victim} (damaged)" in err, err
    one_line_refusal(resume(flipped, tmp_path / "run"), f"dataset /{victim} is damaged", RESUME.damaged)


# ---- every dataset has its checksum --------------------------------------------------------------


def test_a_dataset_without_its_checksum_attribute_is_refused_not_loaded_unverified(fresh_ckpt, tmp_path, capsys):
    """Found in review: a missing `checksum` attribute turned verification off (load accepted the dataset
    unverified, inspect said "no checksum" and exited 0). Every dataset gridlm writes has one: a missing
    one is damage. (Only the RNG rows of the first version-1 files had none: they still load.)"""
    damaged = tmp_path / "step_0000003.h5"
    shutil.copy(fresh_ckpt, damaged)
    victim = "optimizer/exp_avg/blocks.1.mlp.fc.weight"
    with h5py.File(damaged, "r+") as f:
        del f[victim].attrs["checksum"]
    with pytest.raises(CheckpointError, match=f"dataset /{victim} is damaged: it has no checksum attribute"):
        read_header(damaged)
    assert checkpoint_cli(["inspect", str(damaged)]) == 1
    out = capsys.readouterr()
    assert f"/{victim} (damaged)" in out.err and out.err.count("\n") == 1, out.err
    assert "it has no checksum attribute" in next(line for line in out.out.splitlines() if "DAMAGED" in line)
    one_line_refusal(resume(damaged, tmp_path / "run"), f"dataset /{victim} is damaged", "no checksum attribute")

    entry = read_header(fresh_ckpt)["datasets"]["rng/torch_cpu"]
    assert dataset_damage("rng/torch_cpu", {**entry, "checksum": None}, 1) is None
    assert "no checksum" in dataset_damage("rng/torch_cpu", {**entry, "checksum": None}, 2)
    assert "no checksum" in dataset_damage(victim, {**entry, "stored": "<f4", "dtype": "float32",
                                                    "declared": True, "checksum": None}, 1)  # fmt: skip


def test_an_unknown_or_missing_dtype_attribute_is_damage(fresh_ckpt):
    entry = read_header(fresh_ckpt)["datasets"]["model/wte.weight"]
    assert dataset_damage("model/wte.weight", entry, 2) is None
    assert "not one of float32" in dataset_damage("model/wte.weight", {**entry, "dtype": "float31"}, 2)
    assert "missing" in dataset_damage("model/wte.weight", {**entry, "declared": False}, 2)
    assert "<u2, where float32" in dataset_damage("model/wte.weight", {**entry, "stored": "<u2"}, 2)
    assert "not the standard one" in dataset_damage("model/wte.weight", {**entry, "exact": False}, 2)


def test_header_attributes_hdf5_cannot_list_are_one_line_not_a_traceback(tmp_path):
    """Found while fuzzing for this review: a flipped bit in a root attribute's dataspace message (the
    earliest format) made listing the attributes raise HDF5's RuntimeError ("wrong version number in
    dataspace message"), which escaped read_header and inspect as a traceback."""
    from app.checkpoint.io import root_attributes

    class Attributes:
        def keys(self):
            raise RuntimeError("Error iterating over attributes (wrong version number in dataspace message)")

    class File:
        attrs = Attributes()

    path = tmp_path / "step_0000003.h5"
    with pytest.raises(CheckpointError, match=f"{path}: its header attributes cannot be listed .*dataspace"):
        root_attributes(File(), path, RESUME.damaged)


# ---- MPI -------------------------------------------------------------------------------------------


def _all_ranks_ok(runtime, problems: list[str]) -> None:
    problems = sum(runtime.comm.allgather(problems), [])
    assert not problems, "\n".join(problems)


def _state(trainer) -> list[torch.Tensor]:
    opt = trainer.optimizer
    return [trainer.dp.param_buffer.clone(), *(t.clone() for t in trainer.dp.master + opt.exp_avg + opt.exp_avg_sq)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["posix", "independent", "collective"])
def test_every_io_mode_writes_the_checksummed_format_and_loads_it(runtime, grids, shared_tmp, mode):
    """HDF5 1.10's format (superblock 3) through serial HDF5 (posix) and parallel HDF5 (MPI-IO, both
    transfer modes) on 2 ranks; the file loads back to the state that was saved."""
    here = shared_tmp / f"copy{runtime.rank // 2}"  # on 4 ranks two copies of the 2-rank grid, each its run.dirs
    trainer = grid_trainer(grids, 1, 2, 1, (*SMALL, f"run.dir={here / 'first'}", f"checkpoint.io={mode}"))
    train_steps(trainer, 1)
    path = trainer.save("test").path
    problems = []
    if trainer.runtime.rank == 0:
        with h5py.File(path, "r") as f:
            if f.id.get_create_plist().get_version()[0] != 3:
                problems.append(f"superblock version {f.id.get_create_plist().get_version()[0]}, not 3")
    fresh = grid_trainer(grids, 1, 2, 1, (*SMALL, f"run.dir={here / 'second'}", f"checkpoint.io={mode}"))
    assert load(fresh, path)["step"] == 1
    problems += [f"tensor {i} differs" for i, (a, b) in enumerate(zip(_state(trainer), _state(fresh)))
                 if not torch.equal(a, b)]  # fmt: skip
    _all_ranks_ok(trainer.runtime, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [2, 1])
def test_a_dataset_one_rank_cannot_decode_is_named_on_every_rank_without_a_hang(
    runtime, grids, shared_tmp, monkeypatch, dp
):
    """Found in review: the checksum and decode of a dataset ran outside the protected read, so one that
    raised there (values of another type than the metadata says: a KeyError, a ValueError) left that
    rank out of the next dataset's all-gather, where its dp peer waited for the watchdog (30 min); on 1
    rank it was an "internal error" with a traceback. Now the error is kept until the last dataset and
    every rank raises the same CheckpointError naming the dataset, and nothing of the model changed."""
    run = shared_tmp / f"dp{dp}-copy{runtime.rank // dp}"  # a job per copy of the dp-rank grid (dp 1: per rank)
    trainer = grid_trainer(grids, 1, 1, dp, (*SMALL, f"run.dir={run / 'first'}"))
    train_steps(trainer, 1)
    path = trainer.save("test").path
    victim = grid_trainer(grids, 1, 1, dp, (*SMALL, f"run.dir={run / 'victim'}"))
    rt = victim.runtime
    if rt.rank == rt.world_size - 1:
        real, calls = checkpoint_io.decode, []

        def decode(values, logical):
            calls.append(1)
            if len(calls) == 1:
                raise KeyError(16)  # what as_unsigned raised for a float128 dataset
            return real(values, logical)

        monkeypatch.setattr(checkpoint_io, "decode", decode)
    before = _state(victim)
    message = ""
    try:
        load(victim, path)
    except CheckpointError as err:
        message = str(err)
    messages = rt.comm.allgather(message)
    first = read_header(path)["datasets"]
    name = next(iter(sorted(k for k in first if k.startswith("model/"))))
    problems = [f"rank {r}: {m!r}" for r, m in enumerate(messages)
                if f"{path}: dataset /{name} cannot be verified or decoded (16)" not in m or "\n" in m]  # fmt: skip
    if len(set(messages)) > 1:
        problems.append(f"the ranks' messages differ: {messages}")
    if "resume from an older checkpoint" not in message:
        problems.append(f"no fix in {message!r}")
    problems += [f"tensor {i} changed" for i, (a, b) in enumerate(zip(before, _state(victim))) if not torch.equal(a, b)]
    _all_ranks_ok(rt, problems)
