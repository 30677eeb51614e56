"""Tensor-parallel building blocks (Megatron-style 1D, Shoeybi et al. 2019).

Every layer materialises only this tp rank's shard, tagged with a `ParamMeta` that says
where the shard sits in the global tensor; `init_parameters` fills it with the same
values as that slice of the 1-rank model.

    ColumnParallelLinear   W (out, in) split by rows (out/tp, in): input replicated
                           (or sequence-sharded and all-gathered, with SP), output split;
                           `column_parallel_linear` is its function (also the LM head),
                           backward collective overlapped with the weight gradient
    RowParallelLinear      W split by columns (out, in/tp): input split, output partial
                           sums -> all-reduce (or reduce-scatter along the sequence, SP)
    weight_grad / linear   gradient accumulation fusion (train.fuse_grad_accumulation): a
                           weight that DataParallel gave `wgrad_into` has its gradient GEMM
                           add straight into its accumulator; autograd gets a placeholder
    VocabParallelEmbedding rows of the (vocab, hidden) table split over tp
    vocab_parallel_cross_entropy  loss from vocab-split logits; never gathers them

Shapes: activations (batch, sequence, hidden); under sequence parallelism the sequence
dimension of LayerNorm/residual regions is seq_len / tp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.sharding.init import new_param
from app.sharding.layout import ParamMeta, tp_box
from app.tensor_parallel.mappings import SEQ_DIM, TensorParallel, leave_tp_region


def tp_param(meta: ParamMeta, tp: TensorParallel, dim: int, device: Optional[torch.device]) -> nn.Parameter:
    """This tp rank's shard of the parameter described by `meta`, split along `dim`."""
    return new_param(tp_box(meta, tp.size, tp.rank, dim), device)


def replicated_param(
    meta: ParamMeta, tp: TensorParallel, device: Optional[torch.device], sequence_sharded_input: bool = False
) -> nn.Parameter:
    """A parameter every tp rank holds in full. If it acts on sequence-sharded activations
    (sequence parallelism), its gradient is a partial sum over tp."""
    partial = sequence_sharded_input and tp.sequence_parallel and tp.size > 1
    return new_param(dataclasses.replace(meta, sequence_parallel=partial), device=device)


class LayerNorm(nn.Module):
    """LayerNorm over hidden; replicated over tp (sequence-sharded input under SP)."""

    def __init__(self, hidden: int, eps: float, tp: TensorParallel, device: Optional[torch.device]) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param(ParamMeta((hidden,), init="ones", decay=False), tp, device, True)
        self.bias = replicated_param(ParamMeta((hidden,), init="zeros", decay=False), tp, device, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, in fp32 and cast back before the
    weight, as Hugging Face's LlamaRMSNorm does. Eagerly five kernels; `app.model.fused` compiles it."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over hidden (llama: a weight, no bias, no mean); replicated over tp like LayerNorm.
    `kernel`: `rms_norm`, or its compiled form (`GPT.fuse`)."""

    def __init__(self, hidden: int, eps: float, tp: TensorParallel, device: Optional[torch.device]) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param(ParamMeta((hidden,), init="ones", decay=False), tp, device, True)
        self.kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


def weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """dW = grad_out^T inputs (both 2-D: tokens x features). Where the weight's gradient accumulator
    takes it straight (`weight.wgrad_into`, set by DataParallel under train.fuse_grad_accumulation),
    the GEMM writes or adds into the accumulator and autograd gets an unfilled placeholder: the
    parameter's gradient hook still runs (on this thread, in order) and only counts it."""
    into = getattr(weight, "wgrad_into", None)
    if into is None:
        return grad_out.t().matmul(inputs).to(weight.dtype)
    into(weight, grad_out.t(), inputs)
    return torch.empty_like(weight)  # never read: the hook sees that `wgrad_into` took the gradient


class _Linear(torch.autograd.Function):
    """F.linear(x, W, b) whose weight gradient goes through `weight_grad` (a fused weight's only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.param = weight  # `wgrad_into`'s parameter: saved-tensor hooks (recompute, ZeRO-3) unpack another tensor
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_out.matmul(weight) if need_x else None
        grad_w = weight_grad(ctx.param, flat_grad, x.reshape(-1, x.shape[-1])) if need_w else None
        grad_b = flat_grad.sum(dim=0) if need_b else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, or, for a weight whose gradient is fused into its accumulator, `_Linear`."""
    if hasattr(weight, "wgrad_into") and torch.is_grad_enabled():
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class _ColumnParallelLinear(torch.autograd.Function):
    """y = F.linear(copy_to_tp(x), W, b) — gather_from_sequence(x) under SP — as one step,
    so that backward can overlap the input gradient's tp collective with the
    weight-gradient GEMM (AxoNN's overlapped all-reduce; Megatron's async grad all-reduce). Both orders do the same arithmetic:
    results are bitwise equal with `tp.overlap` on or off.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], tp: TensorParallel
    ) -> torch.Tensor:
        total = tp.all_gather(x, SEQ_DIM) if tp.sequence_parallel else x
        # Saves the gathered input under SP (tp x the shard): simpler than Megatron, which
        # saves the shard and all-gathers it again in backward.
        ctx.save_for_backward(total, weight)
        ctx.param = weight  # `wgrad_into`'s parameter: saved-tensor hooks (recompute, ZeRO-3) unpack another tensor
        ctx.tp, ctx.x_dtype = tp, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        total, weight = ctx.saved_tensors
        tp: TensorParallel = ctx.tp
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = handle = None
        if need_x:
            # Each rank holds the gradient through its output columns only: sum over tp.
            grad_total = grad_out.matmul(weight.to(grad_out.dtype))
            if tp.sequence_parallel:
                grad_x, handle = tp.reduce_scatter_async(grad_total, SEQ_DIM)
            else:
                grad_x, handle = tp.all_reduce_async(grad_total)
            if not tp.overlap:
                tp.wait(handle)
                handle = None
        grad_w = grad_b = None
        if need_w:
            flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
            flat_total = total.reshape(-1, total.shape[-1]).to(grad_out.dtype)
            grad_w = weight_grad(ctx.param, flat_grad, flat_total)
        if need_b:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(dim=0).to(ctx.bias_dtype)
        if handle is not None:
            tp.wait(handle)
        if grad_x is not None:
            grad_x = grad_x.contiguous().to(ctx.x_dtype)
        return grad_x, grad_w, grad_b, None


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], tp: TensorParallel
) -> torch.Tensor:
    """F.linear(x, weight, bias) on the column-parallel shard `weight` (out / tp, in).

    x: (B, S, in), or (B, S / tp, in) under SP (all-gathered here). Returns (B, S, out / tp).
    """
    if tp.size == 1:
        return linear(x, weight, bias)
    return _ColumnParallelLinear.apply(x, weight, bias, tp)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: this rank's n_out / tp output features (no b: `bias` False)."""

    def __init__(
        self, n_in: int, n_out: int, std: float, tp: TensorParallel, device: Optional[torch.device], bias: bool = True
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = tp_param(ParamMeta((n_out, n_in), std=std), tp, 0, device)
        self.weight.wgrad_fusable = True  # used by this Linear only: its gradient may go to the accumulator
        self.bias = tp_param(ParamMeta((n_out,), init="zeros", decay=False), tp, 0, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.tp)


class RowParallelLinear(nn.Module):
    """y = sum over tp of x_local W_local^T, + b (added once, after the reduction; no b: `bias` False)."""

    def __init__(
        self, n_in: int, n_out: int, std: float, tp: TensorParallel, device: Optional[torch.device], bias: bool = True
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = tp_param(ParamMeta((n_out, n_in), std=std), tp, 1, device)
        self.weight.wgrad_fusable = True  # used by this Linear only: its gradient may go to the accumulator
        self.bias = replicated_param(ParamMeta((n_out,), init="zeros", decay=False), tp, device, True) if bias else None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """`add_bias` False: y without b, for a caller that adds it in a fused chain of its own
        (the block's bias + residual + norm under run.compile, `app.model.fused`)."""
        y = leave_tp_region(linear(x, self.weight), self.tp)
        return y if self.bias is None or not add_bias else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over tp.

    Each rank looks up the tokens in its row range (zeros elsewhere); the sum over tp
    (all-reduce, or reduce-scatter along the sequence under SP) is the full embedding.
    """

    def __init__(self, vocab: int, hidden: int, std: float, tp: TensorParallel, device: Optional[torch.device]) -> None:
        super().__init__()
        self.tp = tp
        self.weight = tp_param(ParamMeta((vocab, hidden), std=std), tp, 0, device)
        self.start = self.weight.meta.offset[0]
        self.end = self.start + self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp_region(out, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token -log softmax(logits)[target] with logits split over tp along the vocabulary.

    Three small all-reduces of (batch, sequence) tensors — max, sum of exp, target logit —
    instead of gathering (batch, sequence, vocab) logits.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = tp.rank * vocab_local
        global_max = tp.all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = tp.all_reduce(exp.sum(dim=-1))
        outside = (targets < start) | (targets >= start + vocab_local)
        local_target = (targets - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = tp.all_reduce(picked)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        # d loss / d logit = softmax - one_hot(target); the one-hot lives on one tp rank.
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel, reduction: str = "mean"
) -> torch.Tensor:
    """Mean cross-entropy over all positions (`reduction` "none": per position, (B, S));
    `logits` (B, S, V / tp) hold this rank's vocab rows."""
    if tp.size == 1:
        flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction=reduction)
        return flat if reduction == "mean" else flat.view(targets.shape)
    per_token = _VocabParallelCrossEntropy.apply(logits, targets, tp)
    return per_token.mean() if reduction == "mean" else per_token
