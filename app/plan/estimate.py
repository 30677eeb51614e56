"""Parameters, memory and FLOPs of a deck on a grid, per pipeline stage and per rank, without
building anything.

Parameters and the memory of weights, gradients and optimizer state are exact for gridlm's
implementation: the stage's parameter list (`stage_param_list`, which tests compare with
built models) goes through the same `ParamLayout` that DataParallel allocates from, so the
buffers, their padding and the ZeRO-1 shards are counted as they are allocated:

* per tp rank of a transformer block: (4h^2 + 2hf)/t + (3h + f)/t + 6h — the QKV, output,
  MLP-in and MLP-out weights and the column-parallel biases are split over tp; the
  LayerNorms and the row-parallel biases (6h) are replicated;
* the first stage adds the embedding (V/t rows of h) and the positions (s x h), the last
  stage the final LayerNorm (2h) and, when the first stage is elsewhere, its copy of the
  tied embedding (or the untied head), V/t x h;
* bytes per parameter: weights in the compute dtype; the gradient buffer in
  `train.grad_reduce_dtype`; fp32 master weights only for bf16/fp16; two fp32 moments
  (AdamW and LAMB), and LAMB's fp32 update, kept from the update to the trust ratio. ZeRO-1 (`optim.zero: 1`) divides master weights and moments by dp and
  adds a 1/dp gradient shard; each bucket is padded to a multiple of dp elements. ZeRO-2
  (`optim.zero: 2`) keeps the same shards but no whole gradient buffer: at most
  ZERO2_IN_FLIGHT bucket buffers being reduced (with their output shards) and one being
  filled per model chunk, each counted at the largest bucket's size (a bound, not exact).
  ZeRO-3 (`optim.zero: 3`) keeps ZeRO-2's shards and gradient buckets on its own layout, whose
  buckets never hold parameters of two gather units (`stage_units`: the embedding, each
  block, the head), and no whole parameter buffer: a 1/dp parameter shard in the compute
  dtype (the fp32 master itself when computing in fp32) plus the units gathered for compute,
  at most 2 + ZERO3_PREFETCH at once, each counted at the largest unit's buckets (a bound,
  not exact). At dp = 1 every ZeRO stage is ZeRO 0.
* expert parallelism (`parallel.ep`, a mixture of experts): each rank holds E/ep of every stacked
  expert tensor (`app.sharding.layout.ep_box`, as `ExpertParallel.box`), in buckets of their own that the
  expert-data group of dp/ep ranks shares, so ZeRO shards the experts' state over dp/ep ranks
  (the same 1/dp of the experts per rank as at ep = 1) and the rest over dp.

Activations are an estimate, after Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models" (MLSys 2023), eq. 1-2, adapted to this implementation: per
layer and micro-batch of b sequences of s tokens, with e bytes per activation element,

    stored = s b h [ 2e + (2e + 2) / t_sp + (4e + 2e f / h) / t ]

— the inputs of the QKV and MLP-in linears (full size: the column-parallel linear keeps
its all-gathered input under sequence parallelism), the LayerNorm inputs and the two
dropout masks (with dropout: 1 byte an element on GPUs, e on CPU ranks, whose dropout keeps
its mask in the input's dtype: `mask_bytes`; split over tp only with sequence parallelism, t_sp = t),
and Q, K, V, the
attention output, and the GELU input and output (split over tp). There is no s^2 term:
torch's scaled_dot_product_attention (flash / memory-efficient kernels) keeps only its
output and the log-sum-exp, so selective recomputation saves little here — except with
model.attention_kernel: math (the Megatron-LM decks), which keeps the scores: b (a/t) s^2
(e + mask + e with dropout) more per layer, which selective recomputation drops but for the one
layer whose recomputed core runs its backward (`score_bytes`; under context parallelism the
all-to-all's kernel keeps b (a/(t cp)) s^2 of them, the ring none). Full
recomputation keeps only each block's input (s b h e / t_sp) plus one block's working set
during its backward. Under 3D tensor parallelism (x, y, z) a rank's micro-batch is its own
(the batch is split over dp x z), the first three terms are split over x (the residual
stream's hidden), the last over y (heads and MLP features); with z > 1 no Linear's weight
block gathered over z is kept (each pass gathers it again), so the working set adds the blocks
gathered and the gradient blocks not yet reduce-scattered: the head's (V/y, h/x) block and its
gradient, or a block Linear's (largest B = max(3h, f) h / (x y) x e) plus the next one's
prefetched (OAG) and its gradient plus ORS_IN_FLIGHT in flight (ORS), whichever is more
(`gathered_block_bytes`). A stage holds the
activations of the forward passes in flight in its
pipeline schedule (counted from `app.parallel.schedule`: min(pp - stage, m) micro-batches
for 1F1B), and the output each of those passes sent on (s b h e / t_sp; none from the model's
last chunk, whose output is the loss), which the pipeline keeps until the pass's backward;
the last stage also holds the logits of one micro-batch in the compute dtype
and fp32 (s b V / t x (e + 8)).

The optimizer's term adds the work buffers the update keeps between steps (`optimizer_scratch_bytes`),
and with checkpoint.async each rank holds a host copy of its checkpoint slices while the file is
written (`checkpoint_copy_bytes`): in host memory on GPU machines, in the device's on CPU ones.

Not counted: the CUDA context and NCCL buffers, allocator fragmentation and temporary
buffers (the dry run keeps 10% of device memory free for them). Start-up adds no peak of
its own: the runtime builds the model on the meta device and computes the values bucket by
bucket into the buffers (ZeRO-3: into the shards), so beyond the buffers it holds one bucket's
fp32 values, before the gradient buffer and the optimizer moments exist.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Union

from app.archs.spec import ParamSpec
from app.deck import Deck, ModelConfig
from app.metrics.flops import arch_flops_args, gpt_step_flops, linear_step_flops, mlp_forward, moe_layers
from app.names import BYTES, OFFLOAD_FP32, OFFLOAD_SLOTS, OFFLOAD_STATE_TENSORS, offload_chunk, reduce_precision
from app.sharding.layout import (
    ORS_IN_FLIGHT,
    ZERO2_IN_FLIGHT,
    ZERO3_PREFETCH,
    ParamLayout,
    ParamMeta,
    box3d,
    ep_box,
    tp_box,
)


def block_tensors(m: ModelConfig) -> int:
    """Parameter tensors of a block (its architecture's list: 12 for gpt2, 6 for llama)."""
    return len(m.spec.block_params(m))


OFFLOAD_STATE_BYTES = OFFLOAD_STATE_TENSORS * OFFLOAD_FP32  # app/names.py


# (x, y, z) of 3D tensor parallelism (`parallel.tensor`), or None: 1D over the tp degree.
Tensor3DShape = Optional[tuple[int, int, int]]


def _local_numel(p: ParamSpec, tp: int, tensor: Tensor3DShape, ep: int = 1) -> int:
    """Elements of one tp rank's box of `p` (`_box`'s size, without building it); stacked experts
    E/ep of theirs under expert parallelism."""
    shape = list(p.shape)
    if p.expert:
        shape[0] //= ep
    if tensor is not None:
        sizes = dict(zip(("tp_x", "tp_y", "tp_z"), tensor))
        for axis, dim in p.split3d:
            shape[dim] //= sizes[axis]
    elif p.split is not None:
        shape[p.split] //= tp
    return math.prod(shape)


def _box(p: ParamSpec, tp: int, tp_rank: int, tensor: Tensor3DShape, ep: int = 1, ep_rank: int = 0) -> ParamMeta:
    """tp rank `tp_rank`'s box of `p` (and under expert parallelism, expert-group place `ep_rank`'s
    box of stacked experts): only the fields a layout reads (shape, split, decay, tied)."""
    meta = ParamMeta(p.shape, decay=p.decay, tied=p.tied)
    if p.expert:  # whole on every tp rank (no 3D with experts): split over ep only
        return ep_box(meta, ep, ep_rank)
    if tensor is not None:
        return box3d(meta, tensor, tp_rank, p.split3d) if p.split3d else meta
    return tp_box(meta, tp, tp_rank, p.split) if p.split is not None else meta


def block_params(m: ModelConfig, tp: int, tensor: Tensor3DShape = None, ep: int = 1) -> int:
    """Parameters of one transformer block held by one tp rank (its architecture's list; E/ep of
    the stacked experts under expert parallelism)."""
    return sum(_local_numel(p, tp, tensor, ep) for p in m.spec.block_params(m))


def block_expert_params(m: ModelConfig, ep: int = 1) -> int:
    """Elements of one block's stacked experts a rank holds (E/ep of them; 0 for a dense model):
    whole on every tp rank, split over the expert group."""
    return sum(_local_numel(p, 1, None, ep) for p in m.spec.block_params(m) if p.expert)


def stage_param_metas(
    m: ModelConfig,
    tp: int,
    layers: int,
    first: bool,
    last: bool,
    tp_rank: int = 0,
    tensor: Tensor3DShape = None,
    ep: int = 1,
    ep_rank: int = 0,
) -> list[ParamMeta]:
    """The tp boxes of every parameter tp rank `tp_rank` of a pipeline stage holds, in the order
    `GPT.parameters()` yields them (the architecture's `stage_params`, `app/archs/spec.py`). Only the
    fields a layout reads are set (shapes, split, decay, tied), not the initialisation. `tensor`: the
    boxes of 3D tensor parallelism of that shape (x y z = `tp`). `ep`, `ep_rank`: expert parallelism,
    the stacked experts' boxes of that place in an expert group (`ep_box`)."""
    before, after = m.spec.end_params(m, first, last)
    block = [_box(p, tp, tp_rank, tensor, ep, ep_rank) for p in m.spec.block_params(m)]
    return [
        *(_box(p, tp, tp_rank, tensor) for p in before),
        *block * layers,
        *(_box(p, tp, tp_rank, tensor) for p in after),
    ]


def stage_param_list(
    m: ModelConfig, tp: int, layers: int, first: bool, last: bool, tensor: Tensor3DShape = None, ep: int = 1
) -> list[tuple[int, bool]]:
    """(elements, weight decay) of every parameter one tp rank of a pipeline stage holds, in
    `GPT.parameters()` order (`stage_param_metas`)."""
    return [(meta.numel, meta.decay) for meta in stage_param_metas(m, tp, layers, first, last, 0, tensor, ep)]


def stage_units(m: ModelConfig, layers: int, first: bool, last: bool) -> list[str]:
    """The ZeRO-3 gather unit of every parameter of a stage, in `GPT.parameters()` order (that of
    `stage_param_metas`): "embed" (the positions, and the embedding on the first stage),
    "blocks.<i>" (every parameter of the stage's i-th block), "head" (an untied head, the last
    stage's copy of a tied embedding held apart from the first stage, the final norm). The same on
    every tp rank: tp splits parameters, never adds or removes one."""
    before, after = m.spec.end_params(m, first, last)
    tensors = block_tensors(m)  # once, not per layer
    return (
        [p.unit for p in before]
        + [f"blocks.{i}" for i in range(layers) for _ in range(tensors)]
        + [p.unit for p in after]
    )


def stage_params(
    m: ModelConfig,
    tp: int,
    layers: int,
    first: bool,
    last: bool,
    tensor: Tensor3DShape = None,
    block: Optional[int] = None,
    ep: int = 1,
) -> int:
    """Parameters one tp rank of a pipeline stage holds (its `layers` blocks, embedding, head);
    `block`: `block_params(m, tp, tensor, ep)` where the caller has it (a plan counts it once); `ep`:
    expert parallelism (E/ep of the stacked experts)."""
    before, after = m.spec.end_params(m, first, last)
    ends = sum(_local_numel(p, tp, tensor) for p in (*before, *after))
    return ends + layers * (block_params(m, tp, tensor, ep) if block is None else block)


def linear_weight_params(m: ModelConfig, tp: int, layers: int, first: bool, last: bool) -> int:
    """Elements of the Linear weights one tp rank of a pipeline stage holds under 1D tensor
    parallelism (`ParamSpec.linear`: the blocks' and an untied head's), whose gradient GEMMs add
    straight into their accumulators under train.fuse_grad_accumulation."""
    before, after = m.spec.end_params(m, first, last)
    ends = sum(_local_numel(p, tp, None) for p in (*before, *after) if p.linear)
    return ends + layers * sum(_local_numel(p, tp, None) for p in m.spec.block_params(m) if p.linear)


@dataclass(frozen=True)
class LayoutSizes:
    """What the memory estimate reads off a stage's layout (`stage_sizes`), in elements."""

    size: int  # the flat buffers, padding included
    shard: int  # the shards this rank updates (`ParamLayout.shard_elements`)
    largest_bucket: int
    largest_unit: int  # ZeRO-3 layouts: the most one gather unit's buckets hold (0 for the others)
    largest_shard: int = 0  # a bucket's 1/n shard over the ranks sharing it (dp, or dp/ep for experts)
    largest_update: int = 0  # the largest bucket part this rank updates (the whole bucket without ZeRO)
    written: int = 0  # elements a checkpoint has this rank write (`checkpoint_elements`)


# Layouts already built, and the sizes read off them, keyed by every input of `stage_layout`
# (the model config whole); and whole stage estimates (`estimate_stages`). A search passes one
# such dict to every plan, so the grids that share a stage shape share them.
LayoutCache = dict[tuple, Union[ParamLayout, LayoutSizes, "Stages"]]


class StageKey(NamedTuple):
    """What a pipeline stage's parameter layout depends on besides the deck: its blocks, whether
    it holds the embedding (first) and the head (last), ZeRO's sharding over dp (`zero`), and
    ZeRO-3's buckets cut at the gather units (`units`, with zero=True)."""

    layers: int
    first: bool
    last: bool
    zero: bool
    units: bool = False


def stage_layout(deck: Deck, stage: StageKey, cache: Optional[LayoutCache] = None) -> ParamLayout:
    """The `ParamLayout` a stage's `DataParallel` allocates (dp rank 0; every dp rank's shard is
    the same size): the parameters in reverse registration order, the tied embedding alone; ZeRO-3's
    (`stage.units`) cut at the gather units (`stage_units`)."""
    key = _layout_key(deck, stage)
    return _cached(cache, key, lambda: _build_layout(*key))  # type: ignore[return-value]  # layouts' keys hold layouts


def stage_sizes(deck: Deck, stage: StageKey, cache: Optional[LayoutCache] = None) -> LayoutSizes:
    """`LayoutSizes` of `stage_layout(deck, stage)`, kept in `cache` beside it: a search reads them for
    thousands of plans."""

    def sizes() -> LayoutSizes:
        layout = stage_layout(deck, stage, cache)
        largest_unit = 0
        if stage.units:
            units = stage_units(deck.model, stage.layers, stage.first, stage.last)[::-1]  # buffer order
            largest_unit = max(unit_elements(layout, units).values())
        shards = [(b.end - b.start) // layout.sharing(k)[0] for k, b in enumerate(layout.buckets)]
        return LayoutSizes(
            layout.size, layout.shard_elements(), max(b.end - b.start for b in layout.buckets), largest_unit,
            max(shards), max(b.shard_hi - b.shard_lo for b in layout.buckets), checkpoint_elements(layout),
        )  # fmt: skip

    return _cached(cache, ("sizes", *_layout_key(deck, stage)), sizes)  # type: ignore[return-value]  # sizes' keys


def _cached(
    cache: Optional[LayoutCache], key: tuple, make: Callable[[], Union[ParamLayout, LayoutSizes]]
) -> Union[ParamLayout, LayoutSizes]:
    """`cache[key]`, made by `make` and kept there the first time (no cache: made each time)."""
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _layout_key(deck: Deck, stage: StageKey) -> tuple:
    """Every input of a stage's layout (`_build_layout`'s arguments)."""
    par = deck.parallel
    return (
        deck.model, par.tp, par.tensor3d, par.pp > 1, deck.replicas, _bucket_elements(deck), *stage, par.ep,
    )  # fmt: skip


def _bucket_elements(deck: Deck) -> float:
    """`parallel.dp_bucket_mb` in gradient elements (DataParallel's bucket size)."""
    tr = deck.train
    return deck.parallel.dp_bucket_mb * 1e6 / BYTES[reduce_precision(tr.precision, tr.grad_reduce_dtype)]


def _build_layout(
    m: ModelConfig,
    tp: int,
    tensor: Tensor3DShape,
    pipelined: bool,
    dp: int,
    bucket_elements: float,
    layers: int,
    first: bool,
    last: bool,
    zero: bool,
    units: bool,
    ep: int = 1,
) -> ParamLayout:
    """dp rank 0's layout (expert-group place 0: its experts are the first E/ep)."""
    params = stage_param_metas(m, tp, layers, first, last, 0, tensor, ep)[::-1]
    tied = m.tie_embeddings and pipelined and (first or last)
    return ParamLayout.build(
        params,
        tp_rank=0,
        dp=dp,
        dp_rank=0,
        zero=zero,
        bucket_elements=bucket_elements,
        alone=len(params) - 1 - int(first) if tied else None,  # the embedding, after wpe on the first stage
        units=stage_units(m, layers, first, last)[::-1] if units else None,
        ep=ep,
    )


def unit_buckets(deck: Deck, first: bool, last: bool) -> dict[str, list[int]]:
    """ZeRO-3: the elements of each bucket of a stage's gather units, without the padding to dp
    (the performance model's convention): "embed" (first stage), "block" (each block's; blocks
    are alike, and a unit's buckets do not depend on its neighbours), "head" (last stage). Under
    expert parallelism a block's expert buckets (E/ep of the experts, gathered over the dp/ep ranks
    of the expert-data group) are apart, under "block_experts"."""
    par = deck.parallel
    # dp = ep: the layout cuts the experts' buckets apart (`ParamLayout.build`), padded to ep at most.
    layout = _build_layout(
        deck.model, par.tp, par.tensor3d, par.pp > 1, par.ep, _bucket_elements(deck), 1, first, last, True, True,
        par.ep,
    )  # fmt: skip
    units = stage_units(deck.model, 1, first, last)[::-1]
    out: dict[str, list[int]] = {}
    for b in layout.buckets:
        unit = units[b.params[0]]
        kind = "block" if unit.startswith("blocks.") else unit
        out.setdefault(kind + ("_experts" if b.expert else ""), []).append(sum(layout.numels[i] for i in b.params))
    return out


def checkpoint_elements(layout: ParamLayout) -> int:
    """Elements of every checkpointed tensor (a parameter, its master, each moment) that the layout's rank
    writes (`DataParallel._shard_state`): of each parameter it owns (`ParamLayout.owned`), the part in
    its dp slice of the bucket (`ParamLayout.dp_slice`). The plan's layouts are tp rank 0's and dp rank
    0's, the rank that writes the most (the tensors replicated over tp; no padding)."""
    return sum(
        hi - lo
        for k, b in enumerate(layout.buckets)
        for i in b.params
        if layout.owned[i]
        for lo, hi in [layout.local_range(i, layout.dp_slice(k))]
    )


def optimizer_scratch_bytes(deck: Deck, largest: int) -> float:
    """Device bytes of the work buffers `ShardedOptimizer` keeps from step to step beside its state,
    each of the `largest` bucket part the rank updates, fp32. The eager update (CPU ranks, and LAMB,
    whose step is never torch's fused kernel: `ShardedOptimizer.fused`) keeps `Scratch`'s denominator
    and, where the gradient is not fp32 or is scaled (fp16's loss scale, clipping: a bound, the buffer
    comes with the first clipped step), its fp32 copy; GPUs' fused AdamW an fp32 copy of a gradient
    that is not fp32 (`_AdamWCall.build`). Offloaded, the update runs on the host instead."""
    tr = deck.train
    fp32_grads = reduce_precision(tr.precision, tr.grad_reduce_dtype) == "fp32"
    if deck.run.device == "cpu" or deck.optim.name == "lamb":
        scaled = tr.precision == "fp16" or deck.optim.grad_clip > 0
        return 4.0 * largest * (1 + int(scaled or not fp32_grads))
    return 0.0 if fp32_grads else 4.0 * largest


def unit_elements(layout: ParamLayout, units: list[str]) -> dict[str, int]:
    """Elements of each gather unit's buckets in a ZeRO-3 layout (padding included): what one
    unit's all-gathers write. `units`: each parameter's unit, in the layout's (buffer) order."""
    out: dict[str, int] = {}
    for b in layout.buckets:
        unit = units[b.params[0]]  # a ZeRO-3 bucket holds one unit's parameters only
        out[unit] = out.get(unit, 0) + b.end - b.start
    return out


def nvme_buffer_bytes(buffer_mb: float, largest: Optional[int] = None) -> float:
    """Host bytes of the nvme offload's stream buffers, as `NvmeStore` allocates them: SLOTS
    slots of the master and two moments, each a chunk of about buffer_mb x 1e6 / 36 fp32 elements
    (`offload_chunk`), no more than the `largest` shard the rank streams."""
    return float(OFFLOAD_SLOTS * OFFLOAD_STATE_BYTES * offload_chunk(int(buffer_mb * 1e6), largest))


def model_params(m: ModelConfig) -> int:
    """Parameters of the whole (1-rank) model."""
    return stage_params(m, 1, m.layers, True, True)


def checkpoint_bytes(deck: Deck) -> int:
    """Tensor bytes of one checkpoint (what `save` reports, the RNG rows left out): /model in the
    compute dtype, the two fp32 moments, and the fp32 masters apart where they are not the
    parameters (bf16 / fp16, or the delayed offload update: app/checkpoint/io.py)."""
    tr, opt = deck.train, deck.optim
    masters = 4 if tr.precision != "fp32" or opt.offload_delay else 0
    return model_params(deck.model) * (BYTES[tr.precision] + masters + 2 * 4)


def checkpoint_copy_bytes(deck: Deck, written: int) -> float:
    """Host bytes a rank's checkpoint.async snapshot holds while the file is written and training goes on
    (`app.checkpoint.io.snapshot(copy=True)`: every slice the rank writes, copied, device tensors and
    the host's offloaded ones alike): `written` elements (`checkpoint_elements`) of the parameters in
    the compute dtype, the fp32 masters where they are apart (as `checkpoint_bytes`) and two fp32
    moments. 0 for a synchronous checkpoint, whose slices are views of the CPU ranks' state (a GPU's
    tensors pass through host memory during the save only)."""
    if not deck.checkpoint.async_:
        return 0.0
    tr, opt = deck.train, deck.optim
    masters = 4 if tr.precision != "fp32" or opt.offload_delay else 0
    return float(written * (BYTES[tr.precision] + masters + 2 * 4))


def layer_activation_bytes(
    m: ModelConfig,
    micro_batch: int,
    tp: int,
    sp: bool,
    element: int,
    tensor: Tensor3DShape = None,
    cp: int = 1,
    compiled: bool = False,
    mask: int = 1,
    cp_kind: str = "ring",
) -> float:
    """Activation bytes one block keeps for backward, per micro-batch (no recomputation); under
    context parallelism (`cp`) of the rank's seq_len / cp positions; `compiled`: run.compile's
    kernels (`app.model.fused`), which keep fewer of their intermediates than the eager ops;
    `mask`: bytes of a dropout mask's element (`mask_bytes`), two per block; `cp_kind`:
    parallel.cp_kind.

    `tensor` (3D tensor parallelism, x y z): the residual stream and the LayerNorms' outputs are
    split over X, q, k, v, the attention output and the MLP's over Y (a rank's micro-batch is
    its own: the batch is split over Z). The weight blocks gathered over Z are not kept (each
    pass gathers its block again: `gathered_block_bytes`). Checked against the tensors autograd
    saves (tests/test_plan.py)."""
    sbh = m.seq_len // cp * micro_batch * m.hidden
    e = element
    # The two residual dropouts' masks; without dropout their 2 bytes stand for small tensors kept
    # beside them (the tests' bound: kept <= planned <= kept + 2 sbh).
    masks = 2 * (mask if m.dropout > 0 else 1)
    if tensor is not None:
        x, y, _ = tensor
        return sbh * ((4 * e + masks) / x + (4 * e + 2 * e * m.ffn / m.hidden) / y)
    t, t_sp = tp, (tp if sp else 1)
    # Split over tp, in hidden widths: q, k, v and the attention output. Learned positions: q, k and v
    # are views of the QKV output (qkv rows wide). Rotary: q and k are rotated copies; under GQA the
    # keys and values are expanded to every query head (`Attention._expand`), 4 in all whatever the
    # kv heads; without GQA v stays a view and keeps the whole QKV output (3 + 2 + 1).
    attention = (m.qkv_rows + m.hidden) / m.hidden
    if m.spec.positions == "rotary":
        attention = 4.0 if m.kv < m.heads else 6.0
    if cp > 1 and not (cp_kind == "all_to_all" and m.attention_kernel == "math"):
        # One width more (measured): the ring keeps its queries contiguous; the all-to-all its relaid
        # q, k, v and output beside the QKV output, except that torch's math kernel keeps scores
        # (`score_bytes`) and not its output.
        attention += 1.0
    # Eager RMSNorm keeps rows in fp32 that the compiled kernel does not (its input's fp32 copy in
    # bf16 / fp16, its normalised rows in fp32): 4 bytes an element, each of the block's two norms
    # (split as the stream is: t_sp).
    norms = 0.0 if m.spec.norm != "rmsnorm" or compiled else 2 * 4.0

    def mlp(width: int, fused: bool = compiled) -> float:  # an MLP of `width`: its fc output and activation's
        """gpt2: GELU's f beside the fc output's f; llama: silu(gate) and the product (eager: 2f;
        compiled SwiGLU keeps only the product, 1f), beside the fused 2f rows."""
        made = 1 if not m.spec.gated or fused else 2
        return (m.spec.fc_rows(width) + made * width) / m.hidden

    if m.moe_experts:
        # Mixture of experts (every block planned as block 0, which has experts): per routed copy of a
        # token (top_k of them), the experts' fc output and activation at their width and the dispatch
        # buffers in and out (h each), and the shared experts', whole on every tp rank (under SP: its
        # shard's tokens).
        # The stacked experts' SwiGLU runs eager (`GPT.fuse`), the shared experts' as the dense MLP's.
        moe = m.moe_top_k * (mlp(m.expert_ffn, fused=False) + 2) + mlp(m.moe_shared_experts * m.expert_ffn)
        return sbh * (2 * e + (2 * e + masks + norms) / t_sp + attention * e / t + moe * e / t_sp)
    return sbh * (2 * e + (2 * e + masks + norms) / t_sp + (attention + mlp(m.ffn)) * e / t)


def mask_bytes(deck: Deck, element: int) -> int:
    """Bytes a dropout mask keeps per element: 1 on GPUs (a bool mask), the activations' element on
    CPU ranks, where torch's dropout keeps its mask in the input's dtype (measured, torch 2.13).
    `deck.run.device` is the ranks' device once `Deck.on_device` resolved it (auto: a GPU)."""
    return element if deck.run.device == "cpu" else 1


def score_bytes(
    m: ModelConfig,
    micro_batch: int,
    heads_split: int,
    element: int,
    cp: int = 1,
    cp_kind: str = "ring",
    mask: int = 1,
) -> float:
    """model.attention_kernel: math keeps the attention scores for backward, per layer and
    micro-batch: b (a / heads_split) s^2 of the softmax output (e bytes each) and, with dropout,
    its mask (`mask` bytes) and the dropped probabilities (e): Korthikanti et al. 2022's 5 a s / h
    term at e = 2. The flash / memory-efficient kernels keep none (module docstring); selective
    recomputation re-runs the attention core in each layer's backward, so one layer's are held at a
    time. Under context parallelism the
    ring computes its blocks itself (not counted); the all-to-all runs the kernel on heads / cp of
    the heads over the whole sequence."""
    if m.attention_kernel != "math" or (cp > 1 and cp_kind != "all_to_all"):
        return 0.0
    per_score = element + (mask + element if m.dropout > 0 else 0)
    return micro_batch * (m.heads / (heads_split * cp)) * m.seq_len**2 * per_score


def gathered_block_bytes(
    m: ModelConfig, tensor: Tensor3DShape, element: int, ors: bool = False, oag: bool = False
) -> float:
    """3D tensor parallelism with z > 1: the most weight blocks gathered over Z and weight-gradient
    blocks (before their reduce-scatter) a rank holds at once. The head: its (V/y, h/x) block and
    its gradient. A block Linear (largest block B = max(3h, f) h / (x y)): its block, and the next
    one's with OAG (prefetched); its gradient, and with ORS the ORS_IN_FLIGHT still being reduced."""
    if tensor is None or tensor[2] == 1:
        return 0.0
    x, y, _ = tensor
    head = 2.0 * m.vocab_size * m.hidden / (x * y)
    block = max(3 * m.hidden, m.ffn) * m.hidden / (x * y)
    linear = block * ((2 if oag else 1) + (1 + ORS_IN_FLIGHT if ors else 1))
    return max(head, linear) * element


def in_flight(pp: int, stage: int, micro_batches: int, virtual: int, chunk_layers: list[int]) -> int:
    """The most layer-activations (layers x micro-batches) `stage` holds at once in its schedule.

    Chunk c of the stage is global chunk stage + c x pp; `chunk_layers` has every chunk's size.
    Read off `build_schedule`'s structure instead of walking its action list, so that a deck
    with millions of micro-batches or thousands of stages plans in milliseconds (O(virtual)
    per stage; tests/test_deck_fuzz.py checks it against the walk): warm-up forwards, then
    one forward before each backward. Forwards visit the chunks in order and backwards in
    reverse, each chunk for pp passes in a row, so after the warm-up the number held repeats
    every pp x virtual passes and changes slope only where a chunk changes.
    """
    mine = [chunk_layers[stage + c * pp] for c in range(virtual)]
    if virtual == 1:
        return min(pp - stage, micro_batches) * mine[0]  # pp - stage - 1 warm-up forwards, then one more
    total, period = micro_batches * virtual, pp * virtual
    warmup = total if micro_batches == pp else min(total, (pp - stage - 1) * 2 + (virtual - 1) * pp)

    def counter(order: list[int]) -> Callable[[int], int]:
        """Layers run by the first k passes that visit the stage's chunks in `order`, pp each."""
        before = list(itertools.accumulate(order, initial=0))

        def passes(k: int) -> int:
            rounds, rest = divmod(k, period)
            chunk, within = divmod(rest, pp)
            return pp * (rounds * before[-1] + before[chunk]) + within * order[chunk]

        return passes

    forward, backward = counter(mine), counter(mine[::-1])
    peak = forward(warmup)
    steady = min(total - warmup, period)  # held after forward warmup + j, before backward j: periodic in j
    starts = (0, -(warmup + 1) % pp)
    candidates = {0, steady - 1} | {j for s in starts for j in range(s, steady, pp)}
    for j in candidates:
        if 0 <= j < steady:
            peak = max(peak, forward(warmup + j + 1) - backward(j))
    return peak


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage, per rank (every tp and dp rank of a stage holds the same amounts)."""

    stage: int
    layers: list[int]  # layers of each of the stage's chunks
    first: bool
    last: bool
    params: int
    weights: float  # the whole parameter buffer (ZeRO 0, 1 and 2)
    gradients: float  # the whole gradient buffer (ZeRO 0 and 1)
    gradient_buckets: float  # ZeRO-2: the most bucket buffers held at once (a bound; see the module docstring)
    optimizer: dict[str, float]  # "zero0" ... "zero3": master weights + moments (+ ZeRO gradient shard)
    activations: dict[str, float]  # by train.recompute: "none", "selective", "full"
    flops_per_micro_batch: float  # forward + backward model FLOPs of this stage's chunks, one micro-batch
    # ZeRO-3 (the whole buffers at dp = 1): the parameter shard in the compute dtype, the bound on the
    # units gathered at once, and ZeRO-2's bucket bound on ZeRO-3's layout.
    weight_shard: float = 0.0
    gathered: float = 0.0
    zero3_gradient_buckets: float = 0.0
    # `optim.offload`, by ZeRO stage ("zero0" ... "zero3"): the fp32 master shard and two moments that
    # leave the device (12 bytes per shard element, a master copy even in fp32 runs), the ZeRO gradient
    # shard that stays (0 at ZeRO 0 or dp = 1); nvme's host stream buffers (SLOTS x 3 fp32 chunks);
    # and the host's copy of the gradient shard (`HostTransfer`: the reduce dtype; two with
    # optim.offload_delay, plus the staged parameters in the compute dtype).
    offloaded: dict[str, float] = dataclasses.field(default_factory=dict)
    gradient_shard: dict[str, float] = dataclasses.field(default_factory=dict)
    offload_buffers: dict[str, float] = dataclasses.field(default_factory=dict)
    host_transfer: dict[str, float] = dataclasses.field(default_factory=dict)
    # A mixture of experts: the stacked experts' elements among `params` (E/ep of them under expert
    # parallelism, `parallel.ep`); 0 for a dense model.
    expert_params: int = 0
    # By ZeRO stage: the optimizer's work buffers on the device (`optimizer_scratch_bytes`; none offloaded),
    # and checkpoint.async's host copy of the rank's checkpoint slices (`checkpoint_copy_bytes`; 0 without).
    optimizer_scratch: dict[str, float] = dataclasses.field(default_factory=dict)
    checkpoint_copy: dict[str, float] = dataclasses.field(default_factory=dict)

    def weights_for(self, zero: int) -> float:
        """Parameter bytes: the whole buffer, or ZeRO-3's shard plus the gathered units' bound."""
        return self.weight_shard + self.gathered if zero >= 3 else self.weights

    def grads(self, zero: int) -> float:
        """Gradient bytes outside the optimizer's shard: the whole buffer, or ZeRO-2/3's buckets."""
        if zero >= 3:
            return self.zero3_gradient_buckets
        return self.gradient_buckets if zero >= 2 else self.gradients

    def host(self, zero: int, offload: str) -> float:
        """Host memory the offloaded optimizer holds: the state (host) or the stream buffers (nvme),
        and the gradients' host copies."""
        if offload == "none":
            return 0.0
        state = (self.offloaded if offload == "host" else self.offload_buffers)[f"zero{zero}"]
        return state + self.host_transfer[f"zero{zero}"]

    def disk(self, zero: int, offload: str) -> float:
        """Bytes of this rank's nvme state file."""
        return self.offloaded[f"zero{zero}"] if offload == "nvme" else 0.0

    def optimizer_for(self, zero: int, offload: str = "none", host_is_device: bool = False) -> float:
        """Optimizer bytes in device memory: master + moments (+ gradient shard) and the update's work
        buffers on the device, or offloaded only the gradient shard, plus the host part where host
        memory is the device's (CPU machines)."""
        if offload == "none":
            return self.optimizer[f"zero{zero}"] + self.optimizer_scratch.get(f"zero{zero}", 0.0)
        return self.gradient_shard[f"zero{zero}"] + (self.host(zero, offload) if host_is_device else 0.0)

    def snapshot(self, zero: int) -> float:
        """Host bytes of checkpoint.async's copy of this rank's checkpoint slices (0 without it)."""
        return self.checkpoint_copy.get(f"zero{zero}", 0.0)

    def total(self, zero: int, recompute: str, offload: str = "none", host_is_device: bool = False) -> float:
        """Device bytes (`host_is_device`: CPU machines, whose host memory the offload and the
        asynchronous checkpoint's copy use too)."""
        return (
            self.weights_for(zero)
            + self.grads(zero)
            + self.optimizer_for(zero, offload, host_is_device)
            + self.activations[recompute]
            + (self.snapshot(zero) if host_is_device else 0.0)
        )


class Stages(list):
    """`estimate_stages`' result: the stages in order, and the peak stage of each memory setting
    kept once found (a search asks the same of the twins that share one list, `estimate_stages`)."""

    def __init__(self, stages: list[StageEstimate]) -> None:
        super().__init__(stages)
        self._peaks: dict[tuple, StageEstimate] = {}

    def peak(self, zero: int, recompute: str, offload: str = "none", host_is_device: bool = False) -> StageEstimate:
        """The stage that needs the most device bytes under these settings (`StageEstimate.total`)."""
        key = (zero, recompute, offload, host_is_device)
        if key not in self._peaks:
            self._peaks[key] = max(self, key=lambda s: s.total(*key))
        return self._peaks[key]


def estimate_stages(deck: Deck, layouts: Optional[LayoutCache] = None) -> Stages:
    """Per-stage estimates of a deck resolved for a world size (`resolve_for_world`); `layouts`:
    see `LayoutCache`. With a cache, decks that differ only in what the estimates hold every
    value of (ZeRO stage, recompute, offload kind: `StageEstimate.total` picks one) or do not
    read (the axis order) share one list: a search plans 24 such twins per grid shape."""
    if layouts is None:
        return _estimate_stages(deck, {})
    opt, par = deck.optim, deck.parallel
    twin = dataclasses.replace(
        deck,
        parallel=dataclasses.replace(par, order=""),
        optim=dataclasses.replace(opt, zero=0, offload="none", offload_dir=None),
        train=dataclasses.replace(deck.train, recompute="none"),
    )
    key = ("stages", repr(twin), deck.replicas)
    if key not in layouts:
        layouts[key] = _estimate_stages(deck, layouts)
    return layouts[key]  # type: ignore[return-value]  # the stages' keys hold stage lists


def _estimate_stages(deck: Deck, layouts: LayoutCache) -> Stages:
    m, par, tr = deck.model, deck.parallel, deck.train
    tp, pp, dp, v = par.tp, par.pp, deck.replicas, par.virtual_stages  # dp: the replicas ZeRO shards over
    chunks = deck.chunks
    chunk_layers = [len(c) for c in chunks]
    e, grad_bytes = BYTES[tr.precision], BYTES[reduce_precision(tr.precision, tr.grad_reduce_dtype)]
    master = 0 if tr.precision == "fp32" else 4
    # Per shard element: two fp32 moments, and LAMB's update (`ShardedOptimizer`, on the device only).
    moments = 8.0 + (4.0 if deck.optim.name == "lamb" else 0.0)
    micro = deck.num_micro_batches
    tensor = par.tensor3d
    mask = mask_bytes(deck, e)
    per_layer = layer_activation_bytes(
        m,
        tr.micro_batch,
        tp,
        par.sequence_parallel,
        e,
        tensor,
        par.cp,
        compiled=bool(deck.run.compile),
        mask=mask,
        cp_kind=par.cp_kind,
    )
    heads_split = tp if tensor is None else tensor[1]
    scores = score_bytes(m, tr.micro_batch, heads_split, e, par.cp, par.cp_kind, mask)  # math kernel only
    block = block_params(m, tp, tensor, par.ep)
    experts = block_expert_params(m, par.ep)
    seq = m.seq_len // par.cp  # context parallelism: this rank's positions, and 1/cp of the (balanced) work
    tokens = tr.micro_batch * seq
    layer_flops = gpt_step_flops(tr.micro_batch, m.seq_len, 1, m.hidden, 0, m.ffn, **arch_flops_args(m)) / tp / par.cp
    if m.moe_experts:  # the experts run whole on every tp rank (the layers' mean): their GEMMs are not
        # divided, except that under SP each tp rank routes only its shard's tokens (`app/model/moe.py`)
        share, routed = moe_layers(m) / m.layers, tp if par.sequence_parallel else 1
        layer_flops += 3 * tokens * share * (mlp_forward(m, True) / routed - mlp_forward(m, False) / tp)
    if tensor is None:
        hidden_split = tp if par.sequence_parallel else 1  # the block input's split (SP: its sequence)
        vocab_split, gemm_split = tp, tp
    else:  # 3D: a rank's own micro-batch; GEMMs over x y, heads and vocab over y, the hidden over x
        x, y, _ = tensor
        hidden_split, vocab_split, gemm_split = x, y, x * y
        dense = linear_step_flops(m, tokens)  # the Linears, forward and backward (GQA, SwiGLU under llama)
        layer_flops = dense / (x * y) + (layer_flops * tp - dense) / y  # the attention core, replicated over X
    block_input = seq * tr.micro_batch * m.hidden * e / hidden_split
    logits = seq * tr.micro_batch * (m.vocab_size // vocab_split) * (e + 8)
    head_flops = 3 * 2 * tokens * m.hidden * m.vocab_size / gemm_split
    stages = []

    def bucket_bound(sizes: LayoutSizes) -> float:
        """ZeRO-2's gradient buckets held at once: ZERO2_IN_FLIGHT being reduced (with their output
        shards) and one being filled per chunk, at the layout's largest bucket (and largest shard:
        an expert bucket's is 1/(dp/ep) of it under expert parallelism)."""
        return ((ZERO2_IN_FLIGHT + v) * sizes.largest_bucket + ZERO2_IN_FLIGHT * sizes.largest_shard) * grad_bytes

    shapes: dict[tuple[int, bool, bool], dict[str, Any]] = {}  # the stages of one shape share their buffers

    def buffers(layers: int, first: bool, last: bool) -> dict[str, Any]:
        """Buffers and shards as DataParallel allocates them from the layout (padding included):
        the fp32 master (apart from the parameters unless fp32) and two moments per shard
        element, and under ZeRO-1/2 the reduce-scatter's gradient shard."""
        if (layers, first, last) in shapes:
            return shapes[(layers, first, last)]
        whole = stage_sizes(deck, StageKey(layers, first, last, False), layouts)  # middle stages share it
        sharded = stage_sizes(deck, StageKey(layers, first, last, True), layouts) if dp > 1 else whole
        optimizer = {
            "zero0": whole.shard * (master + moments),
            "zero1": sharded.shard * (master + moments + (grad_bytes if dp > 1 else 0)),
        }
        optimizer["zero2"] = optimizer["zero1"]  # the same shards; the whole gradient buffer goes
        buckets = bucket_bound(whole) if dp > 1 else whole.size * float(grad_bytes)
        # ZeRO-3: ZeRO-2's terms on its own layout (cut at the gather units, so padded apart), the
        # parameters as a shard, and the units gathered at once at the largest unit's size.
        weight_shard, gathered, buckets3 = whole.size * float(e), 0.0, buckets
        optimizer["zero3"] = optimizer["zero0"]
        if dp > 1:
            z3 = stage_sizes(deck, StageKey(layers, first, last, True, units=True), layouts)
            weight_shard = z3.shard * float(e)
            gathered = (2 + ZERO3_PREFETCH) * z3.largest_unit * float(e)
            buckets3 = bucket_bound(z3)
            optimizer["zero3"] = z3.shard * (master + moments + grad_bytes)
        # Offloaded: the fp32 master (always a copy) and two moments per shard element, by ZeRO stage.
        shards = {"zero0": whole.shard, "zero1": sharded.shard, "zero2": sharded.shard, "zero3": whole.shard}
        if dp > 1:
            shards["zero3"] = z3.shard
        offloaded = {k: n * float(OFFLOAD_STATE_BYTES) for k, n in shards.items()}
        # nvme's stream buffers: no larger than the largest bucket shard the store streams.
        largest = {"zero0": whole.largest_shard, "zero1": sharded.largest_shard, "zero2": sharded.largest_shard}
        largest["zero3"] = z3.largest_shard if dp > 1 else whole.largest_shard
        stream = {k: nvme_buffer_bytes(deck.optim.offload_buffer_mb, n) for k, n in largest.items()}
        delay = deck.optim.offload_delay
        host_transfer = {k: n * float(grad_bytes * (1 + delay) + e * delay) for k, n in shards.items()}
        gradient_shard = {k: (n * float(grad_bytes) if dp > 1 and k != "zero0" else 0.0) for k, n in shards.items()}
        # The layouts each ZeRO stage runs on (ZeRO-3's cut at the gather units), for the largest bucket
        # part the update works on and the elements a checkpoint writes.
        runs = {"zero0": whole, "zero1": sharded, "zero2": sharded, "zero3": z3 if dp > 1 else whole}
        scratch = {k: optimizer_scratch_bytes(deck, n.largest_update) for k, n in runs.items()}
        snapshot = {k: checkpoint_copy_bytes(deck, n.written) for k, n in runs.items()}
        shapes[(layers, first, last)] = {
            "weights": whole.size * float(e),
            "gradients": whole.size * float(grad_bytes),
            "gradient_buckets": float(buckets),
            "optimizer": optimizer,
            "weight_shard": weight_shard,
            "gathered": gathered,
            "zero3_gradient_buckets": float(buckets3),
            "offloaded": offloaded,
            "offload_buffers": stream,
            "gradient_shard": gradient_shard,
            "host_transfer": host_transfer,
            "optimizer_scratch": scratch,
            "checkpoint_copy": snapshot,
        }
        return shapes[(layers, first, last)]

    for stage in range(pp):
        mine = [chunk_layers[stage + c * pp] for c in range(v)]
        first, last = stage == 0, stage == pp - 1
        held = in_flight(pp, stage, micro, v, chunk_layers)
        # The pipeline keeps each forward's output until its backward (`PipelineSchedule`'s `saved`):
        # one block input's size per pass in flight, but for the model's last chunk (its loss). Its
        # own maximum, a bound where interleaving's peaks fall apart (exact for 1F1B).
        outputs = in_flight(pp, stage, micro, v, [int(c != len(chunk_layers) - 1) for c in range(len(chunk_layers))])
        kept = outputs * block_input
        head = (logits if last else 0.0) + gathered_block_bytes(
            m, tensor, e, par.overlap_tensor_reduce_scatter, par.overlap_tensor_all_gather
        )
        activations = {
            "none": held * (per_layer + scores) + kept + head,
            # The attention core recomputed in a backward keeps its scores (the math kernel's) meanwhile.
            "selective": held * per_layer + scores + kept + head,
            # Kept block inputs, plus one block's activations while its backward recomputes it.
            "full": held * block_input + per_layer + scores + kept + head,
        }
        memory = buffers(sum(mine), first, last)
        stages.append(
            StageEstimate(
                stage=stage,
                layers=mine,
                first=first,
                last=last,
                params=stage_params(m, tp, sum(mine), first, last, tensor, block),
                expert_params=sum(mine) * experts,
                activations=activations,
                flops_per_micro_batch=sum(mine) * layer_flops + (head_flops if last else 0.0),
                **{k: dict(v) if isinstance(v, dict) else v for k, v in memory.items()},
            )
        )
    return Stages(stages)


def rank_device_bytes(deck: Deck, stage: int, gpu: bool) -> float:
    """The dry run's device bytes of one rank of pipeline stage `stage` under the deck's ZeRO stage,
    recompute and offload, on ranks whose device is a GPU (`gpu`) or a CPU: what the preflight
    compares with a GPU's free memory."""
    stages = estimate_stages(deck.on_device(gpu))
    opt = deck.optim
    return stages[min(stage, len(stages) - 1)].total(opt.zero, deck.train.recompute, opt.offload)
