"""The training loop: build -> step -> log -> report.

One optimizer step: for each of this dp rank's micro-batches, forward + backward of
(mean loss / micro-batches); average gradients over dp; clip; AdamW step. The logged loss
is the mean over the whole global batch (all-reduced over dp), so it is the same number
on 1 rank and on N.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from app.data import GlobalBatchSampler, build_dataset, get_batch
from app.deck import Deck
from app.errors import GridlmError
from app.metrics.flops import gpt_step_flops
from app.metrics.peaks import peak_tflops
from app.metrics.report import MetricsWriter, format_line, mean_step_time, versions, write_summary
from app.model.gpt import GPT
from app.optim.optimizer import build_optimizer, clip_gradients, learning_rate
from app.parallel.data import allreduce_gradients
from app.runtime.grid import ProcessGrid
from app.runtime.mpi import Runtime, agree


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_run_dir(runtime: Runtime, deck: Deck) -> Path:
    """Rank 0 creates run.dir and records the resolved deck there; all ranks agree it worked."""
    run_dir = Path(deck.run.dir or "runs/default")

    def create() -> None:
        if runtime.rank != 0:
            return
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "deck.yaml").write_text(yaml.safe_dump(deck.to_dict(), sort_keys=False))
        except OSError as err:
            raise GridlmError(
                f"cannot write run directory run.dir = {str(run_dir)!r}: {err.strerror}; set run.dir to a writable path"
            ) from None

    agree(runtime, create)
    return run_dir


def _global_mean(value: torch.Tensor, grid: ProcessGrid) -> float:
    """Mean of a per-dp-rank scalar over the dp group."""
    value = value.detach().clone()
    if grid.size("dp") > 1:
        dist.all_reduce(value, group=grid.group["dp"])
    return float(value) / grid.size("dp")


def train(deck: Deck, runtime: Runtime, grid: ProcessGrid) -> dict[str, Any]:
    """Train for deck.train.steps steps; rank 0 logs and returns/writes the summary."""
    m, tr = deck.model, deck.train
    device = runtime.device
    dp, dp_rank = grid.size("dp"), grid.coords["dp"]
    run_dir = _make_run_dir(runtime, deck)
    dataset = agree(runtime, lambda: build_dataset(deck.data, m, tr.seed))
    sampler = GlobalBatchSampler(tr.global_batch, tr.micro_batch, dp_rank, dp)
    torch.manual_seed(tr.seed + 1_000_003 * runtime.rank)  # dropout masks differ per rank
    model = GPT(m, tr.seed, device)
    optimizer = build_optimizer(model, deck.optim)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(device_name, "fp32", deck.run.peak_tflops)
    flops_per_step = gpt_step_flops(tr.global_batch, m.seq_len, m.layers, m.hidden, m.vocab_size, m.ffn)
    tokens_per_step = tr.global_batch * m.seq_len
    n_micro = sampler.num_micro_batches
    writer = MetricsWriter(run_dir, enabled=runtime.is_root)

    runtime.log(
        f"gridlm: {model.num_parameters():,} parameters | world {runtime.world_size} on {runtime.nodes} node(s) | "
        f"grid tp={grid.size('tp')} pp={grid.size('pp')} dp={dp} ({deck.parallel.order}) | device {device_name}"
    )
    runtime.log(
        f"gridlm: global batch {tr.global_batch} = micro batch {tr.micro_batch} x {n_micro} accumulation x dp {dp} "
        f"| seq {m.seq_len} | {tr.steps} steps | data {deck.data.kind} | run dir {run_dir}"
    )
    if peak is None:
        runtime.log(
            f"gridlm: no peak FLOP/s known for device {device_name!r}: MFU reported as null (set run.peak_tflops)"
        )

    records: list[dict[str, Any]] = []
    step_times: list[float] = []
    model.train()
    for step in range(tr.steps):
        _sync(device)
        t0 = time.perf_counter()
        lr = learning_rate(deck.optim, step, tr.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for indices in sampler.next_step():
            tokens, targets = get_batch(dataset, indices)
            loss = model.loss(tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)) / n_micro
            loss.backward()
            loss_sum += loss.detach()
        allreduce_gradients(model, grid)
        grad_norm = clip_gradients(model, grid, deck.optim.grad_clip)
        optimizer.step()
        _sync(device)
        step_time = time.perf_counter() - t0
        step_times.append(step_time)

        if (step + 1) % deck.run.log_every == 0 or step + 1 == tr.steps or step == 0:
            loss_value = _global_mean(loss_sum, grid)
            tflops = flops_per_step / step_time / runtime.world_size / 1e12
            record = {
                "step": step + 1,
                "loss": loss_value,
                "lr": lr,
                "step_time_s": step_time,
                "tokens_per_s": tokens_per_step / step_time,
                "tflops_per_rank": tflops,
                "mfu": None if peak is None else tflops / peak,
                "grad_norm": grad_norm,
                "consumed_samples": sampler.consumed_samples,
            }
            records.append(record)
            writer.write(record)
            runtime.log(format_line(record, tr.steps))

    mean_time, std_time = mean_step_time(step_times, deck.run.timing_warmup)
    tflops_per_rank = flops_per_step / mean_time / runtime.world_size / 1e12
    summary = {
        "deck": deck.to_dict(),
        "world_size": runtime.world_size,
        "nodes": runtime.nodes,
        "ranks_per_node": runtime.ranks_per_node,
        "ranks_per_node_list": runtime.ranks_per_node_list,
        "grid": grid.describe(),
        "parameters": model.num_parameters(),
        "steps": tr.steps,
        "global_batch": tr.global_batch,
        "tokens_per_step": tokens_per_step,
        "step_time_s": mean_time,
        "step_time_std_s": std_time,
        "timing_warmup_steps": min(deck.run.timing_warmup, max(0, tr.steps - 1)),
        "tokens_per_s": tokens_per_step / mean_time,
        "flops_per_step": flops_per_step,
        "flops_kind": "model FLOPs, Megatron SC21 count (no recompute, full attention)",
        "tflops_per_rank": tflops_per_rank,
        "aggregate_tflops": tflops_per_rank * runtime.world_size,
        "device": device_name,
        "peak_tflops_per_rank": peak,
        "mfu": None if peak is None else tflops_per_rank / peak,
        "initial_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "consumed_samples": sampler.consumed_samples,
        "torch_threads": torch.get_num_threads(),
        "versions": versions(runtime.comm),
    }
    if runtime.is_root:
        path = write_summary(run_dir, summary)
        mfu = "n/a" if summary["mfu"] is None else f"{100 * summary['mfu']:.1f}%"
        runtime.log(
            f"gridlm: done | loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f} | "
            f"step {mean_time * 1e3:.1f} ms (mean after {summary['timing_warmup_steps']} warm-up) | "
            f"{summary['tokens_per_s']:,.0f} tok/s | {tflops_per_rank:.3f} TFLOP/s/rank | "
            f"{summary['aggregate_tflops']:.3f} TFLOP/s total | mfu {mfu} | {path}"
        )
    return summary
