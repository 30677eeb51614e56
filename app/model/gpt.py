"""A GPT-2-style decoder (learned positions, pre-LayerNorm, GELU MLP, tied embeddings), or with
`model.arch: llama` a Llama-style one (rotary positions, pre-RMSNorm, SwiGLU MLP, grouped-query
attention, no biases, an untied head by default): the blocks are built from the features of the
architecture's registry entry (`app/archs/`: positions, norm, MLP, biases), and hold exactly the
parameters its `stage_params` lists (tests/test_archs.py).

Shapes: tokens (B, S) int64 -> per-position logits (B, S, V / tp) -> mean loss. Built from
the tensor-parallel layers in `app/tensor_parallel/layers.py`: attention heads and MLP columns are
split over tp, the vocabulary too. A `GPT` object holds the part of the model one rank
runs: the layers of its pipeline chunks (`layers`, global indices), the embedding if it
runs the first chunk, the final LayerNorm and head if it runs the last. Parameter names
are those of the 1-rank model (`blocks.7.attn.qkv.weight` on whichever stage runs layer
7), and every parameter is initialised from (seed, name) only (`app/sharding/init.py`), so
any shard on any grid equals the same slice of the 1-rank model. Built on the "meta" device,
the model holds shapes only: `DataParallel` then computes each rank's values straight into its
buffers (`seed=`), so a rank never holds its whole stage in fp32 at start-up.
The fused QKV weight is laid out as (kv_heads, heads / kv_heads + 2, head_dim) rows: per key/value
head, the query heads that share it, then its key, then its value ((heads, 3, head_dim) without
grouped-query attention). A contiguous split of its rows over tensor-parallel ranks hands each
rank whole groups. llama's SwiGLU MLP fuses gate and up the same way: row 2j is gate feature j,
row 2j + 1 up feature j, so a contiguous split keeps each feature's pair on one rank. Both layouts
are the global tensors, the same on every grid (Hugging Face export splits them apart).

Activation recomputation (`recompute`, Korthikanti et al. 2022): "full" keeps only each
block's input and re-runs the block in backward; "selective" re-runs only the attention
core (q, k, v -> context), whose activations grow with the sequence length squared. Both
restore the RNG state, so dropout masks and results equal those without recomputation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Optional, Protocol, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from app.deck import ModelConfig
from app.errors import DeckError
from app.model.goldfish import CountedTargets
from app.model.moe import NO_EP, ExpertParallel, MoE, RouterStats
from app.names import RECOMPUTE
from app.sharding.init import ParamMeta, init_parameters
from app.tensor_parallel.context import NO_CP, ContextParallel
from app.tensor_parallel.layers import (
    ColumnParallelLinear,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    replicated_param,
    rms_norm,
    tp_param,
    vocab_parallel_cross_entropy,
)
from app.tensor_parallel.mappings import TensorParallel
from app.tensor_parallel.tensor3d import (
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    Tensor3D,
    chain_gathers,
    linear3d,
    param3d,
    weight_splits,
)

SINGLE = TensorParallel()
# A micro-batch's targets: (B, S) ids (every position counts equally), or ids with loss weights.
Targets = Union[torch.Tensor, CountedTargets]


class ParamGate(Protocol):
    """Where a sharded-parameter scheme (ZeRO-3, `DataParallel`) gathers and frees: the model calls
    `plan` with the units a chunk pass will run, in order, `enter` before a unit reads its
    parameters (also when recomputation runs it again in backward) and `exit` after its forward."""

    def plan(self, units: list[str]) -> None: ...

    def enter(self, unit: str) -> None: ...

    def exit(self, unit: str) -> None: ...


def _recomputing(module: nn.Module) -> bool:
    # Eval and no-grad passes keep no activations: nothing to save by recomputing.
    return module.training and torch.is_grad_enabled()


def _layer_norm(cfg: ModelConfig, tp: TensorParallel | Tensor3D, device: Optional[torch.device]) -> nn.Module:
    if isinstance(tp, Tensor3D):
        return LayerNorm3D(cfg.hidden, cfg.layernorm_eps, tp, device)
    if cfg.spec.norm == "rmsnorm":
        return RMSNorm(cfg.hidden, cfg.layernorm_eps, tp, device)
    return LayerNorm(cfg.hidden, cfg.layernorm_eps, tp, device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, theta: float, start: int = 0, positions: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021) of q and k, (B, heads, S, head_dim), at positions
    start .. start + S - 1, or at `positions` (S,) (context parallelism's chunks): the two halves of
    each head's features rotate by angle position x theta^(-2i / d), Hugging Face Llama's convention
    (rotate_half, not interleaved pairs), angles in fp32."""
    d, s = q.shape[-1], q.shape[-2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=q.device).float() / d))
    if positions is None:
        positions = torch.arange(start, start + s, device=q.device, dtype=torch.float32)
    else:
        positions = positions.to(device=q.device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up interleaved in h's last dim (row 2j gate, 2j + 1 up: `fc`'s
    layout). Eagerly two kernels over strided halves; `app.model.fused` compiles it into one."""
    gate, up = h.view(*h.shape[:-1], h.shape[-1] // 2, 2).unbind(dim=-1)  # not -1: an expert may get 0 rows
    return F.silu(gate) * up


def add_norm(
    y: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
    norm_bias: Optional[torch.Tensor], eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A block's first residual add and its second norm: x + (y + bias) (no bias: x + y), and that
    normed, LayerNorm with `norm_bias` or, without one, RMSNorm (`rms_norm`). Eagerly a bias add, a
    residual add and a norm, each a pass over memory; `app.model.fused` compiles them into one."""
    x = x + (y if bias is None else y + bias)
    if norm_bias is None:
        return x, rms_norm(x, weight, eps)
    return x, F.layer_norm(x, (x.shape[-1],), weight, norm_bias, eps)


def bias_residual(y: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A block's second residual add with the MLP's row-parallel bias: x + (y + bias), two passes
    eagerly, one compiled (`app.model.fused`)."""
    return x + (y + bias)


class Attention(nn.Module):
    """Causal self-attention; this tp rank runs heads / tp of the heads."""

    def __init__(
        self, cfg: ModelConfig, tp: TensorParallel, device: Optional[torch.device], recompute_core: bool = False
    ) -> None:
        super().__init__()
        self.head_dim, self.dropout = cfg.hidden // cfg.heads, cfg.dropout
        self.group = cfg.heads // cfg.kv  # query heads per key/value head (grouped-query attention)
        self.rope_theta = cfg.rope_theta if cfg.spec.positions == "rotary" else None
        self.rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rotary  # or compiled (`GPT.fuse`)
        self.backend = ATTENTION_BACKENDS.get(cfg.attention_kernel)  # None: torch picks
        self.recompute_core = recompute_core
        self.cp: ContextParallel = NO_CP  # set by GPT: this rank's part of each sequence
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)  # GPT-2: scale residual projections
        # The tp rank's part of the heads, for their attention dropout (`shard_stream`); None: all of them.
        heads_over = tp.y if isinstance(tp, Tensor3D) else tp
        self.head_shard = heads_over.rank if heads_over.size > 1 else None
        if isinstance(tp, Tensor3D):  # heads split over Y (the qkv's out axis, the proj's in axis)
            self.heads = cfg.heads // tp.y.size
            self.qkv: nn.Module = Linear3D(cfg.hidden, 3 * cfg.hidden, cfg.init_std, tp, False, device)
            self.proj: nn.Module = Linear3D(cfg.hidden, cfg.hidden, out_std, tp, True, device)
        else:
            self.heads = cfg.heads // tp.size
            bias = cfg.spec.bias
            self.qkv = ColumnParallelLinear(cfg.hidden, cfg.qkv_rows, cfg.init_std, tp, device, bias)
            self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, out_std, tp, device, bias)

    def _heads(self, x: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, heads, S, head_dim) and k, v (B, kv heads, S, head_dim) of this rank's heads at
        positions start .. start + S - 1 (rotated under llama)."""
        qkv = self.qkv(x)  # (B, S, kv/tp x (group + 2) x head_dim): full sequence even under SP
        b, s, _ = qkv.shape
        if self.group == 1:
            q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, self.heads, 3, self.head_dim).unbind(dim=3))
        else:
            kv = self.heads // self.group
            grouped = qkv.view(b, s, kv, self.group + 2, self.head_dim)
            q = grouped[:, :, :, : self.group].reshape(b, s, self.heads, self.head_dim).transpose(1, 2)
            k, v = (grouped[:, :, :, self.group + i].transpose(1, 2) for i in (0, 1))
        if self.rope_theta is not None and self.cp.size > 1:  # this rank's two chunks of the sequence
            q, k = rotary(q, k, self.rope_theta, positions=self.cp.positions(s * self.cp.size, q.device))
        elif self.rope_theta is not None:
            # Training's shapes are fixed: the fused kernel (`GPT.fuse`); decoding's vary: eager.
            q, k = (self.rotary if start == 0 and self.training else rotary)(q, k, self.rope_theta, start)
        return q, k, v

    def _expand(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.group > 1:  # query head g x group + i reads key/value head g
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        return k, v

    def _project(self, y: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        b, _, s, _ = y.shape
        y = y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.proj(y) if add_bias else self.proj(y, add_bias=False)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """`add_bias` False: without the output projection's bias (the block's fused chain adds it)."""
        q, k, v = self._heads(x)
        dropout = self.dropout if self.training else 0.0
        core: Callable[..., torch.Tensor] = _attention_core
        if self.cp.size > 1:  # over the cp ranks' whole sequence; k and v travel unexpanded
            core = self.cp.attention
        else:
            k, v = self._expand(k, v)
        with shard_stream(self.head_shard if dropout else None, q.device):  # this rank's heads' own masks
            if self.recompute_core and _recomputing(self):
                y = checkpoint(core, q, k, v, dropout, self.backend, use_reentrant=False)
            else:
                y = core(q, k, v, dropout, self.backend)
        return self._project(y, add_bias)

    def decode(self, x: torch.Tensor, cache: LayerCache, start: int) -> torch.Tensor:
        """Inference on new positions start .. start + S - 1 (x: (B, S, H)), attending to the keys
        and values of the earlier positions in `cache`, which gains the new ones."""
        q, k, v = self._heads(x, start)
        k, v = self._expand(*cache.append(k, v, start))
        s, total = q.shape[2], k.shape[2]
        if s == total:  # the prompt: causal over itself
            y = _attention_core(q, k, v, 0.0, self.backend)
        elif s == 1:  # one new token: every cached position is before it
            y = F.scaled_dot_product_attention(q, k, v)
        else:  # several new positions after cached ones: causal, offset
            mask = torch.arange(total, device=q.device)[None, :] <= torch.arange(start, total, device=q.device)[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self._project(y)


class LayerCache:
    """One block's keys and values of the positions decoded so far (B, kv heads on this rank,
    positions, head_dim), in buffers of `capacity` positions allocated at the first append."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store positions start .. start + S - 1; the keys and values of positions 0 .. start + S - 1."""
        stop = start + k.shape[2]
        if stop > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot hold position {stop - 1}")
        if self.k is None or self.v is None:
            b, heads, _, d = k.shape
            self.k = k.new_empty(b, heads, self.capacity, d)
            self.v = v.new_empty(b, heads, self.capacity, d)
        self.k[:, :, start:stop] = k
        self.v[:, :, start:stop] = v
        return self.k[:, :, :stop], self.v[:, :, :stop]


class KVCache:
    """The `LayerCache` of every block of a model, for `GPT.decode`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.layers: dict[str, LayerCache] = {}

    def layer(self, i: str) -> LayerCache:
        return self.layers.setdefault(i, LayerCache(self.capacity))


# model.attention_kernel's choices of one backend (auto: none, torch picks by device, dtype and shape).
ATTENTION_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                      "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip


def check_attention_kernel(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """A DeckError naming model.attention_kernel when the backend it names has no kernel for this
    run's device, compute dtype and head size (cudnn or efficient on CPU ranks, flash in fp32 on
    a GPU), before the first step rather than as torch's error inside it: one causal call of a
    tiny batch with the run's head size."""
    backend = ATTENTION_BACKENDS.get(cfg.attention_kernel)
    if backend is None or backend == SDPBackend.MATH:
        return
    q = torch.zeros(1, 1, 8, cfg.hidden // cfg.heads, device=device, dtype=dtype)
    try:
        _attention_core(q, q, q, cfg.dropout, backend)
    except RuntimeError:
        raise DeckError(
            "model.attention_kernel", cfg.attention_kernel,
            f"torch has no {cfg.attention_kernel} kernel for this run ({device.type}, {str(dtype).removeprefix('torch.')}, "
            f"head size {cfg.hidden // cfg.heads}); use auto (torch picks one that runs) or flash",
        ) from None  # fmt: skip


def shard_seed(shard: int) -> int:
    """A seed for dropout on this rank's shard of an activation split over tensor-parallel ranks: one
    draw of torch's CPU generator, the same on every tp rank (seeded alike, advanced alike), mixed
    with the shard's index. Each shard then draws its own masks (one stream for all of them dropped
    the same features at position p and p + S/tp, or gave every head shard the same mask, as
    Megatron-LM's model-parallel RNG avoids), and a recomputed forward, which restores the
    generator, draws them again."""
    draw = int(torch.randint(0, 2**62, (1,)).item())
    return (draw + (shard + 1) * 0x9E3779B97F4A7C15) % 2**63


@contextmanager
def shard_stream(shard: Optional[int], device: torch.device) -> Iterator[None]:
    """torch's generators (the CPU's and `device`'s) seeded for `shard` inside the block and put back
    after it (`shard_seed`); None: unchanged (a replicated activation, whose masks must be equal)."""
    if shard is None:
        yield
        return
    seed = shard_seed(shard)
    index = (torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else None
    with torch.random.fork_rng(devices=[] if index is None else [index], device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        if index is not None:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def stream_shard(tp: TensorParallel) -> Optional[int]:
    """This rank's shard of the residual stream for its dropout (`shard_stream`): the sequence's under
    SP, the hidden's over X under 3D; None where the tp ranks hold it whole (replicated: equal masks)."""
    if isinstance(tp, Tensor3D):
        return tp.x.rank if tp.x.size > 1 else None
    return tp.rank if tp.sequence_parallel and tp.size > 1 else None


def dropout_of(x: torch.Tensor, p: float, training: bool, shard: Optional[int]) -> torch.Tensor:
    """F.dropout(x, p, training), drawn for `shard` (`shard_stream`) where x is this rank's shard."""
    if not training or p == 0.0:
        return x
    with shard_stream(shard, x.device):
        return F.dropout(x, p, True)


def _attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, backend: Optional[SDPBackend] = None
) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v: (B, heads, S, head_dim) each -> the same shape, with
    `backend` only (model.attention_kernel; MATH, torch's reference, materialises the scores), or
    the one torch picks."""
    if backend is not None:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


class MLP(nn.Module):
    """GELU MLP (gpt2), or llama's SwiGLU: proj(silu(gate x) * (up x)), gate and up fused in `fc`
    as interleaved rows (module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, device: Optional[torch.device]) -> None:
        super().__init__()
        self.swiglu = cfg.spec.gated
        self.swiglu_kernel: Callable[[torch.Tensor], torch.Tensor] = swiglu  # or compiled (`GPT.fuse`)
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        if isinstance(tp, Tensor3D):
            self.fc: nn.Module = Linear3D(cfg.hidden, cfg.ffn, cfg.init_std, tp, False, device)
            self.proj: nn.Module = Linear3D(cfg.ffn, cfg.hidden, out_std, tp, True, device)
        else:
            bias = cfg.spec.bias
            self.fc = ColumnParallelLinear(cfg.hidden, cfg.fc_rows, cfg.init_std, tp, device, bias)
            self.proj = RowParallelLinear(cfg.ffn, cfg.hidden, out_std, tp, device, bias)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """`add_bias` False: without proj's bias (the block's fused chain adds it)."""
        h = self.swiglu_kernel(self.fc(x)) if self.swiglu else F.gelu(self.fc(x), approximate="tanh")
        return self.proj(h) if add_bias else self.proj(h, add_bias=False)


def _gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


def _moe(
    cfg: ModelConfig, tp: TensorParallel, device: Optional[torch.device], stats: RouterStats, ep: ExpertParallel
) -> MoE:
    """A block's mixture of experts (`app/model/moe.py`), its experts the dense MLP's kind."""
    return MoE(
        cfg.hidden, cfg.moe_experts, cfg.moe_top_k, cfg.expert_ffn, cfg.spec.fc_rows(cfg.expert_ffn), cfg.spec.bias,
        cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.layers), cfg.moe_capacity_factor, cfg.moe_shared_experts,
        (cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef), swiglu if cfg.spec.gated else _gelu, stats, tp, device, ep,
    )  # fmt: skip


class Block(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TensorParallel,
        device: Optional[torch.device],
        recompute: str = "none",
        layer: int = 0,
        stats: Optional[RouterStats] = None,
        ep: ExpertParallel = NO_EP,
    ) -> None:
        super().__init__()
        self.recompute = recompute
        self.ln1 = _layer_norm(cfg, tp, device)
        self.attn = Attention(cfg, tp, device, recompute_core=recompute == "selective")
        self.ln2 = _layer_norm(cfg, tp, device)
        self.mlp: nn.Module = (
            _moe(cfg, tp, device, stats if stats is not None else RouterStats(), ep)
            if cfg.is_moe(layer)
            else MLP(cfg, tp, device)
        )
        self.dropout = cfg.dropout
        self.stream_shard = stream_shard(tp)
        if isinstance(tp, Tensor3D):  # OAG: each Linear prefetches the next one's block (`_forward`'s order)
            chain_gathers([lin.slot for lin in (self.attn.qkv, self.attn.proj, self.mlp.fc, self.mlp.proj)])  # type: ignore[union-attr]
        # ZeRO-3 (`GPT.gate`): this block's unit is gathered where its forward starts, so the
        # recomputation of a checkpointed block in backward gathers it too.
        self.gate: Optional[ParamGate] = None
        self.unit = ""
        # run.compile's chains across the block's Linears and norms (`GPT.fuse`); None: op by op.
        self.add_norm: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None
        self.bias_residual: Optional[Callable[..., torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and _recomputing(self):
            y = checkpoint(self._forward, x, use_reentrant=False)
        else:
            y = self._forward(x)
        if self.gate is not None:
            self.gate.exit(self.unit)
        return y

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            self.gate.enter(self.unit)
        if self.add_norm is not None and self.training:
            return self._chained(x)
        p, shard = self.dropout, self.stream_shard
        x = x + dropout_of(self.attn(self.ln1(x)), p, self.training, shard)
        return x + dropout_of(self.mlp(self.ln2(x)), p, self.training, shard)

    def _chained(self, x: torch.Tensor) -> torch.Tensor:
        """`_forward` with fused chains (no dropout: `GPT.fuse`): the attention's output bias, the
        residual add and ln2 as one kernel; the MLP's output bias and the residual add as another."""
        assert self.add_norm is not None
        ln2 = self.ln2
        x, h = self.add_norm(
            self.attn(self.ln1(x), add_bias=False), self.attn.proj.bias, x, ln2.weight, getattr(ln2, "bias", None),
            ln2.eps,
        )  # fmt: skip
        if self.bias_residual is not None:  # a dense MLP with an output bias (`GPT.fuse`)
            return self.bias_residual(self.mlp(h, add_bias=False), self.mlp.proj.bias, x)
        return x + self.mlp(h)

    def decode(self, x: torch.Tensor, cache: LayerCache, start: int) -> torch.Tensor:
        """Inference (no dropout) on new positions from `start`, with the earlier ones in `cache`."""
        x = x + self.attn.decode(self.ln1(x), cache, start)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The part of the GPT this rank runs (the whole model by default: 1 rank, no pipeline).

    `layers`: global indices of the transformer blocks held here; `first`: holds the
    embedding (runs the first pipeline chunk); `last`: holds the final LayerNorm and the
    head (runs the last chunk). With tied embeddings and first != last, the last stage
    keeps its own copy of the embedding (`ParamMeta.tied`), kept equal by summing the two
    gradients (see `app/parallel/data.py`). `recompute`: "none", "full" or
    "selective" activation recomputation in training (module docstring). `ep`: this rank's place in
    its expert group (a mixture of experts' experts split over `parallel.ep`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int,
        device: Optional[torch.device] = None,
        tp: TensorParallel = SINGLE,
        layers: Optional[Iterable[int]] = None,
        first: bool = True,
        last: bool = True,
        recompute: str = "none",
        ep: ExpertParallel = NO_EP,
        cp: ContextParallel = NO_CP,
    ) -> None:
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE)}")
        self.cfg, self.tp, self.first, self.last, self.recompute = cfg, tp, first, last, recompute
        self.cp = cp
        self.dropout, self.stream_shard = cfg.dropout, stream_shard(tp)
        if first or (last and cfg.tie_embeddings):
            if isinstance(tp, Tensor3D):
                self.wte: nn.Module = Embedding3D(cfg.vocab_size, cfg.hidden, cfg.init_std, tp, device)
            else:
                self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, cfg.init_std, tp, device)
            if not first:
                self.wte.weight.meta = dataclasses.replace(self.wte.weight.meta, tied=True)
        if first and cfg.spec.learned_positions:  # rotary positions are in attention: no table
            # Positions are added to the sequence shard under SP: a partial gradient per tp rank.
            wpe = ParamMeta((cfg.seq_len, cfg.hidden), std=cfg.init_std)
            if isinstance(tp, Tensor3D):  # the hidden split over X, like the residual stream
                self.wpe = param3d(wpe, tp, [("tp_x", 1)], device)
            else:
                self.wpe = replicated_param(wpe, tp, device, True)
        ids = range(cfg.layers) if layers is None else layers
        self.router_stats = RouterStats()  # the mixture-of-experts layers' losses this step (app/model/moe.py)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, tp, device, recompute, i, self.router_stats, ep) for i in ids})
        for block in self.blocks.values():
            block.attn.cp = cp
            if isinstance(block.mlp, MoE):  # routes this rank's chunks; its losses' sums span the cp group
                block.mlp.cp = cp
        if last:
            self.ln_f = _layer_norm(cfg, tp, device)
            if not cfg.tie_embeddings:
                head = ParamMeta((cfg.vocab_size, cfg.hidden), std=cfg.init_std)
                if isinstance(tp, Tensor3D):  # the embedding's layout: A
                    self.head = param3d(head, tp, weight_splits(False), device)
                else:
                    self.head = tp_param(head, tp, 0, device)
                    self.head.wgrad_fusable = True  # the head's Linear is its only user
        if device is None or torch.device(device).type != "meta":
            init_parameters(self, seed)
        self.gate: Optional[ParamGate] = None

    def fuse(self, kernels: Any) -> None:
        """Run the blocks' element-wise chains with `kernels` (`app.model.fused.Kernels`: compiled
        by torch.compile under run.compile, or the eager functions). The chains across a block's
        Linears and norms (`Block._chained`) need 1D tensor parallelism and no dropout (a compiled
        dropout draws other masks than eager ones); elsewhere the block runs its ops one by one."""
        chains = kernels.add_norm is not None and self.cfg.dropout == 0 and not isinstance(self.tp, Tensor3D)
        for block in self.blocks.values():
            block.add_norm = kernels.add_norm if chains else None
            biased = isinstance(block.mlp, MLP) and block.mlp.proj.bias is not None  # MoE and llama: a plain add
            block.bias_residual = kernels.bias_residual if chains and biased else None
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernels.rms_norm
            elif isinstance(module, Attention):
                module.rotary = kernels.rotary
            elif isinstance(module, MLP):
                module.swiglu_kernel = kernels.swiglu
            elif isinstance(module, MoE) and self.cfg.spec.gated:
                # Eager (found in review): the stacked experts' buffers change width with every
                # micro-batch's routing, and a static-shape kernel recompiled for each width stopped the
                # run at torch._dynamo's recompile limit. The shared experts are MLPs: compiled.
                module.act = swiglu

    def set_gate(self, gate: Optional[ParamGate]) -> None:
        """Route every unit's parameter reads through `gate` (ZeRO-3), or none."""
        self.gate = gate
        for i, block in self.blocks.items():
            block.gate, block.unit = gate, f"blocks.{i}"

    def param_units(self) -> list[tuple[str, list[nn.Parameter]]]:
        """(unit, parameters) in forward order: the gather units of ZeRO-3. "embed" (the embedding
        and the positions), "blocks.<i>", "head" (the final LayerNorm and the head: the untied
        head, the tied embedding itself where this rank also embeds, or the last stage's copy)."""
        units: list[tuple[str, list[nn.Parameter]]] = []
        if self.first:
            units.append(("embed", [self.wte.weight, *self._positions()]))
        units += [(f"blocks.{i}", list(block.parameters())) for i, block in self.blocks.items()]
        if self.last:
            head = self.wte.weight if self.cfg.tie_embeddings else self.head
            units.append(("head", [*self.ln_f.parameters(), head]))
        return units

    def _positions(self) -> list[nn.Parameter]:
        """The learned position table, where there is one (gpt2's first stage)."""
        return [self.wpe] if hasattr(self, "wpe") else []

    def _enter(self, unit: str) -> None:
        if self.gate is not None:
            self.gate.enter(unit)

    def _exit(self, unit: str) -> None:
        if self.gate is not None:
            self.gate.exit(unit)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) -> hidden states (B, S, H), or (B, S / tp, H) under SP."""
        self._enter("embed")
        # wte's call is the first use of wte and wpe (`first_uses`): a sharded optimizer's overlapped
        # gather of both ends there, so wpe is read after it. A view of wpe taken before could see
        # the gather land in place, which autograd refuses for split's views (a SP run failed so).
        embedded = self.wte(tokens)
        if not self.cfg.spec.learned_positions:  # rotary positions, in attention
            x = dropout_of(embedded, self.dropout, self.training, self.stream_shard)
            self._exit("embed")
            return x
        positions = self.wpe[: tokens.shape[1]]
        if self.cp.size > 1:  # tokens are this rank's two chunks: the rows of their positions
            positions = self.cp.split(self.wpe[: tokens.shape[1] * self.cp.size], 0)
        if self.tp.sequence_parallel:
            positions = self.tp.split(positions, 0)  # this rank's sequence chunk, like the embedding's
        x = dropout_of(embedded + positions, self.dropout, self.training, self.stream_shard)
        self._exit("embed")
        return x

    def head_loss(self, x: torch.Tensor, targets: Targets) -> torch.Tensor:
        """Final LayerNorm, vocab-parallel head and mean cross-entropy over the (B, S) positions
        (3D: the vocabulary is split over Y); for `CountedTargets` (Goldfish) the weighted sum
        sum(weights x CE) instead."""
        vocab_axis = self.tp.y if isinstance(self.tp, Tensor3D) else self.tp
        if isinstance(targets, CountedTargets):
            per_token = vocab_parallel_cross_entropy(self._logits(x), targets.ids, vocab_axis, reduction="none")
            return (per_token * targets.weights).sum()
        return vocab_parallel_cross_entropy(self._logits(x), targets, vocab_axis)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        self._enter("head")
        weight = self.wte.weight if self.cfg.tie_embeddings else self.head
        if isinstance(self.tp, Tensor3D):
            logits = linear3d(self.ln_f(x), weight, None, self.tp, False)
        else:
            logits = column_parallel_linear(self.ln_f(x), weight, None, self.tp)
        self._exit("head")
        return logits

    def forward_chunk(
        self,
        x: torch.Tensor,
        layers: Iterable[int],
        first: bool,
        last: bool,
        targets: Optional[Targets] = None,
    ) -> torch.Tensor:
        """Run one pipeline chunk: [embedding] -> blocks `layers` -> [head and loss]."""
        if self.gate is not None:
            layers = list(layers)
            self.gate.plan((["embed"] if first else []) + [f"blocks.{i}" for i in layers] + (["head"] if last else []))
        if first:
            x = self.embed(x)
        for i in layers:
            x = self.blocks[str(i)](x)
        return self.head_loss(x, targets) if last else x

    def finish_backward(self) -> None:
        """After each backward pass through a chunk: 3D's deferred work ends here (the ORS
        reduce-scatters retire into the gradients, `Tensor3D.finish_backward`)."""
        if isinstance(self.tp, Tensor3D):
            self.tp.finish_backward()

    def _check_whole(self) -> None:
        if not (self.first and self.last and len(self.blocks) == self.cfg.layers):
            raise RuntimeError("this needs the whole model on one pipeline stage; use a pipeline schedule")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) -> logits (B, S, V / tp) of this tp rank's vocabulary rows (pp = 1 only)."""
        self._check_whole()
        return self._logits(self.forward_chunk(tokens, range(self.cfg.layers), True, False))

    def loss(self, tokens: torch.Tensor, targets: Targets) -> torch.Tensor:
        """Mean next-token cross-entropy over the B x S positions (the whole model is here)."""
        self._check_whole()
        return self.forward_chunk(tokens, range(self.cfg.layers), True, True, targets)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """Inference with a KV cache: tokens (B, S) at positions start .. start + S - 1 -> the fp32
        logits (B, V) over the whole vocabulary (gathered over tp) of the last position. `cache`
        holds the earlier positions' keys and values and gains these. No dropout, no SP, 1D tp."""
        self._check_whole()
        if self.tp.sequence_parallel or isinstance(self.tp, Tensor3D):
            raise RuntimeError("decode runs on 1D tensor parallelism without sequence parallelism")
        x = self.wte(tokens)
        if self.cfg.spec.learned_positions:
            x = x + self.wpe[start : start + tokens.shape[1]]
        for i, block in self.blocks.items():
            x = block.decode(x, cache.layer(i), start)
        logits = self._logits(x[:, -1:])  # (B, 1, V / tp): this rank's vocabulary rows
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, -1)
        return logits[:, 0].float()

    def first_uses(self) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """(module, parameters) pairs: calling `module` is the first use of those parameters in a
        forward pass — where a sharded optimizer waits for their all-gather."""
        uses: list[tuple[nn.Module, list[nn.Parameter]]] = []
        if self.first:
            uses.append((self.wte, [self.wte.weight, *self._positions()]))
        uses += [(block, list(block.parameters())) for block in self.blocks.values()]
        if self.last:
            head = self.wte.weight if self.cfg.tie_embeddings else self.head
            uses.append((self.ln_f, [*self.ln_f.parameters(), head]))
        return uses

    def num_parameters(self) -> int:
        """Global parameter count of the whole model (the tied embedding counted once)."""
        return gpt_num_parameters(self.cfg)


def gpt_num_parameters(cfg: ModelConfig) -> int:
    """Parameters of the 1-rank model: its architecture's list (`app/archs/spec.py`)."""
    return cfg.spec.num_params(cfg)
