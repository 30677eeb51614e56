"""Data-parallel training inside one MPI job: the N-rank run equals a 1-rank run.

The 1-rank reference runs in the same process on a grid over MPI.COMM_SELF, so every rank
of `mpirun -n N` compares the world's losses and parameters with its own 1-rank run.

Tolerance: fp32. The runs differ only in summation order (N partial gradients all-reduced
vs. N micro-batches accumulated on one rank), ~1e-7 relative per step; Adam's
normalisation can amplify that for tiny second moments, so after 5 steps we allow
1e-5 relative on the loss and 1e-5 absolute on parameters (typical size 2e-2).
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from app.deck import load_deck, resolve_for_world
from app.parallel.data import DataParallel
from app.train import Trainer
from conftest import REPO, read_metrics

SMALL = (
    "model.vocab_size=101", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
    "train.steps=5", "train.global_batch=16", "train.micro_batch=2", "run.log_every=1",
    "optim.lr=3.0e-3", "optim.warmup_steps=2", "data.noise=0.1",
)  # fmt: skip


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.mpi(min_size=2)
def test_dp_training_matches_single_rank_loss_and_parameters(runtime, shared_tmp, tmp_path, grids):
    world_deck = resolve_for_world(
        load_deck(REPO / "inputs/gpt_tiny.yaml", (*SMALL, f"run.dir={shared_tmp / 'world'}")), runtime.world_size
    )
    world = Trainer(world_deck, runtime, grids.grid(1, 1, runtime.world_size))
    world_summary = world.run()
    runtime.comm.Barrier()  # rank 0 has written metrics.jsonl

    solo_rt = grids.runtime(1)
    solo_deck = resolve_for_world(load_deck(REPO / "inputs/gpt_tiny.yaml", (*SMALL, f"run.dir={tmp_path / 'solo'}")), 1)
    solo = Trainer(solo_deck, solo_rt, grids.grid(1, 1, 1))
    solo_summary = solo.run()

    assert world_deck.num_micro_batches * runtime.world_size == solo_deck.num_micro_batches
    world_losses, solo_losses = _losses(shared_tmp / "world"), _losses(tmp_path / "solo")
    assert len(world_losses) == len(solo_losses) == 5
    assert world_losses == pytest.approx(solo_losses, rel=1e-5)
    assert world_losses[-1] < world_losses[0]  # it learns
    assert world_summary["final_loss"] == pytest.approx(solo_summary["final_loss"], rel=1e-5)
    for (name, p), (_, q) in zip(world.model.named_parameters(), solo.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)
    # Replicas stay identical across dp ranks (bitwise: same all-reduced gradient, same update).
    digest = float(sum(p.detach().double().sum() for p in world.model.parameters()))
    assert len(set(runtime.comm.allgather(digest))) == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [False, True], ids=["allreduce", "zero1"])
@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlapped"])
def test_bucketed_dp_reduction_gives_the_mean_gradient(runtime, zero, overlap, grids):
    """Buckets (two here: 0.0002 MB = 50 fp32 elements or more each) reduced from the backward
    hooks, or after it, hold the dp mean of the gradients, accumulated over 2 micro-batches;
    under ZeRO-1 each rank holds a disjoint 1/dp slice and the slices tile every parameter.
    Exact comparison up to 1e-6: the reference sums the same fp32 values in another order."""
    from app.sharding.init import ParamMeta

    grid = grids.grid(1, 1, runtime.world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    for p in model.parameters():
        p.meta = ParamMeta(tuple(p.shape))
    inputs = [
        torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * r + m))
        for r in range(runtime.world_size)
        for m in range(2)
    ]
    # Reference: the plain autograd gradient of the mean over all ranks' micro-batches.
    ref = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    ref.load_state_dict(model.state_dict())
    for x in inputs:
        (ref(x).square().sum() / len(inputs)).backward()
    dp = DataParallel(model, grid, bucket_mb=0.0002, zero=zero, overlap_grad_reduce=overlap)
    assert len(dp.buckets) > 1
    dp.start_step(2)
    for m in range(2):
        (model(inputs[2 * runtime.rank + m]).square().sum() / 2).backward()
    assert all(p.grad is None for p in model.parameters())  # moved into the flat buffer
    dp.finish_grad_reduce()
    covered = {id(p): torch.zeros(p.numel()) for p in model.parameters()}
    ref_grads = {id(p): q.grad.reshape(-1) for p, q in zip(model.parameters(), ref.parameters())}
    for seg, p, g in dp.held_grads():
        expected = ref_grads[id(p)][seg.param_lo : seg.param_lo + seg.hi - seg.lo]
        torch.testing.assert_close(g, expected, rtol=0, atol=1e-6)
        covered[id(p)][seg.param_lo : seg.param_lo + seg.hi - seg.lo] += 1
    # Every element is held by exactly one dp rank (ZeRO-1) or by all of them.
    for c in covered.values():
        total = torch.from_numpy(runtime.comm.allreduce(c.numpy()))
        assert torch.equal(total, torch.full_like(total, 1.0 if zero else runtime.world_size))
    # The update path: each rank writes its master shard; after publishing every rank sees all of them.
    for master in dp.master:
        master.fill_(float(runtime.rank + 1) if zero else 1.0)
    dp.publish_params()
    dp.wait_params()
    values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digests = runtime.comm.allgather(float(values.double().sum()))
    assert len(set(digests)) == 1 and values.min() >= 1.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_overlapped_zero1_gather_finishing_after_a_forward_saved_weights_leaves_backward_intact(
    runtime, monkeypatch, precision, grids
):
    """The ZeRO-1 race (3 of 14 loaded 4-rank runs died in backward with "modified by an inplace
    operation"): gloo completes an all-gather by copying into its output in a worker thread, an
    in-place op that bumps the output's version counter. The trainer's parameters (built on the
    meta device, then made views of the flat buffer) all shared the buffer's counter, so a bucket gathered after the forward had saved another
    bucket's weights made those look modified. The interleaving is forced here: rank 1 launches the second
    bucket's gather 0.5 s late, so on rank 0 `first` saves its weight before `later`'s bucket
    arrives. Each bucket now has its own counter; backward runs and the gradient is right."""
    from app.names import torch_dtype
    from app.sharding.init import ParamMeta

    class TwoStage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # Registered last, run first: buffer order is reverse registration, so `first`'s
            # parameters are bucket 0, gathered first; `later`'s are bucket 1.
            self.later = torch.nn.Linear(13, 5)
            self.first = torch.nn.Linear(7, 13)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.later(torch.tanh(self.first(x)))

    grid = grids.grid(1, 1, runtime.world_size)
    with torch.device("meta"):  # as the trainer builds it: DataParallel computes the values
        model = TwoStage()
    for p in model.parameters():
        p.meta = ParamMeta(tuple(p.shape))
    dtype = torch_dtype(precision)
    dp = DataParallel(model, grid, compute_dtype=dtype, bucket_mb=0.0002, zero=1, seed=11, device=torch.device("cpu"))
    assert [dp.bucket_of[id(p)] for p in model.first.parameters()] == [0, 0]
    assert [dp.bucket_of[id(p)] for p in model.later.parameters()] == [1, 1]
    dp.prefetch_hooks([(model.first, list(model.first.parameters())), (model.later, list(model.later.parameters()))])
    gather, launched = torch.distributed.all_gather_single, []

    def late_second_bucket(*args, **kwargs):
        launched.append(1)
        if runtime.rank == 1 and len(launched) == 2:
            time.sleep(0.5)
        return gather(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_gather_single", late_second_bucket)
    for master in dp.master:
        master.fill_(0.25)
    dp.publish_params()  # the step's update: gathers in flight, waited for by the pre-hooks
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    model(x).sum().backward()  # raised on rank 0 when every parameter shared one version counter
    assert len(launched) == 2
    # d/dx of sum(later(tanh(first(x)))) with every weight and bias 0.25.
    w1, w2 = torch.full((13, 7), 0.25), torch.full((5, 13), 0.25)
    h = x.detach().float() @ w1.T + 0.25
    expected = ((torch.ones(4, 5) @ w2) * (1 - torch.tanh(h) ** 2)) @ w1
    torch.testing.assert_close(x.grad.float(), expected, rtol=2e-2 if precision == "bf16" else 1e-6, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("zero,precision", [(0, "fp32"), (1, "bf16"), (3, "fp32"), (3, "bf16")])
def test_a_meta_model_builds_the_same_buffers_as_a_materialised_one(runtime, zero, precision, grids):
    """The trainer builds its model on the meta device and DataParallel computes the values from
    (seed, name) straight into its buffers, bucket by bucket (ZeRO-3: only this rank's shards).
    Bitwise the same parameters and fp32 masters as building the whole model first, on a dp grid
    of the world's size, with the parameter objects kept (the units and hooks refer to them)."""
    from app.model.gpt import GPT
    from app.names import torch_dtype

    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", SMALL)
    grid = grids.grid(1, 1, runtime.world_size)
    cpu, dtype = torch.device("cpu"), torch_dtype(precision)
    built = {}
    for device in (cpu, torch.device("meta")):
        model = GPT(deck.model, 11, device)
        before = {n: id(p) for n, p in model.named_parameters()}
        dp = DataParallel(model, grid, compute_dtype=dtype, bucket_mb=0.01, zero=zero, units=model.param_units(),
                          seed=11, device=cpu)  # fmt: skip
        assert len(dp.buckets) > 2 and {n: id(p) for n, p in model.named_parameters()} == before
        with dp.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        built[device.type] = (params, [m.clone() for m in dp.master])
    (a, master_a), (b, master_b) = built["cpu"], built["meta"]
    assert all(p.device == cpu and p.dtype == dtype for p in b.values())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert len(master_a) == len(master_b) and all(torch.equal(x, y) for x, y in zip(master_a, master_b))
    assert all(m.dtype == torch.float32 for m in master_b)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [2, 3])
def test_zero2_and_zero3_release_every_bucket_buffer_after_backward(runtime, zero, grids):
    """Under ZeRO-2/3 a bucket's gradient buffer lives from its first gradient to its reduction. A
    parameter's `main_grad` view of it used to outlive the reduction, so after a backward every
    bucket's buffer was still alive (found measuring the 823M deck's RSS: +1 block per backward
    block). After the reduction no parameter points into a bucket buffer, and nothing is counted."""
    from app.model.gpt import GPT

    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", SMALL)
    grid = grids.grid(1, 1, runtime.world_size)
    model = GPT(deck.model, 11, torch.device("meta"))
    dp = DataParallel(model, grid, bucket_mb=0.01, zero=zero, units=model.param_units(), seed=11,
                      device=torch.device("cpu"))  # fmt: skip
    if dp.shard_params:
        model.set_gate(dp)
    tokens = torch.randint(
        0, deck.model.vocab_size, (2, deck.model.seq_len + 1), generator=torch.Generator().manual_seed(3)
    )
    dp.start_step(1)
    with dp.saving():
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    dp.finish_grad_reduce()
    assert len(dp.buckets) > 2
    assert all(getattr(p, "main_grad", None) is None for p in model.parameters())
    assert dp.bucket_bytes == 0 and dp.gathered_bytes == 0
    assert all(f.full is None for f in dp.flight)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_context_parallel_communication_is_timed_on_its_own_axis(runtime, shared_tmp, grids, kind, capsys):
    """cp = the world: the ring's sends and receives (or the all-to-alls) are charged to a "cp" axis
    in every step's timers and the summary, exposed <= total, and the end-of-run line names it; tp
    and pp did not communicate (the gradients' reduction over the dp x cp replicas is dp's)."""
    deck = resolve_for_world(
        load_deck(
            REPO / "inputs/gpt_tiny.yaml",
            (
                *SMALL,
                "train.steps=2",
                f"run.dir={shared_tmp / kind}",
                f"parallel.cp={runtime.world_size}",
                f"parallel.cp_kind={kind}",
                "parallel.dp=1",
            ),
        ),  # fmt: skip
        runtime.world_size,
    )
    summary = Trainer(deck, runtime, grids.grid(1, 1, 1, deck.parallel.order, runtime.world_size)).run()
    runtime.comm.Barrier()
    for r in read_metrics(shared_tmp / kind):
        assert 0 < r["exposed_comm_s"]["cp"] <= r["comm_s"]["cp"] + 1e-6
        assert r["comm_s"]["tp"] == r["comm_s"]["pp"] == 0 and r["comm_s"]["dp"] > 0
    assert summary["timers"]["comm_s"]["cp"] > 0 and summary["exposed_comm_fraction"] > 0
    assert summary["grid"]["cp"] == runtime.world_size and "ep" not in summary["grid"]
    if runtime.is_root:  # rank 0 prints the end-of-run lines
        assert re.search(r"communication tp 0\.0, pp 0\.0, dp [\d.]+, cp [\d.]+ ms", capsys.readouterr().out)


@pytest.mark.mpi
def test_a_short_run_writes_the_output_contract(runtime, shared_tmp, grids):
    deck = resolve_for_world(
        load_deck(
            REPO / "inputs/gpt_tiny.yaml",
            (
                *SMALL,
                "train.steps=3",
                f"run.dir={shared_tmp}",
                "run.tensorboard=true",
                "run.study=demo",
                "run.study_kind=weak",
                f"run.study_point={runtime.world_size}",
            ),
        ),  # fmt: skip
        runtime.world_size,
    )
    summary = Trainer(deck, runtime, grids.grid(1, 1, runtime.world_size)).run()
    runtime.comm.Barrier()
    for key in ("deck", "world_size", "nodes", "ranks_per_node", "grid", "parameters", "steps", "step_time_s",
                "tokens_per_s", "tflops_per_rank", "aggregate_tflops", "mfu", "final_loss", "versions"):  # fmt: skip
        assert key in summary, key
    assert summary["world_size"] == runtime.world_size and summary["grid"]["dp"] == runtime.world_size
    assert summary["mfu"] is None  # CPU: no peak in the table, none in the deck
    assert summary["versions"]["hdf5_parallel"] is True
    on_disk = json.loads((shared_tmp / "summary.json").read_text())
    assert on_disk["final_loss"] == summary["final_loss"]
    records = read_metrics(shared_tmp)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"step", "loss", "lr", "step_time_s", "tokens_per_s", "tflops_per_rank", "mfu"} <= set(r)
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] is None
        # Timers (run.timers defaults to on): phases inside the step, exposed <= total per axis.
        assert 0 < r["forward_s"] < r["step_time_s"] and 0 < r["backward_s"] < r["step_time_s"]
        assert 0 < r["optimizer_s"] < r["step_time_s"]
        for axis in ("tp", "pp", "dp"):
            assert 0 <= r["exposed_comm_s"][axis] <= r["comm_s"][axis] + 1e-6
        assert (r["comm_s"]["dp"] > 0) == (runtime.world_size > 1)
        assert r["comm_s"]["tp"] == r["comm_s"]["pp"] == 0  # no tp, no pp on this grid
    assert (shared_tmp / "deck.yaml").exists()
    t = summary["timers"]
    assert t["forward_s"] + t["backward_s"] + t["optimizer_s"] <= summary["step_time_s"] * 1.01
    assert 0 <= summary["exposed_comm_fraction"] < 1
    memory = summary["memory_bytes_rank0"]
    assert memory["parameters"] >= 4 * summary["parameters_rank0"]  # fp32 buffer (+ bucket padding)
    assert memory["optimizer_state"] == 2 * memory["parameters"]  # Adam moments; fp32: no separate master
    # The process's peak resident memory holds at least the buffers above (CPU ranks).
    assert memory["peak_rss"] > memory["parameters"] + memory["gradients"] + memory["optimizer_state"]
    # Each figure's most over the ranks (each rank's summary holds its own figures as rank 0's).
    everyone = runtime.comm.allgather(memory)
    assert summary["memory_bytes_max"] == {key: max(m[key] for m in everyone) for key in memory}
    assert summary["hardware_flops_per_step"] == summary["flops_per_step"]  # no recomputation
    # Scaling studies group runs by this; FLOP/s say which count they are.
    assert summary["study"] == {"name": "demo", "kind": "weak", "point": runtime.world_size}
    assert summary["aggregate_pflops"] == pytest.approx(summary["tflops_per_rank"] * runtime.world_size / 1e3)
    assert "not causally halved" in summary["flops_kind"]
    if runtime.is_root:  # run.tensorboard: every logged step's scalars, with the FLOP count in the tag
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(shared_tmp / "tb"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"train/loss", "train/lr", "train/grad_norm", "perf/step_time_s", "perf/model_tflops_per_gpu"} <= tags
        assert "perf/mfu" not in tags  # null on a CPU: not written as a number
        losses = events.Scalars("train/loss")
        assert [e.step for e in losses] == [1, 2, 3]
        assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)


@pytest.mark.mpi
def test_training_on_prepared_text_files_learns(runtime, shared_tmp, grids):
    from app.data.prepare import prepare

    prefix = shared_tmp / "corpus"
    if runtime.rank == 0:
        text = shared_tmp / "text.txt"
        text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
        prepare([str(text)], str(prefix))
    runtime.comm.Barrier()
    overrides = (*SMALL, "model.vocab_size=257", "train.steps=6", "data.kind=memmap", f"data.path={prefix}",
                 f"run.dir={shared_tmp / 'run'}")  # fmt: skip
    deck = resolve_for_world(load_deck(REPO / "inputs/gpt_tiny.yaml", overrides), runtime.world_size)
    summary = Trainer(deck, runtime, grids.grid(1, 1, runtime.world_size)).run()
    assert summary["final_loss"] < summary["initial_loss"] - 0.5  # a repeated sentence is easy
    assert summary["consumed_samples"] == 6 * deck.train.global_batch
