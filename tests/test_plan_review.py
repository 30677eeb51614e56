"""Review of the planner (app/plan): the memory estimate against the bytes a real pipeline holds."""

from __future__ import annotations

import json

import pytest

from app.names import BYTES
from app.plan.estimate import estimate_stages, layer_activation_bytes, mask_bytes
from conftest import REPO, grid_trainer, train_steps


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


# One H100 80 GB with 128 GiB of host memory (inputs/machines/h100_1gpu.yaml), as README's "Memory at scale".
ONE_H100 = ("train.precision=bf16", "model.seq_len=2048", "model.vocab_size=51200", "train.micro_batch=1",
            "train.global_batch=8", "train.recompute=full", "parallel.dp=1")  # fmt: skip
GPT_6_9B = ("model.layers=33", "model.hidden=4096", "model.heads=32")  # README's largest with host offload


def _tiny(*sets: str):
    from app.deck import load_deck
    from conftest import REPO

    return load_deck(REPO / "inputs/gpt_tiny.yaml", sets)


def test_an_async_checkpoint_s_host_copy_is_planned_in_host_memory_or_the_device():
    """Found in review (2026-12-02): checkpoint.async copies every slice a rank writes (parameters, fp32
    masters, moments; the offloaded ones too) into host memory and keeps the copy while training goes
    on; the plan counted none of it. README's 6.9B on one H100 with host offload planned 102.28 of
    102.4 GiB host, "ok", with 14 bytes a parameter more to hold. Now it is in host memory on GPU
    machines (refused there) and in the device's total on CPU machines, a line of its own."""
    from app.plan.dryrun import format_text, make_plan
    from app.plan.estimate import checkpoint_bytes, model_params
    from app.plan.machine import load_machine

    h100 = load_machine("h100_1gpu")
    sync = make_plan(_tiny(*ONE_H100, *GPT_6_9B, "optim.offload=host"), 1, h100)
    deck = _tiny(*ONE_H100, *GPT_6_9B, "optim.offload=host", "checkpoint.async=true")
    plan = make_plan(deck, 1, h100)
    assert not sync.problems and sync.stages[0].snapshot(0) == 0
    # One rank writes every element: bf16 parameters, fp32 masters and two fp32 moments, the checkpoint's bytes.
    copy = plan.stages[0].snapshot(0)
    assert copy == model_params(deck.model) * (2 + 4 + 8) == checkpoint_bytes(deck)
    (problem,) = plan.problems
    host = plan.stages[0].host(0, "host")
    assert "checkpoint.async's host copy of the checkpoint do not fit the host memory" in problem, problem
    assert f"= {(host + copy) / 2**30:,.1f} GiB, h100_1gpu has 102.4 GiB usable" in problem, problem
    assert "--set checkpoint.async=false" in problem
    assert f"ckpt copy  {copy / 2**30:.2f} GiB per rank" in format_text(plan, "deck")
    # A CPU machine: in the device's total (its host memory); a pipeline's stages share the copy.
    local = load_machine("local")
    for pp in (1, 2):
        sets = ("parallel.dp=1", f"parallel.pp={pp}", "train.global_batch=4")
        cpu = {a: make_plan(_tiny(*sets, f"checkpoint.async={a}"), pp, local) for a in ("false", "true")}
        stages = cpu["true"].stages
        assert sum(s.snapshot(0) for s in stages) == checkpoint_bytes(cpu["true"].deck)
        for s, plain in zip(stages, cpu["false"].stages):
            assert cpu["true"].stage_total(s) - cpu["false"].stage_total(plain) == s.snapshot(0) > 0


def test_every_element_of_a_checkpoint_is_written_once_and_the_plan_takes_the_rank_that_writes_most():
    """`checkpoint_elements` (the async copy's size) over every tp and dp rank of a stage's layout adds up
    to the stage's parameters (each written once: tp rank 0 the replicated ones, each dp rank its slice,
    never the tied head copy, never the padding), and the plan's rank (tp 0, dp 0) writes the most."""
    from app.deck import resolve_for_world
    from app.plan.estimate import _bucket_elements, checkpoint_elements, stage_param_metas, stage_params, stage_units
    from app.sharding.layout import ParamLayout

    deck = resolve_for_world(
        _tiny("parallel.tp=2", "parallel.pp=2", "parallel.dp=3", "parallel.dp_bucket_mb=0.1", "train.global_batch=12"),
        12,
    )
    m = deck.model
    for layers, first, last in ((2, True, False), (2, False, True)):
        stage = stage_params(m, 1, layers, first, last) - (m.vocab_size * m.hidden if last else 0)  # the head is tied
        cut, buckets = stage_units(m, layers, first, last)[::-1], _bucket_elements(deck)
        for units in (False, True):
            counts = {}
            for tp_rank in range(2):
                params = stage_param_metas(m, 2, layers, first, last, tp_rank)[::-1]
                for dp_rank in range(3):
                    layout = ParamLayout.build(
                        params, tp_rank=tp_rank, dp=3, dp_rank=dp_rank, zero=True, bucket_elements=buckets,
                        alone=len(params) - 1 - int(first), units=cut if units else None,
                    )  # fmt: skip
                    counts[tp_rank, dp_rank] = checkpoint_elements(layout)
            assert sum(counts.values()) == stage, (first, units)
            assert max(counts.values()) == counts[0, 0]


@pytest.mark.mpi
@pytest.mark.parametrize("overrides", [(), ("train.precision=bf16",)], ids=["fp32", "bf16"])
def test_the_async_checkpoint_s_planned_copy_is_what_its_snapshot_holds(runtime, grids, tmp_path, overrides):
    """The plan's per-rank copy (`StageEstimate.snapshot`) against the host bytes of a real
    `snapshot(copy=True)`, the one checkpoint.async takes: equal."""
    from app.checkpoint.io import snapshot
    from app.plan.estimate import estimate_stages

    sets = (*overrides, "checkpoint.async=true", "run.resume=none", "train.global_batch=16", f"run.dir={tmp_path}/run")
    trainer = grid_trainer(grids, 1, 1, 1, sets)
    if not grids.trains(1):
        trainer.close()
        return
    train_steps(trainer, 1)
    held = snapshot(trainer, copy=True).host_bytes
    trainer.close()
    assert held == estimate_stages(trainer.deck.on_device(False))[0].snapshot(0) > 0


# The review's deck: a 40B GPT on one Frontier node (8 GCDs) with pp 8, whose host-offloaded state
# (12 bytes an element and the gradients' copy, 8 ranks) exceeds 80% of the node's 512 GiB.
FRONTIER_40B = ("train.precision=bf16", "model.seq_len=2048", "model.vocab_size=51200", "train.micro_batch=1",
                "train.global_batch=16", "train.recompute=full", "model.layers=88", "model.hidden=6144",
                "model.heads=48", "parallel.dp=auto", "parallel.pp=8")  # fmt: skip


def test_the_search_offloads_to_nvme_where_host_offload_overfills_the_host_memory():
    """Found in review (2026-12-02): on a GPU machine the search tried optim.offload host only, so a deck
    whose host offload exceeds the node's host memory got "no configuration of this deck can run",
    though --dry-run --set optim.offload=nvme fits. It now plans nvme where the host-offloaded twin is
    refused for the host memory and the machine file gives the drive's capacity and rates."""
    from app.plan.dryrun import make_plan
    from app.plan.machine import load_machine
    from app.plan.search import _apply, format_text, search

    frontier = load_machine("frontier")
    deck = _tiny(*FRONTIER_40B)
    result = search(deck, 8, frontier, top=3, tensor="1d")
    assert result.best and all(c.sets.get("optim.offload") == "nvme" for c in result.best), format_text(result, "d")
    assert result.rejected["offloaded state does not fit the host or drive"] > 0
    best = result.best[0]
    assert "--set optim.offload=nvme" in best.overrides()
    for kind, fits in (("nvme", True), ("host", False)):  # the best's host twin: refused for the host memory
        plan = make_plan(_apply(deck, {**best.sets, "optim.offload": kind}), 8, frontier)
        assert (not plan.problems) == fits, plan.problems
        assert fits or all("not fit the host memory" in p for p in plan.problems)


def test_the_optimizer_s_work_buffers_are_planned_where_the_update_keeps_them():
    """Found in review (2026-12-02): the optimizer keeps fp32 work buffers the size of its largest bucket
    part from step to step, which the plan left out (gpt_tiny at vocab 16384 on one CPU rank: planned
    177 MiB, measured 209). The eager update (CPU ranks, LAMB anywhere) keeps `Scratch`'s denominator
    and the scaled gradient's copy (clipping, fp16's loss scale, or a gradient not in fp32); GPUs'
    fused AdamW only an fp32 copy of a gradient that is not fp32; an offloaded update none."""
    import dataclasses

    from app.deck import resolve_for_world
    from app.plan.estimate import StageKey, estimate_stages, stage_layout

    def extra(*sets: str, gpu: bool) -> tuple[float, float]:
        """(the optimizer's device bytes beyond its state, 4 bytes x the largest bucket part updated)."""
        deck = resolve_for_world(_tiny("parallel.dp=1", "model.vocab_size=16384", *sets), 1).on_device(gpu)
        s = estimate_stages(deck)[0]
        layout = stage_layout(deck, StageKey(4, True, True, False))
        largest = max(b.shard_hi - b.shard_lo for b in layout.buckets)
        return s.optimizer_for(0) - s.optimizer["zero0"], 4.0 * largest

    for sets, gpu, buffers in (
        ((), False, 2),  # gpt_tiny clips at 1.0: the denominator and the clipped gradient's copy
        (("optim.grad_clip=0",), False, 1),  # fp32 gradients used as they are
        (("train.precision=bf16", "train.grad_reduce_dtype=compute"), False, 2),  # bf16 gradients copied to fp32
        ((), True, 0),  # torch's fused AdamW unscales as it reads
        (("train.precision=bf16", "train.grad_reduce_dtype=compute"), True, 1),  # `_AdamWCall`'s fp32 copy
        (("optim.name=lamb",), True, 2),  # LAMB is eager on GPUs too
        (("optim.name=lamb", "optim.grad_clip=0"), True, 1),
    ):
        got, one = extra(*sets, gpu=gpu)
        assert got == buffers * one, (sets, gpu, got / one)
    deck = resolve_for_world(_tiny("parallel.dp=1", "optim.offload=host"), 1).on_device(False)
    s = estimate_stages(deck)[0]
    assert s.optimizer_for(0, "host") == s.gradient_shard["zero0"]  # the update runs on the host
    assert dataclasses.replace(s, optimizer_scratch={}).total(0, "none") < s.total(0, "none")


@pytest.mark.mpi
def test_the_optimizer_keeps_the_work_buffers_the_plan_counts(runtime, grids, tmp_path):
    """The planned work buffers against `Scratch`'s after a clipped step of a real CPU rank: equal."""
    from app.plan.estimate import estimate_stages

    sets = ("optim.grad_clip=0.000001", "run.resume=none", "train.global_batch=16", f"run.dir={tmp_path}/run")
    trainer = grid_trainer(grids, 1, 1, 1, sets)
    if not grids.trains(1):
        trainer.close()
        return
    train_steps(trainer, 1)
    kept = sum(t.numel() * t.element_size() for t in trainer.optimizer.scratch._buffers.values())
    trainer.close()
    s = estimate_stages(trainer.deck.on_device(False))[0]
    assert kept == s.optimizer_for(0) - s.optimizer["zero0"] > 0


def test_selective_recompute_with_the_math_kernel_plans_one_layer_s_scores():
    """Found in review (2026-12-02): under train.recompute selective the attention core runs again in each
    layer's backward, and torch's math kernel (model.attention_kernel math, or auto on CPU ranks with
    dropout) keeps that layer's scores meanwhile; the plan's selective line counted none (gpt_tiny,
    dropout 0.1, seq 256, micro-batch 2: planned 39.0 MiB, measured 49.6: 12 MiB of scores)."""
    from app.deck import resolve_for_world
    from app.plan.estimate import estimate_stages

    sets = ("parallel.dp=1", "model.dropout=0.1", "model.seq_len=256", "train.micro_batch=2", "train.global_batch=4")
    m = _tiny(*sets).model
    # b a s^2 scores of the softmax's output, its dropout mask and the dropped values: fp32 on CPU ranks,
    # whose dropout mask is in the input's dtype (4 + 4 + 4 bytes); a bool mask on GPUs (4 + 1 + 4).
    for gpu, kernel, per_score in ((False, "auto", 12), (True, "math", 9), (True, "auto", 0)):
        deck = resolve_for_world(_tiny(*sets, f"model.attention_kernel={kernel}"), 1).on_device(gpu)
        flash = resolve_for_world(_tiny(*sets, "model.attention_kernel=flash"), 1).on_device(gpu)
        s, f = estimate_stages(deck)[0], estimate_stages(flash)[0]
        scores = 2 * m.heads * m.seq_len**2 * per_score
        assert s.activations["selective"] - f.activations["selective"] == scores, (gpu, kernel)
        assert s.activations["full"] - f.activations["full"] == scores
        assert s.activations["none"] - f.activations["none"] == m.layers * scores


def test_the_does_not_fit_advice_suggests_no_offload_that_the_host_or_drive_refuses():
    """Found in review (2026-12-02): a deck that does not fit the device was told to try optim.offload=host
    and =nvme without a look at the host memory or the drive, and both were then refused (9.9B on one
    H100: 147 GiB of host state against 102.4 usable, 119 GB of files against 61.2). Each is now named
    as a fix only where it passes its capacity check, else with the capacity it overfills; the host
    refusal's nvme fix likewise."""
    from app.plan.dryrun import make_plan
    from app.plan.machine import load_machine

    h100 = load_machine("h100_1gpu")
    big = ("model.layers=48", "model.hidden=4096", "model.heads=32")  # 9.9B
    (problem,) = make_plan(_tiny(*ONE_H100, *big), 1, h100).problems
    assert "--set optim.offload" not in problem, problem
    assert "optim.offload=host fits the device (" in problem and "but not the host memory: 1 ranks" in problem
    assert "optim.offload=nvme fits the device (" in problem and "but not the node-local NVMe: 1 ranks" in problem
    for kind, store in (("host", "host memory"), ("nvme", "node-local NVMe")):
        refused = make_plan(_tiny(*ONE_H100, *big, f"optim.offload={kind}"), 1, h100).problems
        assert any(f"does not fit the {store}" in p for p in refused), refused
    (host,) = make_plan(_tiny(*ONE_H100, *big, "optim.offload=host"), 1, h100).problems
    assert "try --set optim.offload=nvme (on a larger drive: its state files do not fit the node-local NVMe" in host
    # 6.9B: the host holds its state (README's table), the drive not: host is the fix, nvme said apart.
    (problem,) = make_plan(_tiny(*ONE_H100, *GPT_6_9B), 1, h100).problems
    assert "try --set optim.offload=host (" in problem and "--set optim.offload=nvme" not in problem
    assert "optim.offload=nvme fits the device (" in problem
    assert not make_plan(_tiny(*ONE_H100, *GPT_6_9B, "optim.offload=host"), 1, h100).problems


def test_nvme_files_are_checked_against_the_drive_on_cpu_machines_too(tmp_path):
    """Found in review (2026-12-02): on a CPU machine (host memory = the device) the capacity check
    returned before the drive's, so nvme files larger than its nvme_gb planned "ok"; and a small state
    was refused as "0.0 GB x 1 = 0.0 GB". The host check alone is left to the device's there."""
    from app.plan.dryrun import make_plan
    from app.plan.machine import load_machine
    from conftest import REPO

    deck = _tiny("optim.offload=nvme", "parallel.dp=4")
    per_rank = make_plan(deck, 4, load_machine("local")).stages[0].disk(0, "nvme")
    for name, gb, fits in (("small_disk", 4 * per_rank / 1e9 / 2, False), ("large_disk", 4 * per_rank / 1e9 * 2, True)):
        text = (REPO / "inputs/machines/local.yaml").read_text().replace("name: local", f"name: {name}")
        (tmp_path / f"{name}.yaml").write_text(text + f"nvme_gb: {gb}\n")
        plan = make_plan(deck, 4, load_machine(tmp_path / f"{name}.yaml"))
        assert (not plan.problems) == fits, plan.problems
        if not fits:
            (problem,) = plan.problems
            assert "does not fit the node-local NVMe" in problem
            assert f"4 ranks per node x {per_rank / 1e9:.3g} GB (stage 0) = {4 * per_rank / 1e9:.3g} GB" in problem
            assert " 0.0 GB" not in problem


def test_largest_finds_the_most_layers_where_uneven_splits_are_unbalanced(monkeypatch):
    """Found in review (2026-12-02): `largest_gpt` bisected the layers as if "fits" grew monotonically
    with them, but a count the pipeline's stages split unevenly can be unbalanced below one that is
    not: with pp 6 at a 1.1 imbalance limit it stopped at 17 layers of width 6144 on six H100s where 48
    plan without problems. The answer is now every count's own dry run's largest."""
    import dataclasses

    from app.deck import validate
    from app.errors import GridlmError
    from app.plan import dryrun
    from app.plan.machine import load_machine

    monkeypatch.setattr(dryrun, "GPT_WIDTHS", ((6144, 48),))
    machine = load_machine("h100_1gpu")
    deck = _tiny(*ONE_H100, "parallel.pp=6", "model.layers=12")

    def plans(layers: int) -> bool:
        trial = dataclasses.replace(deck, model=dataclasses.replace(deck.model, hidden=6144, heads=48, layers=layers))
        try:
            validate(trial)
        except GridlmError:
            return False
        return not dryrun.make_plan(trial, 6, machine, max_imbalance=1.1, predict_step=False).problems

    fitting = [n for n in range(1, dryrun.MAX_LAYERS + 1) if plans(n)]
    (shape,) = dryrun.largest_gpt(deck, 6, machine, max_imbalance=1.1)
    assert shape.layers == fitting[-1]
    assert any(n not in fitting for n in range(fitting[0], fitting[-1]))  # the case: not monotone


def test_the_host_memory_check_sums_the_stages_a_node_holds():
    """Found in review (2026-12-02): the host and drive checks counted every rank of a node as the stage
    that needs the most device memory, whose offloaded state can be the smallest: a 27.8B GPT with pp 4 x
    dp 2 (ZeRO-3) on one Frontier node (stages of 57.3, 54.0, 48.0 and 51.1 GiB of host state; the last
    needs the most device memory) planned 8 x 51.1 = 409 GiB, "fits" 409.6, where its ranks hold 421.
    Now the node's own ranks are summed, each its stage's."""
    from app.plan.dryrun import GiB, make_plan
    from app.plan.machine import load_machine

    sets = ("model.layers=34", "model.hidden=8192", "model.heads=64", "model.seq_len=2048", "model.vocab_size=51200",
            "train.global_batch=16", "train.micro_batch=4", "train.precision=bf16", "parallel.tp=1",
            "parallel.pp=4", "parallel.dp=2", "parallel.order=tp-pp-dp", "optim.zero=3", "train.recompute=full",
            "optim.offload=host")  # fmt: skip
    plan = make_plan(_tiny(*sets), 8, load_machine("frontier"))
    held = sum(plan.stages[plan.layout.coords(r)["pp"]].host(3, "host") for r in range(8))
    usable = 0.8 * 512 * GiB
    assert 8 * plan.peak_stage().host(3, "host") <= usable < held  # the case: the peak stage's bound passed it
    (problem,) = plan.problems
    assert f"8 ranks per node (stages 0-3) = {held / GiB:,.1f} GiB, frontier has 409.6 GiB usable" in problem, problem


def test_the_search_keeps_3d_candidates_of_a_deck_that_asks_for_gradient_accumulation_fusion():
    """Found in the day's diff review (2026-12-02): the deck refuses train.fuse_grad_accumulation: true
    under parallel.tensor (nothing fuses there), so every 3D candidate built from such a deck failed
    validation and was dropped uncounted (gpt_10b --tensor 3d: 0 configurations). A 3D candidate sets
    the key back to its default; the 3D ranking is the same as without it."""
    from app.deck import load_deck
    from app.plan.machine import load_machine
    from app.plan.search import search

    machine = load_machine("frontier")
    found = {}
    for fuse in ("null", "true"):
        deck = load_deck(
            REPO / "inputs/gpt_tiny.yaml", (f"train.fuse_grad_accumulation={fuse}", "train.global_batch=64")
        )
        result = search(deck, 8, machine, top=3, tensor="3d")
        assert result.best, fuse
        found[fuse] = [(c.sets["parallel.tensor"], c.sets["parallel.pp"], round(c.step, 9)) for c in result.best]
        assert all(c.sets.get("train.fuse_grad_accumulation", None) is None for c in result.best)
    assert found["true"] == found["null"]
