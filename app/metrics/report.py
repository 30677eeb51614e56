"""Run reports: the per-step log line, `metrics.jsonl` and `summary.json` (rank 0 writes).

Output contract (later tools read these):
  metrics.jsonl — one object per logged step: step, loss, loss_tokens, lr, step_time_s,
                  tokens_per_s, tflops_per_rank, mfu (null when the device peak is unknown),
                  grad_norm, consumed_samples; val_loss and val_perplexity at an evaluation.
  summary.json  — the keys of `app/metrics/summary.Summary`, in its order (docs/RUNNING.md, "Outputs").
Both are strict JSON (RFC 8259 has no NaN or Infinity): a non-finite number is written as
null and its key is listed in the object's `nonfinite` (`strict_json`).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import platform
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional


def strict_json(value: Any, path: str = "") -> tuple[Any, list[str]]:
    """(`value` with every non-finite float replaced by None, the dotted paths replaced), for
    nested dicts and lists; strict JSON parsers reject NaN and Infinity."""
    if isinstance(value, dict):
        out, flagged = {}, []
        for key, item in value.items():
            out[key], sub = strict_json(item, f"{path}.{key}" if path else str(key))
            flagged += sub
        return out, flagged
    if isinstance(value, (list, tuple)):
        items = [strict_json(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return [item for item, _ in items], [p for _, sub in items for p in sub]
    is_float = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
    if is_float and not math.isfinite(value):
        return None, [path]
    return value, []


def dumps_strict(record: dict[str, Any], **kwargs: Any) -> str:
    """JSON text of `record` with non-finite numbers as null, listed under `nonfinite`."""
    clean, flagged = strict_json(record)
    if flagged:
        clean["nonfinite"] = flagged
    return json.dumps(clean, allow_nan=False, **kwargs)


class MetricsWriter:
    """Appends one JSON line per logged step; only the rank that owns it writes."""

    def __init__(self, run_dir: Path, enabled: bool, resumed_step: Optional[int] = None) -> None:
        """A fresh log, or on resume from step k the old log's records up to step k (a run that
        died after its last checkpoint logged steps that are now trained again)."""
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        if enabled:
            self.truncate(resumed_step)

    def truncate(self, step: Optional[int]) -> None:
        """Keep the records up to `step` (None: none); also after a rollback to a checkpoint."""
        if not self.enabled:
            return
        kept = []
        if step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    break  # a torn last line of a killed run
        # Atomically: a job killed here (a time limit) keeps the earlier jobs' records.
        with run_dir_write(self.path):
            replace_text(self.path, "".join(kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with run_dir_write(self.path), self.path.open("a") as f:
                f.write(dumps_strict(record) + "\n")


# metrics.jsonl key -> TensorBoard tag; FLOP/s tags say which count (see flops.FLOPS_CONVENTION).
TB_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "step_time_s": "perf/step_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops_per_rank": "perf/model_tflops_per_gpu",
    "hw_tflops_per_rank": "perf/hardware_tflops_per_gpu",
    "mfu": "perf/mfu",
    "val_loss": "eval/loss",
    "val_perplexity": "eval/perplexity",
}


def require_tensorboard() -> None:
    """run.tensorboard needs the tensorboard package (launch/setup.sh installs it)."""
    import importlib.util

    from app.errors import DeckError

    if importlib.util.find_spec("tensorboard") is None:
        raise DeckError(
            "run.tensorboard", True, "needs the tensorboard package: run launch/setup.sh (or pip install "
            "tensorboard), or set run.tensorboard: false"
        )  # fmt: skip


class TensorBoardWriter:
    """Scalars of every logged step under <run dir>/tb (rank 0 only). On resume from step k,
    TensorBoard drops the events after k (`purge_step`), and a fresh run all earlier ones, like
    metrics.jsonl."""

    def __init__(self, run_dir: Path, enabled: bool, resumed_step: Optional[int] = None) -> None:
        self.writer = None
        self.log_dir = run_dir / "tb"
        if enabled:
            self._open(resumed_step)

    def _open(self, step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A fresh run purges from step 0: an earlier run's events in this run.dir would be drawn as
        # its curve too (found in review), as metrics.jsonl starts afresh.
        purge = 0 if step is None else step + 1
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)

    def truncate(self, step: int) -> None:
        """Drop the events after `step` (a rollback to that step's checkpoint)."""
        if self.writer is not None:
            self.writer.close()
            self._open(step)

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, tag in TB_SCALARS.items():
            value = record.get(key)
            if value is not None and math.isfinite(value):  # a NaN would wreck the plot's scale
                self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def format_line(r: dict[str, Any], steps: int, targets: Optional[int] = None) -> str:
    """The log line of a record (non-finite numbers print as nan / inf). `targets`: the targets of a
    step's loss when Goldfish drops some (the line then says how many counted)."""
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    loss = "n/a" if r["loss"] is None else f"{r['loss']:.4f}"
    if targets is not None and r.get("loss_tokens") is not None:
        loss += f" on {r['loss_tokens']:,}/{targets:,} targets"
    gnorm = "n/a" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
    val = ""
    if "val_loss" in r:
        v, ppl = r["val_loss"], r["val_perplexity"]
        val = f" | val loss {'n/a' if v is None else f'{v:.4f}'} ppl {'n/a' if ppl is None else f'{ppl:.2f}'}"
    if "moe_aux_loss" in r:  # mixture of experts: the routers' losses, and the share of assignments dropped
        val += f" | aux {r['moe_aux_loss']:.4f} z {r['moe_z_loss']:.3f} dropped {100 * r['moe_dropped']:.1f}%"
    return (
        f"step {r['step']:>{len(str(steps))}}/{steps} | loss {loss} | lr {r['lr']:.2e} | "
        f"{r['step_time_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} tok/s | "
        f"{r['tflops_per_rank']:.3f} TFLOP/s/rank | mfu {mfu} | gnorm {gnorm}{val}"
    )


def mean_step_time(step_times: list[float], warmup: int) -> tuple[float, float, int]:
    """(mean, stdev, steps left out) of the step times, leaving out the first `warmup`
    steps when enough steps remain (otherwise none)."""
    skipped = warmup if len(step_times) > warmup else 0
    kept = step_times[skipped:]
    return statistics.fmean(kept), (statistics.stdev(kept) if len(kept) > 1 else 0.0), skipped


def versions() -> dict[str, Optional[str]]:
    """Software versions of the stack, for the report."""
    import h5py
    import mpi4py
    import numpy
    import torch
    from mpi4py import MPI

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().strip("\x00 \n").splitlines()[0],
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "hdf5_parallel": bool(h5py.get_config().mpi),
    }


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write summary.json atomically (temp file + rename): a reader never sees half of it.
    Strict JSON: non-finite numbers become null, listed under `nonfinite`."""
    path = run_dir / "summary.json"
    with run_dir_write(path):
        replace_text(path, dumps_strict(summary, indent=2) + "\n")
    return path


@contextmanager
def run_dir_write(path: Path) -> Iterator[None]:
    """A write of rank 0 into run.dir (metrics.jsonl, summary.json), whose OSError ends the job at once
    (RankFatal, exit 2: its peers may be in a collective) naming the file and the fix."""
    from app.errors import RankFatal

    try:
        yield
    except OSError as err:
        raise RankFatal(
            f"cannot write {path}: {err.strerror or err}; free space in (or fix the permissions of) run.dir = "
            f"{str(path.parent)!r}, then resubmit (run.resume: auto continues from the last checkpoint)"
        ) from None


def replace_text(path: Path, text: str) -> None:
    """`path` holds `text`, written to PATH.tmp and renamed over it: a reader, or a job killed in
    between, never finds half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
