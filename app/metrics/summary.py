"""summary.json's schema: every key a run writes, in file order, with its type.

The one definition of the file: app/train.py writes through `Summary.to_dict` and
postprocess/ reads through `Summary.from_dict`. Standard library only, so that postprocess
and other tools read summaries without importing torch.

A reader may be handed an older or hand-written summary.json: `from_dict` refuses one that
lacks a key of REQUIRED_KEYS (the ones a scaling table cannot do without) and gives None for
any other key it lacks, which is why those fields are typed Optional although a run always
writes them. Keys it does not know are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, TypedDict, Union


class _GridAxesAboveOne(TypedDict, total=False):
    """Axes named only where they split something (above 1); `NotRequired` needs Python 3.11."""

    cp: int  # context parallelism: every sequence split over cp ranks
    ep: int  # expert parallelism: the experts split over ep of the dp ranks


class GridInfo(_GridAxesAboveOne):
    tp: int
    pp: int
    dp: int
    order: str  # innermost axis first, e.g. "tp-dp-pp"
    within_node: dict[str, bool]  # axis -> every group of that axis is inside one node
    tensor: Optional[list[int]]  # 3D tensor parallelism's [x, y, z] (x y z = tp); None: 1D
    tensor_order: Optional[str]  # 3D: the sub-axes' order in the tp group, innermost first; None: 1D


class PipelineInfo(TypedDict):
    schedule: str  # "1f1b" or "interleaved-1f1b"
    virtual_stages: int
    layers_per_chunk: list[int]
    micro_batches: int  # per dp rank and step


class TimersInfo(TypedDict):
    """Rank 0's mean seconds per step after the warm-up (run.timers)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: dict[str, float]  # axis -> communication time
    exposed_comm_s: dict[str, float]  # axis -> the part no computation hid


class StudyInfo(TypedDict):
    name: str
    kind: Optional[str]  # "weak" or "strong"
    point: Optional[int]


class CheckpointInfo(TypedDict):
    step: int
    path: str
    bytes: int
    seconds: float  # the whole save, from copying the state to the commit
    blocked_seconds: float  # of which the step loop waited: all of it, unless written in the background
    background: bool  # written by the writer thread (checkpoint.async)
    reason: str  # "every N steps", "end of training", a signal's name


class GoldfishInfo(TypedDict):
    """train.goldfish_k: the targets this job's steps counted in the loss, of all their targets."""

    k: int
    context: int
    counted_targets: int
    targets: int
    counted_fraction: float


class EvalInfo(TypedDict):
    """One evaluation (eval.every, python -m app.eval): the mean validation loss over `tokens`
    targets, as app/eval computes it, the run report logs it and summary.json holds the last."""

    step: int
    loss: float
    perplexity: float
    samples: int
    tokens: int
    seconds: float
    source: str


# The keys postprocess/scaling.py cannot make a row without.
REQUIRED_KEYS = (
    "world_size", "nodes", "grid", "tokens_per_step", "step_time_s", "step_time_std_s", "tokens_per_s",
    "flops_per_step", "tflops_per_rank", "aggregate_tflops",
)  # fmt: skip


@dataclass(frozen=True)
class Summary:
    """One run's summary.json. Every field is a key, in the order the file has them; the
    constructor takes every one (a writer cannot forget a key), `nonfinite` aside."""

    # What ran, and where
    deck: Optional[dict[str, Any]]  # the resolved deck, section -> key -> value
    world_size: int
    nodes: int
    ranks_per_node: Optional[int]
    ranks_per_node_list: Optional[list[int]]
    grid: GridInfo
    parameters: Optional[int]  # of the whole (1-rank) model
    parameters_rank0: Optional[int]
    pipeline: Optional[PipelineInfo]
    sequence_parallel: Optional[bool]
    precision: Optional[str]
    optimizer: Optional[str]
    zero: Optional[int]
    recompute: Optional[str]
    overlap: Optional[dict[str, bool]]  # parallel.overlap_* -> on
    dp_buckets: Optional[int]
    memory_bytes_rank0: Optional[dict[str, int]]  # parameters, gradients, optimizer_state
    memory_bytes_max: Optional[dict[str, int]]  # the same keys, each the most of any rank
    # How training went
    skipped_steps: Optional[int]  # fp16 overflows
    nonfinite_steps: Optional[int]
    rollbacks: Optional[int]
    steps: Optional[int]
    global_batch: Optional[int]
    tokens_per_step: int
    # Performance (means after the warm-up steps)
    step_time_s: float
    step_time_std_s: float
    timing_warmup_steps: Optional[int]
    timers: Optional[TimersInfo]  # None unless run.timers
    exposed_comm_fraction: Optional[float]
    tokens_per_s: float
    flops_per_step: float  # model FLOPs of one step, the whole grid (app/metrics/flops.py)
    hardware_flops_per_step: Optional[float]  # with recomputation
    flops_kind: Optional[str]  # the FLOP convention, in words
    tflops_per_rank: float
    hw_tflops_per_rank: Optional[float]
    aggregate_tflops: float
    aggregate_pflops: Optional[float]
    study: Optional[StudyInfo]
    device: Optional[str]
    peak_tflops_per_rank: Optional[float]  # None: the device's peak is unknown
    mfu: Optional[float]
    hfu: Optional[float]
    initial_loss: Optional[float]
    final_loss: Optional[float]
    goldfish: Optional[GoldfishInfo]  # None: train.goldfish_k = 0
    eval: Optional[EvalInfo]  # None: no evaluation ran
    consumed_samples: Optional[int]
    torch_threads: Optional[int]
    versions: Optional[dict[str, Union[str, bool, None]]]
    # This job's part of the run
    start_step: Optional[int]  # > 0 when it resumed from a checkpoint
    resumed_from: Optional[dict[str, Any]]  # what the loaded checkpoint's header said
    interrupted: Optional[str]  # the signal that stopped it early
    checkpoints: Optional[list[CheckpointInfo]]
    # Strict JSON's list of the keys written as null because they were NaN/Inf (report.dumps_strict
    # adds it); only present in a file when there was one.
    nonfinite: Optional[list[str]] = None

    @classmethod
    def file_keys(cls) -> list[str]:
        """The keys every summary.json has, in file order (`nonfinite` only when needed)."""
        return [f.name for f in fields(cls) if f.name != "nonfinite"]

    @staticmethod
    def missing_keys(data: object) -> list[str]:
        """The REQUIRED_KEYS that `data` (a parsed summary.json) lacks; all of them if it is no object."""
        return [key for key in REQUIRED_KEYS if not isinstance(data, dict) or key not in data]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        """A parsed summary.json; ValueError naming the REQUIRED_KEYS it lacks."""
        missing = cls.missing_keys(data)
        if missing:
            raise ValueError(f"lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        values = dict.fromkeys(cls.file_keys())
        values.update((key, value) for key, value in data.items() if key in known)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The file's object, keys in order; `nonfinite` only when set."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["nonfinite"] is None:
            del out["nonfinite"]
        return out
