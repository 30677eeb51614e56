"""RunReport: what a run tells about itself: the banner, one record and log line per logged
step (metrics.jsonl, TensorBoard), the end-of-run lines and summary.json.

It is handed what it reports (the deck, runtime, grid, what the trainer built, each step's
numbers) and knows nothing of how a step is computed. Every rank keeps the same report;
rank 0 alone prints (`Runtime.log`) and writes files.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from app.deck import Deck, ModelConfig
from app.metrics.flops import FLOPS_CONVENTION, step_flops
from app.metrics.peaks import peak_tflops
from app.metrics.report import (
    MetricsWriter,
    TensorBoardWriter,
    format_line,
    mean_step_time,
    require_tensorboard,
    run_dir_write,
    versions,
    write_summary,
)
from app.metrics.summary import (
    CheckpointInfo,
    EvalInfo,
    GoldfishInfo,
    GridInfo,
    PipelineInfo,
    StudyInfo,
    Summary,
    TimersInfo,
)
from app.names import AXES, SCHEDULES, SUB_AXES, USED_AXES, reduce_precision, schedule_key
from app.runtime.grid import ProcessGrid, placement_warnings
from app.runtime.mpi import Runtime, node_summary, on_root
from app.runtime.timers import PHASES

OVERLAP_KEYS = (
    "overlap_grad_reduce",
    "overlap_param_gather",
    "overlap_tp_comm",
    "overlap_pp_comm",
    "overlap_tensor_reduce_scatter",
    "overlap_tensor_all_gather",
)


def _sub_axes_words(t: TimersInfo) -> str:
    """ " | tp sub-axes (communication/exposed ms): tp_x 1.0/0.5 ..." under 3D tensor parallelism, and
    " | ep all-to-all ...: ep 3.0/3.0" under expert parallelism (both within their axis's figures)."""
    out = ""
    for parent, words in (("tp", "tp sub-axes"), ("dp", "ep all-to-all, within dp")):
        subs = [a for a, axis in SUB_AXES.items() if axis == parent and a in t["comm_s"]]
        if subs:
            each = ", ".join(f"{a} {t['comm_s'][a] * 1e3:.1f}/{t['exposed_comm_s'][a] * 1e3:.1f}" for a in subs)
            out += f" | {words} (communication/exposed ms): {each}"
    return out


def _arch_words(m: ModelConfig) -> str:
    """ " (llama, K key/value heads)" after the parameter count of a llama model; "" for gpt2."""
    return f" ({m.arch_words})" if m.arch_words else ""


def _tensor3d_words(tensor: Optional[tuple[int, int, int]], order: str = "xyz") -> str:
    """ " (3D x=.. y=.. z=.., order ...)" after the tp degree of a 3D tensor-parallel run; "" under 1D."""
    return "" if tensor is None else " (3D x={} y={} z={}, {} innermost first)".format(*tensor, order)


@dataclass(frozen=True)
class Built:
    """What the trainer built, as the report tells it (this rank's share where ranks differ)."""

    parameters: int  # of the whole (1-rank) model
    parameters_rank0: int  # held by this rank
    layers_per_chunk: list[int]
    micro_batches: int  # per dp rank and step
    dp_buckets: int
    zero_sharded: bool  # ZeRO in effect (optim.zero >= 1 and dp > 1)
    eval_source: Optional[str] = None  # where eval.every's held-out data comes from (None: no evaluation)


def mean_timings(timings: list[dict[str, Any]]) -> TimersInfo:
    """Per-step means of the `StepTimers.pop()` records (numbers and per-axis dicts)."""
    out: dict[str, Any] = {f"{p}_s": sum(t[f"{p}_s"] for t in timings) / len(timings) for p in PHASES}
    # cp, 3D tensor parallelism's sub-axes, ep: where they communicated
    used = [a for a in (*USED_AXES, *SUB_AXES) if any(a in t["comm_s"] for t in timings)]
    for key in ("comm_s", "exposed_comm_s"):
        out[key] = {a: sum(t[key].get(a, 0.0) for t in timings) / len(timings) for a in (*AXES, *used)}
    return TimersInfo(**out)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class RunReport:
    """The run's report: `banner()`, then `open()` once the start step is known, `timed()` for
    every trained step and `log_step()` for those `due()`, `rollback()`, and `finish()`."""

    def __init__(self, deck: Deck, runtime: Runtime, grid: ProcessGrid, run_dir: Path, built: Built) -> None:
        self.deck, self.runtime, self.grid, self.run_dir, self.built = deck, runtime, grid, run_dir, built
        m, tr = deck.model, deck.train
        self.device_name = device_name(runtime.device)
        self.peak = peak_tflops(self.device_name, tr.precision, deck.run.peak_tflops)
        flops = step_flops(deck, runtime.device is not None and runtime.device.type == "cuda")
        self.flops_per_step, self.hardware_flops_per_step = flops["model"], flops["hardware"]
        self.tokens_per_step = tr.global_batch * m.seq_len
        self.start_step = 0
        self.records: list[dict[str, Any]] = []  # the logged steps' records
        self.step_times: list[float] = []  # every trained step's
        self.timings: list[dict[str, Any]] = []  # every trained step's `StepTimers.pop()`
        # Disabled until `open`, which knows whether old records are to be kept.
        self.writer = MetricsWriter(run_dir, enabled=False)
        self.board = TensorBoardWriter(run_dir, enabled=False)

    def banner(self) -> None:
        """The run's shape, before training: four lines, any warnings, the FLOP convention."""
        deck, rt, grid, built = self.deck, self.runtime, self.grid, self.built
        tr, par = deck.train, deck.parallel
        cp = grid.size("cp")
        order = "-".join(grid.layout.order) if cp > 1 else par.order  # where cp sits, once it is there
        rt.log(
            f"gridlm: {built.parameters:,} parameters{_arch_words(deck.model)} | world {rt.world_size} on {rt.nodes} node(s) | "
            f"grid tp={grid.size('tp')}{_tensor3d_words(par.tensor3d, par.tensor_order)} "
            f"{f'cp={cp} ' if cp > 1 else ''}pp={grid.size('pp')} dp={grid.size('dp')} "
            f"{f'(ep={par.ep}) ' if par.ep > 1 else ''}({order}) | "
            f"device {self.device_name}"
        )
        if rt.nodes > 1 or rt.store_source == "GRIDLM_MASTER_ADDR":
            host, port = rt.store_address or ("?", 0)
            rt.log(f"gridlm: nodes {node_summary(rt)} | rendezvous {host}:{port} ({rt.store_source})")
        rt.log(
            f"gridlm: global batch {tr.global_batch} = micro batch {tr.micro_batch} x "
            f"{built.micro_batches} accumulation x dp {grid.size('dp')}"
            f"{f' x z {par.batch_split}' if par.batch_split > 1 else ''} | seq {deck.model.seq_len}"
            f"{f' split over cp {par.cp} ({par.cp_kind}, {deck.model.seq_len // par.cp} per rank)' if par.cp > 1 else ''} | "
            f"{tr.steps} steps | data {deck.data.kind} | run dir {self.run_dir}"
        )
        schedule = SCHEDULES[schedule_key(par.virtual_stages)]
        rt.log(
            f"gridlm: pipeline {schedule}, {grid.size('pp')} stage(s) x {par.virtual_stages} chunk(s), "
            f"layers per chunk {built.layers_per_chunk} | sequence parallel {'on' if par.sequence_parallel else 'off'} | "
            f"groups inside a node: "
            + ", ".join(f"{a} {'yes' if grid.within_node[a] else 'no'}" for a in grid.layout.axes)
        )
        opt = deck.optim
        overlaps = ", ".join(f"{k.removeprefix('overlap_').replace('_', '-')} {'on' if getattr(par, k) else 'off'}"
                             for k in OVERLAP_KEYS if par.tensor is not None or "tensor" not in k)  # fmt: skip
        zero = f"ZeRO-{opt.zero}"
        zero = (f" {zero}" if built.zero_sharded else f" ({zero} has no effect at dp = 1)") if opt.zero else ""
        rt.log(
            f"gridlm: precision {tr.precision} (gradients reduced in "
            f"{reduce_precision(tr.precision, tr.grad_reduce_dtype)}) | optimizer {opt.name}"
            f"{zero} | recompute {tr.recompute} | {built.dp_buckets} dp bucket(s) "
            f"of <= {par.dp_bucket_mb:g} MB | overlap: {overlaps}"
        )
        if tr.goldfish_k:
            h = tr.goldfish_context
            rule = (
                f"its table value for the product of the {h} targets ending at it is below 1/{tr.goldfish_k} (the "
                f"authors' hash-table rule; the first {h - 1} of a sample always count)"
                if tr.goldfish_rule == "hash-table"
                else f"the SplitMix64 hash of the {h} targets before it is 0 mod {tr.goldfish_k} (the first {h} of a "
                f"sample always count)"
            )
            rt.log(f"gridlm: goldfish loss k={tr.goldfish_k} h={h}: a target is left out of the loss when {rule}")
        if built.eval_source is not None:
            ev = deck.eval
            rt.log(
                f"gridlm: evaluation every {ev.every} steps and after the last: {ev.batches} x {tr.global_batch} "
                f"samples of {built.eval_source}"
            )
        for warning in placement_warnings(grid.within_node, rt.ranks_per_node, par.gpus_per_node):
            rt.log(f"gridlm: warning: {warning}")
        if self.peak is None:
            rt.log(
                f"gridlm: warning: no peak FLOP/s known for device {self.device_name!r} at {tr.precision}: MFU is null "
                "(set run.peak_tflops to report it)"
            )
        rt.log(f"gridlm: FLOP/s are {FLOPS_CONVENTION}")

    def open(self, start_step: int, resumed: bool) -> None:
        """Start the step records at `start_step`: metrics.jsonl (and TensorBoard) keep a resumed
        run's records up to it and drop the rest (steps logged after its checkpoint); a fresh run
        starts them afresh and removes an earlier run's summary.json."""
        rt, kept = self.runtime, (start_step if resumed else None)
        self.start_step = start_step
        self.records, self.step_times, self.timings = [], [], []
        self.writer = MetricsWriter(self.run_dir, enabled=rt.is_root, resumed_step=kept)
        if rt.is_root and not resumed:
            # A fresh run's summary.json is its own or none, as its metrics.jsonl (found in review: an
            # earlier run's stayed until the end, and a fresh run that failed left it read as its result).
            summary = self.run_dir / "summary.json"
            with run_dir_write(summary):
                summary.unlink(missing_ok=True)
        if self.deck.run.tensorboard:
            on_root(rt, require_tensorboard)
        self.board = TensorBoardWriter(self.run_dir, rt.is_root and self.deck.run.tensorboard, kept)

    def timed(self, step_time: float, timings: dict[str, Any]) -> None:
        """A trained step's seconds and its `StepTimers.pop()` record (every step, logged or not)."""
        self.step_times.append(step_time)
        self.timings.append(timings)

    def due(self, step: int) -> bool:
        """Whether `step` is logged: every run.log_every steps, the first of this job and the last."""
        steps = self.deck.train.steps
        return step % self.deck.run.log_every == 0 or step == steps or step == self.start_step + 1

    def log_step(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        consumed_samples: int,
        loss_scale: Optional[float] = None,
        skipped_steps: Optional[int] = None,
        loss_tokens: Optional[int] = None,
        evaluated: Optional[EvalInfo] = None,
        moe: Optional[dict[str, float]] = None,
    ) -> dict[str, Any]:
        """The record of the step just `timed` (`loss`: the global-batch mean over its `loss_tokens`
        counted targets; `loss_scale` and `skipped_steps` under fp16; `evaluated`: the evaluation
        after it; `moe`: the routers' losses and drops, `Trainer.router_losses`): metrics.jsonl,
        TensorBoard and the log line."""
        step_time, world = self.step_times[-1], self.runtime.world_size
        tflops = self.flops_per_step / step_time / world / 1e12
        hw_tflops = self.hardware_flops_per_step / step_time / world / 1e12
        record: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "loss_tokens": self.tokens_per_step if loss_tokens is None else loss_tokens,
            "lr": lr,
            "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "tflops_per_rank": tflops,
            "hw_tflops_per_rank": hw_tflops,
            "mfu": None if self.peak is None else tflops / self.peak,
            "grad_norm": grad_norm,
            "consumed_samples": consumed_samples,
        }
        if loss_scale is not None:
            record["loss_scale"] = loss_scale
            record["skipped_steps"] = skipped_steps
        if evaluated is not None:
            record["val_loss"], record["val_perplexity"] = evaluated["loss"], evaluated["perplexity"]
        if moe is not None:
            record.update(moe)
        if self.deck.run.timers:
            record.update(self.timings[-1])  # rank 0's phase and communication seconds this step
        self.writer.write(record)
        goldfish = self.tokens_per_step if self.deck.train.goldfish_k else None
        self.runtime.log(format_line(record, self.deck.train.steps, goldfish))
        self.records.append(record)
        self.board.write(record)
        return record

    def rollback(self, step: int) -> None:
        """Back to a checkpoint of `step`: the records after it go (they are trained again)."""
        self.writer.truncate(step)
        self.board.truncate(step)
        self.records = [r for r in self.records if r["step"] <= step]

    @staticmethod
    def peak_memory(device: torch.device) -> dict[str, int]:
        """This process's peak resident memory (`peak_rss`, bytes; Linux's ru_maxrss is in KiB) and,
        on a GPU, the most memory torch allocated on it (`peak_device_allocated`)."""
        out = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if device.type == "cuda":
            out["peak_device_allocated"] = int(torch.cuda.max_memory_allocated(device))
        return out

    def _most_of_any_rank(self, memory_bytes: dict[str, int]) -> dict[str, int]:
        """Each memory figure's maximum over the ranks (collective): under pp the last stage (the head
        and the logits) or the first (the embedding) may hold more than rank 0."""
        from mpi4py import MPI

        keys = sorted(memory_bytes)  # the same keys on every rank: one deck, one device kind
        most = np.array([memory_bytes[key] for key in keys], dtype=np.int64)
        with self.runtime.watchdog.blocking("MPI_Allreduce (memory per rank)"):
            self.runtime.comm.Allreduce(MPI.IN_PLACE, most, op=MPI.MAX)
        maxima = dict(zip(keys, most.tolist()))
        return {key: maxima[key] for key in memory_bytes}  # in the rank's own order, as memory_bytes_rank0

    def finish(
        self,
        *,
        memory_bytes: dict[str, int],
        skipped_steps: int,
        nonfinite_steps: int,
        rollbacks: int,
        consumed_samples: int,
        resumed_from: Optional[dict[str, Any]],
        interrupted: Optional[str],
        checkpoints: list[CheckpointInfo],
        job_targets: tuple[int, int] = (0, 0),
        evaluated: Optional[EvalInfo] = None,
    ) -> Summary:
        """The summary (every rank), written to run.dir/summary.json and told in the end-of-run
        lines by rank 0. `memory_bytes`: this rank's parameter, gradient and optimizer state;
        `job_targets`: (counted, all) targets of this job's steps; `evaluated`: the last evaluation."""
        self.board.close()
        deck, rt, tr, par, built = self.deck, self.runtime, self.deck.train, self.deck.parallel, self.built
        mean_time, std_time, skipped = mean_step_time(self.step_times, deck.run.timing_warmup)
        timers = mean_timings(self.timings[skipped:]) if deck.run.timers else None
        exposed = (
            sum(timers["exposed_comm_s"][a] for a in (*AXES, *USED_AXES) if a in timers["exposed_comm_s"]) / mean_time
            if timers
            else None
        )
        tflops_per_rank = self.flops_per_step / mean_time / rt.world_size / 1e12
        hw_tflops_per_rank = self.hardware_flops_per_step / mean_time / rt.world_size / 1e12
        study = deck.run.study
        summary = Summary(
            deck=deck.to_dict(),
            world_size=rt.world_size,
            nodes=rt.nodes,
            ranks_per_node=rt.ranks_per_node,
            ranks_per_node_list=rt.ranks_per_node_list,
            grid=GridInfo(
                **self.grid.describe(),
                tensor=list(par.tensor3d) if par.tensor3d else None,
                tensor_order=par.tensor_order if par.tensor3d else None,
                **({"ep": par.ep} if par.ep > 1 else {}),
            ),
            parameters=built.parameters,
            parameters_rank0=built.parameters_rank0,
            pipeline=PipelineInfo(
                schedule=schedule_key(par.virtual_stages),
                virtual_stages=par.virtual_stages,
                layers_per_chunk=built.layers_per_chunk,
                micro_batches=built.micro_batches,
            ),
            sequence_parallel=par.sequence_parallel,
            precision=tr.precision,
            optimizer=deck.optim.name,
            zero=deck.optim.zero,
            recompute=tr.recompute,
            overlap={k: getattr(par, k) for k in OVERLAP_KEYS},
            dp_buckets=built.dp_buckets,
            memory_bytes_rank0=memory_bytes,
            memory_bytes_max=self._most_of_any_rank(memory_bytes),
            skipped_steps=skipped_steps,
            nonfinite_steps=nonfinite_steps,
            rollbacks=rollbacks,
            steps=tr.steps,
            global_batch=tr.global_batch,
            tokens_per_step=self.tokens_per_step,
            step_time_s=mean_time,
            step_time_std_s=std_time,
            timing_warmup_steps=skipped,
            timers=timers,
            exposed_comm_fraction=exposed,
            tokens_per_s=self.tokens_per_step / mean_time,
            flops_per_step=self.flops_per_step,
            hardware_flops_per_step=self.hardware_flops_per_step,
            flops_kind=FLOPS_CONVENTION,
            tflops_per_rank=tflops_per_rank,
            hw_tflops_per_rank=hw_tflops_per_rank,
            aggregate_tflops=tflops_per_rank * rt.world_size,
            aggregate_pflops=tflops_per_rank * rt.world_size / 1e3,
            study=None
            if study is None
            else StudyInfo(name=study, kind=deck.run.study_kind, point=deck.run.study_point),
            device=self.device_name,
            peak_tflops_per_rank=self.peak,
            mfu=None if self.peak is None else tflops_per_rank / self.peak,
            hfu=None if self.peak is None else hw_tflops_per_rank / self.peak,
            initial_loss=self.records[0]["loss"] if self.records else None,
            final_loss=self.records[-1]["loss"] if self.records else None,
            goldfish=None
            if not tr.goldfish_k
            else GoldfishInfo(
                k=tr.goldfish_k,
                context=tr.goldfish_context,
                counted_targets=job_targets[0],
                targets=job_targets[1],
                counted_fraction=job_targets[0] / max(job_targets[1], 1),
            ),
            eval=evaluated,
            consumed_samples=consumed_samples,
            torch_threads=torch.get_num_threads(),
            versions=versions(),
            start_step=self.start_step,
            resumed_from=resumed_from,
            interrupted=interrupted,
            checkpoints=checkpoints,
        )
        if rt.is_root:
            path = write_summary(self.run_dir, summary.to_dict())
            self._log_done(summary, path)
        return summary

    def _log_done(self, s: Summary, path: Path) -> None:
        rt = self.runtime
        mfu = "n/a" if s.mfu is None else f"{100 * s.mfu:.1f}%"
        first, last = ("n/a" if x is None else f"{x:.4f}" for x in (s.initial_loss, s.final_loss))
        nonfinite = f" | {s.nonfinite_steps} non-finite step(s), {s.rollbacks} rollback(s)"
        extra = ""
        if s.goldfish is not None:
            g = s.goldfish
            extra += (
                f" | goldfish k={g['k']} h={g['context']}: {g['counted_targets']:,} of {g['targets']:,} targets "
                f"counted ({100 * g['counted_fraction']:.1f}%)"
            )
        if s.eval is not None:
            extra += f" | val loss {s.eval['loss']:.4f} ppl {s.eval['perplexity']:.2f} (step {s.eval['step']})"
        rt.log(
            f"gridlm: done | loss {first} -> {last}{nonfinite if s.nonfinite_steps else ''}{extra} | "
            f"step {s.step_time_s * 1e3:.1f} ms (mean after {s.timing_warmup_steps} warm-up) | "
            f"{s.tokens_per_s:,.0f} tok/s | {s.tflops_per_rank:.3f} TFLOP/s/rank | "
            f"{s.aggregate_tflops:.3f} TFLOP/s total | mfu {mfu} | {path}"
        )
        if s.timers is not None:
            t = s.timers
            axes = [a for a in (*AXES, *USED_AXES) if a in t["comm_s"]]  # cp where it communicated
            rt.log(
                f"gridlm: rank 0 per step: forward {t['forward_s'] * 1e3:.1f} ms, backward "
                f"{t['backward_s'] * 1e3:.1f} ms, optimizer {t['optimizer_s'] * 1e3:.1f} ms | communication "
                + ", ".join(f"{a} {t['comm_s'][a] * 1e3:.1f}" for a in axes)
                + " ms, exposed "
                + ", ".join(f"{a} {t['exposed_comm_s'][a] * 1e3:.1f}" for a in axes)
                + f" ms ({100 * (s.exposed_comm_fraction or 0.0):.1f}% of the step)"
                + _sub_axes_words(t)
            )
