"""The input deck: typed, frozen sections with defaults, validation and `--set` overrides.

A deck is YAML with the sections `model`, `parallel`, `train`, `optim`, `data`, `eval`, `run`,
`checkpoint`.
Every key has a type, a default and a range (numbers: finite, with an upper bound the code
can honour), a set of choices or a text rule (printable, no control characters), declared
once in the dataclasses below; `load_deck` checks unknown keys, types and values with the
schema engine (app/schema.py, which also checks machine and study files) and raises
`DeckError` naming the key, the bad value, what is accepted and where the value came from
(the deck file or --set). The deck file and `--set` values are untrusted YAML: read with
limits (size, depth, values, no anchors, aliases, tags or duplicate keys), so that any input
ends in a value or a DeckError, quickly.
`resolve_for_world` then checks what depends on the world size (tp x pp x dp, batches), and
`check_paths` the file system, at the start of a real run.
"""

from __future__ import annotations

import dataclasses
import keyword
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import yaml

from app import archs
from app.archs.spec import Arch
from app.deck_yaml import MAX_DECK_BYTES, comment_in, deck_error, parse_yaml, read_deck_file
from app.errors import DeckError
from app.names import AXES, CP_KINDS, GRID_AXES, PRECISIONS, RECOMPUTE
from app.schema import REQUIRED, Key, Problem, check, check_value, type_name

T = TypeVar("T")

# Upper bounds of the keys: what the code can honour, far above any real run.
MAX_RANKS = 2**20  # tp x cp x pp x dp; a dry run places every rank of the plan
MAX_LAYERS = 4096  # also bounds pp x virtual_stages (every chunk needs a layer)
MAX_BATCH = 2**24  # samples; steps x global_batch stays far below 2^63 (int64 checkpoint attributes)
DEFAULT_ARCH = "gpt2"  # model.arch of a deck that names none: log lines do not name it
DEFAULT_RUN_DIR = "runs/default"  # run.dir of a deck built without a file (RunConfig.directory)
MAX_STEPS = 10**9
MAX_LOSS_SCALE = 2.0**24  # fp16 overflows at 65504: a larger first scale only skips steps while it halves


def _key(default: Any, help: str, **rules: Any) -> Any:
    """A deck key: default, one-line help (the reference in docs/DECK.md) and the rules of its
    `schema.Key` (min, max, choices, words, path); its type is the field's annotation."""
    return field(default=default, metadata={"help": help, **rules})


@dataclass(frozen=True)
class ModelConfig:
    arch: str = _key(
        DEFAULT_ARCH, "the architecture (app/archs/): gpt2 (learned positions, LayerNorm, GELU MLP, biases) or llama "
        "(rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases)",
    )  # fmt: skip
    vocab_size: int = _key(512, "vocabulary size (byte-level data needs >= 257)", min=2, max=2**24)
    seq_len: int = _key(128, "tokens per sample (gpt2: also the number of learned positions)", min=1, max=2**20)
    layers: int = _key(4, "transformer blocks", min=1, max=MAX_LAYERS)
    hidden: int = _key(256, "model width h", min=1, max=2**17)
    heads: int = _key(4, "attention heads; must divide hidden", min=1, max=2**16)
    ffn_hidden: Optional[int] = _key(
        None, "MLP width; null means 4 x hidden (gpt2), or 8/3 x hidden rounded up to a multiple of 64 (llama)",
        min=1, max=2**20,
    )  # fmt: skip
    kv_heads: Optional[int] = _key(
        None, "llama: key/value heads (grouped-query attention), dividing heads; null means heads", min=1, max=2**16
    )
    rope_theta: float = _key(10000.0, "llama: base of the rotary position embedding's frequencies", min=1.0, max=1e9)
    dropout: float = _key(0.0, "dropout probability (0 keeps runs grid-independent)", min=0.0, max=0.99)
    attention_kernel: str = _key(
        "auto",
        "scaled_dot_product_attention backend: auto (torch picks: flash / memory-efficient on GPUs); flash, cudnn "
        "(NVIDIA GPUs) or efficient (GPUs) to choose one (benchmarks/gpu_bench.py compares them); or math (scores "
        "materialised, as in Megatron-LM 2021: to reproduce such runs). A backend with no kernel for the run's "
        "device, dtype and head size is a deck error before the first step",
        choices=("auto", "flash", "cudnn", "efficient", "math"),
    )
    layernorm_eps: float = _key(1e-5, "LayerNorm (llama: RMSNorm) epsilon", min=0.0, max=1.0)
    init_std: float = _key(
        0.02, "std of the normal init (GPT-2); residual projections scaled by 1/sqrt(2 layers)", min=0.0, max=10.0
    )
    tie_embeddings: Optional[bool] = _key(
        None, "share the token embedding with the output head; null means the arch's default: true for gpt2, "
        "false for llama",
    )  # fmt: skip

    moe_experts: int = _key(
        0, "mixture of experts: 0 keeps dense MLPs; E >= 2 makes the MLP of every model.moe_every-th block E "
        "experts behind a learned top-k router (app/model/moe.py)", min=0, max=4096,
    )  # fmt: skip
    moe_top_k: int = _key(2, "mixture of experts: experts per token (<= model.moe_experts)", min=1, max=4096)
    moe_ffn_hidden: Optional[int] = _key(
        None, "mixture of experts: an expert's MLP width; null means the dense MLP's (model.ffn_hidden)", min=1,
        max=2**20,
    )  # fmt: skip
    moe_every: int = _key(
        1, "mixture of experts: blocks 0, N, 2N, ... have experts, the others a dense MLP", min=1, max=MAX_LAYERS
    )
    moe_capacity_factor: Optional[float] = _key(
        None, "mixture of experts: null routes every token (dropless); F caps an expert at ceil(F x tokens x top_k / "
        "experts) per training micro-batch, dropping later tokens (counted in the log); evaluation, generation and "
        "the exported model route every token", min=0.01, max=1e3,
    )  # fmt: skip
    moe_aux_loss_coef: float = _key(
        0.01, "mixture of experts: weight of the load-balancing loss (Switch: E sum f_e P_e) per MoE layer", min=0.0,
        max=1e3,
    )  # fmt: skip
    moe_z_loss_coef: float = _key(
        0.0, "mixture of experts: weight of the router z-loss (mean logsumexp^2, ST-MoE) per MoE layer", min=0.0,
        max=1e3,
    )  # fmt: skip
    moe_shared_experts: int = _key(
        0, "mixture of experts: S > 0 adds a dense MLP of width S x the expert width beside the routed experts, run "
        "on every token (DeepSeekMoE's shared experts)", min=0, max=64,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.tie_embeddings is None and self.arch in archs.names():  # the arch's default: code reads a bool
            object.__setattr__(self, "tie_embeddings", archs.get(self.arch).tie_embeddings)

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return self.spec.ffn(self.hidden)

    @property
    def spec(self) -> Arch:
        """The architecture's registry entry (`app/archs/`)."""
        return archs.get(self.arch)

    @property
    def arch_words(self) -> str:
        """The architecture in a log line ("llama, 4 key/value heads", "8 experts of 256, top-2, 2.3M
        active"); "" for the default dense one."""
        words = [] if self.arch == DEFAULT_ARCH else [self.spec.words(self.kv)]
        if self.moe_experts:
            every = f" every {self.moe_every} blocks" if self.moe_every > 1 else ""
            active = self.spec.active_params(self)
            words.append(f"{self.moe_experts} experts of {self.expert_ffn}{every}, top-{self.moe_top_k}, "
                         f"{active / 1e6:.1f}M active")  # fmt: skip
        return ", ".join(words)

    @property
    def expert_ffn(self) -> int:
        """An expert's MLP width: model.moe_ffn_hidden, or the dense MLP's."""
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn

    def attention_on(self, gpu: bool) -> str:
        """The attention kernel ranks on a GPU (`gpu`) or a CPU run: `attention_kernel`, except auto on
        CPU ranks with dropout, where torch's CPU flash kernel has none and SDPA runs its math
        reference, which keeps the scores (the plan's memory and step time ask)."""
        return "math" if self.attention_kernel == "auto" and not gpu and self.dropout > 0 else self.attention_kernel

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` (global index) has experts."""
        return self.moe_experts > 0 and layer % self.moe_every == 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv(self) -> int:
        """Key/value heads: kv_heads under llama's grouped-query attention, else heads."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV weight: (heads + 2 kv) x head_dim (3 hidden without GQA)."""
        return (self.heads + 2 * self.kv) * self.head_dim

    @property
    def fc_rows(self) -> int:
        """Rows of the MLP's first weight: the width, twice under a gated MLP (SwiGLU's gate and up)."""
        return self.spec.fc_rows(self.ffn)


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = _key(1, "tensor-parallel degree", min=1, max=4096)
    pp: int = _key(1, "pipeline-parallel degree (stages)", min=1, max=MAX_LAYERS)
    dp: Union[int, str] = _key(
        "auto", "data-parallel degree; auto = world size / (tp x cp x pp)", min=1, max=MAX_RANKS, words=("auto",)
    )
    order: str = _key(
        "tp-dp-pp",
        "grid axes from innermost (neighbouring ranks) to outermost; cp may be placed too (else it "
        "comes right after tp: tp-cp-dp-pp)",
    )
    cp: int = _key(
        1, "context-parallel degree: ranks that hold the same samples and split every sequence into 2 cp chunks "
        "(rank i holds chunks i and 2 cp - 1 - i, the same causal work on each); model.seq_len must be a multiple "
        "of 2 cp; world = tp x cp x pp x dp", min=1, max=4096,
    )  # fmt: skip
    cp_kind: str = _key(
        "ring", "context parallelism's attention: ring (key/value blocks passed around the cp ranks, overlapped "
        "with the block attention) or all_to_all (Ulysses: the heads split over cp around attention; cp must "
        "divide the heads per tp rank)", choices=CP_KINDS,
    )  # fmt: skip
    ep: int = _key(
        1, "mixture of experts: expert-parallel degree, ranks of the dp axis that split the experts (each holds "
        "model.moe_experts / ep) and exchange tokens by all-to-all; must divide dp and model.moe_experts",
        min=1, max=MAX_RANKS,
    )  # fmt: skip
    tensor: Optional[list[int]] = _key(
        None, "3D tensor parallelism (AxoNN): [x, y, z] splits each weight (out / y, in / x) and shards it 1/z, "
        "the batch split over dp x z; x y z must equal tp; null = 1D (Megatron) tensor parallelism",
        min=1, max=4096,
    )  # fmt: skip
    tensor_order: str = _key(
        "xyz", "3D tensor: the sub-axes' order inside the tp group, innermost (neighbouring ranks) first, "
        "a permutation of x, y, z; xyz keeps x's all-reduces between the nearest ranks",
    )  # fmt: skip
    sequence_parallel: bool = _key(
        False, "shard LayerNorm/dropout regions along the sequence over tp (all-gather/reduce-scatter)"
    )
    virtual_stages: int = _key(
        1, "model chunks per pipeline stage; > 1 selects the interleaved 1F1B schedule", min=1, max=MAX_LAYERS
    )
    stage_layers: Optional[list[int]] = _key(
        None,
        "layers per model chunk, pp x virtual_stages entries in pipeline order; null = balanced",
        min=1,
        max=MAX_LAYERS,
    )
    gpus_per_node: Optional[int] = _key(
        None,
        "node shape for planning; a real run uses the placement MPI reports and warns if it differs",
        min=1,
        max=1024,
    )
    backend: str = _key(
        "auto", "torch.distributed backend; auto = nccl on GPUs, gloo on CPUs", choices=("auto", "gloo", "nccl")
    )
    dp_bucket_mb: float = _key(
        25.0, "MB of gradients per data-parallel bucket (one all-reduce or reduce-scatter each)", min=0.001, max=1e5
    )
    overlap_grad_reduce: bool = _key(
        True, "launch each dp bucket's reduction from backward as soon as its gradients are ready"
    )
    overlap_param_gather: bool = _key(
        True, "ZeRO-1: all-gather updated parameters bucket by bucket during the next forward, not after the step"
    )
    overlap_tp_comm: bool = _key(
        True, "overlap the tp backward all-reduce (reduce-scatter under SP) with the weight-gradient GEMM"
    )
    overlap_pp_comm: bool = _key(True, "post the next pipeline receive before the current micro-batch's compute")
    overlap_tensor_reduce_scatter: bool = _key(
        True, "3D tensor: reduce-scatter each weight gradient over z behind the backward of the layers before it"
    )
    overlap_tensor_all_gather: bool = _key(
        True, "3D tensor: all-gather the next Linear's weight over z during this Linear's GEMM (forward and backward)"
    )

    @property
    def tensor3d(self) -> Optional[tuple[int, int, int]]:
        """(x, y, z) under 3D tensor parallelism, None under 1D."""
        return None if self.tensor is None else (self.tensor[0], self.tensor[1], self.tensor[2])

    @property
    def batch_split(self) -> int:
        """The tensor ranks that hold different samples: z under 3D tensor parallelism (the batch
        is split over dp x z), 1 under 1D."""
        return 1 if self.tensor is None else self.tensor[2]


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _key(100, "optimizer steps", min=1, max=MAX_STEPS)
    global_batch: int = _key(32, "samples per optimizer step = micro_batch x accumulation x dp", min=1, max=MAX_BATCH)
    micro_batch: int = _key(4, "samples per forward/backward pass on one rank", min=1, max=MAX_BATCH)
    seed: int = _key(1234, "seed of parameter init and data; results do not depend on the grid", min=0, max=2**63 - 1)
    precision: str = _key(
        "fp32",
        "compute dtype; bf16/fp16 keep fp32 master weights and optimizer state",
        choices=PRECISIONS,
    )
    grad_reduce_dtype: str = _key(
        "fp32", "dtype gradients are accumulated and reduced in: fp32, or compute (= train.precision)",
        choices=("fp32", "compute"),
    )  # fmt: skip
    fuse_grad_accumulation: Optional[bool] = _key(
        None, "the weight-gradient GEMM of each block Linear and of an untied head adds straight into the "
        "gradient accumulator (Megatron's gradient accumulation fusion: no weight gradient of its own, no pass "
        "adding it; on GPUs bf16/fp16 GEMMs write the fp32 accumulator; not under 3D tensor parallelism, whose "
        "Linears hand their gradients over after their own reduce-scatters); null = on GPU ranks, off on CPU ranks "
        "(where plain autograd's "
        "results stay bitwise)",
    )  # fmt: skip
    loss_scale: float = _key(65536.0, "fp16: initial dynamic loss scale", min=1.0, max=MAX_LOSS_SCALE)
    loss_scale_window: int = _key(
        1000, "fp16: double the loss scale after this many steps without overflow", min=1, max=MAX_STEPS
    )
    recompute: str = _key(
        "none", "activation recomputation: none, full (every block), selective (attention core)",
        choices=RECOMPUTE,
    )  # fmt: skip
    nonfinite: str = _key(
        "abort", "a NaN/Inf loss or gradient norm: abort (exit 3, no checkpoint of the bad state), skip the step "
        "(abort after max_skipped in a row), or rollback to the last good checkpoint and skip the batch",
        choices=("abort", "skip", "rollback"),
    )  # fmt: skip
    max_skipped: int = _key(
        10,
        "nonfinite skip/rollback: abort after this many consecutive non-finite steps (or rollbacks without "
        "training past the bad step)",
        min=1,
        max=MAX_STEPS,
    )
    min_loss_scale: float = _key(
        1.0,
        "fp16: abort when the dynamic loss scale would fall below this (at most train.loss_scale)",
        min=0.0,
        max=MAX_LOSS_SCALE,
    )
    goldfish_k: int = _key(
        0, "Goldfish loss (Hans et al. 2024): drop about 1 in k targets from the loss, chosen by a hash of their "
        "context (train.goldfish_rule); 0 = off; the paper's configurations use 4", min=0, max=2**20,
    )  # fmt: skip
    goldfish_context: int = _key(
        13, "Goldfish: h, the width of the hashed context (the paper's 13); the first h - 1 targets of a sample "
        "always count (h with the splitmix rule)", min=1, max=2**20,
    )  # fmt: skip
    goldfish_rule: str = _key(
        "hash-table", "Goldfish: hash-table, the authors' rule (the product of the h targets ending at this one, "
        "mod 1,000,003, looked up in their seeded table); splitmix, gridlm's earlier rule (a SplitMix64 chain "
        "over the h targets before it)", choices=("hash-table", "splitmix"),
    )  # fmt: skip

    def fuses_grad_accumulation(self, gpu: bool) -> bool:
        """Whether the weight-gradient GEMMs add into the accumulators on ranks whose device is a GPU
        (`gpu`) or a CPU: train.fuse_grad_accumulation, or where it is null, on GPUs only."""
        return gpu if self.fuse_grad_accumulation is None else self.fuse_grad_accumulation


@dataclass(frozen=True)
class OptimConfig:
    name: str = _key(
        "adamw", "adamw, or lamb (layer-wise trust ratio on the full parameter)", choices=("adamw", "lamb")
    )
    zero: int = _key(
        0,
        "1: shard fp32 master weights and optimizer moments over dp (ZeRO-1); 2: the gradients as well, "
        "reduce-scattered per micro-batch and never kept whole (ZeRO-2); 3: the parameters as well, each block's "
        "all-gathered before its forward and its backward and freed after (ZeRO-3)",
        min=0,
        max=3,
    )
    offload: str = _key(
        "none",
        "where the fp32 master shards and Adam moments live: none (the device), host (host memory; the update "
        "runs on the CPU) or nvme (a file per rank under optim.offload_dir, streamed through optim.offload_buffer_mb)",
        choices=("none", "host", "nvme"),
    )
    offload_dir: Optional[str] = _key(
        None,
        "offload nvme: node-local directory of the per-rank state files (named by run.dir, so jobs may share "
        "it; its free space is checked for the node's ranks at the start); null means <run.dir>/offload",
        path=True,
    )
    offload_buffer_mb: float = _key(
        64.0,
        "offload nvme: host memory (MB) of the read-ahead/update/write-behind buffers (at most what the "
        "largest bucket's state needs)",
        min=0.01,
        max=1e6,
    )
    offload_delay: int = _key(
        0,
        "offload with adamw: 1 runs each step's host update while the next step's forward and backward run, on "
        "parameters one update behind (ZeRO-Offload's delayed parameter update: stale gradients, so other numerics "
        "than 0's; for GPUs: on CPU ranks its thread takes the cores forward and backward need); 0 updates before "
        "the next step, exactly",
        min=0,
        max=1,
    )
    lr: float = _key(3e-4, "peak learning rate", min=0.0, max=10.0)
    min_lr: float = _key(3e-5, "learning rate at the end of the decay", min=0.0, max=10.0)
    warmup_steps: int = _key(0, "linear warm-up steps", min=0, max=MAX_STEPS)
    schedule: str = _key("cosine", "decay after warm-up", choices=("cosine", "linear", "constant"))
    weight_decay: float = _key(0.1, "decoupled weight decay (not applied to biases and LayerNorm)", min=0.0, max=10.0)
    beta1: float = _key(0.9, "Adam beta1", min=0.0, max=0.999999)
    beta2: float = _key(0.95, "Adam beta2", min=0.0, max=0.999999)
    # At least float32's smallest normal: the kernels compute in fp32, where a smaller eps is 0 and an
    # element with no gradient yet (an unseen token's embedding row) updates by 0/0.
    eps: float = _key(
        1e-8, "Adam epsilon (the update runs in fp32: at least its smallest normal)", min=1.1754944e-38, max=1.0
    )
    grad_clip: float = _key(1.0, "clip the global gradient norm to this; 0 disables", min=0.0, max=1e6)


@dataclass(frozen=True)
class DataConfig:
    kind: str = _key(
        "synthetic", "synthetic (learnable, deterministic) or memmap (token files)", choices=("synthetic", "memmap")
    )
    path: Optional[str] = _key(None, "memmap: PREFIX of PREFIX.bin/.json/.idx.npy from app.data.prepare", path=True)
    paths: Optional[list] = _key(
        None, "memmap blend, instead of data.path: a list of {path: PREFIX, weight: W}; samples come from each "
        "token file in proportion to W (the weights need not sum to 1), the same on any grid",
    )  # fmt: skip
    noise: float = _key(0.05, "synthetic: probability that a token is random", min=0.0, max=1.0)
    split: float = _key(
        0.0, "memmap: fraction of the documents held out for validation (the last ones in the file; training "
        "never reads them); 0 = none", min=0.0, max=0.5,
    )  # fmt: skip

    @property
    def blend(self) -> list[tuple[float, str]]:
        """(weight, PREFIX) of each token file: data.paths, or data.path with weight 1; [] for synthetic."""
        if self.paths is not None:
            return [(float(item["weight"]), str(item["path"])) for item in self.paths]
        return [(1.0, self.path)] if self.path else []


@dataclass(frozen=True)
class EvalConfig:
    every: int = _key(0, "evaluate the validation loss every N steps and after the last; 0 = off", min=0, max=MAX_STEPS)
    batches: int = _key(
        4, "global batches (train.global_batch samples each) per evaluation, the same samples each time",
        min=1, max=2**20,
    )  # fmt: skip
    path: Optional[str] = _key(
        None, "PREFIX of a held-out token file (as data.path); null: the data.split part of data.path, or for "
        "synthetic data a stream of its own", path=True,
    )  # fmt: skip


@dataclass(frozen=True)
class RunConfig:
    dir: Optional[str] = _key(None, "run directory; null means runs/<deck file stem>", path=True)
    log_every: int = _key(10, "log a metrics line every N steps (and the last step)", min=1, max=MAX_STEPS)
    device: str = _key("auto", "auto = a GPU per rank when present, else CPU", choices=("auto", "cpu", "cuda"))
    peak_tflops: Optional[float] = _key(
        None, "peak TFLOP/s per rank for MFU when the device is not in the peak table (e.g. a CPU)", min=0.0,
        exclusive_min=True, max=1e6,
    )  # fmt: skip
    timing_warmup: int = _key(2, "first steps left out of the mean step time", min=0, max=MAX_STEPS)
    timers: bool = _key(True, "time forward, backward, optimizer and (exposed) communication per axis, every step")
    profile: int = _key(
        0, "profile this many steps after run.timing_warmup with torch.profiler: rank 0 writes <run.dir>/profile.txt "
        "(device time and kernel counts per step by kind, the kernels by time); 0: off. Profiled steps run slower",
        min=0, max=MAX_STEPS,
    )  # fmt: skip
    compile: Optional[bool] = _key(
        None,
        "fuse the blocks' element-wise chains with torch.compile (llama's RMSNorm, rotary embedding, SwiGLU; "
        "with model.dropout 0 and 1D tp, each output bias + residual add + next norm); null: on GPU ranks (the "
        "Llama 0.84B deck 1.35x faster on an H200), off on CPU ranks; false where a node cannot build inductor's "
        "kernels",
    )
    threads: Optional[int] = _key(
        None,
        "torch threads per rank; null means the physical cores the rank may run on (a core's hardware threads "
        "count once), at most the node's CPUs / ranks per node; OMP_NUM_THREADS does not change it",
        min=1,
        max=1024,
    )
    malloc_mmap_threshold_kb: int = _key(
        1024, "glibc malloc: host allocations of at least this many KiB are mmapped, so the memory of a freed "
        "tensor goes back to the system at once; 0 keeps glibc's dynamic threshold, under which freed "
        "temporaries up to 32 MiB can stay resident", min=0, max=32768,
    )  # fmt: skip
    machine: Optional[str] = _key(
        None, "machine the deck is planned for (inputs/machines/NAME.yaml or a path): the default of --dry-run's "
        "and launch/submit.py's --machine",
    )  # fmt: skip
    tensorboard: bool = _key(
        False, "write TensorBoard scalars (loss, lr, step time, TFLOP/s, MFU, grad norm) to <run.dir>/tb"
    )
    study: Optional[str] = _key(None, "name of the scaling study this run is a point of (set by launch/study.py)")
    study_kind: Optional[str] = _key(
        None, "weak or strong: the kind of that study (set by launch/study.py)", choices=("weak", "strong")
    )
    study_point: Optional[int] = _key(
        None,
        "the study point this run is: nodes, or ranks for --run-local (set by launch/study.py)",
        min=1,
        max=MAX_RANKS,
    )
    comm_timeout_s: float = _key(
        1800.0, "watchdog: a rank blocked this long in one communication or checkpoint I/O call names the "
        "operation and the stuck ranks, then aborts the job (exit 4); the default covers a first NCCL call "
        "at 32,768 ranks", min=1.0, max=7 * 24 * 3600.0,
    )  # fmt: skip
    resume: str = _key(
        "auto", "auto = continue from the latest checkpoint if there is one; none = start fresh; or a checkpoint "
        "file (.h5) or directory", path=True,
    )  # fmt: skip
    init_from: Optional[str] = _key(
        None, "a local Hugging Face GPT-2 or Llama directory (config.json, safetensors) whose weights start the run "
        "(fine-tuning; the optimizer starts fresh); the model section must describe that model. A run that resumes "
        "from its own checkpoint ignores it (see docs/CHECKPOINT.md, Fine-tuning from Hugging Face weights)",
        path=True,
    )  # fmt: skip

    def compiles(self, gpu: bool) -> bool:
        """Whether the blocks' chains run compiled on ranks whose device is a GPU (`gpu`) or a CPU:
        run.compile, or where it is null, on GPUs only (the training and the performance model ask)."""
        return gpu if self.compile is None else self.compile

    @property
    def directory(self) -> str:
        """run.dir, or DEFAULT_RUN_DIR for a deck built without a file (load_deck fills run.dir from
        the deck file's stem): the one home of that fallback."""
        return self.dir or DEFAULT_RUN_DIR


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Optional[str] = _key(None, "where checkpoints go; null means <run.dir>/checkpoints", path=True)
    every: int = _key(
        0, "write a checkpoint every N steps; 0 = only at exit and on SIGTERM/SIGUSR1", min=0, max=MAX_STEPS
    )
    at_exit: bool = _key(True, "write a checkpoint when training ends (unless the last step just wrote one)")
    keep: int = _key(
        2, "keep the newest N checkpoints (never the one `latest` names); 0 keeps all", min=0, max=MAX_STEPS
    )
    io: str = _key(
        "posix", "how the ranks move the tensors' bytes: posix (rank 0 makes the HDF5 file and its metadata, "
        "each rank pwrites / preads its own slabs at the offsets HDF5 allocated; measured fastest, "
        "docs/CHECKPOINT.md), or through parallel HDF5's MPI-IO: independent (each rank its own slabs) or "
        "collective (two-phase I/O through aggregators)",
        choices=("posix", "independent", "collective"),
    )  # fmt: skip
    on_error: str = _key(
        "stop", "a checkpoint write that fails (disk full, I/O or permission error): stop (exit 2; the previous "
        "checkpoint stays latest) or continue training and retry at the next interval",
        choices=("stop", "continue"),
    )  # fmt: skip
    alignment_threshold: int = _key(
        1048576,
        "HDF5: datasets of at least this many bytes start at a multiple of alignment_interval",
        min=1,
        max=2**30,
    )
    alignment_interval: int = _key(
        1048576, "HDF5: alignment in bytes (match the file system's stripe or block size)", min=1, max=2**30
    )
    # The deck key `async` (a Python keyword: the field carries PEP 8's trailing underscore, `key_name`).
    async_: bool = _key(
        False, "write checkpoints in the background: the step loop waits only while this rank's state is copied "
        "to host memory, one write in flight at a time (needs MPI_THREAD_MULTIPLE, else synchronous with a "
        "warning; docs/CHECKPOINT.md)",
    )  # fmt: skip


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "eval": EvalConfig,
    "run": RunConfig,
    "checkpoint": CheckpointConfig,
}


def partition_layers(layers: int, chunks: int, counts: list[int] | None = None) -> list[range]:
    """Split layers 0..layers-1 into `chunks` consecutive ranges.

    `counts` (the deck's parallel.stage_layers) gives the sizes; otherwise balanced by
    layer count, the extra layers going to the earliest chunks (the last one also runs
    the head and the loss).
    """
    if counts is None:
        base, extra = divmod(layers, chunks)
        counts = [base + (1 if c < extra else 0) for c in range(chunks)]
    if len(counts) != chunks or sum(counts) != layers or min(counts) < 1:
        raise ValueError(f"cannot split {layers} layers into chunks of {counts}")
    bounds = [sum(counts[:c]) for c in range(chunks + 1)]
    return [range(bounds[c], bounds[c + 1]) for c in range(chunks)]


@dataclass(frozen=True)
class Deck:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """section -> deck key -> value (what a deck file would say)."""
        out = {}
        for name in SECTIONS:
            section = getattr(self, name)
            values = dataclasses.asdict(section)
            out[name] = {key_name(f): values[f.name] for f in dataclasses.fields(section)}
        return out

    def on_device(self, gpu: bool) -> Deck:
        """This deck with what its null or auto keys become on ranks whose device is a GPU (`gpu`)
        or a CPU: run.device, run.compile, train.fuse_grad_accumulation and model.attention_kernel
        (math on CPU ranks with dropout: `ModelConfig.attention_on`). The memory estimate, the FLOPs and the
        performance model read these (`app.plan.perf.as_run_on`)."""
        return replaced(
            self,
            model=replaced(self.model, attention_kernel=self.model.attention_on(gpu)),
            train=replaced(self.train, fuse_grad_accumulation=self.train.fuses_grad_accumulation(gpu)),
            run=replaced(self.run, compile=self.run.compiles(gpu), device="cuda" if gpu else "cpu"),
        )

    @property
    def dp(self) -> int:
        """The data-parallel degree; only valid after `resolve_for_world`."""
        if not isinstance(self.parallel.dp, int):
            raise RuntimeError("deck not resolved for a world size yet")
        return self.parallel.dp

    @property
    def replicas(self) -> int:
        """The ranks that hold the same parameters: dp, times cp under context parallelism (its ranks
        split the sequences, not the model). Gradients are averaged and ZeRO shards over them."""
        return self.dp * self.parallel.cp

    @property
    def zero3(self) -> bool:
        """ZeRO-3 in effect: `optim.zero` >= 3 and dp x cp > 1 (with one replica nothing is sharded);
        resolved decks."""
        return self.optim.zero >= 3 and self.replicas > 1

    @property
    def checkpoint_directory(self) -> str:
        """checkpoint.dir, or <run.dir>/checkpoints: the one home of that default."""
        return self.checkpoint.dir or os.path.join(self.run.directory, "checkpoints")

    @property
    def offload_directory(self) -> str:
        """Where optim.offload = nvme keeps its per-rank files: optim.offload_dir, or <run.dir>/offload."""
        return self.optim.offload_dir or os.path.join(self.run.directory, "offload")

    @property
    def data_ranks(self) -> int:
        """The ranks of a stage that hold different samples: dp, times z under 3D tensor parallelism."""
        return self.dp * self.parallel.batch_split

    @property
    def stage_message(self) -> tuple[int, int, int]:
        """The shape of one pipeline message (a micro-batch's activation between stages, or its
        gradient) on a rank: (micro_batch, sequence, hidden), the sequence split over tp under sequence
        parallelism, the hidden over X under 3D tensor parallelism. The trainer's and the performance
        model's."""
        m, par = self.model, self.parallel
        seq = m.seq_len // par.cp  # context parallelism: this rank's two chunks of every sequence
        seq = seq // par.tp if par.sequence_parallel else seq
        return self.train.micro_batch, seq, m.hidden // (par.tensor[0] if par.tensor is not None else 1)

    @property
    def num_micro_batches(self) -> int:
        """Gradient-accumulation steps per optimizer step on each data rank (`data_ranks`)."""
        return self.train.global_batch // (self.train.micro_batch * self.data_ranks)

    @property
    def chunks(self) -> list[range]:
        """The global layer indices of each of the pp x virtual_stages pipeline chunks (chunk c runs
        on stage c mod pp): parallel.stage_layers, or balanced (`partition_layers`). One home for the
        trainer, the memory estimate and the performance model."""
        par = self.parallel
        return partition_layers(self.model.layers, par.pp * par.virtual_stages, par.stage_layers)


def replaced(obj: T, **changes: Any) -> T:
    """`dataclasses.replace` for the deck and its sections, without running `__init__` again: a
    shallow copy with `changes` set. The search derives tens of thousands of decks from one, eight
    copies each: 8.4 -> 7.4 s of CPU for the 529.6B row's search on a 2-core machine. Sections with
    a `__post_init__` (model: the arch's default tie) go through `dataclasses.replace`."""
    cls = type(obj)
    if hasattr(cls, "__post_init__"):
        return dataclasses.replace(obj, **changes)
    unknown = changes.keys() - cls.__dataclass_fields__.keys()
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)  # frozen: only through __dict__
    return new


def key_name(f: dataclasses.Field) -> str:
    """A section field's deck key: its name, less the trailing underscore of a field named after a
    Python keyword (`checkpoint.async` is the field `async_`)."""
    name = f.name.removesuffix("_")
    return name if name != f.name and keyword.iskeyword(name) else f.name


def _section_keys(cls: type) -> dict[str, Key]:
    """The schema engine's declaration of a section's keys: its dataclass fields' types, defaults
    and `_key` rules. Every deck string is text (printable, of a sane length)."""
    hints = typing.get_type_hints(cls)
    return {key_name(f): Key(hints[f.name], f.default, text=True, **f.metadata) for f in dataclasses.fields(cls)}


def _section(cls: type, values: dict[str, Any]) -> Any:
    """A section from its checked keys (deck key -> value)."""
    fields = {key_name(f): f.name for f in dataclasses.fields(cls)}
    return cls(**{fields[key]: value for key, value in values.items()})


KEYS: dict[str, dict[str, Key]] = {name: _section_keys(cls) for name, cls in SECTIONS.items()}
# The top level: each section is a mapping, or null (all defaults).
SECTION_KEYS: dict[str, Key] = {
    name: Key(Optional[dict], None, f"the {name} keys: {', '.join(KEYS[name])}") for name in SECTIONS
}


def deck_reference() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every deck key, in order: the reference in docs/DECK.md."""
    return [
        (f"{section}.{name}", type_name(key.type), key.default, key.help)
        for section, keys in KEYS.items()
        for name, key in keys.items()
    ]


def _checked(raw: Any, keys: dict[str, Key], file: str, given: set[str], prefix: str = "", noun: str = "key") -> Any:
    """`schema.check` of one level of the deck; a DeckError naming where the bad value came
    from: the deck file, or --set for the keys in `given`."""
    try:
        return check(raw, keys, file, prefix=prefix, noun=noun)
    except Problem as bad:
        origin = "--set" if bad.key.split("[")[0] in given else bad.file
        raise deck_error(bad.key, bad.value, bad.expected, origin) from None


def apply_override(raw: dict[str, Any], assignment: str) -> str:
    """Apply one `--set section.key=value` to the raw deck mapping (value parsed as YAML); the
    key it set, `section.key`."""
    if "=" not in assignment:
        raise deck_error("--set", assignment, "expected section.key=value, e.g. train.steps=50")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    # An empty name would print as "deck error:  = ...": say which part is missing instead.
    if not dotted.strip():
        raise deck_error("--set", assignment, "the key is empty; write --set section.key=value, e.g. train.steps=50")
    if len(parts) == 2 and not all(parts):
        empty = "section" if not parts[0] else "key"
        raise deck_error(
            "--set", assignment, f"the {empty} is empty; write --set section.key=value, e.g. train.steps=50"
        )
    if len(parts) != 2 or parts[0] not in SECTIONS:
        raise deck_error(dotted, text, "expected section.key with section one of: " + ", ".join(SECTIONS))
    if len(text) > MAX_DECK_BYTES:
        raise deck_error(dotted, text, f"a value of {len(text):,} characters; at most {MAX_DECK_BYTES:,}")
    try:
        value = parse_yaml(text, (dotted, text), dotted) if text.strip() else None
    except (yaml.YAMLError, ValueError):
        value = text  # not YAML: the plain string (checked like any string)
    else:
        comment = comment_in(text)
        if comment is not None:
            raise deck_error(
                dotted, text, f"YAML reads {comment!r} as a comment, which would leave {value!r}: leave the comment out, or "
                f"quote the value if the # belongs to it (--set '{dotted}=\"{text.strip()}\"')"
            )  # fmt: skip
        key = KEYS.get(parts[0], {}).get(parts[1])
        if text.strip() == "~" and key is not None and key.path:  # YAML's null, the default: not a home directory
            raise deck_error(dotted, text, "YAML reads ~ as null (the default): write null, or give the expanded path")
    section = raw.setdefault(parts[0], {})
    if section is None:
        section = raw[parts[0]] = {}
    if not isinstance(section, dict):
        raise deck_error(parts[0], section, "expected a mapping of keys to values")
    section[parts[1]] = value
    return f"{parts[0]}.{parts[1]}"


def load_deck(path: Union[str, Path, None], overrides: tuple[str, ...] = ()) -> Deck:
    """Read, override and validate a deck (everything that does not depend on the world size).

    `path` None means all defaults. The file is untrusted input: anything wrong with it, its
    YAML or its values is a DeckError naming the file or key, never another exception.
    """
    raw: Any = {} if path is None else read_deck_file(path)
    file = "--set" if path is None else f"deck file {path}"
    return build_deck(raw, str(path), file, Path(path).stem if path is not None else "default", overrides)


def build_deck(raw: Any, origin: str, file: str, stem: str, overrides: tuple[str, ...] = ()) -> Deck:
    """`load_deck` of a deck already parsed (`raw`, from `origin`: a file, or the deck a checkpoint
    carries), named `file` in messages; run.dir defaults to runs/<stem>."""
    if not isinstance(raw, dict):
        raise DeckError("DECK", origin, "expected a YAML mapping with sections " + ", ".join(SECTIONS))
    given = {apply_override(raw, assignment) for assignment in overrides}
    sections = _checked(raw, SECTION_KEYS, file, given, noun="section")
    deck = Deck(**{
        name: _section(cls, _checked(sections.get(name) or {}, KEYS[name], file, given, prefix=f"{name}."))
        for name, cls in SECTIONS.items()
    })  # fmt: skip
    if deck.run.dir is None:
        try:
            run_dir = check_value(KEYS["run"]["dir"], f"runs/{stem}", "run.dir", file)
        except Problem as bad:  # a deck file named with control characters
            raise deck_error(bad.key, bad.value, bad.expected, bad.file) from None
        deck = dataclasses.replace(deck, run=dataclasses.replace(deck.run, dir=run_dir))
    _validate(deck)
    return deck


def validate(deck: Deck) -> None:
    """Check a deck built in code (e.g. by the grid search) as `load_deck` checks a file."""
    _validate(deck)


def _validate(deck: Deck) -> None:
    m, par, tr, opt = deck.model, deck.parallel, deck.train, deck.optim
    if m.arch not in archs.names():  # read from the registry here, not frozen into the key's choices
        raise DeckError("model.arch", m.arch, "accepted: " + ", ".join(archs.names()))
    if m.hidden % m.heads:
        raise DeckError("model.heads", m.heads, f"must divide model.hidden = {m.hidden}")
    if (m.hidden // m.heads) % 2:
        raise DeckError("model.heads", m.heads, f"hidden / heads = {m.hidden // m.heads} must be even")
    axes = par.order.split("-")
    if sorted(axes) not in (sorted(AXES), sorted(GRID_AXES)):
        raise DeckError(
            "parallel.order", par.order, "a permutation of tp, pp, dp (and cp) joined by '-', innermost first, "
            "e.g. tp-dp-pp or tp-cp-dp-pp"
        )  # fmt: skip
    if par.cp > 1:
        _validate_cp(deck)
    _validate_model_split(m, par)
    _validate_arch(m, par)
    if sorted(par.tensor_order) != ["x", "y", "z"]:
        raise DeckError(
            "parallel.tensor_order", par.tensor_order, "a permutation of x, y, z, innermost first, e.g. xyz"
        )
    if par.tensor is None and par.tensor_order != "xyz":
        raise DeckError(
            "parallel.tensor_order", par.tensor_order, "only used with parallel.tensor (3D tensor parallelism)"
        )
    ranks = par.tp * par.cp * par.pp * (par.dp if isinstance(par.dp, int) else 1)
    if ranks > MAX_RANKS:
        raise DeckError(
            "parallel.tp", par.tp, f"tp x cp x pp{' x dp' if isinstance(par.dp, int) else ''} = {ranks:,} ranks; "
            f"gridlm runs on at most {MAX_RANKS:,}"
        )  # fmt: skip
    if tr.global_batch % tr.micro_batch:
        raise DeckError(
            "train.global_batch", tr.global_batch, f"must be a multiple of train.micro_batch = {tr.micro_batch}"
        )
    if opt.min_lr > opt.lr:
        raise DeckError("optim.min_lr", opt.min_lr, f"must be <= optim.lr = {opt.lr}")
    if tr.precision == "fp16" and tr.min_loss_scale > tr.loss_scale:  # the first overflow would read as divergence
        raise DeckError("train.min_loss_scale", tr.min_loss_scale, f"must be <= train.loss_scale = {tr.loss_scale:g}")
    if opt.offload == "nvme" and opt.name == "lamb":
        raise DeckError(
            "optim.offload", opt.offload, "nvme streams the state once per step, and LAMB's trust ratio needs two "
            "passes over it: use optim.offload = host with lamb, or adamw"
        )  # fmt: skip
    if opt.offload == "nvme" and deck.checkpoint.async_:
        raise DeckError(
            "optim.offload", opt.offload, "an asynchronous checkpoint snapshots the optimizer state into host memory, "
            "which nvme offload exists to avoid: set checkpoint.async = false"
        )  # fmt: skip
    if m.moe_experts:
        _validate_moe(deck)
    elif deck.parallel.ep > 1:
        raise DeckError(
            "parallel.ep", deck.parallel.ep, "expert parallelism splits a mixture of experts: set model.moe_experts, "
            "or parallel.ep to 1"
        )  # fmt: skip
    if opt.offload_delay and (opt.offload == "none" or opt.name != "adamw"):
        raise DeckError(
            "optim.offload_delay", opt.offload_delay, "the delayed update is the offloaded AdamW's: set "
            "optim.offload to host or nvme and optim.name to adamw, or optim.offload_delay to 0"
        )  # fmt: skip
    if opt.offload_dir and opt.offload != "nvme":
        raise DeckError("optim.offload_dir", opt.offload_dir, "only used with optim.offload = nvme")
    if tr.fuse_grad_accumulation and par.tensor is not None:  # asked for, and nothing would be fused
        raise DeckError(
            "train.fuse_grad_accumulation", True, "3D tensor parallelism's Linears hand their gradients over after "
            "their own reduce-scatters: nothing is fused under parallel.tensor; leave the key out (null) or false"
        )  # fmt: skip
    _validate_data(deck.data)
    _validate_goldfish_eval(deck)


def _validate_cp(deck: Deck) -> None:
    """Context parallelism (parallel.cp > 1): the sequence splits into 2 cp equal chunks (and each
    rank's two into tp shards under sequence parallelism); what it does not combine with yet."""
    m, par = deck.model, deck.parallel
    if m.seq_len % (2 * par.cp):
        raise DeckError(
            "model.seq_len", m.seq_len, f"parallel.cp = {par.cp} splits every sequence into 2 cp = {2 * par.cp} "
            f"chunks: use a multiple of {2 * par.cp}"
        )  # fmt: skip
    if par.sequence_parallel and (m.seq_len // par.cp) % par.tp:
        raise DeckError(
            "model.seq_len", m.seq_len, f"sequence parallelism splits each cp rank's {m.seq_len // par.cp} positions "
            f"over tp = {par.tp}: use a multiple of {par.cp * par.tp}"
        )  # fmt: skip
    if par.cp_kind == "all_to_all" and (m.heads // par.tp) % par.cp:
        raise DeckError(
            "parallel.cp_kind", par.cp_kind, f"the all-to-all splits each tp rank's {m.heads // par.tp} heads over "
            f"cp = {par.cp}: use cp_kind: ring, or a cp that divides them"
        )  # fmt: skip
    # Not yet: each would need its own split (the 3D grid's Z; the capacity's token order over the
    # cp ranks' chunks; the experts' exchange beside cp) and its equivalence cases.
    for key, value, bad in (
        ("parallel.tensor", par.tensor, par.tensor is not None),
        ("model.moe_capacity_factor", m.moe_capacity_factor, bool(m.moe_experts) and m.moe_capacity_factor is not None),
        ("parallel.ep", par.ep, par.ep > 1),
    ):
        if bad:
            raise DeckError(
                key, value, f"not yet with context parallelism (parallel.cp = {par.cp}): set parallel.cp: 1"
            )


def _validate_moe(deck: Deck) -> None:
    """Mixture of experts: a router over at least two experts, on the grids it runs on so far."""
    m, par = deck.model, deck.parallel
    if m.moe_experts < 2:
        raise DeckError("model.moe_experts", m.moe_experts, "a router needs at least 2 experts (0: dense MLPs)")
    if m.moe_top_k > m.moe_experts:
        raise DeckError("model.moe_top_k", m.moe_top_k, f"must be <= model.moe_experts = {m.moe_experts}")
    if par.sequence_parallel and m.moe_capacity_factor is not None and par.tp > 1:
        raise DeckError(
            "model.moe_capacity_factor", m.moe_capacity_factor, "not yet with sequence parallelism (each tp rank "
            "routes its sequence shard; the capacity is the micro-batch's): set it to null (dropless) or "
            "parallel.sequence_parallel to false"
        )  # fmt: skip
    if par.tensor is not None:
        raise DeckError("parallel.tensor", list(par.tensor), "3D tensor parallelism has no mixture of experts yet")
    if m.moe_experts % par.ep:
        raise DeckError(
            "parallel.ep", par.ep, f"must divide model.moe_experts = {m.moe_experts} (each rank holds the same "
            "number of experts)"
        )  # fmt: skip


BLEND_ITEM = "a mapping {path: PREFIX, weight: W} with W > 0"
BLEND_KEYS = {
    "path": Key(str, text=True, path=True, help="PREFIX written by `python -m app.data.prepare`"),
    "weight": Key(float, min=0.0, exclusive_min=True, max=1e9, help="share of the samples (relative)"),
}


def _validate_data(data: DataConfig) -> None:
    """data.path xor data.paths for memmap, neither for synthetic; each blend entry a path and a weight."""
    if data.path and data.paths is not None:
        raise DeckError(
            "data.paths", data.paths, "data.path is set as well: give one token file as data.path, or a blend as "
            "data.paths, not both"
        )  # fmt: skip
    if data.kind == "memmap" and not data.path and data.paths is None:
        raise DeckError(
            "data.path", data.path, "data.kind = memmap needs the PREFIX written by `python -m app.data.prepare` "
            "(or a blend of several as data.paths)"
        )  # fmt: skip
    if data.kind == "synthetic":
        for key in ("path", "paths"):
            if getattr(data, key) is not None:
                raise DeckError(f"data.{key}", getattr(data, key), "only used with data.kind = memmap")
    if data.paths is None:
        return
    if not data.paths:
        raise DeckError("data.paths", data.paths, f"an empty blend; give at least one entry, each {BLEND_ITEM}")
    seen: set[str] = set()
    for i, item in enumerate(data.paths):
        name = f"data.paths[{i}]"
        try:
            checked = check(item, BLEND_KEYS, "", prefix=name + ".")
        except Problem as bad:
            missing = bad.value is REQUIRED or not bad.key  # name the entry, not a key it lacks
            raise DeckError(
                name if missing else bad.key,
                item if missing else bad.value,
                f"{bad.expected}; each entry is {BLEND_ITEM}",
            ) from None
        if checked["path"] in seen:
            raise DeckError(
                f"{name}.path", checked["path"], "is listed twice; list each token file once, with the sum of its weights"
            )  # fmt: skip
        seen.add(checked["path"])


def _validate_goldfish_eval(deck: Deck) -> None:
    """Goldfish's k and h against the sample; where evaluation reads its held-out data."""
    tr, data, ev = deck.train, deck.data, deck.eval
    if tr.goldfish_k == 1:
        raise DeckError("train.goldfish_k", 1, "k = 1 would drop every target after the first h: use 0 (off) or >= 2")
    if tr.goldfish_k and tr.goldfish_context >= deck.model.seq_len:
        raise DeckError(
            "train.goldfish_context", tr.goldfish_context, f"must be below model.seq_len = {deck.model.seq_len}: a "
            f"sample's first goldfish_context - 1 targets (goldfish_context with the splitmix rule) always count, so "
            f"little or nothing would be dropped"
        )  # fmt: skip
    if data.split and data.kind != "memmap":
        raise DeckError("data.split", data.split, "holds out documents of a token file: only with data.kind = memmap")
    if data.split and data.paths is not None:
        raise DeckError(
            "data.split", data.split, "holds out the last documents of data.path, not of a blend (data.paths): "
            "set data.split: 0 and give the held-out tokens as eval.path",
        )  # fmt: skip
    if data.split and ev.path:
        raise DeckError(
            "data.split", data.split, f"evaluation reads eval.path = {ev.path!r}: set data.split: 0 or eval.path: null"
        )
    if ev.every and data.kind == "memmap" and not ev.path and not data.split:
        raise DeckError(
            "eval.every", ev.every, "evaluation needs held-out data: set eval.path to a token file PREFIX, or "
            "data.split (e.g. 0.05) to hold out the last documents of data.path"
        )  # fmt: skip


def _validate_arch(m: ModelConfig, par: ParallelConfig) -> None:
    """What the architecture allows: grouped-query attention (kv_heads dividing heads, tp splitting
    whole kv groups), 3D tensor parallelism."""
    if m.kv_heads is not None and not m.spec.grouped_query and m.kv_heads != m.heads:
        grouped = [a for a in archs.names() if archs.get(a).grouped_query]
        raise DeckError(
            "model.kv_heads", m.kv_heads, f"{m.arch} has no grouped-query attention: set model.arch: "
            f"{' or '.join(grouped)}, or model.kv_heads: null",
        )  # fmt: skip
    if m.heads % m.kv:
        raise DeckError("model.kv_heads", m.kv_heads, f"must divide model.heads = {m.heads}")
    if not m.spec.tensor3d and par.tensor is not None:
        raise DeckError(
            "model.arch", m.arch, f"{m.arch} blocks run on 1D tensor parallelism (parallel.tp) only, not yet on "
            "parallel.tensor: set parallel.tensor: null",
        )  # fmt: skip
    if m.kv != m.heads and par.tensor is None and m.kv % par.tp:
        raise DeckError(
            "model.kv_heads", m.kv, f"parallel.tp = {par.tp} splits the key/value heads (each rank whole groups "
            f"of query heads sharing them), so it must divide kv_heads: choose a tp that divides {m.kv}",
        )  # fmt: skip


def _validate_tensor3d(m: ModelConfig, par: ParallelConfig) -> None:
    """3D tensor parallelism: x y z = tp; every block of every weight splits evenly."""
    t = par.tensor
    assert t is not None
    if len(t) != 3:
        raise DeckError("parallel.tensor", t, "needs three entries [x, y, z], e.g. [2, 2, 1]")
    x, y, z = t
    if x * y * z != par.tp:
        raise DeckError(
            "parallel.tensor", t, f"x y z = {x * y * z} must equal parallel.tp = {par.tp}: set parallel.tp: {x * y * z}"
        )
    if par.sequence_parallel:
        raise DeckError(
            "parallel.sequence_parallel", True, "not with parallel.tensor: 3D tensor parallelism already splits "
            "the hidden dimension of the LayerNorm and residual regions over x; set it to false",
        )  # fmt: skip
    h, f, v = m.hidden, m.ffn, m.vocab_size
    needs = [
        ("model.hidden", h, x * z, "hidden features (over x, each block's rows over z)"),
        ("model.hidden", h, y, "hidden features of the transposed linears (over y)"),
        ("model.heads", m.heads, y, "attention heads (over y)"),
        ("model.ffn_hidden", f, y * z, "MLP columns (over y, each block's rows over z)"),
        ("model.vocab_size", v, y * z, "vocabulary rows (over y, each block's rows over z)"),
        ("model.hidden", 3 * h, y * z, "QKV rows 3 x hidden (over y, each block's rows over z)"),
    ]
    for key, value, parts, what in needs:
        if value % parts:
            raise DeckError(
                key, value if key != "model.hidden" or parts != y * z else h, f"parallel.tensor = {t} splits the "
                f"{what} into {parts} parts: use a multiple of {parts}, or another [x, y, z]",
            )  # fmt: skip


def _validate_model_split(m: ModelConfig, par: ParallelConfig) -> None:
    """tp must split heads, MLP and vocabulary evenly; pp x virtual_stages chunks need layers."""
    tp = par.tp
    if par.tensor is not None:
        _validate_tensor3d(m, par)
    for key, value, what in (
        ("model.heads", m.heads, "attention heads"),
        ("model.ffn_hidden", m.ffn, "MLP columns"),
        ("model.vocab_size", m.vocab_size, "vocabulary rows"),
    ):
        if value % tp and par.tensor is None:
            raise DeckError(
                key, value, f"parallel.tp = {tp} splits the {what}, so it must be a multiple of {tp} "
                f"(e.g. {value + tp - value % tp}), or choose a tp that divides {value}"
            )  # fmt: skip
    if par.sequence_parallel and m.seq_len % tp:
        raise DeckError(
            "model.seq_len", m.seq_len, f"parallel.sequence_parallel shards the sequence over tp = {tp}: "
            f"use a multiple of {tp} or set parallel.sequence_parallel: false"
        )  # fmt: skip
    if par.virtual_stages > 1 and par.pp == 1:
        raise DeckError(
            "parallel.virtual_stages", par.virtual_stages, "interleaving needs pipeline stages: set parallel.pp > 1 "
            "or parallel.virtual_stages: 1"
        )  # fmt: skip
    chunks = par.pp * par.virtual_stages
    if par.stage_layers is not None:
        if len(par.stage_layers) != chunks or sum(par.stage_layers) != m.layers:
            raise DeckError(
                "parallel.stage_layers", par.stage_layers, f"needs pp x virtual_stages = {chunks} entries "
                f"summing to model.layers = {m.layers}, or null for a balanced split"
            )  # fmt: skip
    elif m.layers < chunks:
        raise DeckError(
            "model.layers", m.layers, f"pp x virtual_stages = {par.pp} x {par.virtual_stages} = {chunks} model "
            f"chunks need at least {chunks} layers; lower parallel.pp or parallel.virtual_stages"
        )  # fmt: skip


def resolve_for_world(deck: Deck, world_size: int) -> Deck:
    """Fill in dp = world / (tp x cp x pp) and check everything that depends on the world size."""
    par, tr = deck.parallel, deck.train
    if not 1 <= world_size <= MAX_RANKS:
        raise DeckError("parallel.dp", par.dp, f"a world of {world_size:,} ranks; gridlm runs on 1 .. {MAX_RANKS:,}")
    model_ranks = par.tp * par.cp * par.pp  # the ranks of one data replica
    names, sizes = (
        ("tp x cp x pp", f"{par.tp} x {par.cp} x {par.pp}") if par.cp > 1 else ("tp x pp", f"{par.tp} x {par.pp}")
    )
    if par.dp == "auto":
        if world_size % model_ranks:
            # Named by the largest factor (pp in tp 1 x pp 2), with the ranks that would fit.
            key, value = max((("parallel.tp", par.tp), ("parallel.cp", par.cp), ("parallel.pp", par.pp)),
                             key=lambda kv: kv[1])  # fmt: skip
            below, above = world_size // model_ranks * model_ranks, -(-world_size // model_ranks) * model_ranks
            launch = f"{below} or {above}" if below else f"{above}"
            raise DeckError(
                key, value, f"{names} = {sizes} = {model_ranks} (the ranks of one replica) must divide the world size "
                f"{world_size}: launch {launch} ranks (a multiple of {model_ranks}), or change {names}"
            )  # fmt: skip
        dp = world_size // model_ranks
    else:
        dp = int(par.dp)
        if model_ranks * dp != world_size:
            raise DeckError(
                "parallel.dp",
                dp,
                f"{names} x dp = {sizes} x {dp} = {model_ranks * dp} must equal the world size "
                f"{world_size}; use dp: auto or launch {model_ranks * dp} ranks",
            )
    z = par.tensor[2] if par.tensor is not None else 1  # 3D tensor parallelism splits the batch over Z too
    if tr.global_batch % (tr.micro_batch * dp * z):
        what = f"micro_batch x dp = {tr.micro_batch} x {dp}" + (f" x z = {z} (parallel.tensor)" if z > 1 else "")
        raise DeckError(
            "train.global_batch", tr.global_batch, f"must be a multiple of {what} = {tr.micro_batch * dp * z}"
        )
    if dp % par.ep:
        raise DeckError(
            "parallel.ep", par.ep, f"expert parallelism splits the dp axis: ep must divide dp = {dp} (tp x pp x dp = "
            f"{par.tp} x {par.pp} x {dp})"
        )  # fmt: skip
    micro = tr.global_batch // (tr.micro_batch * dp * z)
    if par.virtual_stages > 1 and micro % par.pp:
        # Interleaving walks the chunks in groups of pp micro-batches.
        good = tr.micro_batch * dp * z * par.pp * max(1, round(micro / par.pp))  # z: 3D's batch split, as above
        per = f"micro_batch x dp{' x z' if z > 1 else ''}"
        raise DeckError(
            "train.global_batch", tr.global_batch, f"the interleaved schedule needs the micro-batches per dp rank "
            f"(global_batch / ({per}) = {micro}) to be a multiple of pp = {par.pp}: "
            f"e.g. global_batch = {good}, or parallel.virtual_stages: 1"
        )  # fmt: skip
    return replaced(deck, parallel=replaced(par, dp=dp))
