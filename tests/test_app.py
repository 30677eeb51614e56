"""`python -m app` as users launch it: -n 1 vs -n 4 vs an -n 8 3D grid, and bad input on every rank.

These tests start real MPI jobs (subprocesses), so they run in the serial group.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import read_metrics, run_app, run_mpi

TINY = "inputs/gpt_tiny.yaml"
FAST = (
    "--set", "model.layers=2", "--set", "model.hidden=64", "--set", "model.seq_len=32",
    "--set", "train.steps=6", "--set", "train.global_batch=8", "--set", "train.micro_batch=2",
    "--set", "run.log_every=1", "--set", "optim.warmup_steps=2",
)  # fmt: skip


def test_one_rank_four_ranks_and_an_eight_rank_3d_grid_give_the_same_losses(tmp_path):
    # 1 rank: 4 micro-batches accumulated; 4 ranks: dp=4, 1 micro-batch each; 8 ranks: the
    # issue's `--set parallel.tp=2 --set parallel.pp=2` (dp=2, 1F1B over 2 stages). Same global
    # batch. Tolerance 1e-5 relative: fp32, only the summation order differs (see
    # tests/test_parallel_equivalence.py for the reasoning and the measured errors).
    runs = {}
    for name, ranks, grid in (
        ("1", 1, ()),
        ("4", 4, ()),
        ("8", 8, ("--set", "parallel.tp=2", "--set", "parallel.pp=2")),
    ):
        out = run_app(ranks, TINY, *FAST, *grid, "--set", f"run.dir={tmp_path / name}")
        assert out.returncode == 0, out.stdout + out.stderr
        runs[name] = read_metrics(tmp_path / name)
        assert out.stdout.count("gridlm: done") == 1  # rank 0 alone reports
    losses = {name: [r["loss"] for r in records] for name, records in runs.items()}
    assert len(losses["1"]) == 6
    assert losses["4"] == pytest.approx(losses["1"], rel=1e-5)
    assert losses["8"] == pytest.approx(losses["1"], rel=1e-5)
    assert losses["1"][-1] < losses["1"][0]
    summary = json.loads((tmp_path / "4" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["nodes"] == 1 and summary["ranks_per_node"] == 4
    assert summary["grid"] == {"tp": 1, "pp": 1, "dp": 4, "order": "tp-dp-pp", "tensor": None, "tensor_order": None,
                               "within_node": {"tp": True, "pp": True, "dp": True}}  # fmt: skip
    assert summary["deck"]["train"]["steps"] == 6 and summary["steps"] == 6
    assert summary["final_loss"] == runs["4"][-1]["loss"]
    assert summary["aggregate_tflops"] == pytest.approx(4 * summary["tflops_per_rank"])
    assert summary["versions"]["mpi_library"].startswith(("Open MPI", "MPICH", "Intel"))
    grid = json.loads((tmp_path / "8" / "summary.json").read_text())
    assert grid["grid"] == {"tp": 2, "pp": 2, "dp": 2, "order": "tp-dp-pp", "tensor": None, "tensor_order": None,
                            "within_node": {"tp": True, "pp": True, "dp": True}}  # fmt: skip
    assert grid["pipeline"] == {"schedule": "1f1b", "virtual_stages": 1, "layers_per_chunk": [1, 1], "micro_batches": 2}
    # Rank 0 holds a quarter of the blocks' weights and half the embedding: far less than the model.
    assert grid["parameters_rank0"] < grid["parameters"] / 2


def _sets(*assignments: str) -> tuple[str, ...]:
    return tuple(arg for a in assignments for arg in ("--set", a))


BAD = [
    (_sets("train.steps=0"), "deck error: train.steps = 0: must be >= 1"),
    (_sets("model.heads=5"), "deck error: model.heads = 5: must divide model.hidden = 256"),
    (_sets("parallel.dp=4"), "must equal the world size 2"),
    (_sets("parallel.tp=3"), "deck error: model.heads = 8: parallel.tp = 3 splits the attention heads"),
    (_sets("parallel.pp=2", "parallel.virtual_stages=2", "train.global_batch=6", "train.micro_batch=2"),
     "to be a multiple of pp = 2"),
    (_sets("train.global_batch=6", "train.micro_batch=2"), "micro_batch x dp = 2 x 2 = 4"),
    (_sets("data.kind=memmap", "data.path=/nonexistent/corpus"), "/nonexistent/corpus"),
]  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    # Two in every tier (a deck key against the world, a missing data file); the other deck errors
    # are also refused in-process by tests/test_deck.py.
    [pytest.param(*b, marks=() if i in (2, 6) else pytest.mark.full) for i, b in enumerate(BAD)],
    ids=[b[1][:40] for b in BAD],
)
def test_bad_input_gives_one_message_and_status_2_on_every_rank(tmp_path, args, message):
    out = run_app(2, TINY, "--set", "train.steps=2", "--set", f"run.dir={tmp_path}", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("gridlm:") == 1, out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_every_rank_exits_with_status_2(tmp_path):
    # Look at each rank's own exit status, not only mpirun's summary of them.
    script = f"{sys.executable} -m app {TINY} --set train.steps=-3; echo rank-status=$?"
    out = run_mpi(2, "sh", "-c", script, timeout=120)
    assert out.stdout.count("rank-status=2") == 2, out.stdout + out.stderr


def test_missing_deck_file_is_a_clear_error(tmp_path):
    out = run_app(1, str(tmp_path / "missing.yaml"))
    assert out.returncode == 2
    assert "file not found" in out.stderr and "Traceback" not in out.stderr
