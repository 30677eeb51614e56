"""The training loop: build -> step -> run (what the run reports is `app/metrics/run_report.py`).

Build: the grid gives this rank its tp shard (tensor-parallel layers), its pipeline
chunks (stage layers) and its dp share of each global batch; the model holds only that,
in the flat buffers of `DataParallel` (compute dtype), with fp32 master weights (sharded
over dp under ZeRO-1) updated by `ShardedOptimizer` (AdamW or LAMB).
One optimizer step: the pipeline schedule runs forward + backward of (mean loss /
micro-batches) x loss scale for each of this dp rank's micro-batches, while gradient
hooks launch each dp bucket's reduction as soon as it is complete; `update` waits for
them, adds the sequence-parallel and tied-embedding sums, takes the grid-wide norm,
checks the loss and the norm on the whole grid at once (one MAX all-reduce of two flags:
an fp16 overflow skips the step everywhere, any other NaN/Inf goes to train.nonfinite:
abort, skip, or rollback to the last checkpoint and skip the batch), clips and steps. The
logged loss is the mean over the whole global batch, so it is the same number on 1 rank
and on any grid.
A run starts from the checkpoint run.resume names (any grid's), writes checkpoints every
checkpoint.every steps and at exit, and on SIGTERM / SIGUSR1 stops after the current step
with a checkpoint (`app/checkpoint/`, docs/CHECKPOINT.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from app.checkpoint.background import background_writer, describe
from app.checkpoint.io import Saved, describe_grid
from app.checkpoint.io import load as load_checkpoint
from app.checkpoint.io import save as save_checkpoint
from app.checkpoint.store import checkpoint_dir, resolve_resume, step_file
from app.data import GlobalBatchSampler, build_dataset, get_batch
from app.data.synthetic import SyntheticTokens
from app.deck import Deck
from app.deck_paths import check_paths
from app.deck_yaml import dump_yaml
from app.errors import CheckpointError, GridlmError, NonFiniteError, RankFatal
from app.eval import NoOptimizer, check_held_out_tokens, eval_dataset, evaluate, held_out_note
from app.metrics.profile import StepProfiler
from app.metrics.report import replace_text, run_dir_write
from app.metrics.run_report import Built, RunReport
from app.metrics.summary import CheckpointInfo, EvalInfo
from app.model.fused import Kernels
from app.model.goldfish import CountedTargets, goldfish_keep
from app.model.gpt import GPT, Targets, check_attention_kernel
from app.model.moe import NO_EP, ExpertParallel, top1_warning
from app.names import reduce_precision, torch_dtype
from app.optim.offload import offload_path
from app.optim.optimizer import (
    LossScaler,
    NonFiniteGuard,
    ShardedOptimizer,
    clip_coefficient,
    describe_nonfinite,
    learning_rate,
    step_verdict,
)
from app.parallel.data import DataParallel
from app.parallel.loss import global_loss
from app.parallel.pipeline import Pipeline
from app.plan.estimate import rank_device_bytes
from app.runtime.grid import ProcessGrid
from app.runtime.lock import RunLock, acquire_run_lock
from app.runtime.mpi import Runtime, agree, on_root
from app.runtime.preflight import GIB, checkpoint_read, gpu_memory, h5py_has_mpi, preflight
from app.runtime.signals import StopSignals, signal_name
from app.runtime.timers import StepTimers
from app.runtime.watchdog import AnyWatchdog
from app.tensor_parallel.context import NO_CP, ContextParallel, Ring
from app.tensor_parallel.mappings import TensorParallel
from app.tensor_parallel.tensor3d import Tensor3D, tensor3d_from_grid


def _sync(device: torch.device, watchdog: AnyWatchdog) -> None:
    """Wait for the kernels of the compute stream, the step's: not the whole device, whose NCCL
    streams may still run the ZeRO parameter all-gathers launched at the step's end, which the next
    forward overlaps (found in review: torch.cuda.synchronize waited for them, so on GPUs they never
    overlapped, and their time was in the step but in no timer). Watched: on NCCL a collective's
    wait() returns at once and the host first blocks here, so a hung peer shows here."""
    if device.type == "cuda":
        with watchdog.blocking("device sync (the step's kernels and collectives)"):
            torch.cuda.current_stream(device).synchronize()


def _make_run_dir(runtime: Runtime, deck: Deck) -> tuple[Path, Optional[RunLock]]:
    """Rank 0 checks the deck's paths, takes run.dir's lock (one job per run directory) and only
    then records the resolved deck there; every rank learns the verdict. Returns the run
    directory and, on rank 0, the lock to hold for the life of the job."""
    run_dir = Path(deck.run.directory)
    held: list[RunLock] = []

    def create() -> None:
        check_paths(deck)
        lock = acquire_run_lock(run_dir, warn=runtime.log)
        held.append(lock)
        try:
            replace_text(run_dir / "deck.yaml", dump_yaml(deck.to_dict(), sort_keys=False))  # never half a deck
        except OSError as err:
            raise GridlmError(
                f"cannot write run directory run.dir = {str(run_dir)!r}: {err.strerror}; set run.dir to a writable path"
            ) from None

    # on_root, not agree: a refusal is about the directory, not about rank 0's host.
    on_root(runtime, create)
    return run_dir, (held[0] if held else None)


class Trainer:
    """Everything one rank needs to train: model, optimizer, data, sampler, and the `RunReport`.

    `step()` runs one optimizer step; `run()` runs deck.train.steps of them, handing each step's
    numbers to the report, and returns the summary (written to run.dir/summary.json by rank 0).
    """

    def __init__(self, deck: Deck, runtime: Runtime, grid: ProcessGrid, evaluate_only: bool = False) -> None:
        """`evaluate_only` (app.eval): a model to load a checkpoint into and evaluate; run.dir is left
        alone (no lock, no deck.yaml), the training data is not opened (it need not be here), and no
        optimizer state is built (`NoOptimizer`: no offload store to touch a training's files)."""
        self.deck, self.runtime, self.grid = deck, runtime, grid
        m, tr = deck.model, deck.train
        self.device = runtime.device
        self.phase = "start-up"  # what the rank is doing, for an out-of-memory line (`out_of_memory`)
        if not evaluate_only:  # what would fail hours in (no MPI in h5py, shared GPUs, memory): now
            stage, gpu = grid.coords["pp"], self.device.type == "cuda"
            warning = agree(runtime, lambda: preflight(deck, runtime, lambda: rank_device_bytes(deck, stage, gpu)))
            if warning:
                print(f"gridlm: rank {runtime.rank}: {warning}", file=sys.stderr, flush=True)
        if evaluate_only:
            self.run_dir, self.run_lock = Path(deck.run.directory), None
        else:
            self.run_dir, self.run_lock = _make_run_dir(runtime, deck)
        # The held-out data (eval.every, app.eval).
        # Rank 0 alone reads the token files' whole document indexes (`MemmapTokens`); `agree` shares its verdict.
        whole = runtime.is_root
        self.eval_data = agree(runtime, lambda: eval_dataset(deck, whole)) if deck.eval.every or evaluate_only else None
        note = None if self.eval_data is None else held_out_note(deck, self.eval_data)
        if note is not None:
            runtime.log(note)
        if evaluate_only:
            assert self.eval_data is not None
            self.dataset = self.eval_data.dataset  # never trained on: the sampler state of a checkpoint is all it meets
        else:
            self.dataset = agree(runtime, lambda: build_dataset(deck.data, m, tr.seed, whole))
            if self.eval_data is not None and deck.eval.path:
                agree(runtime, lambda: check_held_out_tokens(self.dataset, self.eval_data))
        self.last_eval: Optional[EvalInfo] = None
        # Targets of the last step's loss (Goldfish drops some) and of this job's steps: (counted, all).
        self.step_targets = (0, 0)
        self.job_targets = [0, 0]
        # job_targets at each step this job saved: a rollback to one takes them back (found in review:
        # the replayed steps were counted twice in summary.goldfish); 0 at the file it resumed from.
        self.targets_at: dict[int, tuple[int, int]] = {}
        par = deck.parallel
        self.timers = StepTimers(self.device, deck.run.timers, runtime.watchdog)
        self.tp: TensorParallel | Tensor3D
        if par.tensor is not None:  # 3D: the batch is split over dp x Z, the hidden over X
            self.tp = tensor3d_from_grid(
                grid,
                tuple(par.tensor),
                par.tensor_order,
                self.timers,
                overlap_all_reduce=par.overlap_tp_comm,
                overlap_reduce_scatter=par.overlap_tensor_reduce_scatter,
                overlap_all_gather=par.overlap_tensor_all_gather,
                prefetch_backward=not deck.zero3,
            )
            z, z_size = self.tp.z.rank, self.tp.z.size
        else:
            self.tp = TensorParallel.from_grid(grid, par.sequence_parallel, self.timers, overlap=par.overlap_tp_comm)
            z, z_size = 0, 1
        self.z_size = z_size
        self.data_rank = data_rank = grid.coords["dp"] * z_size + z
        self.sampler = GlobalBatchSampler(tr.global_batch, tr.micro_batch, data_rank, deck.data_ranks)
        # Dropout masks differ between data ranks, cp ranks (other tokens) and stages, but not between
        # the tp ranks of a stage: their replicated activations (and so parameters) must stay equal.
        # At cp = 1 the seeds are those of the runs before cp.
        stream = (data_rank * grid.size("cp") + grid.coord("cp")) * grid.size("pp") + grid.coords["pp"]
        torch.manual_seed(tr.seed + 1_000_003 * stream)
        self.chunks = deck.chunks
        self.pipeline = Pipeline(grid, self.chunks, deck.stage_message, self.timers, prefetch=par.overlap_pp_comm)
        pipe = self.pipeline
        # Shapes only ("meta"): DataParallel computes each value straight into its buffers.
        meta = torch.device("meta")
        ep = NO_EP
        if par.ep > 1:  # experts split over ep consecutive dp ranks (`ProcessGrid.expert_groups`)
            place, group, _ = grid.expert_groups(par.ep)["ep"]
            ep = ExpertParallel(par.ep, place, group, self.timers)
        # Context parallelism: the cp ranks hold the same samples, each its two chunks of every sequence.
        cp = NO_CP
        if grid.size("cp") > 1:  # its messages charged to the step timers' cp axis
            cp = ContextParallel(Ring.of_group(grid.group["cp"], self.timers), par.cp_kind)
        check_attention_kernel(m, self.device, torch_dtype(tr.precision))  # a backend that cannot run here
        self.model = GPT(m, tr.seed, meta, self.tp, pipe.layers, pipe.first, pipe.last, tr.recompute, ep, cp)
        if deck.run.compiles(self.device.type == "cuda"):
            self.model.fuse(Kernels.compiled(deck.run.compile))  # the blocks' element-wise chains as generated kernels
        compute = torch_dtype(tr.precision)
        tied = (self.model.wte.weight, pipe.tied_group) if pipe.tied_group is not None and m.tie_embeddings else None
        self.dp = DataParallel(
            self.model,
            grid,
            compute_dtype=compute,
            reduce_dtype=torch_dtype(reduce_precision(tr.precision, tr.grad_reduce_dtype)),
            bucket_mb=par.dp_bucket_mb,
            zero=deck.optim.zero,
            overlap_grad_reduce=par.overlap_grad_reduce,
            overlap_param_gather=par.overlap_param_gather,
            tied=tied,
            timers=self.timers,
            units=self.model.param_units(),
            seed=tr.seed,
            device=self.device,
            ep=par.ep,
            fuse_wgrad=tr.fuses_grad_accumulation(self.device.type == "cuda"),
        )
        self.dp.prefetch_hooks(self.model.first_uses())
        reduce_dtype = self.dp.reduce_dtype
        if self.device.type == "cuda" and self.dp.fused_wgrads and not self.dp.mixed_gemm and compute != reduce_dtype:
            # Correct either way, but slower: say so (found in review: it fell back without a word).
            runtime.log(
                f"gridlm: warning: train.fuse_grad_accumulation: this torch's GEMM on {self.device} cannot write a "
                f"{reduce_dtype} accumulator from {compute} inputs (torch.mm out_dtype); the weight gradients are "
                "added separately (slower; train.grad_reduce_dtype: compute avoids the mixed GEMM)"
            )
        top1 = top1_warning(deck.model.moe_experts, deck.model.moe_top_k)
        if top1:
            runtime.log(top1)
        if isinstance(self.tp, Tensor3D):  # ORS: the deferred weight gradients go where autograd's go
            self.tp.grads.sink = self.dp.accumulate
        if self.dp.shard_params:  # ZeRO-3: the model gathers each unit's parameters through DataParallel
            self.model.set_gate(self.dp)
        # Replicated parameters with partial gradients: over tp under SP, over Z under 3D.
        self.sp_group = grid.group["tp"] if par.sequence_parallel and grid.size("tp") > 1 else None
        if isinstance(self.tp, Tensor3D) and self.tp.z.size > 1:
            self.sp_group = self.tp.z.group
        self.optimizer: ShardedOptimizer | NoOptimizer
        if evaluate_only:  # the parameters alone: the fp32 masters and the optimizer's state are not built
            self.dp.offload_master()  # dropped: the load reads the file's masters into the parameters
            self.optimizer = NoOptimizer()
        else:
            offload_file = (
                offload_path(Path(deck.offload_directory), runtime.rank, self.run_dir)
                if deck.optim.offload == "nvme"
                else None
            )
            # The node's ranks share optim.offload_dir (a node-local drive): its free space is checked for them all.
            self.optimizer = ShardedOptimizer(self.dp, deck.optim, grid, offload_file, runtime.local_size)
        self.scaler = (
            LossScaler(tr.loss_scale, tr.loss_scale_window, tr.min_loss_scale) if tr.precision == "fp16" else None
        )
        self.guard = NonFiniteGuard(tr.nonfinite, tr.max_skipped, tr.precision)
        self.step_nonfinite: list[str] = []  # what was NaN/Inf in the last step ("loss", "grad_norm")
        self.batch_start = 0  # consumed_samples before the last step's batch
        self.bad_batches: set[int] = set()  # batches (by consumed_samples) that rollback skips
        self.steps_done = 0
        self.resumed: Optional[dict[str, Any]] = None  # what `resume` loaded
        self.checkpoints: list[CheckpointInfo] = []  # what `save` wrote
        # checkpoint.async: the writer thread and its communicator (collective: every rank, here).
        self.writer = background_writer(runtime) if deck.checkpoint.async_ else None
        built = Built(
            parameters=self.model.num_parameters(),
            parameters_rank0=sum(p.numel() for p in self.model.parameters()),
            layers_per_chunk=[len(c) for c in self.chunks],
            micro_batches=self.sampler.num_micro_batches,
            dp_buckets=len(self.dp.buckets),
            zero_sharded=self.dp.zero,
            eval_source=self.eval_data.source if self.eval_data is not None else None,
        )
        self.report = RunReport(deck, runtime, grid, self.run_dir, built)
        self.unlogged: Optional[Callable[[], None]] = None  # the last step's record, when not due
        self.profiler = StepProfiler(
            deck.run.profile, deck.run.timing_warmup, runtime.rank, self.run_dir / "profile.txt", self.device
        )

    @property
    def nonfinite_events(self) -> int:
        """Non-finite steps so far (fp16 overflows not counted); kept in the checkpoint header."""
        return self.guard.events

    @nonfinite_events.setter
    def nonfinite_events(self, value: int) -> None:
        self.guard.events = int(value)

    @property
    def nonfinite_in_a_row(self) -> int:
        """Non-finite steps (or rollbacks) since the last update; kept in the checkpoint header."""
        return self.guard.in_a_row

    def step(self) -> tuple[torch.Tensor, float, float]:
        """One optimizer step over the global batch: (this dp rank's mean loss on the last stage, 0 on
        the others; lr; global grad norm, inf when fp16 overflowed and the step was skipped). A
        non-finite step updates nothing and sets `step_nonfinite` (or raises NonFiniteError)."""
        lr = learning_rate(self.deck.optim, self.steps_done, self.deck.train.steps)
        self.batch_start = self.sampler.consumed_samples
        self.phase = "forward/backward"  # named by an out-of-memory error (`out_of_memory`)
        loss_sum = self.forward_backward()
        norm = self.update(lr, loss_sum)
        return loss_sum, lr, norm

    def forward_backward(self) -> torch.Tensor:
        """The pipeline over this dp rank's micro-batches; gradients land in the dp buckets."""

        # Context parallelism: each cp rank reads its chunks only, unless Goldfish needs the whole
        # targets for its masks (then every cp rank reads the whole samples and splits them).
        whole = bool(self.deck.train.goldfish_k) or self.model.cp.size == 1
        positions = None if whole else self.model.cp.spans(self.deck.model.seq_len)

        def read() -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [get_batch(self.dataset, indices, positions) for indices in self.sampler.next_step()]

        # A token id out of range on one dp rank (DataError) must end every rank, not strand the
        # others in the first collective; synthetic data is in range by construction.
        batches = read() if isinstance(self.dataset, SyntheticTokens) else agree(self.runtime, read)
        batches = self._goldfish(batches) if self.deck.train.goldfish_k else self._count_all(batches)
        micro_batches = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                         for x, y in batches]  # fmt: skip
        if whole:
            micro_batches = self.model.cp.split_batches(micro_batches)  # context parallelism: this rank's chunks
        self.dp.start_step(len(micro_batches))
        # Mean over micro-batches in the pipeline, mean over dp in the reduction: the global-batch mean.
        with self.dp.saving():
            # 3D: the Z ranks' gradients are summed (reduce-scatter, `sp_group`), so each is 1/Z of the mean.
            scale = (self.scaler.scale if self.scaler else 1.0) / self.z_size
            return self.pipeline.run(self.model, micro_batches, scale)

    def _count_all(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, Targets]]:
        """No Goldfish: every target of the global batch counts (and the loss path is untouched)."""
        every = self.deck.train.global_batch * self.deck.model.seq_len
        self._note_targets(every, every)
        return list(batches)

    def _goldfish(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, Targets]]:
        """train.goldfish_k: each micro-batch's targets with their loss weights (`CountedTargets`).

        The mask is computed from the targets on the host (`goldfish_keep`); the number N of
        counted targets of the whole global batch is summed over dp (and Z, which splits the
        batch under 3D), and a counted target weighs M / N (M micro-batches in the global batch):
        after the pipeline's mean over this rank's micro-batches and the dp (and Z) mean of the
        gradients, the loss and its gradient are the mean over the N counted targets, as on 1 rank.
        Under cp every cp rank holds the same whole samples: the masks come from the whole targets,
        the count is the same on each, and `ContextParallel.split_batches` then splits the weights."""
        tr = self.deck.train
        keeps = [goldfish_keep(y, tr.goldfish_k, tr.goldfish_context, tr.goldfish_rule) for _, y in batches]
        count = torch.tensor(sum(int(keep.sum()) for keep in keeps), dtype=torch.int64, device=self.device)
        self.grid.all_reduce(count, ("dp",))
        if isinstance(self.tp, Tensor3D) and self.tp.z.size > 1:
            count = self.tp.z.all_reduce(count)
        counted = int(count)
        self._note_targets(counted, tr.global_batch * self.deck.model.seq_len)
        # Context parallelism: each cp rank sums its chunks' weighted CE, and the gradients are
        # averaged over dp x cp, so a cp rank's share weighs cp times more (the sum over cp then).
        weight = self.sampler.num_micro_batches * self.deck.data_ranks * self.grid.size("cp") / max(counted, 1)
        return [(x, CountedTargets(y, keep.to(torch.float32) * weight)) for (x, y), keep in zip(batches, keeps)]

    def _note_targets(self, counted: int, every: int) -> None:
        self.step_targets = (counted, every)
        self.job_targets[0] += counted
        self.job_targets[1] += every

    def evaluate(self) -> EvalInfo:
        """The validation loss now (eval.every's held-out data; collective), logged on rank 0."""
        self.phase = "evaluation"
        assert self.eval_data is not None
        self.runtime.watchdog.at(step=self.steps_done, micro=0)
        result = evaluate(self, self.eval_data)
        self.last_eval = result
        return result

    def update(self, lr: float, loss_sum: Optional[torch.Tensor] = None) -> float:
        """Finish the gradient reductions, check `loss_sum` (this rank's; None: unchecked) and the
        norm on the whole grid, clip, step; the global grad norm. Every rank reaches the same
        verdict: fp16 overflow (finite loss) skips the step; any other NaN/Inf is train.nonfinite's."""
        self.phase = "optimizer"
        with self.timers.phase("optimizer"):
            self.dp.finish_grad_reduce(self.sp_group)
            squares = self.optimizer.grad_squares()
            scale = self.scaler.scale if self.scaler else 1.0
            self.steps_done += 1
            norm, loss_bad, norm_bad = step_verdict(squares, loss_sum, self.dp, self.grid)
            overflow = norm_bad and not loss_bad and self.scaler is not None
            flagged = [key for key, bad in (("loss", loss_bad), ("grad_norm", norm_bad)) if bad]
            self.step_nonfinite = [] if overflow else flagged
            if self.step_nonfinite:
                self.guard.nonfinite(self.steps_done, self.step_nonfinite)  # abort (or too many): raises
                return norm / scale  # skip / rollback: the parameters stay as they are
            if self.scaler is not None:
                self.scaler.update(overflow, self.steps_done)  # raises below train.min_loss_scale
                if overflow:
                    return math.inf  # every rank skips: the parameters stay as they are
            norm /= scale
            self.optimizer.step(lr, clip_coefficient(norm, self.deck.optim.grad_clip) / scale)
            self.guard.updated(self.steps_done)
        return norm

    def resume(self) -> Optional[dict[str, Any]]:
        """Load the checkpoint run.resume names, if any (auto: `latest`, when there is one)."""
        path = on_root(self.runtime, lambda: resolve_resume(self.deck))
        if path is None:
            if self.deck.run.resume == "auto":
                self.runtime.log(f"gridlm: no checkpoint in {checkpoint_dir(self.deck)}: starting at step 0")
            return None
        agree(self.runtime, lambda: checkpoint_read(path, h5py_has_mpi()))
        info = load_checkpoint(self, path)
        self.nonfinite_events = info["nonfinite_events"]
        self.guard.resumed(info["nonfinite_in_a_row"], info["step"])  # a streak the checkpoint was written in
        self.resumed = info
        g = info["grid"]
        self.runtime.log(
            f"gridlm: resumed from {path} at step {info['step']} ({info['seconds']:.2f} s) | written on "
            f"{describe_grid(g)} zero={g['zero']} {info['precision']}"
            + (" | resharded to this grid" if info["resharded"] else "")
            + ("" if info["rng_restored"] else " | RNG states not restored (other grid): dropout masks differ")
        )
        if info["changed_function"]:
            said = ", ".join(
                f"model.{key} = {now!r} (trained with {was!r})" for key, was, now in info["changed_function"]
            )
            self.runtime.log(
                f"gridlm: warning: this deck changes the checkpoint's model: {said}; training goes on with the "
                "deck's values (e.g. a larger rope_theta to extend the context); if that is not meant, set the "
                "trained values in the deck's model section"
            )
        if info["changed_schedule"]:
            self.runtime.log(schedule_warning(info["changed_schedule"], self.deck, info["step"]))
        return info

    def initialise_from_hf(self, directory: Path) -> None:
        """Start from a Hugging Face model's weights (run.init_from), on any grid; the optimizer stays fresh."""
        from app.checkpoint.hf_import import HFWeights
        from app.checkpoint.io import initialise

        t0 = time.perf_counter()
        weights = agree(self.runtime, lambda: HFWeights(directory, self.deck.model))
        agree(self.runtime, lambda: initialise(self, weights.tensor))
        self.runtime.log(
            f"gridlm: initial weights from {directory}: {weights.describe()} | {time.perf_counter() - t0:.2f} s | "
            "optimizer fresh"
        )

    def save(self, reason: str, final: bool = False) -> Optional[Saved]:
        """Write a checkpoint of the current step (all ranks); logs it and notes it for the summary.

        A write that fails (CheckpointError: disk full, I/O or permission error; every rank
        raises it together and `latest` still names the previous checkpoint) ends the run
        (exit 2) unless checkpoint.on_error is `continue`: then rank 0 logs one warning line,
        this returns None, and the next interval tries again — except for a `final` save (end of
        training, stop signal), which has no next interval. A NaN/Inf in the state
        (NonFiniteError) always ends it.

        checkpoint.async: after waiting for the write in flight, if any, this copies the state and
        returns while the write goes on (the returned Saved's `seconds` is the copy's); a `final`
        save waits for its write. The write's outcome is handled as above when `finish_save` takes it."""
        self.phase = "checkpoint"
        self.targets_at[self.steps_done] = (self.job_targets[0], self.job_targets[1])  # a rollback's
        try:
            return self._save(reason, final)
        finally:
            self.timers.pop()  # its waits (the parameters' all-gathers) are not the next step's

    def _save(self, reason: str, final: bool) -> Optional[Saved]:
        directory = checkpoint_dir(self.deck)
        if self.writer is None:
            return self._outcome(lambda: save_checkpoint(self, directory), self.steps_done, reason, final)
        self.finish_save()  # one write in flight at most
        copied = self.writer.start(self, directory, reason, final)
        if final:
            return self.finish_save()
        return Saved(
            step_file(directory, self.steps_done), self.steps_done, 0, copied, blocked=copied
        )  # not written yet

    def finish_save(self) -> Optional[Saved]:
        """Wait for the background write in flight, if any, and take its outcome as `save` does (every
        rank at the same step: the next save, a stop, the end, a rollback, or once all are done)."""
        if self.writer is None or not self.writer.in_flight:
            return None
        return self._outcome(self.writer.wait, self.writer.step, self.writer.reason, self.writer.final)

    def _outcome(self, write: Callable[[], Saved], step: int, reason: str, final: bool) -> Optional[Saved]:
        """Run `write` (a save, or the wait for one) and record or report what it ended in (`save`)."""
        try:
            saved = write()
        except NonFiniteError:
            raise
        except CheckpointError as err:
            if self.deck.checkpoint.on_error != "continue" or final:
                raise  # a final save (end of training, stop signal) has no later interval to retry in
            self.runtime.log(
                f"gridlm: warning: checkpoint step {step} ({reason}) failed, training goes on "
                f"(checkpoint.on_error: continue): {err}"
            )
            return None
        blocked = saved.seconds if saved.blocked is None else saved.blocked
        record = CheckpointInfo(step=saved.step, path=str(saved.path), bytes=saved.bytes, seconds=saved.seconds,
                                blocked_seconds=blocked, background=saved.blocked is not None,
                                reason=reason)  # fmt: skip
        self.checkpoints.append(record)
        self.runtime.log(
            f"gridlm: checkpoint step {saved.step} ({reason}) -> {saved.path} | {saved.bytes / 1e6:.1f} MB in "
            f"{saved.seconds:.2f} s ({saved.bytes / max(saved.seconds, 1e-9) / 1e9:.2f} GB/s)"
            + ("" if saved.blocked is None else f", {describe(saved)}")
        )
        return saved

    def close(self) -> None:
        """Wait for a checkpoint write still in flight and release its communicator (every rank, however
        `run` ended; `train` calls it). Its outcome after another error is only logged: its failure,
        or the checkpoint it committed (where the next job resumes)."""
        if self.writer is not None:
            outcome = self.writer.close()
            what = f"gridlm: checkpoint step {self.writer.step} ({self.writer.reason})"
            if isinstance(outcome, BaseException):
                self.runtime.log(f"{what}: {outcome}")
            elif outcome is not None:
                self.runtime.log(
                    f"{what} -> {outcome.path}: written in the background and committed while the run was ending"
                )
        self.optimizer.close()  # an nvme offload's scratch file goes; the checkpoints hold the state

    def run(self) -> dict[str, Any]:
        """Train to deck.train.steps, logging every run.log_every steps; returns the summary."""
        steps = self.deck.train.steps
        self.report.banner()
        try:  # one rank's out of memory, wherever it strikes: name it and end the job (RankFatal)
            return self._run(steps)
        except torch.OutOfMemoryError as err:
            raise out_of_memory(self, err) from None

    def _run(self, steps: int) -> dict[str, Any]:
        # SIGUSR1 / SIGTERM are recorded from the resume to the end: one that arrives while a large
        # checkpoint loads stops the run after its first step (with a checkpoint), one during the
        # last write is moot, and neither kills the rank by the default action mid-way.
        with StopSignals() as signals:
            return self._run_recording(steps, signals)

    def _run_recording(self, steps: int, signals: StopSignals) -> dict[str, Any]:
        deck, rt, report = self.deck, self.runtime, self.report
        self.phase = "resume"
        self.resume()
        if deck.run.init_from and self.resumed is None:
            self.initialise_from_hf(Path(deck.run.init_from))
        elif deck.run.init_from:
            rt.log(f"gridlm: run.init_from {deck.run.init_from} not used: the run continues from its checkpoint")
        start = self.steps_done
        if start >= steps:
            rt.log(
                f"gridlm: the checkpoint is at step {start} >= train.steps = {steps}: nothing to train (raise "
                f"train.steps to continue, or set run.resume: none to start over)"
            )
            summary = self.run_dir / "summary.json"
            if rt.is_root and summary.is_file():  # the finished run's result stands for this attempt too
                with suppress(OSError):  # (postprocess/ dates a point's summary against its attempt)
                    os.utime(summary)
            return {"steps": steps, "start_step": start, "resumed_from": self.resumed}
        report.open(start, resumed=self.resumed is not None)
        if rt.is_root and self.resumed is None:  # a fresh run's profile.txt is its own or none
            with run_dir_write(self.profiler.out):
                self.profiler.out.unlink(missing_ok=True)
        self.model.train()
        interrupted = self._train_to(steps, signals)
        self._profiled(self.profiler.close())  # the run ended inside the profiled steps
        if deck.run.profile and not self.profiler.done:
            rt.log(
                f"gridlm: warning: run.profile = {deck.run.profile}: no step profiled, this job timed "
                f"{self.profiler.seen} step(s) and profiling starts after run.timing_warmup = {deck.run.timing_warmup}; "
                "run more steps or lower run.timing_warmup"
            )
        self.phase = "checkpoint"
        self.finish_save()  # no write left in flight (checkpoint.at_exit: false)
        self.optimizer.publish()  # optim.offload_delay: the run ends on its last update's parameters
        self._log_host_update()
        self.phase = "the end of the run"
        return self._finish(interrupted)

    def _train_to(self, steps: int, signals: StopSignals) -> Optional[str]:
        """The steps up to `steps`, their checkpoints and the stop signals (`signals` records them);
        the signal that stopped them, or None."""
        deck, rt = self.deck, self.runtime
        every, interrupted = deck.checkpoint.every, None
        saved_now = False  # the last step's checkpoint started (none yet)
        while self.steps_done < steps:
            self._train_step(signals)
            if self.step_nonfinite and deck.train.nonfinite == "rollback":
                self._rollback()
                continue
            step = self.steps_done
            if self.writer is not None and self.writer.done_everywhere():
                self.finish_save()  # the background write ended on every rank: log it now
            # A skipped step (train.nonfinite: skip, a replayed bad batch) left the state as it was:
            # finite, so it may be saved (and save refuses anything non-finite anyway).
            # None: it failed under checkpoint.on_error: continue; a stop or the end saves again.
            saved_now = bool(every) and step % every == 0 and self.save(f"every {every} steps") is not None
            received = signals.agreed(rt.comm, rt.watchdog)
            if received:
                interrupted = signal_name(received)
                if self.unlogged is not None:  # the run's last step is in metrics.jsonl and summary.json
                    self.unlogged()
                if not self._committed(saved_now):
                    self.save(interrupted, final=True)
                rt.log(
                    f"gridlm: {interrupted} received: stopped after step {step} of {steps} with a checkpoint; "
                    f"resubmit the job to continue (run.resume: auto)"
                )
                break
        else:
            if deck.checkpoint.at_exit and not self._committed(saved_now):
                self.save("end of training", final=True)
        return interrupted

    def _finish(self, interrupted: Optional[str]) -> dict[str, Any]:
        """The run's summary (written by rank 0), once no gather is in flight."""
        report = self.report
        self.dp.wait_params()  # no all-gather left in flight: the parameters are complete
        summary = report.finish(
            memory_bytes={
                **self.dp.buffer_bytes(),
                "optimizer_state": self.optimizer.state_bytes(),
                **report.peak_memory(self.device),
            },  # fmt: skip
            skipped_steps=self.scaler.skipped if self.scaler else 0,
            nonfinite_steps=self.nonfinite_events,
            rollbacks=self.guard.rollbacks,
            consumed_samples=self.sampler.consumed_samples,
            resumed_from=self.resumed,
            interrupted=interrupted,
            checkpoints=self.checkpoints,
            job_targets=(self.job_targets[0], self.job_targets[1]),
            evaluated=self.last_eval,
        )
        return summary.to_dict()

    def _committed(self, saved_now: bool) -> bool:
        """Whether a checkpoint of this step is committed (saved_now: one was started): a background
        write in flight is waited for first (it failed, under checkpoint.on_error: continue: False)."""
        if self.writer is not None and self.writer.in_flight:
            writing = self.writer.step
            return self.finish_save() is not None and saved_now and writing == self.steps_done
        return saved_now

    def _log_host_update(self) -> None:
        """optim.offload with AdamW: the host's update per step (after the timing warm-up), which the
        optimizer timer shows only where the step waits for it (optim.offload_delay)."""
        times = list(self.optimizer.host_update_s)[self.deck.run.timing_warmup :]
        if times:
            delay = self.deck.optim.offload_delay
            self.runtime.log(
                f"gridlm: offloaded update on the host: {statistics.median(times) * 1e3:.1f} ms a step (median of "
                f"{len(times)}; {'beside the next step' if delay else 'after the backward'}, "
                f"{torch.get_num_threads()} threads)"
            )

    def _profiled(self, written: Optional[Path]) -> None:
        if written is not None:
            self.runtime.log(f"gridlm: profile of {self.profiler.done} step(s) written to {written}")

    def _train_step(self, signals: Optional[StopSignals] = None) -> None:
        """One timed step, reported when it is due; its evaluation, unless a stop signal came (`signals`)."""
        deck, rt = self.deck, self.runtime
        rt.watchdog.at(step=self.steps_done + 1)
        self.unlogged = None
        if self.sampler.consumed_samples in self.bad_batches:
            self._skip_bad_batch()
            if self._evaluation_due(self.steps_done, signals):  # the parameters as they are (found in review:
                done = self.evaluate()  # a skipped last step left the run without its final evaluation)
                rt.log(f"gridlm: step {self.steps_done}: val loss {done['loss']:.4f} | ppl {done['perplexity']:.2f}")
            return
        _sync(self.device, rt.watchdog)
        self.profiler.begin()
        t0 = time.perf_counter()
        loss_sum, lr, norm = self.step()
        _sync(self.device, rt.watchdog)
        self.report.timed(time.perf_counter() - t0, self.timers.pop())
        self._profiled(self.profiler.end())
        step = self.steps_done
        if self.step_nonfinite:
            if deck.train.nonfinite == "rollback":
                return  # `run` rolls back: this step's record would be dropped with the rest
            rt.log(
                f"gridlm: warning: non-finite {describe_nonfinite(self.step_nonfinite)} at step {step}: step skipped, "
                f"parameters unchanged ({self.guard.in_a_row} in a row; train.max_skipped = {deck.train.max_skipped})"
            )
        evaluated = self.evaluate() if self._evaluation_due(step, signals) else None
        fp16 = self.scaler

        def log() -> None:  # collective (global_loss, router_losses): the same steps on every rank
            self.report.log_step(
                step,
                global_loss(loss_sum, self.grid, self.tp),
                lr,
                norm,
                self.sampler.consumed_samples,
                loss_scale=fp16.scale if fp16 else None,
                skipped_steps=fp16.skipped if fp16 else None,
                loss_tokens=self.step_targets[0],
                evaluated=evaluated,
                moe=self.router_losses(),
            )

        if self.report.due(step) or evaluated:
            log()
        else:  # logged after all should a stop signal end the run at this step (`_train_to`)
            self.unlogged = log

    def _evaluation_due(self, step: int, signals: Optional[StopSignals]) -> bool:
        """Whether step `step` evaluates (eval.every, and after the last step): not when a stop signal
        came first (found in review: the scheduler's lead covers a step and a checkpoint, not an
        evaluation, gpt_1t's 4 batches ~260 s, which would push the checkpoint past the limit)."""
        every, rt = self.deck.eval.every, self.runtime
        if not every or (step % every and step != self.deck.train.steps):
            return False
        received = signals.agreed(rt.comm, rt.watchdog) if signals is not None else 0
        if received:
            rt.log(f"gridlm: {signal_name(received)} received: the evaluation of step {step} is skipped")
        return not received

    def router_losses(self) -> Optional[dict[str, float]]:
        """Mixture of experts (collective): this step's load-balancing and z-losses, each the mean over
        the MoE layers and micro-batches of the global batch, and the share of the routed assignments
        dropped over capacity; None for a dense model. A tp group's ranks route alike: counted once."""
        if not self.deck.model.moe_experts:
            return None
        stats = self.model.router_stats
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = torch.stack([zero if t is None else t for t in (stats.aux, stats.z, stats.dropped, stats.assigned)])
        sums = torch.cat([sums, torch.tensor([float(stats.calls)], dtype=torch.float64, device=self.device)])
        self.grid.all_reduce(sums, ("dp", "pp"))
        aux, z, dropped, assigned, calls = sums.tolist()
        return {"moe_aux_loss": aux / max(calls, 1), "moe_z_loss": z / max(calls, 1),
                "moe_dropped": dropped / max(assigned, 1)}  # fmt: skip

    def _skip_bad_batch(self) -> None:
        """After a rollback: consume the batch that gave the NaN, count the step, update nothing."""
        start = self.sampler.consumed_samples
        self.sampler.next_step()
        self.steps_done += 1
        self.step_nonfinite = []
        self.runtime.log(
            f"gridlm: step {self.steps_done}: skipped the batch of samples [{start}, {self.sampler.consumed_samples}) "
            f"(non-finite before the rollback)"
        )

    def last_checkpoint(self) -> Optional[Path]:
        """This job's newest committed checkpoint, the same on every rank: the last `save` that
        committed, else the checkpoint it resumed from; None before either."""
        if self.checkpoints:
            return Path(self.checkpoints[-1]["path"])
        return None if self.resumed is None else Path(self.resumed["path"])

    def _rollback(self) -> None:
        """train.nonfinite: rollback (every rank): reload this job's newest committed checkpoint (its last
        save, else the one it resumed from), remember the batch that gave the NaN so that the replay
        skips it, and cut the metrics back to the checkpoint's step so that no step is recorded twice.
        Never `latest` of another line of the run directory: after a resume from an older file, or
        with run.resume: none beside an earlier run's checkpoints, that is a later or foreign state."""
        rt, step, what = self.runtime, self.steps_done, self.step_nonfinite
        directory = checkpoint_dir(self.deck)
        self.finish_save()  # the write in flight committed (or failed) first
        path = self.last_checkpoint()
        if path is None:
            raise NonFiniteError(self.guard.no_checkpoint(step, what, directory))
        self.bad_batches.add(self.batch_start)
        self.dp.wait_params()
        events = self.nonfinite_events  # this run's count, not the checkpoint's
        agree(self.runtime, lambda: checkpoint_read(path, h5py_has_mpi()))
        info = load_checkpoint(self, path)
        self.timers.pop()  # the load's waits are not the next step's
        self.nonfinite_events = events
        self.step_nonfinite = []
        back_to = info["step"]
        self.report.rollback(back_to)
        self.job_targets = list(self.targets_at.get(back_to, (0, 0)))
        rt.log(
            f"gridlm: warning: non-finite {describe_nonfinite(what)} at step {step}: rolled back to {path} (step "
            f"{back_to}); its batch, samples [{self.batch_start}, {self.batch_start + self.deck.train.global_batch}), "
            f"will be skipped ({self.guard.in_a_row} rollback(s) in a row; train.max_skipped = "
            f"{self.deck.train.max_skipped})"
        )


def schedule_warning(changed: list[tuple[str, Any, Any]], deck: Deck, step: int) -> str:
    """The resume's line for a deck that changes the checkpoint's optimizer or schedule keys
    (`changed`: key, the checkpoint's value, the deck's): which, and the learning rate of the next
    step on each schedule, so that a jump in the curve is expected, not found later."""
    said = ", ".join(f"{key} = {now!r} (trained with {was!r})" for key, was, now in changed)
    saved = {key: was for key, was, _ in changed}
    kept = {k.split(".")[1]: v for k, v in saved.items() if k.startswith("optim.")}
    try:
        before = learning_rate(
            dataclasses.replace(deck.optim, **kept), step, saved.get("train.steps", deck.train.steps)
        )
        rates = f"the learning rate of step {step + 1} is {learning_rate(deck.optim, step, deck.train.steps):.2e}"
        rates += f" ({before:.2e} on the checkpoint's)"
    except (TypeError, ValueError):  # a stored value of another type (an edited file): no rate to compare
        rates = "the learning rate follows the deck's schedule"
    return (
        f"gridlm: warning: this deck changes the checkpoint's optimizer or schedule: {said}; training goes on with "
        f"the deck's values, the schedule over its train.steps: {rates}; if that is not meant, set the trained "
        "values in the deck"
    )


def out_of_memory(trainer: Trainer, err: BaseException) -> RankFatal:
    """One line for a device out of memory on this rank: where (rank, phase, step), how much the
    device holds against the plan, and the deck keys that need less."""
    where = f"{trainer.phase} at step {trainer.steps_done + 1}"
    return oom_fatal(trainer.deck, trainer.runtime, trainer.grid, where, err)


def oom_fatal(deck: Deck, runtime: Runtime, grid: ProcessGrid, where: str, err: BaseException) -> RankFatal:
    """`out_of_memory`'s line, also before a Trainer exists (building the model and optimizer)."""
    device = runtime.device
    memory = gpu_memory(device)
    held = ""
    if memory is not None:
        held = f"; {torch.cuda.memory_allocated(device) / GIB:.2f} GiB allocated of {memory[1] / GIB:.2f} GiB"
    plan = rank_device_bytes(deck, grid.coords["pp"], device.type == "cuda") / GIB
    tr = deck.train
    return RankFatal(
        f"rank {runtime.rank}: {device} out of memory in {where}{held}; the plan estimated {plan:.2f} GiB per "
        f"device (train.micro_batch {tr.micro_batch}, train.recompute {tr.recompute}, optim.zero {deck.optim.zero}): "
        f"lower train.micro_batch, set train.recompute: full, raise optim.zero (1-3) or optim.offload, or use more "
        f"tp/pp ranks ({str(err).splitlines()[0][:160] if str(err) else type(err).__name__})"
    )


def train(deck: Deck, runtime: Runtime, grid: ProcessGrid) -> dict[str, Any]:
    """Build a `Trainer` and run it; returns the summary. run.dir stays locked until it returns."""
    try:
        trainer = Trainer(deck, runtime, grid)
    except torch.OutOfMemoryError as err:  # the model, its optimizer state and buffers do not fit
        raise oom_fatal(deck, runtime, grid, "start-up (building the model and optimizer)", err) from None
    try:
        return trainer.run()
    finally:
        trainer.close()
        if trainer.run_lock is not None:
            trainer.run_lock.release()
