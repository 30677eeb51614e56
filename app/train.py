"""The training loop: build -> step -> log -> report.

Build: the grid gives this rank its tp shard (tensor-parallel layers), its pipeline
chunks (stage layers) and its dp share of each global batch; the model holds only that,
in the flat buffers of `DataParallel` (compute dtype), with fp32 master weights (sharded
over dp under ZeRO-1) updated by `ShardedOptimizer` (AdamW or LAMB).
One optimizer step: the pipeline schedule runs forward + backward of (mean loss /
micro-batches) x loss scale for each of this dp rank's micro-batches, while gradient
hooks launch each dp bucket's reduction as soon as it is complete; `update` waits for
them, adds the sequence-parallel and tied-embedding sums, takes the grid-wide norm
(fp16: an overflow anywhere skips the step everywhere), clips and steps. The logged loss
is the mean over the whole global batch, so it is the same number on 1 rank and on any
grid.
A run starts from the checkpoint run.resume names (any grid's), writes checkpoints every
checkpoint.every steps and at exit, and on SIGTERM / SIGUSR1 stops after the current step
with a checkpoint (`app/checkpoint/`, docs/CHECKPOINT.md).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from app.checkpoint.io import Saved
from app.checkpoint.io import load as load_checkpoint
from app.checkpoint.io import save as save_checkpoint
from app.checkpoint.store import checkpoint_dir, resolve_resume
from app.data import GlobalBatchSampler, build_dataset, get_batch
from app.data.memmap import MemmapTokens
from app.deck import Deck, check_paths
from app.errors import GridlmError
from app.metrics.flops import FLOPS_CONVENTION, gpt_hardware_step_flops, gpt_step_flops
from app.metrics.peaks import peak_tflops
from app.metrics.report import (
    MetricsWriter,
    TensorBoardWriter,
    format_line,
    mean_step_time,
    require_tensorboard,
    versions,
    write_summary,
)
from app.metrics.timers import PHASES, StepTimers
from app.model.gpt import GPT
from app.optim.optimizer import LossScaler, ShardedOptimizer, any_rank, clip_coefficient, grad_norm, learning_rate
from app.parallel.data import DataParallel
from app.parallel.pipeline import Pipeline
from app.parallel.schedule import partition_layers
from app.runtime.collectives import TensorParallel
from app.runtime.grid import AXES, ProcessGrid, placement_warnings
from app.runtime.lock import RunLock, acquire_run_lock
from app.runtime.mpi import Runtime, agree, on_root
from app.runtime.signals import StopSignals, signal_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_run_dir(runtime: Runtime, deck: Deck) -> tuple[Path, Optional[RunLock]]:
    """Rank 0 checks the deck's paths, takes run.dir's lock (one job per run directory) and only
    then records the resolved deck there; every rank learns the verdict. Returns the run
    directory and, on rank 0, the lock to hold for the life of the job."""
    run_dir = Path(deck.run.dir or "runs/default")
    held: list[RunLock] = []

    def create() -> None:
        check_paths(deck)
        lock = acquire_run_lock(run_dir, warn=runtime.log)
        held.append(lock)
        try:
            (run_dir / "deck.yaml").write_text(yaml.safe_dump(deck.to_dict(), sort_keys=False))
        except OSError as err:
            raise GridlmError(
                f"cannot write run directory run.dir = {str(run_dir)!r}: {err.strerror}; set run.dir to a writable path"
            ) from None

    # on_root, not agree: a refusal is about the directory, not about rank 0's host.
    on_root(runtime, create)
    return run_dir, (held[0] if held else None)


OVERLAP_KEYS = ("overlap_grad_reduce", "overlap_param_gather", "overlap_tp_comm", "overlap_pp_comm")


def mean_timings(timings: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step means of the `StepTimers.pop()` records (numbers and per-axis dicts)."""
    out: dict[str, Any] = {f"{p}_s": sum(t[f"{p}_s"] for t in timings) / len(timings) for p in PHASES}
    for key in ("comm_s", "exposed_comm_s"):
        out[key] = {a: sum(t[key][a] for t in timings) / len(timings) for a in AXES}
    return out


def global_loss(loss_sum: torch.Tensor, grid: ProcessGrid) -> float:
    """The global-batch mean loss: held by the last stage (summed over pp), averaged over dp."""
    value = loss_sum.detach().clone()
    grid.all_reduce(value, ("pp", "dp"))
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
        self.run_dir, self.run_lock = _make_run_dir(runtime, deck)
        self.dataset = agree(runtime, lambda: build_dataset(deck.data, m, tr.seed))
        self.sampler = GlobalBatchSampler(tr.global_batch, tr.micro_batch, grid.coords["dp"], grid.size("dp"))
        # Dropout masks differ between dp replicas and stages, but not between the tp ranks of a
        # stage: their replicated activations (and so their replicated parameters) must stay equal.
        torch.manual_seed(tr.seed + 1_000_003 * (grid.coords["dp"] * grid.size("pp") + grid.coords["pp"]))
        par = deck.parallel
        self.timers = StepTimers(self.device, deck.run.timers, runtime.watchdog)
        self.tp = TensorParallel.from_grid(grid, par.sequence_parallel, self.timers, overlap=par.overlap_tp_comm)
        self.chunks = partition_layers(m.layers, par.pp * par.virtual_stages, par.stage_layers)
        seq = m.seq_len // grid.size("tp") if par.sequence_parallel else m.seq_len
        self.pipeline = Pipeline(
            grid, self.chunks, (tr.micro_batch, seq, m.hidden), self.timers, prefetch=par.overlap_pp_comm
        )
        pipe = self.pipeline
        self.model = GPT(m, tr.seed, self.device, self.tp, pipe.layers, pipe.first, pipe.last, recompute=tr.recompute)
        compute = DTYPES[tr.precision]
        tied = (self.model.wte.weight, pipe.tied_group) if pipe.tied_group is not None and m.tie_embeddings else None
        self.dp = DataParallel(
            self.model,
            grid,
            compute_dtype=compute,
            reduce_dtype=compute if tr.grad_reduce_dtype == "compute" else torch.float32,
            bucket_mb=par.dp_bucket_mb,
            zero=deck.optim.zero == 1,
            overlap_grad_reduce=par.overlap_grad_reduce,
            overlap_param_gather=par.overlap_param_gather,
            tied=tied,
            timers=self.timers,
        )
        self.dp.prefetch_hooks(self.model.first_uses())
        self.sp_group = grid.group["tp"] if par.sequence_parallel and grid.size("tp") > 1 else None
        self.optimizer = ShardedOptimizer(self.dp, deck.optim, grid)
        self.scaler = LossScaler(tr.loss_scale, tr.loss_scale_window) if tr.precision == "fp16" else None
        self.steps_done = 0
        self.resumed: Optional[dict[str, Any]] = None  # what `resume` loaded
        self.checkpoints: list[dict[str, Any]] = []  # what `save` wrote
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.peak = peak_tflops(self.device_name, tr.precision, deck.run.peak_tflops)
        self.flops_per_step = gpt_step_flops(tr.global_batch, m.seq_len, m.layers, m.hidden, m.vocab_size, m.ffn)
        self.hardware_flops_per_step = gpt_hardware_step_flops(
            tr.global_batch, m.seq_len, m.layers, m.hidden, m.vocab_size, m.ffn, tr.recompute
        )
        self.tokens_per_step = tr.global_batch * m.seq_len

    def step(self) -> tuple[torch.Tensor, float, float]:
        """One optimizer step over the global batch: (this dp rank's mean loss on the last stage, 0 on
        the others; lr; global grad norm, inf when fp16 overflowed and the step was skipped)."""
        lr = learning_rate(self.deck.optim, self.steps_done, self.deck.train.steps)
        loss_sum = self.forward_backward()
        norm = self.update(lr)
        return loss_sum, lr, norm

    def forward_backward(self) -> torch.Tensor:
        """The pipeline over this dp rank's micro-batches; gradients land in the dp buckets."""
        def read() -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [get_batch(self.dataset, indices) for indices in self.sampler.next_step()]

        # A token id out of range on one dp rank (DataError) must end every rank, not strand the
        # others in the first collective; synthetic data is in range by construction.
        batches = agree(self.runtime, read) if isinstance(self.dataset, MemmapTokens) else read()
        micro_batches = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                         for x, y in batches]  # fmt: skip
        self.dp.start_step(len(micro_batches))
        # Mean over micro-batches in the pipeline, mean over dp in the reduction: the global-batch mean.
        return self.pipeline.run(self.model, micro_batches, self.scaler.scale if self.scaler else 1.0)

    def update(self, lr: float) -> float:
        """Finish the gradient reductions, clip, step (unless fp16 overflowed); the global grad norm."""
        with self.timers.phase("optimizer"):
            self.dp.finish_grad_reduce(self.sp_group)
            norm = grad_norm(self.dp, self.grid)
            scale = self.scaler.scale if self.scaler else 1.0
            self.steps_done += 1
            if self.scaler is not None:
                overflow = any_rank(not math.isfinite(norm), self.grid, self.device)
                self.scaler.update(overflow)
                if overflow:
                    return math.inf  # every rank skips: the parameters stay as they are
            norm /= scale
            self.optimizer.step(lr, clip_coefficient(norm, self.deck.optim.grad_clip) / scale)
        return norm

    def resume(self) -> Optional[dict[str, Any]]:
        """Load the checkpoint run.resume names, if any (auto: `latest`, when there is one)."""
        path = on_root(self.runtime, lambda: resolve_resume(self.deck))
        if path is None:
            if self.deck.run.resume == "auto":
                self.runtime.log(f"gridlm: no checkpoint in {checkpoint_dir(self.deck)}: starting at step 0")
            return None
        info = load_checkpoint(self, path)
        self.resumed = info
        g = info["grid"]
        self.runtime.log(
            f"gridlm: resumed from {path} at step {info['step']} ({info['seconds']:.2f} s) | written on "
            f"tp={g['tp']} pp={g['pp']} dp={g['dp']} zero={g['zero']} {info['precision']}"
            + (" | resharded to this grid" if info["resharded"] else "")
            + ("" if info["rng_restored"] else " | RNG states not restored (other grid): dropout masks differ")
        )
        return info

    def save(self, reason: str) -> Saved:
        """Write a checkpoint of the current step (all ranks); logs it and notes it for the summary."""
        saved = save_checkpoint(self, checkpoint_dir(self.deck))
        record = {"step": saved.step, "path": str(saved.path), "bytes": saved.bytes, "seconds": saved.seconds,
                  "reason": reason}  # fmt: skip
        self.checkpoints.append(record)
        self.runtime.log(
            f"gridlm: checkpoint step {saved.step} ({reason}) -> {saved.path} | {saved.bytes / 1e6:.1f} MB in "
            f"{saved.seconds:.2f} s ({saved.bytes / max(saved.seconds, 1e-9) / 1e9:.2f} GB/s)"
        )
        return saved

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
        par = deck.parallel
        schedule = "interleaved 1F1B" if par.virtual_stages > 1 else "1F1B"
        counts = [len(c) for c in self.chunks]
        rt.log(
            f"gridlm: pipeline {schedule}, {grid.size('pp')} stage(s) x {par.virtual_stages} chunk(s), "
            f"layers per chunk {counts} | sequence parallel {'on' if par.sequence_parallel else 'off'} | "
            f"groups inside a node: " + ", ".join(f"{a} {'yes' if grid.within_node[a] else 'no'}" for a in AXES)
        )
        opt = deck.optim
        overlaps = ", ".join(f"{k.removeprefix('overlap_').replace('_', '-')} {'on' if getattr(par, k) else 'off'}"
                             for k in OVERLAP_KEYS)  # fmt: skip
        rt.log(
            f"gridlm: precision {tr.precision} (gradients reduced in "
            f"{tr.precision if tr.grad_reduce_dtype == 'compute' else 'fp32'}) | optimizer {opt.name}"
            f"{(' ZeRO-1' if self.dp.zero else ' (ZeRO-1 has no effect at dp = 1)') if opt.zero else ''} | recompute {tr.recompute} | {len(self.dp.buckets)} dp bucket(s) "
            f"of <= {par.dp_bucket_mb:g} MB | overlap: {overlaps}"
        )
        for warning in placement_warnings(grid.within_node, rt.ranks_per_node, par.gpus_per_node):
            rt.log(f"gridlm: warning: {warning}")
        if self.peak is None:
            rt.log(
                f"gridlm: warning: no peak FLOP/s known for device {self.device_name!r} at {tr.precision}: MFU is null "
                "(set run.peak_tflops to report it)"
            )
        rt.log(f"gridlm: FLOP/s are {FLOPS_CONVENTION}")

    def run(self) -> dict[str, Any]:
        """Train to deck.train.steps, logging every run.log_every steps; returns the summary."""
        deck, rt = self.deck, self.runtime
        steps = deck.train.steps
        self._banner()
        self.resume()
        start = self.steps_done
        if start >= steps:
            rt.log(
                f"gridlm: the checkpoint is at step {start} >= train.steps = {steps}: nothing to train (raise "
                f"train.steps to continue, or set run.resume: none to start over)"
            )
            return {"steps": steps, "start_step": start, "resumed_from": self.resumed}
        resumed_step = start if self.resumed else None
        writer = MetricsWriter(self.run_dir, enabled=rt.is_root, resumed_step=resumed_step)
        if deck.run.tensorboard:
            on_root(rt, require_tensorboard)
        board = TensorBoardWriter(self.run_dir, rt.is_root and deck.run.tensorboard, resumed_step)
        records: list[dict[str, Any]] = []
        step_times: list[float] = []
        timings: list[dict[str, Any]] = []
        interrupted = None
        every = deck.checkpoint.every
        self.model.train()
        with StopSignals() as signals:
            while self.steps_done < steps:
                record = self._train_step(writer, start, step_times, timings)
                if record is not None:
                    records.append(record)
                    board.write(record)
                step = self.steps_done
                saved_now = bool(every) and step % every == 0
                if saved_now:
                    self.save(f"every {every} steps")
                received = signals.agreed(rt.comm, rt.watchdog)
                if received:
                    interrupted = signal_name(received)
                    if not saved_now:
                        self.save(interrupted)
                    rt.log(
                        f"gridlm: {interrupted} received: stopped after step {step} of {steps} with a checkpoint; "
                        f"resubmit the job to continue (run.resume: auto)"
                    )
                    break
            else:
                if deck.checkpoint.at_exit and not saved_now:
                    self.save("end of training")
        board.close()
        self.dp.wait_params()  # no all-gather left in flight: the parameters are complete
        summary = self._summary(records, step_times, timings)
        summary.update(start_step=start, resumed_from=self.resumed, interrupted=interrupted,
                       checkpoints=self.checkpoints)  # fmt: skip
        if rt.is_root:
            path = write_summary(self.run_dir, summary)
            mfu = "n/a" if summary["mfu"] is None else f"{100 * summary['mfu']:.1f}%"
            rt.log(
                f"gridlm: done | loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f} | "
                f"step {summary['step_time_s'] * 1e3:.1f} ms (mean after {summary['timing_warmup_steps']} warm-up) | "
                f"{summary['tokens_per_s']:,.0f} tok/s | {summary['tflops_per_rank']:.3f} TFLOP/s/rank | "
                f"{summary['aggregate_tflops']:.3f} TFLOP/s total | mfu {mfu} | {path}"
            )
            if summary["timers"] is not None:
                t = summary["timers"]
                rt.log(
                    f"gridlm: rank 0 per step: forward {t['forward_s'] * 1e3:.1f} ms, backward "
                    f"{t['backward_s'] * 1e3:.1f} ms, optimizer {t['optimizer_s'] * 1e3:.1f} ms | communication "
                    + ", ".join(f"{a} {t['comm_s'][a] * 1e3:.1f}" for a in AXES)
                    + " ms, exposed "
                    + ", ".join(f"{a} {t['exposed_comm_s'][a] * 1e3:.1f}" for a in AXES)
                    + f" ms ({100 * summary['exposed_comm_fraction']:.1f}% of the step)"
                )
        return summary

    def _train_step(
        self, writer: MetricsWriter, start: int, step_times: list[float], timings: list[dict[str, Any]]
    ) -> Optional[dict[str, Any]]:
        """One timed step; its metrics record when this step is logged (else None)."""
        deck, rt, steps = self.deck, self.runtime, self.deck.train.steps
        rt.watchdog.at(step=self.steps_done + 1)
        _sync(self.device)
        t0 = time.perf_counter()
        loss_sum, lr, grad_norm = self.step()
        _sync(self.device)
        step_time = time.perf_counter() - t0
        step_times.append(step_time)
        timings.append(self.timers.pop())
        step = self.steps_done
        if not (step % deck.run.log_every == 0 or step == steps or step == start + 1):
            return None
        tflops = self.flops_per_step / step_time / rt.world_size / 1e12
        hw_tflops = self.hardware_flops_per_step / step_time / rt.world_size / 1e12
        record = {
            "step": step,
            "loss": global_loss(loss_sum, self.grid),
            "lr": lr,
            "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "tflops_per_rank": tflops,
            "hw_tflops_per_rank": hw_tflops,
            "mfu": None if self.peak is None else tflops / self.peak,
            "grad_norm": grad_norm,
            "consumed_samples": self.sampler.consumed_samples,
        }
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.scale
            record["skipped_steps"] = self.scaler.skipped
        if deck.run.timers:
            record.update(timings[-1])  # rank 0's phase and communication seconds this step
        writer.write(record)
        rt.log(format_line(record, steps))
        return record

    def _summary(
        self, records: list[dict[str, Any]], step_times: list[float], timings: list[dict[str, Any]]
    ) -> dict[str, Any]:
        deck, rt, tr, par = self.deck, self.runtime, self.deck.train, self.deck.parallel
        mean_time, std_time, skipped = mean_step_time(step_times, deck.run.timing_warmup)
        timers = mean_timings(timings[skipped:]) if deck.run.timers else None
        exposed = sum(timers["exposed_comm_s"].values()) / mean_time if timers else None
        tflops_per_rank = self.flops_per_step / mean_time / rt.world_size / 1e12
        hw_tflops_per_rank = self.hardware_flops_per_step / mean_time / rt.world_size / 1e12
        memory = self.dp.buffer_bytes()
        memory["optimizer_state"] = self.optimizer.state_bytes()
        return {
            "deck": deck.to_dict(),
            "world_size": rt.world_size,
            "nodes": rt.nodes,
            "ranks_per_node": rt.ranks_per_node,
            "ranks_per_node_list": rt.ranks_per_node_list,
            "grid": self.grid.describe(),
            "parameters": self.model.num_parameters(),
            "parameters_rank0": sum(p.numel() for p in self.model.parameters()),
            "pipeline": {
                "schedule": "interleaved-1f1b" if par.virtual_stages > 1 else "1f1b",
                "virtual_stages": par.virtual_stages,
                "layers_per_chunk": [len(c) for c in self.chunks],
                "micro_batches": self.sampler.num_micro_batches,
            },
            "sequence_parallel": par.sequence_parallel,
            "precision": tr.precision,
            "optimizer": deck.optim.name,
            "zero": deck.optim.zero,
            "recompute": tr.recompute,
            "overlap": {k: getattr(par, k) for k in OVERLAP_KEYS},
            "dp_buckets": len(self.dp.buckets),
            "memory_bytes_rank0": memory,
            "skipped_steps": self.scaler.skipped if self.scaler else 0,
            "steps": tr.steps,
            "global_batch": tr.global_batch,
            "tokens_per_step": self.tokens_per_step,
            "step_time_s": mean_time,
            "step_time_std_s": std_time,
            "timing_warmup_steps": skipped,
            "timers": timers,
            "exposed_comm_fraction": exposed,
            "tokens_per_s": self.tokens_per_step / mean_time,
            "flops_per_step": self.flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "flops_kind": FLOPS_CONVENTION,
            "tflops_per_rank": tflops_per_rank,
            "hw_tflops_per_rank": hw_tflops_per_rank,
            "aggregate_tflops": tflops_per_rank * rt.world_size,
            "aggregate_pflops": tflops_per_rank * rt.world_size / 1e3,
            "study": None
            if deck.run.study is None
            else {"name": deck.run.study, "kind": deck.run.study_kind, "point": deck.run.study_point},
            "device": self.device_name,
            "peak_tflops_per_rank": self.peak,
            "mfu": None if self.peak is None else tflops_per_rank / self.peak,
            "hfu": None if self.peak is None else hw_tflops_per_rank / self.peak,
            "initial_loss": records[0]["loss"],
            "final_loss": records[-1]["loss"],
            "consumed_samples": self.sampler.consumed_samples,
            "torch_threads": torch.get_num_threads(),
            "versions": versions(),
        }


def train(deck: Deck, runtime: Runtime, grid: ProcessGrid) -> dict[str, Any]:
    """Build a `Trainer` and run it; returns the summary. run.dir stays locked until it returns."""
    trainer = Trainer(deck, runtime, grid)
    try:
        return trainer.run()
    finally:
        if trainer.run_lock is not None:
            trainer.run_lock.release()
