"""Review of the planner (app/plan): the memory estimate against the bytes a real pipeline holds."""

from __future__ import annotations

import json

import pytest

from app.names import BYTES
from app.plan.estimate import estimate_stages, layer_activation_bytes, mask_bytes
from conftest import grid_trainer, train_steps


def _live_bytes_at_first_backward(trace: str) -> tuple[float, float]:
    """(tensor bytes live at the step's start, at its first backward op) on this rank, from a profiler
    trace of one step that starts with a MARK range. The frees of tensors released on the groups'
    threads are not recorded there: an address allocated again counts as freed before."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    mark = min(e["ts"] for e in events if e.get("name") == "MARK")
    backward = min(
        e["ts"] for e in events if e.get("ph") == "X" and e["name"].startswith("autograd::engine") and e["ts"] > mark
    )
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live: dict[int, int] = {}
    total, start = 0, None
    for e in memory:
        if e["ts"] > backward:
            break
        if start is None and e["ts"] >= mark:
            start = total
        address, size = e["args"]["Addr"], e["args"]["Bytes"]
        if size > 0:
            total += size - live.pop(address, 0)
            live[address] = size
        elif address in live:
            total -= live.pop(address)
    assert start is not None
    return float(start), float(total)


@pytest.mark.mpi(min_size=2)
def test_the_pipeline_s_kept_outputs_are_planned(runtime, grids, tmp_path):
    """Found in review (2026-12-01): the pipeline keeps every forward's output until its backward
    (`PipelineSchedule`'s `saved`), one block input's size per pass in flight, which the plan left out:
    under full recomputation with few layers per chunk that is as much as the block inputs it counts
    (gpt_1t, 2 layers a stage: 6.25 GiB of stage 0's 56 GiB, past the dry run's 10% margin). Measured on
    stage 0 of an interleaved pipeline (1 layer per chunk) just before its first backward, when the
    schedule holds the most passes and nothing of a backward's working set exists yet."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    sets = ("model.seq_len=256", "model.layers=8", "model.ffn_hidden=256", "model.dropout=0", "train.micro_batch=2",
            "train.global_batch=16", "parallel.virtual_stages=4", "train.recompute=full", "run.resume=none",
            f"run.dir={tmp_path}/run")  # fmt: skip
    trainer = grid_trainer(grids, 1, 2, 1, sets)
    if not grids.trains(2):  # the world's other copies of the 2-rank grid only build it
        trainer.close()
        return
    train_steps(trainer, 1)  # the optimizer's state and buffers exist from the first step on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("MARK"):
            torch.empty(1)
        train_steps(trainer, 1)
    trace = str(tmp_path / f"trace{runtime.rank}.json")
    prof.export_chrome_trace(trace)
    trainer.close()
    if trainer.grid.coords["pp"] != 0:
        return
    deck = trainer.deck.on_device(False)
    m, e = deck.model, BYTES[deck.train.precision]
    start, before_backward = _live_bytes_at_first_backward(trace)
    # The plan's full recomputation: the passes' kept inputs (and outputs), plus one block's activations
    # while it is recomputed (not yet live here; stage 0 holds no logits).
    one_block = layer_activation_bytes(m, deck.train.micro_batch, 1, False, e, mask=mask_bytes(deck, e))
    planned = estimate_stages(deck)[0].activations["full"] - one_block
    block_input = m.seq_len * deck.train.micro_batch * m.hidden * e
    held = before_backward - start
    # Also live: the gradient received for the first backward (one block input) and the micro-batches' tokens.
    assert planned <= held <= planned + 1.5 * block_input, (held / block_input, planned / block_input)


def test_a_search_that_cannot_time_the_offload_says_so():
    """Found in review (2026-12-01): on a machine file without the offload's rates (h100_1gpu lacks
    host_memory_gbs) the search tried no offloaded configuration and ended 'no configuration of this
    deck can run on this allocation', though every rejected one fits with optim.offload=host (its own
    rejection said so). It now says which were not planned and why."""
    from app.deck import load_deck
    from app.plan.machine import load_machine
    from app.plan.search import format_text, search, to_json
    from conftest import REPO

    deck = load_deck(REPO / "inputs/gpu/gpt_6.1b_offload.yaml", ("optim.offload=none",))
    result = search(deck, 1, load_machine("h100_1gpu"), top=1, tensor="1d")
    assert not result.best and result.unplanned_offload > 0
    text = format_text(result, "gpt_6.1b_offload.yaml")
    assert "not planned:" in text and "optim.offload=host" in text and "host_memory_gbs" in text, text
    assert "host_memory_gbs" in to_json(result)["not_planned"]
