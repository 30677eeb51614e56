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


class Trainer:
    """Everything one rank needs to train: model, optimizer, data, sampler, reports.

    `step()` runs one optimizer step; `run()` runs deck.train.steps of them with logging
    and returns the summary (written to run.dir/summary.json by rank 0).
    """

    def __init__(self, deck: Deck, runtime: Runtime, grid: ProcessGrid) -> None:
        self.deck, self.runtime, self.grid = deck, runtime, grid
        m, tr = deck.model, deck.train
        self.device = runtime.device
        self.run_dir = _make_run_dir(runtime, deck)
        self.dataset = agree(runtime, lambda: build_dataset(deck.data, m, tr.seed))
        self.sampler = GlobalBatchSampler(tr.global_batch, tr.micro_batch, grid.coords["dp"], grid.size("dp"))
        torch.manual_seed(tr.seed + 1_000_003 * runtime.rank)  # dropout masks differ per rank
        self.model = GPT(m, tr.seed, self.device)
        self.optimizer = build_optimizer(self.model, deck.optim)
        self.steps_done = 0
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.peak = peak_tflops(self.device_name, "fp32", deck.run.peak_tflops)
        self.flops_per_step = gpt_step_flops(tr.global_batch, m.seq_len, m.layers, m.hidden, m.vocab_size, m.ffn)
        self.tokens_per_step = tr.global_batch * m.seq_len

    def step(self) -> tuple[torch.Tensor, float, float]:
        """One optimizer step over the global batch: (this dp rank's mean loss, lr, grad norm)."""
        lr = learning_rate(self.deck.optim, self.steps_done, self.deck.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        n_micro = self.sampler.num_micro_batches
        loss_sum = torch.zeros((), device=self.device)
        for indices in self.sampler.next_step():
            tokens, targets = get_batch(self.dataset, indices)
            tokens, targets = tokens.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            # Mean over micro-batches here, mean over dp in the all-reduce: the global-batch mean.
            loss = self.model.loss(tokens, targets) / n_micro
            loss.backward()
            loss_sum += loss.detach()
        allreduce_gradients(self.model, self.grid)
        grad_norm = clip_gradients(self.model, self.grid, self.deck.optim.grad_clip)
        self.optimizer.step()
        self.steps_done += 1
        return loss_sum, lr, grad_norm

    def _banner(self) -> None:
        deck, rt, grid, tr = self.deck, self.runtime, self.grid, self.deck.train
        rt.log(
            f"gridlm: {self.model.num_parameters():,} parameters | world {rt.world_size} on {rt.nodes} node(s) | "
            f"grid tp={grid.size('tp')} pp={grid.size('pp')} dp={grid.size('dp')} ({deck.parallel.order}) | "
            f"device {self.device_name}"
        )
        rt.log(
            f"gridlm: global batch {tr.global_batch} = micro batch {tr.micro_batch} x "
            f"{self.sampler.num_micro_batches} accumulation x dp {grid.size('dp')} | seq {deck.model.seq_len} | "
            f"{tr.steps} steps | data {deck.data.kind} | run dir {self.run_dir}"
        )
        if self.peak is None:
            rt.log(f"gridlm: no peak FLOP/s known for device {self.device_name!r}: MFU is null (set run.peak_tflops)")

    def run(self) -> dict[str, Any]:
        """Train to deck.train.steps, logging every run.log_every steps; returns the summary."""
        deck, rt = self.deck, self.runtime
        steps = deck.train.steps
        writer = MetricsWriter(self.run_dir, enabled=rt.is_root)
        self._banner()
        records: list[dict[str, Any]] = []
        step_times: list[float] = []
        self.model.train()
        while self.steps_done < steps:
            _sync(self.device)
            t0 = time.perf_counter()
            loss_sum, lr, grad_norm = self.step()
            _sync(self.device)
            step_time = time.perf_counter() - t0
            step_times.append(step_time)
            step = self.steps_done
            if step % deck.run.log_every == 0 or step == steps or step == 1:
                tflops = self.flops_per_step / step_time / rt.world_size / 1e12
                record = {
                    "step": step,
                    "loss": _global_mean(loss_sum, self.grid),
                    "lr": lr,
                    "step_time_s": step_time,
                    "tokens_per_s": self.tokens_per_step / step_time,
                    "tflops_per_rank": tflops,
                    "mfu": None if self.peak is None else tflops / self.peak,
                    "grad_norm": grad_norm,
                    "consumed_samples": self.sampler.consumed_samples,
                }
                records.append(record)
                writer.write(record)
                rt.log(format_line(record, steps))
        summary = self._summary(records, step_times)
        if rt.is_root:
            path = write_summary(self.run_dir, summary)
            mfu = "n/a" if summary["mfu"] is None else f"{100 * summary['mfu']:.1f}%"
            rt.log(
                f"gridlm: done | loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f} | "
                f"step {summary['step_time_s'] * 1e3:.1f} ms (mean after {summary['timing_warmup_steps']} warm-up) | "
                f"{summary['tokens_per_s']:,.0f} tok/s | {summary['tflops_per_rank']:.3f} TFLOP/s/rank | "
                f"{summary['aggregate_tflops']:.3f} TFLOP/s total | mfu {mfu} | {path}"
            )
        return summary

    def _summary(self, records: list[dict[str, Any]], step_times: list[float]) -> dict[str, Any]:
        deck, rt, tr = self.deck, self.runtime, self.deck.train
        mean_time, std_time, skipped = mean_step_time(step_times, deck.run.timing_warmup)
        tflops_per_rank = self.flops_per_step / mean_time / rt.world_size / 1e12
        return {
            "deck": deck.to_dict(),
            "world_size": rt.world_size,
            "nodes": rt.nodes,
            "ranks_per_node": rt.ranks_per_node,
            "ranks_per_node_list": rt.ranks_per_node_list,
            "grid": self.grid.describe(),
            "parameters": self.model.num_parameters(),
            "steps": tr.steps,
            "global_batch": tr.global_batch,
            "tokens_per_step": self.tokens_per_step,
            "step_time_s": mean_time,
            "step_time_std_s": std_time,
            "timing_warmup_steps": skipped,
            "tokens_per_s": self.tokens_per_step / mean_time,
            "flops_per_step": self.flops_per_step,
            "flops_kind": "model FLOPs, Megatron SC21 count (no recompute, full attention)",
            "tflops_per_rank": tflops_per_rank,
            "aggregate_tflops": tflops_per_rank * rt.world_size,
            "device": self.device_name,
            "peak_tflops_per_rank": self.peak,
            "mfu": None if self.peak is None else tflops_per_rank / self.peak,
            "initial_loss": records[0]["loss"],
            "final_loss": records[-1]["loss"],
            "consumed_samples": self.sampler.consumed_samples,
            "torch_threads": torch.get_num_threads(),
            "versions": versions(),
        }


def train(deck: Deck, runtime: Runtime, grid: ProcessGrid) -> dict[str, Any]:
    """Build a `Trainer` and run it; returns the summary."""
    return Trainer(deck, runtime, grid).run()
