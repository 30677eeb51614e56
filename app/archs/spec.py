"""What an architecture is, torch-free: the features its blocks compute, and every parameter it
has, listed once.

An `Arch` is a registry entry (`app/archs/__init__.py`). Its features (positions, norm, MLP,
biases, grouped-query attention) are what the model builder (`app/model/gpt.py`) builds a block
from; `stage_params` derives from them the list of parameters a pipeline stage holds — name,
global shape, initialisation, weight decay, its split under 1D and 3D tensor parallelism, its
ZeRO-3 gather unit — in the order `GPT.parameters()` yields them. The planner
(`app/plan/estimate.py`, `perf.py`), the parameter count, the FLOP counter
(`app/metrics/flops.py`) and checkpoint export and import (`app/checkpoint/export.py`,
`hf_import.py`, through the entry's `HFFormat`) read the entry; tests/test_archs.py holds the
builder to the list, parameter by parameter.

A new architecture is a new entry: a module beside `gpt2.py` and `llama.py` and a line in the
registry. A new *feature* (a norm, an MLP, a position scheme the blocks do not compute yet) is code
in the builder as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

POSITIONS = ("learned", "rotary")  # a learned table added after the embedding; rotary q and k (Su et al.)
NORMS = ("layernorm", "rmsnorm")  # LayerNorm (weight and bias), RMSNorm (weight)
MLPS = ("gelu", "swiglu")  # GELU (tanh approximation); SwiGLU with gate and up fused in fc (interleaved rows)

# 3D tensor parallelism's cuts of an (out, in) weight, in order (`app.sharding.layout.box3d`): the A
# layout puts rows over Y then Z and columns over X; the transposed B layout rows over X then Z and
# columns over Y.
A_SPLITS: tuple[tuple[str, int], ...] = (("tp_y", 0), ("tp_z", 0), ("tp_x", 1))
B_SPLITS: tuple[tuple[str, int], ...] = (("tp_x", 0), ("tp_z", 0), ("tp_y", 1))
OVER_X: tuple[tuple[str, int], ...] = (("tp_x", 0),)  # a vector of the hidden width, split like the residual stream


class ModelShape(Protocol):
    """The sizes of a deck's `model` section the parameter list reads (`app.deck.ModelConfig`)."""

    arch: str
    vocab_size: int
    seq_len: int
    layers: int
    hidden: int
    heads: int
    init_std: float
    tie_embeddings: Optional[bool]

    @property
    def ffn(self) -> int: ...

    @property
    def kv(self) -> int: ...

    moe_experts: int
    moe_top_k: int
    moe_shared_experts: int

    @property
    def expert_ffn(self) -> int: ...

    def is_moe(self, layer: int) -> bool: ...


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the 1-rank model.

    `split`: the dim split over tp under 1D tensor parallelism (0: vocab- or column-parallel rows, 1:
    row-parallel columns), None when every tp rank holds it whole. `seq_sharded`: held whole but
    acting on a sequence shard, so under sequence parallelism each tp rank's gradient is partial
    (`app.sharding.layout.ParamMeta.sequence_parallel`). `split3d`: its cuts under 3D tensor
    parallelism (`box3d`). `unit`: the ZeRO-3 gather unit (embed, blocks.<i>, head). `tied`: the last
    stage's copy of a tied embedding. `expert`: a mixture of experts' stacked experts (E, ...), split
    along dim 0 over expert parallelism (`parallel.ep`, `app.model.moe.ExpertParallel`). `linear`: the
    weight of a Linear that is its only user (a block's, an untied head), so that its gradient GEMM can
    add straight into its accumulator (train.fuse_grad_accumulation; the built parameter's
    `wgrad_fusable` under 1D tensor parallelism)."""

    name: str
    shape: tuple[int, ...]
    init: str = "normal"  # normal (std) | zeros | ones
    std: float = 0.0
    decay: bool = True
    split: Optional[int] = None
    seq_sharded: bool = False
    split3d: tuple[tuple[str, int], ...] = ()
    unit: str = ""
    tied: bool = False
    expert: bool = False
    linear: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class HFFormat:
    """How an architecture's weights and config read in Hugging Face transformers (`app/archs/hf.py`).

    `config(model)`: config.json for a checkpoint's model section; `rules(model)`: gridlm parameter
    name -> `hf.Rule` (export converts, import places); `expected(config)`: (deck model key, HF key,
    the value the deck must have) for the keys that shape the model; `unsupported(config, model)`:
    what of the HF model gridlm's blocks do not compute, or None. `model_type`: config.json's;
    `prefix`: the base model class's key prefix ("transformer.", "model."); `also`: further
    model_types the entry reads (llama: mixtral, its blocks with experts); `unexportable(model)`: why a
    checkpoint's model section has no Hugging Face form, or None (default: a model with experts has
    none)."""

    model_type: str
    prefix: str
    config: Callable[[dict[str, Any]], dict[str, Any]]
    rules: Callable[[dict[str, Any]], dict[str, Any]]
    expected: Callable[[dict[str, Any]], list[tuple[str, str, Any]]]
    unsupported: Callable[[dict[str, Any], Any], Optional[str]]
    also: tuple[str, ...] = ()
    unexportable: Callable[[dict[str, Any]], Optional[str]] = lambda model: (
        f"model.arch {model['arch']} has no Hugging Face form with experts (model.moe_experts)"
        if model.get("moe_experts")
        else None
    )


@dataclass(frozen=True)
class Arch:
    """A registry entry: one architecture (module docstring)."""

    name: str  # model.arch
    summary: str  # one line, for the deck reference
    positions: str  # POSITIONS
    norm: str  # NORMS
    mlp: str  # MLPS
    bias: bool  # the Linears have biases
    grouped_query: bool  # model.kv_heads may be fewer than heads
    tensor3d: bool  # runs under 3D tensor parallelism (parallel.tensor)
    tie_embeddings: bool  # model.tie_embeddings' default
    ffn: Callable[[int], int]  # model.ffn_hidden's default, from hidden
    hf: HFFormat

    def __post_init__(self) -> None:
        for value, allowed in ((self.positions, POSITIONS), (self.norm, NORMS), (self.mlp, MLPS)):
            if value not in allowed:
                raise ValueError(f"arch {self.name}: {value!r} is not one of {', '.join(allowed)}")

    @property
    def gated(self) -> bool:
        """The MLP has a third matrix (SwiGLU's gate)."""
        return self.mlp == "swiglu"

    @property
    def learned_positions(self) -> bool:
        return self.positions == "learned"

    # Element-wise bytes of the features, as gridlm runs them (each op a pass over memory; `e` the
    # bytes of an activation element; `compiled`: run.compile fuses a chain into one read and one
    # write, app/model/fused.py). The performance model (app/plan/perf.py) reads them.
    def norm_bytes(self, e: int, compiled: bool) -> float:
        """Bytes per element of one norm's forward. LayerNorm: one read, one write (torch's kernel).
        Eager RMSNorm (`tensor_parallel/layers.rms_norm`): casts to fp32 (e + 4), squares (8), takes
        the mean (4), multiplies (8), casts back (4 + e) and applies the weight (2e)."""
        return 2 * e if self.norm == "layernorm" or compiled else 4 * e + 24

    def act_bytes(self, e: int, compiled: bool) -> float:
        """Bytes per MLP-width element of the activation's forward. GELU reads f and writes f;
        eager SwiGLU's silu (2e) and product (3e) read strided halves (`model/gpt.swiglu`)."""
        if self.mlp == "gelu":
            return 2 * e
        return 3 * e if compiled else 5 * e

    def rotary_bytes(self, e: int, compiled: bool) -> float:
        """Bytes per rotated q or k element (0 with learned positions). Eager (`model/gpt.rotary`): x cos
        (2e), rotate_half's negation and concatenation (3e), x sin (2e), the sum (3e)."""
        if self.positions != "rotary":
            return 0.0
        return 2 * e if compiled else 10 * e

    def words(self, kv: int) -> str:
        """The architecture in a log line: its name (and key/value heads)."""
        return self.name + (f", {kv} key/value heads" if self.grouped_query else "")

    def fc_rows(self, ffn: int) -> int:
        """Rows of the MLP's first weight: the width, twice when gated (gate and up fused)."""
        return 2 * ffn if self.gated else ffn

    def norm_params(self, name: str, hidden: int, unit: str) -> list[ParamSpec]:
        """A norm's parameters: the weight, and LayerNorm's bias; whole over tp (a sequence shard's
        partial gradient under SP), over X under 3D."""
        kinds = ("weight", "ones"), ("bias", "zeros")
        return [
            ParamSpec(f"{name}.{p}", (hidden,), init, decay=False, seq_sharded=True, split3d=OVER_X, unit=unit)
            for p, init in kinds[: 2 if self.norm == "layernorm" else 1]
        ]

    def linear_params(self, name: str, n_out: int, n_in: int, std: float, column: bool, unit: str) -> list[ParamSpec]:
        """A Linear's weight (out, in) and bias: column-parallel (rows split over tp; 3D's A layout)
        or row-parallel (columns split; 3D's B layout, its bias whole over tp)."""
        out = [ParamSpec(f"{name}.weight", (n_out, n_in), std=std, split=0 if column else 1,
                         split3d=A_SPLITS if column else B_SPLITS, unit=unit, linear=True)]  # fmt: skip
        if self.bias:
            if column:
                bias = ParamSpec(f"{name}.bias", (n_out,), "zeros", decay=False, split=0, split3d=(("tp_y", 0),),
                                 unit=unit)  # fmt: skip
            else:
                bias = ParamSpec(f"{name}.bias", (n_out,), "zeros", decay=False, seq_sharded=True, split3d=OVER_X,
                                 unit=unit)  # fmt: skip
            out.append(bias)
        return out

    def block_params(self, m: ModelShape, i: int = 0) -> list[ParamSpec]:
        """Block i's parameters as `Block` registers them: ln1, the fused QKV (column-parallel), the
        attention's output projection (row-parallel), ln2, the MLP's fc (column) and proj (row), or
        a mixture of experts' router and stacked experts (`moe_params`)."""
        h, unit = m.hidden, f"blocks.{i}"
        out_std = m.init_std / math.sqrt(2 * m.layers)  # GPT-2: residual projections scaled
        qkv_rows = (m.heads + 2 * m.kv) * (h // m.heads)
        mlp = (
            self.moe_params(m, unit, out_std)
            if m.is_moe(i)
            else [
                *self.linear_params(f"{unit}.mlp.fc", self.fc_rows(m.ffn), h, m.init_std, True, unit),
                *self.linear_params(f"{unit}.mlp.proj", h, m.ffn, out_std, False, unit),
            ]
        )
        return [
            *self.norm_params(f"{unit}.ln1", h, unit),
            *self.linear_params(f"{unit}.attn.qkv", qkv_rows, h, m.init_std, True, unit),
            *self.linear_params(f"{unit}.attn.proj", h, h, out_std, False, unit),
            *self.norm_params(f"{unit}.ln2", h, unit),
            *mlp,
        ]

    def moe_params(self, m: ModelShape, unit: str, out_std: float) -> list[ParamSpec]:
        """A mixture of experts (`app/model/moe.py`): the router (E, h) and each matrix of the E experts
        stacked, (E, out, in), with their biases (E, out); whole on every tp rank, fed a sequence
        shard under SP."""
        e, h, f = m.moe_experts, m.hidden, m.expert_ffn
        rows = self.fc_rows(f)
        out = [ParamSpec(f"{unit}.mlp.router.weight", (e, h), std=m.init_std, seq_sharded=True, unit=unit)]
        for name, n_out, n_in, std in (("fc", rows, h, m.init_std), ("proj", h, f, out_std)):
            out.append(ParamSpec(f"{unit}.mlp.{name}.weight", (e, n_out, n_in), std=std, seq_sharded=True, unit=unit,
                                 expert=True))  # fmt: skip
            if self.bias:
                out.append(ParamSpec(f"{unit}.mlp.{name}.bias", (e, n_out), "zeros", decay=False, seq_sharded=True,
                                     unit=unit, expert=True))  # fmt: skip
        shared = m.moe_shared_experts * f  # the shared experts: one dense MLP of their summed width
        for name, n_out, n_in, std in (("fc", self.fc_rows(shared), h, m.init_std), ("proj", h, shared, out_std)):
            if not shared:
                break
            out.append(ParamSpec(f"{unit}.mlp.shared.{name}.weight", (n_out, n_in), std=std, seq_sharded=True,
                                 unit=unit))  # fmt: skip
            if self.bias:
                out.append(ParamSpec(f"{unit}.mlp.shared.{name}.bias", (n_out,), "zeros", decay=False, seq_sharded=True,
                                     unit=unit))  # fmt: skip
        return out

    def end_params(self, m: ModelShape, first: bool, last: bool) -> tuple[list[ParamSpec], list[ParamSpec]]:
        """A stage's parameters (before its blocks, after them) in `GPT.parameters()` order: its own
        tensors (the learned positions on the first stage, an untied head on the last), then its
        modules' (the embedding, or the last stage's copy of a tied one), [the blocks], the final norm."""
        h, v, std = m.hidden, m.vocab_size, m.init_std

        def table(name: str, unit: str, tied: bool = False, linear: bool = False) -> ParamSpec:  # vocab-parallel
            return ParamSpec(name, (v, h), std=std, split=0, split3d=A_SPLITS, unit=unit, tied=tied, linear=linear)

        before = []
        if first and self.learned_positions:  # the hidden split over X under 3D, like the residual stream
            before.append(ParamSpec("wpe", (m.seq_len, h), std=std, seq_sharded=True, split3d=(("tp_x", 1),),
                                    unit="embed"))  # fmt: skip
        if last and not m.tie_embeddings:
            before.append(table("head", "head", linear=True))  # the head's Linear is its only user
        if first or (last and m.tie_embeddings):
            before.append(table("wte.weight", "embed" if first else "head", tied=not first))
        return before, self.norm_params("ln_f", h, "head") if last else []

    def stage_params(self, m: ModelShape, layers: Iterable[int], first: bool, last: bool) -> list[ParamSpec]:
        """Every parameter of a pipeline stage running blocks `layers` (global indices), with the
        embedding if `first` and the final norm and head if `last`, in `GPT.parameters()` order."""
        before, after = self.end_params(m, first, last)
        return [*before, *(p for i in layers for p in self.block_params(m, i)), *after]

    def active_params(self, m: ModelShape) -> int:
        """Parameters a token runs through: `num_params` less the experts it is not routed to (a
        mixture of experts' E - top_k of every MoE block's E)."""
        idle = 0
        for i in range(m.layers):
            if m.is_moe(i):
                experts = [p for p in self.moe_params(m, f"blocks.{i}", 0.0) if p.name.split(".")[3] in ("fc", "proj")]
                idle += sum(p.numel for p in experts) // m.moe_experts * (m.moe_experts - m.moe_top_k)
        return self.num_params(m) - idle

    def num_params(self, m: ModelShape) -> int:
        """Parameters of the 1-rank model (the tied embedding counted once)."""
        before, after = self.end_params(m, True, True)
        return sum(p.numel for p in (*before, *after)) + sum(
            p.numel for i in range(m.layers) for p in self.block_params(m, i)
        )
