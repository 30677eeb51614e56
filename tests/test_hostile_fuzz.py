"""Property: no input file other than the deck can hurt gridlm either.

Hypothesis writes machine files (the real keys with valid, invalid and junk values, then the
YAML mutated at the byte level as test_deck_fuzz.py mutates decks), checkpoint headers (a real
checkpoint's root attributes changed, deleted or added, with the header digest left stale,
recomputed over the new values, or removed as in files written before it), token-file metadata
(PREFIX.json) and index files (PREFIX.idx.npy: any dtype, shape and values, a forged .npy
header, random bytes). Each goes through what reads it (`load_machine` and the dry run's plan
and prediction; `read_header` and `python -m app.checkpoint inspect`; `MemmapTokens` and a
sample) and must end in a GridlmError or a value, never another exception. A stale digest over
changed values must always be refused.

Memory: each example's peak RSS above what the process held before it (Linux's VmHWM, reset
per example through /proc/self/clear_refs) stays under MAX_GROWTH: the loaders read bounded
amounts whatever the file says. A hang shows as the per-test timeout (no time is asserted).
Derandomized: CI runs the same examples every time.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_deck_fuzz import FUZZ, HUGE, JUNK, NONFINITE, TEXT, mutate

from app.deck import load_deck
from app.errors import CheckpointError, GridlmError
from conftest import REPO, run_app

MAX_GROWTH = 100 << 20  # bytes of peak RSS an example may add: the bounded reads are at most a few MB


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


@contextlib.contextmanager
def bounded_rss():
    """Assert that the block's peak RSS stays within MAX_GROWTH of the RSS before it."""
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark := the current RSS
    before = _status_bytes("VmRSS")
    yield
    grown = _status_bytes("VmHWM") - before
    assert grown < MAX_GROWTH, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def refused_or_done(action) -> str:
    """'done' or 'refused' (a GridlmError); any other exception fails the example."""
    with bounded_rss():
        try:
            action()
        except GridlmError:
            event("refused")  # --hypothesis-show-statistics shows the mix
            return "refused"
    event("done")
    return "done"


# ---- machine files ---------------------------------------------------------------------

MACHINE = yaml.safe_load((REPO / "inputs/machines/dgx_h100.yaml").read_text())
MACHINE_KEYS = [*MACHINE, "peak_tflops", "memory_gbs", "fault_gbs", "host_memory_gbs", "nvme_read_gbs",
                "op_overhead_us", "collectives", "network_collectives", "elementwise_gbs", "unknown"]  # fmt: skip
MACHINE_VALUE = st.one_of(
    st.sampled_from([0, -1, 1, 8, 0.5, 1e-300, 1e300, *HUGE, *NONFINITE]),
    st.integers(),
    st.floats(),
    TEXT,
    JUNK,
    st.lists(
        st.fixed_dictionaries(
            {"name": TEXT, "devices": st.none() | st.integers(-2, 2**40), "gbs": st.floats(), "latency_us": st.floats()}
        ),
        max_size=3,
    ),  # fmt: skip
    st.fixed_dictionaries({"efficiency": st.floats(), "compute_units": st.integers(), "tile": JUNK}),
)


@st.composite
def machine_texts(draw: st.DrawFn) -> bytes:
    machine = dict(MACHINE)
    for key, value in draw(st.lists(st.tuples(st.sampled_from(MACHINE_KEYS), MACHINE_VALUE), max_size=2)):
        machine[key] = value
    if draw(st.integers(0, 3)) == 0:  # a required key left out (every one is refused by name)
        machine.pop(draw(st.sampled_from(list(MACHINE))), None)
    text = yaml.safe_dump(machine, sort_keys=False, allow_unicode=True).encode()
    return mutate(draw, text) if draw(st.booleans()) else text


@pytest.fixture(scope="module")
def tiny_deck():
    return load_deck(REPO / "inputs/gpt_tiny.yaml", ("parallel.dp=auto",))


@settings(FUZZ, max_examples=300)
@given(data=machine_texts(), world=st.sampled_from([4, 8, 64]))
def test_any_machine_file_is_refused_or_planned(tmp_path_factory, tiny_deck, data, world):
    from app.plan.dryrun import dump_json, format_text, make_plan, world_for
    from app.plan.machine import load_machine

    path = tmp_path_factory.mktemp("machine") / "dgx_h100.yaml"  # name = the stem
    path.write_bytes(data)

    def plan() -> None:
        machine = load_machine(path)
        world_size, rpn = world_for(tiny_deck, world, None, machine)
        made = make_plan(tiny_deck, world_size, machine, rpn)
        format_text(made, "deck.yaml")
        dump_json(made)

    refused_or_done(plan)


def test_the_base_machine_file_plans(tmp_path, tiny_deck):
    """The fuzz's base file and deck plan: the property is not vacuous."""
    from app.plan.dryrun import make_plan
    from app.plan.machine import load_machine

    path = tmp_path / "dgx_h100.yaml"
    path.write_text(yaml.safe_dump(MACHINE, sort_keys=False))
    assert make_plan(tiny_deck, 4, load_machine(path), 8).world_size == 4


# ---- checkpoint headers ------------------------------------------------------------------

HEADER_KEYS = ["format", "format_version", "step", "consumed_samples", "sampler", "optimizer_steps", "precision",
               "loss_scaler", "deck", "grid", "versions", "created", "checksum_algorithm", "nonfinite_events",
               "nonfinite_in_a_row", "committed", "header_sha256", "extra"]  # fmt: skip
PLAUSIBLE_JSON = [
    '{"consumed_samples": -1}', '{"consumed_samples": 1e30}', '{"consumed_samples": "48"}', "[48]", "null", "{}",
    '{"scale": 0, "clean": 0, "skipped": 0}', '{"scale": "NaN", "clean": 1, "skipped": 1}', '{"scale": 1e400}',
    '{"tp": 0, "pp": 1, "dp": 1}', '{"tp": 2}', "[" * 5000 + "]" * 5000, '"model:\\n  hidden: 1"',
]  # fmt: skip
NO_NUL = TEXT.filter(lambda t: "\x00" not in t)  # HDF5's strings end at a NUL
ATTRIBUTE = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.booleans(),
    NO_NUL,
    JUNK.map(json.dumps),
    st.sampled_from(PLAUSIBLE_JSON),
    st.sampled_from(["fp16", "fp8", "model: [1, 2", "model:\n  hidden: -1\n", "a: &a [1]\nb: *a\n"]),
    st.lists(st.integers(-9, 9), max_size=4).map(lambda v: np.array(v, dtype=np.int64)),
    st.binary(max_size=8).filter(lambda b: b"\x00" not in b).map(np.bytes_),
)


def _attributes(f: h5py.File) -> dict:
    from app.checkpoint.io import root_attributes

    return root_attributes(f, Path(f.filename))  # as read_header reads them


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real committed checkpoint of a 1-rank, one-step run of a tiny GPT."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    sets = ["model.layers=1", "model.hidden=16", "model.heads=2", "model.seq_len=8", "model.vocab_size=64",
            "train.steps=1", "train.global_batch=2", "train.micro_batch=1", f"run.dir={run_dir}"]  # fmt: skip
    out = run_app(1, "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s)))
    assert out.returncode == 0, out.stdout + out.stderr
    return run_dir / "checkpoints" / "step_0000001.h5"


def _inspect(path: Path) -> tuple[int, str]:
    from app.checkpoint.__main__ import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = run(["inspect", str(path)])
    return rc, err.getvalue()


@settings(FUZZ, max_examples=200)
@given(
    changes=st.lists(st.tuples(st.sampled_from(HEADER_KEYS), st.none() | ATTRIBUTE), min_size=1, max_size=3),
    digest=st.sampled_from(["stale", "recomputed", "removed"]),
)
def test_any_checkpoint_header_is_refused_or_read(tmp_path_factory, checkpoint, changes, digest):
    from app.checkpoint.io import HEADER_DIGEST, header_digest, model_section, read_header

    path = tmp_path_factory.mktemp("header") / checkpoint.name
    shutil.copyfile(checkpoint, path)
    with h5py.File(path, "r+") as f:
        written = f.attrs[HEADER_DIGEST]
        for key, value in changes:
            if value is None:
                f.attrs.pop(key, None)
            else:
                f.attrs[key] = value
        changed = header_digest(_attributes(f)) != written
        if digest == "recomputed":
            f.attrs[HEADER_DIGEST] = header_digest(_attributes(f))
        elif digest == "removed":
            f.attrs.pop(HEADER_DIGEST, None)
        elif HEADER_DIGEST in f.attrs:  # stale: the digest the writer wrote, where a change left it
            f.attrs[HEADER_DIGEST] = written

    def read() -> None:
        header = read_header(path)
        model_section(header, path)

    outcome = refused_or_done(read)
    with bounded_rss():
        rc, err = _inspect(path)
    assert rc in (0, 2) and (rc == 0) == (outcome == "done"), err
    assert rc == 0 or err.startswith("gridlm: ") and err.count("\n") == 1, err
    if digest == "stale" and changed and all(k not in ("committed", HEADER_DIGEST) for k, _ in changes):
        assert outcome == "refused", changes  # a changed header under the writer's digest never loads


@pytest.mark.parametrize("version", [True, "model:\n  hidden: -1\n", 2.0, -1, 3])
def test_a_format_version_of_another_type_or_value_is_one_line_naming_it(tmp_path, checkpoint, version):
    """Found by a long randomized run of the fuzz test above (2026-11-30): format_version = True (a bool,
    which equals 1) was read as version 1, its v1 checksums failed and inspect exited 1 calling the data
    corrupt; a string with newlines came back in a three-line message. Each is now one line naming the
    value (exit 2), with the advice for a damaged header, and a newer integer version still says to update."""
    from app.checkpoint.io import HEADER_DIGEST, header_digest, read_header

    path = tmp_path / checkpoint.name
    shutil.copyfile(checkpoint, path)
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = version
        f.attrs[HEADER_DIGEST] = header_digest(_attributes(f))  # a consistent rewrite: only the value is wrong
    with pytest.raises(CheckpointError, match=r"has format version ") as refused:
        read_header(path)
    assert repr(version) in str(refused.value) and "\n" not in str(refused.value), refused.value
    assert ("update gridlm" in str(refused.value)) == (version == 3), refused.value
    rc, err = _inspect(path)
    assert rc == 2 and err.startswith("gridlm: ") and err.count("\n") == 1, err


def test_a_consistently_rewritten_bad_header_is_refused_by_a_resume(tmp_path, checkpoint):
    """A header whose values were changed and its digest recomputed (not a bit flip: a hand edit, or
    a file of a buggy tool): the resume ends in one line naming the attribute, exit 2, no traceback."""
    from app.checkpoint.io import HEADER_DIGEST, header_digest

    path = tmp_path / checkpoint.name
    shutil.copyfile(checkpoint, path)
    with h5py.File(path, "r+") as f:
        f.attrs["sampler"] = '{"consumed_samples": -2}'
        f.attrs[HEADER_DIGEST] = header_digest(_attributes(f))
    with pytest.raises(CheckpointError, match="header attribute sampler"):
        from app.checkpoint.io import read_header

        read_header(path)
    sets = ["model.layers=1", "model.hidden=16", "model.heads=2", "model.seq_len=8", "model.vocab_size=64",
            "train.steps=2", "train.global_batch=2", "train.micro_batch=1", f"run.dir={tmp_path / 'run'}",
            f"run.resume={path}"]  # fmt: skip
    out = run_app(1, "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s)))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "header attribute sampler" in out.stderr, out.stderr


# ---- token files: metadata and index ------------------------------------------------------


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    from test_goldfish import write_tokens

    prefix = tmp_path_factory.mktemp("tokens") / "data"
    write_tokens(str(prefix), [list(range(10, 40))] * 6 + [[1, 2, 3]] * 4)
    return prefix


def _copy_tokens(token_file: Path, directory: Path) -> Path:
    for suffix in (".bin", ".json", ".idx.npy"):
        shutil.copyfile(f"{token_file}{suffix}", f"{directory / 'data'}{suffix}")
    return directory / "data"


def _open_and_sample(prefix: Path) -> None:
    from app.data.memmap import MemmapTokens

    tokens = MemmapTokens(str(prefix), 16, 512, seed=3, split=0.2)
    assert tokens.sample(0).shape == (17,) and tokens.sample(10 * tokens.num_samples).shape == (17,)


METADATA_KEYS = ["format", "version", "dtype", "vocab_size", "num_tokens", "num_documents", "tokenizer", "eos",
                 "max_token_id", "tokenizer_path", "tokenizer_sha256", "unknown"]  # fmt: skip
META_VALUE = st.one_of(st.sampled_from([0, -1, 1, 256, 257, True, None, "uint8", "uint32", "byte", *HUGE]), JUNK)


@st.composite
def metadata_texts(draw: st.DrawFn, base: dict) -> bytes:
    meta = dict(base)
    for key, value in draw(st.lists(st.tuples(st.sampled_from(METADATA_KEYS), META_VALUE), max_size=3)):
        meta[key] = value
    if draw(st.integers(0, 3)) == 0:
        meta.pop(draw(st.sampled_from(list(base))), None)
    text = json.dumps(meta).encode()
    return mutate(draw, text) if draw(st.booleans()) else text


def test_the_base_token_file_opens_and_samples(token_file):
    _open_and_sample(token_file)


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_any_token_file_metadata_is_refused_or_read(tmp_path_factory, token_file, data):
    prefix = _copy_tokens(token_file, tmp_path_factory.mktemp("meta"))
    base = json.loads(Path(f"{token_file}.json").read_text())
    Path(f"{prefix}.json").write_bytes(data.draw(metadata_texts(base)))
    refused_or_done(lambda: _open_and_sample(prefix))


INDEX_DTYPES = ["<i8", "<u8", "<i4", "<u2", ">i8", "<f8", "<f4", "|b1", "<c16", "|S4", "<U2", "O"]


@st.composite
def index_bytes(draw: st.DrawFn, offsets: np.ndarray) -> bytes:
    """An index file: the real offsets changed, another dtype or shape, a forged header, junk."""
    kind = draw(st.sampled_from(["values", "dtype", "shape", "forged", "truncated", "junk"]))
    values = offsets.copy()
    if kind == "values":
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(values) - 1))
            values[at] = draw(st.sampled_from([-1, 0, 1, 2**62, -(2**63), int(offsets[-1]) + 1]) | st.integers(-5, 500))
    elif kind == "dtype":
        dtype = draw(st.sampled_from(INDEX_DTYPES))
        values = np.array([str(v) for v in values] if dtype in ("|S4", "<U2") else values).astype(dtype)
    elif kind == "shape":
        values = draw(st.sampled_from([values.reshape(1, -1), values[:0], values[:1], np.int64(values[-1]),
                                       np.stack([values, values])]))  # fmt: skip
    buffer = io.BytesIO()
    if kind == "forged":  # a header claiming far more than the file holds (np.load mmaps it)
        shape = draw(st.sampled_from([(2**40,), (2**62,), (len(offsets) + 1,), (0,), (3, 2**31)]))
        np.lib.format.write_array_header_1_0(buffer, {"descr": "<i8", "fortran_order": False, "shape": shape})
        buffer.write(offsets.tobytes())
    else:
        np.save(buffer, values, allow_pickle=True)  # an object array pickles: the reader must refuse it
    data = buffer.getvalue()
    if kind == "truncated":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif kind == "junk":
        data = draw(st.binary(max_size=200)) if draw(st.booleans()) else mutate(draw, data)
    return data


def test_a_token_index_whose_npy_header_is_cut_is_a_data_error(tmp_path_factory, token_file):
    """Found by a long randomized run of the fuzz test below (2026-11-30): a .npy header of one byte, "{",
    made numpy's header parser raise tokenize.TokenError, which the loader let through as a traceback."""
    from app.errors import DataError

    prefix = _copy_tokens(token_file, tmp_path_factory.mktemp("cut"))
    good = Path(f"{token_file}.idx.npy").read_bytes()
    Path(f"{prefix}.idx.npy").write_bytes(b"\x93NUMPY\x01\x00\x01\x00{" + good[128:])
    with pytest.raises(DataError, match=r"idx\.npy is not a readable \.npy file"):
        _open_and_sample(prefix)


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_any_token_index_is_refused_or_read(tmp_path_factory, token_file, data):
    prefix = _copy_tokens(token_file, tmp_path_factory.mktemp("index"))
    offsets = np.load(f"{token_file}.idx.npy")
    Path(f"{prefix}.idx.npy").write_bytes(data.draw(index_bytes(offsets)))
    refused_or_done(lambda: _open_and_sample(prefix))
