"""Mixture-of-experts MLPs (`model.moe_experts`): E expert MLPs behind a learned router, each
token sent to its top-k experts (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang
et al. 2024).

For a token x (one row of the block's MLP input):

    logits  = W_r x                                   (E,)   the router, no bias
    p       = softmax(logits)                          in fp32
    w, e    = top-k of p, w / sum(w)                   Mixtral's weights: a softmax over the k chosen
    y       = sum_j w_j MLP_{e_j}(x)                   each expert the block's MLP (GELU or SwiGLU)

The load-balancing loss (Switch/GShard, Megatron's `switch_load_balancing_loss_func`) over the T
tokens of a micro-batch, f_e the share of the T k assignments routed to e (before any drop) and
P_e the mean of p over the tokens, and the router z-loss (ST-MoE, Zoph et al. 2022):

    aux = E sum_e f_e P_e          z = mean_t logsumexp(logits_t)^2

enter the loss as model.moe_aux_loss_coef x aux + model.moe_z_loss_coef x z per MoE layer and
micro-batch: their gradient is injected in backward at the scale of the micro-batch's loss
(`_AttachLoss`, after Megatron's MoEAuxLossAutoScaler), so the pipeline passes only the hidden
states on. Their values, and the assignments dropped, are summed for the log (`RouterStats`).
With model.moe_shared_experts S, a dense MLP of width S x the expert width runs on every token
beside them and adds its output (DeepSeekMoE's shared experts, Dai et al. 2024).

Dispatch. The T k assignments are sorted by expert (stable: token order within an expert); the
experts run as two batched matmuls over an (E, C, h) buffer, C the most assignments any expert
got (dropless, the default) or the capacity ceil(capacity_factor T k / E), beyond which an
expert's later tokens (by position) are dropped: their share of y is 0 and the residual carries
them. Each token's k outputs are summed in a fixed order, so the result does not depend on the
grid. Under tensor parallelism the experts are whole on every tp rank: without sequence
parallelism each rank routes all tokens, with it each its own sequence shard (the weights'
gradients then partial sums over tp, like the norms'; the losses' token sums summed over tp:
`balance_losses`; dropless only). Expert parallelism comes later (the deck refuses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from app.sharding.init import ParamMeta
from app.tensor_parallel.layers import replicated_param
from app.tensor_parallel.mappings import TensorParallel, in_backward


@dataclass
class RouterStats:
    """A model's routers this step: the backward scale of a micro-batch's loss (set by the pipeline
    before each micro-batch's forward) and the sums the log reads (device tensors, no sync)."""

    scale: float = 1.0
    aux: Optional[torch.Tensor] = None  # sum of aux over MoE layers x micro-batches
    z: Optional[torch.Tensor] = None
    dropped: Optional[torch.Tensor] = None  # assignments dropped
    assigned: Optional[torch.Tensor] = None  # assignments made (T k per layer and micro-batch)
    calls: int = 0  # MoE layer forwards (layers x micro-batches)

    def reset(self) -> None:
        self.aux = self.z = self.dropped = self.assigned = None
        self.calls = 0

    def add(self, aux: torch.Tensor, z: torch.Tensor, dropped: torch.Tensor, assigned: int) -> None:
        values = (aux.detach().double(), z.detach().double(), dropped.double())
        if self.aux is None:
            self.aux, self.z, self.dropped = values
            self.assigned = torch.tensor(float(assigned), dtype=torch.float64, device=aux.device)
        else:
            self.aux, self.z, self.dropped = (a + b for a, b in zip((self.aux, self.z, self.dropped), values))
            self.assigned = self.assigned + assigned  # type: ignore[operator]
        self.calls += 1


class _AttachLoss(torch.autograd.Function):
    """y = x in forward; in backward, the scalar `loss` gets the gradient `scale` (it is added to the
    model's loss at the micro-batch's scale without travelling with the activations)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 probabilities (T, E), the top-k weights renormalised (T, k), their experts (T, k))."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True), experts


def balance_losses(
    logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, tp: Optional[TensorParallel] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the load-balancing loss E sum_e f_e P_e, the z-loss mean_t logsumexp^2, the z-loss's value)
    over a micro-batch's T tokens. Under sequence parallelism (`tp`) this rank holds T / tp of them:
    the sums over the tokens are summed over tp (one all-reduce), and a rank's losses carry the
    gradient of its own tokens only, so that the tp ranks' backward passes add up to the whole's
    (the aux value is the whole's on every rank; the z-loss is this rank's share of the whole's,
    whose value the third element gives for the log)."""
    n_experts = probs.shape[-1]
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype)
    mass = probs.sum(dim=0)
    lse2 = torch.logsumexp(logits.float(), dim=-1).pow(2).sum()
    tokens = probs.shape[0]
    if tp is not None and tp.size > 1:
        local = torch.cat([counts, mass.detach(), lse2.detach().reshape(1)])
        whole = tp.all_reduce(local)
        counts = whole[:n_experts]
        mass = mass + (whole[n_experts : 2 * n_experts] - mass.detach())  # the gradient reaches this rank's tokens
        tokens *= tp.size
        z_value = whole[-1] / tokens
    else:
        z_value = lse2.detach() / tokens
    share = counts / (tokens * experts.shape[-1])
    aux = n_experts * (share * mass / tokens).sum()
    return aux, lse2 / tokens, z_value


class MoE(nn.Module):
    """The block's MLP as `experts` routed experts (module docstring). `act`: the MLP's activation on
    the first matmul's output (GELU, or SwiGLU over interleaved gate/up rows)."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        top_k: int,
        ffn: int,
        fc_rows: int,
        bias: bool,
        std: float,
        out_std: float,
        capacity_factor: Optional[float],
        shared: int,
        coefficients: tuple[float, float],
        act: Callable[[torch.Tensor], torch.Tensor],
        stats: RouterStats,
        tp: TensorParallel,
        device: Optional[torch.device],
    ) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.aux_coef, self.z_coef = coefficients
        self.act, self.stats = act, stats
        # Sequence parallelism: each tp rank routes its own sequence shard (a partial gradient per rank).
        self.tp = tp if tp.sequence_parallel and tp.size > 1 else None

        def param(meta: ParamMeta) -> nn.Parameter:
            return replicated_param(meta, tp, device, sequence_sharded_input=True)

        self.router = nn.Module()
        self.router.weight = param(ParamMeta((experts, hidden), std=std))
        self.fc = nn.Module()
        self.fc.weight = param(ParamMeta((experts, fc_rows, hidden), std=std))
        if bias:
            self.fc.bias = param(ParamMeta((experts, fc_rows), init="zeros", decay=False))
        self.proj = nn.Module()
        self.proj.weight = param(ParamMeta((experts, hidden, ffn), std=out_std))
        if bias:
            self.proj.bias = param(ParamMeta((experts, hidden), init="zeros", decay=False))
        self.bias = bias
        # Shared experts: one dense MLP of their summed width, on every token (none: `shared` 0).
        self.shared: Optional[nn.Module] = None
        if shared:
            width, rows = shared * ffn, fc_rows // ffn * shared * ffn
            self.shared = nn.Module()
            self.shared.fc = nn.Module()
            self.shared.fc.weight = param(ParamMeta((rows, hidden), std=std))
            if bias:
                self.shared.fc.bias = param(ParamMeta((rows,), init="zeros", decay=False))
            self.shared.proj = nn.Module()
            self.shared.proj.weight = param(ParamMeta((hidden, width), std=out_std))
            if bias:
                self.shared.proj.bias = param(ParamMeta((hidden,), init="zeros", decay=False))

    def _mlp(self, x: torch.Tensor, fc: nn.Module, proj: nn.Module) -> torch.Tensor:
        """proj(act(fc x)) with (out, in) weights: the stacked experts' (E, out, in) over x (E, C, h),
        or the shared experts' over x (T, h)."""
        h = torch.matmul(x, fc.weight.transpose(-1, -2))
        if self.bias:
            h = h + fc.bias.unsqueeze(-2)
        out = torch.matmul(self.act(h), proj.weight.transpose(-1, -2))
        return out + proj.bias.unsqueeze(-2) if self.bias else out

    def capacity(self, tokens: int) -> Optional[int]:
        """The most assignments an expert takes (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n, k, n_experts = tokens.shape[0], self.top_k, self.experts
        logits = F.linear(tokens, self.router.weight)
        probs, weights, experts = route(logits, k)
        aux, z, z_value = balance_losses(logits, probs, experts, self.tp)
        # Sort the n k assignments by expert; an assignment's slot is its rank within its expert.
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_experts)
        starts = torch.cumsum(counts, 0) - counts
        slot_sorted = torch.arange(n * k, device=x.device) - starts[flat[order]]
        slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
        limit = self.capacity(n)
        width = int(counts.max()) if limit is None else limit
        kept = slot < width
        dropped = (~kept).sum()
        # The experts' inputs, (E, C, h): unfilled slots stay zero (their outputs are never read).
        src = torch.arange(n, device=x.device).repeat_interleave(k)
        where = flat * width + slot.clamp(max=width - 1)
        buffer = tokens.new_zeros(n_experts * width, shape[-1])
        buffer.index_copy_(0, where[kept], tokens[src[kept]])
        out = self._mlp(buffer.view(n_experts, width, -1), self.fc, self.proj)  # a batched matmul per matrix
        picked = out.reshape(n_experts * width, -1)[where] * (weights.reshape(-1, 1) * kept.unsqueeze(1)).to(out.dtype)
        y = picked.view(n, k, -1).sum(dim=1)
        if self.shared is not None:
            y = y + self._mlp(tokens, self.shared.fc, self.shared.proj)
        y = y.view(shape)
        # A recomputation in backward (full activation recompute): its statistics were counted once.
        if torch.is_grad_enabled() and not in_backward():
            self.stats.add(aux, z_value, dropped, n * k)
        extra = self.aux_coef * aux + self.z_coef * z
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            y = _AttachLoss.apply(y, extra, self.stats.scale)
        return y
