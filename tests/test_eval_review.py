"""Review of evaluation and the run's reports (app/eval, app/metrics): faults found and fixed.

Tiny models (2 layers of 32) on the synthetic stream; real Trainers on the session's grids."""

from __future__ import annotations

import json
import math

import pytest
import torch

from app.errors import NonFiniteError
from conftest import REPO

TINY = "inputs/gpt_tiny.yaml"
SMALL = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
    "train.global_batch=8", "train.micro_batch=2", "run.log_every=1", "checkpoint.at_exit=false",
)  # fmt: skip


def _trainer(runtime, grids, *sets: str):
    from app.deck import load_deck, resolve_for_world
    from app.train import Trainer

    deck = resolve_for_world(load_deck(REPO / TINY, (*SMALL, *sets)), runtime.world_size)
    return Trainer(deck, runtime, grids.grid(1, 1, runtime.world_size))


def _release(trainer) -> None:
    trainer.close()
    if trainer.run_lock is not None:
        trainer.run_lock.release()


@pytest.mark.mpi
def test_a_nan_validation_loss_has_a_nan_perplexity_not_an_infinite_one(runtime, shared_tmp, grids):
    """Found in review: `exp(loss) if loss < 700 else inf` sent a NaN loss (NaN < 700 is false) to an
    infinite perplexity, so the log said "ppl inf" (an overflowing, diverged loss) of a model whose
    loss is NaN. A NaN weight makes the loss NaN on every rank."""
    from app.eval import evaluate
    from app.metrics.report import dumps_strict

    trainer = _trainer(runtime, grids, "eval.every=1", "eval.batches=1", f"run.dir={shared_tmp / 'nan'}")
    try:
        with torch.no_grad():
            trainer.model.wte.weight.view(-1)[0] = math.nan  # every rank's copy (dp replicas)
        assert trainer.eval_data is not None
        result = evaluate(trainer, trainer.eval_data)
    finally:
        _release(trainer)
    assert math.isnan(result["loss"])
    assert math.isnan(result["perplexity"]), result["perplexity"]
    # Written strict: both null, both named.
    assert json.loads(dumps_strict(dict(result)))["nonfinite"] == ["loss", "perplexity"]


@pytest.mark.mpi
def test_a_fresh_run_that_fails_leaves_no_earlier_runs_summary_behind(runtime, shared_tmp, grids):
    """Found in review: a fresh run (no resume) starts metrics.jsonl, TensorBoard and profile.txt
    afresh, but an earlier run's summary.json stayed in run.dir until the new one finished: a fresh
    run that then failed (here train.nonfinite: abort at step 2) left run.dir with its own 1-step
    metrics.jsonl beside a summary.json of another run's 2 finished steps, interrupted: null, read
    as this run's result. A resumed run keeps the summary of the job it continues (that one says
    where it stopped)."""
    run_dir = shared_tmp / "fresh"
    earlier = _trainer(runtime, grids, "train.steps=2", f"run.dir={run_dir}")
    try:
        earlier.run()
    finally:
        _release(earlier)
    runtime.comm.Barrier()
    assert (run_dir / "summary.json").is_file()

    again = _trainer(runtime, grids, "train.steps=4", "run.resume=none", f"run.dir={run_dir}")
    step = again.forward_backward

    def nan_at_step_2() -> torch.Tensor:  # the loss is NaN on one rank: every rank aborts together
        loss = step()
        poisoned = again.steps_done == 1 and runtime.rank == runtime.world_size - 1
        return loss * math.nan if poisoned else loss

    again.forward_backward = nan_at_step_2
    try:
        with pytest.raises(NonFiniteError, match="at step 2"):
            again.run()
    finally:
        _release(again)
    runtime.comm.Barrier()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]  # this run's own records only
    assert not (run_dir / "summary.json").exists()  # no other run's result in its place
