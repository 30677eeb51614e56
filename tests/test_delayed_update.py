"""The offloaded update's pipeline (`app/optim/transfer.py`) and the delayed parameter update
(`optim.offload_delay: 1`, after ZeRO-Offload's DPU).

The delayed update is checked against a delayed AdamW written here: each step's gradients are
computed on the parameters of two updates before (W_{n-2}; W_0 for the first two steps), the fp32
masters follow torch.optim.AdamW (W_n = AdamW(W_{n-1}, g_n)), and the parameters are set to W_{n-1}
at the end of step n. gridlm's update is torch's fused CPU AdamW (`HostAdamW`), the reference
torch's single-tensor loop: the same formula rounded in another order, about 1 ulp apart per
element and step, as in tests/test_offload.py (fp32: 1e-6 relative on the losses, measured equal
there). A parameter published a step early or late moves the loss by ~lr x the gradient (1e-4 or
more here), which the test also checks is far outside that tolerance.

The resumed run is held to the grid-equivalence matrix's fp32 tolerances (1e-5 on the losses,
2e-5 on an element: tests/test_parallel_equivalence.py): another grid only sums in another order.
"""

from __future__ import annotations

import math

import pytest
import torch

from app.checkpoint.io import load, read_header
from app.optim.optimizer import clip_coefficient, learning_rate
from app.parallel.loss import global_loss
from conftest import grid_trainer, settle, shard_errors, train_steps

STEPS, SAVE_AT = 6, 3
DELAY_RTOL = 1e-6
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5
TINY = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
    f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2", "optim.lr=3.0e-3",
    "optim.warmup_steps=2", "data.noise=0.1", "run.log_every=100", "parallel.dp_bucket_mb=0.02",
    "run.resume=none", "checkpoint.at_exit=false",
)  # fmt: skip
DELAYED = ("optim.offload=host", "optim.offload_delay=1")

_CACHE: dict = {}


def _delayed_adamw(grids, run_dir: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """(the delayed reference's losses, the exact run's losses, the reference's final parameters by
    name), on world rank 0's 1-rank grid, broadcast; computed once."""
    if "reference" not in _CACHE:
        grids.grid(1, 1, 1)
        result = None
        if grids.world.rank == 0:
            exact = train_steps(grid_trainer(grids, 1, 1, 1, (*TINY, f"run.dir={run_dir}/exact")), STEPS)
            trainer = grid_trainer(grids, 1, 1, 1, (*TINY, f"run.dir={run_dir}/reference"))
            cfg = trainer.deck.optim
            named = list(trainer.model.named_parameters())
            masters = [p.detach().clone().float().requires_grad_(True) for _, p in named]
            decay = [p.meta.decay for _, p in named]
            opt = torch.optim.AdamW(
                [{"params": [m for m, d in zip(masters, decay) if d], "weight_decay": cfg.weight_decay},
                 {"params": [m for m, d in zip(masters, decay) if not d], "weight_decay": 0.0}],
                lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False,
            )  # fmt: skip
            losses, pending = [], None
            trainer.model.train()
            for step in range(STEPS):
                loss_sum = trainer.forward_backward()  # on the parameters published so far
                trainer.dp.finish_grad_reduce(trainer.sp_group)
                grads = [p.main_grad.detach().clone() for _, p in named]
                norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
                coefficient = clip_coefficient(norm, cfg.grad_clip)
                for m, g in zip(masters, grads):
                    m.grad = g * coefficient
                for group in opt.param_groups:
                    group["lr"] = learning_rate(cfg, step, STEPS)
                opt.step()
                losses.append(global_loss(loss_sum, trainer.grid, trainer.tp))
                with torch.no_grad():
                    if pending is not None:  # the last step's update reaches the parameters now
                        for (_, p), w in zip(named, pending):
                            p.copy_(w)
                pending = [m.detach().clone() for m in masters]
            result = (losses, exact, {name: p.detach().clone() for name, p in named})
        settle(grids.world.comm)
        _CACHE["reference"] = grids.world.comm.bcast(result, root=0)
    return _CACHE["reference"]


@pytest.mark.mpi(min_size=2)
def test_the_delayed_update_equals_a_delayed_adamw_written_here(runtime, grids, tmp_path):
    """One rank, host and nvme (chunks of a 0.05 MB buffer), and dp2 with ZeRO-1 (2 ranks): the losses
    and the final parameters of the delayed update equal the reference's; host and nvme to the bit."""
    base = runtime.comm.bcast(str(tmp_path), root=0)
    ref_losses, exact_losses, ref_params = _delayed_adamw(grids, base)
    # The delay is visible: from step 2 on, the exact run trains on other parameters.
    assert abs(ref_losses[1] - exact_losses[1]) > 100 * DELAY_RTOL * abs(exact_losses[1])
    assert ref_losses[0] == pytest.approx(exact_losses[0], rel=DELAY_RTOL)
    one, problems = {}, []
    if runtime.rank == 0:
        for store in ("host", "nvme"):
            extra = ("optim.offload_buffer_mb=0.05",) if store == "nvme" else ()
            sets = (*TINY, *DELAYED, f"optim.offload={store}", *extra, f"run.dir={base}/{store}")
            trainer = grid_trainer(grids, 1, 1, 1, sets)
            one[store] = train_steps(trainer, STEPS)
            if store == "host":
                found, worst = shard_errors(trainer.model, ref_params, PARAM_ATOL, 0)
                problems += found
                print(f"\ndelayed update vs the reference: worst parameter error {worst:.2e}")
            trainer.close()
    grids.grid(1, 1, 2)  # every rank makes the same groups (GridPool)
    sub = grids.runtime(2)
    two = None
    if grids.trains(2):
        run_dir = sub.comm.bcast(f"{base}/dp2", root=0)
        trainer = grid_trainer(grids, 1, 1, 2, (*TINY, *DELAYED, "optim.zero=1", f"run.dir={run_dir}"))
        two = train_steps(trainer, STEPS)
        trainer.close()
    settle(runtime.comm)
    one = runtime.comm.bcast(one, root=0)
    problems = sum(runtime.comm.allgather(problems), [])
    two = next(x for x in runtime.comm.allgather(two) if x is not None)
    assert one["host"] == one["nvme"], one
    assert one["host"] == pytest.approx(ref_losses, rel=DELAY_RTOL), f"{one['host']} vs {ref_losses}"
    assert not problems, "\n".join(problems)
    assert two == pytest.approx(ref_losses, rel=LOSS_RTOL), f"{two} vs {ref_losses}"


@pytest.mark.mpi(min_size=2)
def test_a_delayed_update_checkpoint_resumes_exactly_on_another_grid(runtime, grids, tmp_path):
    """Saved at step SAVE_AT by dp2 with ZeRO-1 (the update of step SAVE_AT not yet on the device:
    offload_pending), resumed by tp2 with sequence parallelism and the nvme store: the remaining
    losses and the final parameters are the reference's. The same file resumed by a run without
    the delay publishes the pending update at once: its next loss is the one of the masters."""
    base = runtime.comm.bcast(str(tmp_path), root=0)
    ref_losses, _, ref_params = _delayed_adamw(grids, base)
    sub = grids.runtime(2)
    saved = sub.comm.bcast(f"{base}/saved", root=0)
    grids.grid(1, 1, 2)
    grids.grid(2, 1, 1)
    first = losses = header = None
    problems: list[str] = []
    if grids.trains(2):
        trainer = grid_trainer(grids, 1, 1, 2, (*TINY, *DELAYED, "optim.zero=1", f"run.dir={saved}"))
        first = train_steps(trainer, SAVE_AT)
        path = trainer.save("test").path
        trainer.close()
        header = read_header(path) if sub.is_root else None
        sets = (
            *TINY,
            *DELAYED,
            "optim.offload=nvme",
            "optim.offload_buffer_mb=0.05",
            "parallel.sequence_parallel=true",
        )
        resumed = grid_trainer(grids, 2, 1, 1, (*sets, f"run.dir={saved}-tp2"))
        info = load(resumed, path)
        assert info["resharded"] and resumed.optimizer.unpublished
        losses = train_steps(resumed, STEPS - SAVE_AT)
        problems, _ = shard_errors(resumed.model, ref_params, PARAM_ATOL, runtime.rank)
        resumed.close()
    settle(runtime.comm)
    problems = sum(runtime.comm.allgather(problems), [])
    first, losses, header = next(x for x in runtime.comm.allgather((first, losses, header)) if x[2] is not None)
    assert header["offload_pending"] == 1 and any(k.startswith("optimizer/master/") for k in header["datasets"])
    assert first == pytest.approx(ref_losses[:SAVE_AT], rel=LOSS_RTOL)
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=LOSS_RTOL), f"{losses} vs {ref_losses[SAVE_AT:]}"
    assert not problems, "\n".join(problems)


@pytest.mark.mpi
def test_gradients_leave_during_backward_and_the_update_is_the_same(runtime, grids, tmp_path):
    """dp = 1, host offload: every bucket's gradient is copied to the host as backward finishes it
    (before `finish_grad_reduce`), and the run equals the one whose copies all wait for the end of
    backward (parallel.overlap_grad_reduce: false), to the bit."""
    grids.grid(1, 1, 1)
    result = None
    if runtime.rank == 0:
        result = {}
        for overlap in ("true", "false"):
            sets = (
                *TINY,
                "optim.offload=host",
                f"parallel.overlap_grad_reduce={overlap}",
                f"run.dir={tmp_path}/{overlap}",
            )
            trainer = grid_trainer(grids, 1, 1, 1, sets)
            losses = train_steps(trainer, 2)
            transfer = trainer.optimizer._transfer
            assert transfer is not None
            result[overlap] = (losses, transfer.early, len(trainer.dp.buckets))
            trainer.close()
    settle(runtime.comm)
    result = runtime.comm.bcast(result, root=0)
    losses, early, buckets = result["true"]
    assert buckets > 1 and early == buckets
    assert result["false"][0] == losses
