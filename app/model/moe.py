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

Dispatch. The T k assignments are sorted by expert (stable: token order within an expert); each
expert runs its two GEMMs over exactly the assignments it kept: all it got (dropless, the
default), or at most the capacity ceil(capacity_factor T k / E), beyond which an expert's later
tokens (by position) are dropped: their share of y is 0 and the
residual carries them. Each token's k outputs are summed in a fixed order, so the result does not
depend on the grid. Under tensor parallelism the experts are whole on every tp rank: without sequence
parallelism each rank routes all tokens, with it each its own sequence shard (the weights'
gradients then partial sums over tp, like the norms'; the losses' token sums summed over tp:
`balance_losses`; dropless only). Under context parallelism each cp rank routes its chunks of
the sequence: the losses' token sums are summed over cp too, and each rank's share of their
gradient counts cp times, the gradients being averaged over dp x cp (dropless, ep 1 only).

Expert parallelism (`parallel.ep`, `ExpertParallel`): the ep ranks of an expert group (consecutive
dp ranks, `ProcessGrid.expert_groups`) hold E / ep experts each, (E / ep, out, in) boxes of the
stacked tensors (`ParamMeta.split["ep"]`). Each rank routes its own tokens and applies the capacity
to them (so the same assignments drop as on one rank), sorts its kept assignments by expert, and
(1) exchanges the per-expert counts (one small all-to-all, read on the host: the split sizes),
(2) sends each assignment's token to the rank of its expert (all-to-all, variable splits), which
runs each of its experts over the rows it received for it from every rank (the shared experts
run while the tokens travel: `all_to_all_start`), and (3) the outputs return by the reverse all-to-all (backward: the same exchanges reversed, `mappings.all_to_all`).
The experts' gradients sum over the ranks that hold the same experts (`DataParallel`'s expert
buckets); the router and the shared experts stay replicated like any dense parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.runtime.timers import StepTimers, comm_region
from app.sharding.init import ParamMeta
from app.sharding.layout import ep_box
from app.tensor_parallel.context import NO_CP, ContextParallel
from app.tensor_parallel.layers import replicated_param
from app.tensor_parallel.mappings import TensorParallel, all_to_all, all_to_all_start, in_backward


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in its expert group (`parallel.ep`): `size` ranks holding E / size experts
    each, this rank the `rank`-th (experts [rank E / size, (rank + 1) E / size)), `group` their torch
    group (None at size 1), `timers` the step timers its exchanges are charged to (sub-axis "ep")."""

    size: int = 1
    rank: int = 0
    group: Any = None
    timers: Optional[StepTimers] = None

    def box(self, meta: ParamMeta) -> ParamMeta:
        """`meta` of stacked experts (E, ...) for this rank: its E / size along dim 0 (`ep_box`)."""
        return ep_box(meta, self.size, self.rank)


NO_EP = ExpertParallel()


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


def top1_warning(experts: int, top_k: int) -> Optional[str]:
    """The log's warning for top-1 routing: `route` renormalises the chosen weights (Mixtral's rule, which
    the export matches), so a lone expert's weight is exactly 1 and the language-model loss gives the
    router no gradient (found in review: 7e-7, rounding, against 9.5 at top-2): it learns only from the
    balancing and z-losses. None otherwise."""
    if not experts or top_k != 1:
        return None
    return (
        "gridlm: warning: model.moe_top_k = 1: the chosen expert's weight is renormalised to exactly 1 (Mixtral's "
        "rule), so the language-model loss does not train the router; only model.moe_aux_loss_coef and "
        "model.moe_z_loss_coef do. Use model.moe_top_k >= 2 for a router trained by the loss"
    )


def balance_losses(
    logits: torch.Tensor,
    probs: torch.Tensor,
    experts: torch.Tensor,
    tp: Optional[TensorParallel] = None,
    cp: ContextParallel = NO_CP,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the load-balancing loss E sum_e f_e P_e, the z-loss mean_t logsumexp^2, the z-loss's value)
    over a micro-batch's T tokens. Under sequence parallelism (`tp`) this rank holds T / tp of them,
    under context parallelism (`cp`) T / cp: the sums over the tokens are summed over tp and cp (an
    all-reduce each), and a rank's losses carry the gradient of its own tokens only, so that the
    ranks' backward passes add up to the whole's (the aux value is the whole's on every rank; the
    z-loss is this rank's share of the whole's, whose value the third element gives for the log)."""
    n_experts = probs.shape[-1]
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype)
    mass = probs.sum(dim=0)
    lse2 = torch.logsumexp(logits.float(), dim=-1).pow(2).sum()
    tokens = probs.shape[0]
    splits = [g for g in (tp, cp) if g is not None and g.size > 1]  # the groups holding the other tokens
    if splits:
        whole = torch.cat([counts, mass.detach(), lse2.detach().reshape(1)])
        for group in splits:
            whole = group.all_reduce(whole)
            tokens *= group.size
        counts = whole[:n_experts]
        mass = mass + (whole[n_experts : 2 * n_experts] - mass.detach())  # the gradient reaches this rank's tokens
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
        ep: ExpertParallel = NO_EP,
    ) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.ep, self.local_experts = ep, experts // ep.size
        self.aux_coef, self.z_coef = coefficients
        self.act, self.stats = act, stats
        # Sequence parallelism: each tp rank routes its own sequence shard (a partial gradient per rank).
        self.tp = tp if tp.sequence_parallel and tp.size > 1 else None
        self.cp: ContextParallel = NO_CP  # set by GPT: each cp rank routes its chunks of the sequence

        def param(meta: ParamMeta) -> nn.Parameter:
            return replicated_param(meta, tp, device, sequence_sharded_input=True)

        self.router = nn.Module()
        self.router.weight = param(ParamMeta((experts, hidden), std=std))
        self.fc = nn.Module()  # the stacked experts: this rank's E / ep of them (`ExpertParallel.box`)
        self.fc.weight = param(ep.box(ParamMeta((experts, fc_rows, hidden), std=std)))
        if bias:
            self.fc.bias = param(ep.box(ParamMeta((experts, fc_rows), init="zeros", decay=False)))
        self.proj = nn.Module()
        self.proj.weight = param(ep.box(ParamMeta((experts, hidden, ffn), std=out_std)))
        if bias:
            self.proj.bias = param(ep.box(ParamMeta((experts, hidden), init="zeros", decay=False)))
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

    def _mlp(
        self,
        x: torch.Tensor,
        w1: torch.Tensor,
        b1: Optional[torch.Tensor],
        w2: torch.Tensor,
        b2: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """proj(act(fc x)) with (out, in) weights w1, w2 (and biases b1, b2 where the model has them):
        one expert's over its rows x (R_e, h), or the shared experts' over x (T, h)."""
        h = torch.matmul(x, w1.transpose(-1, -2))
        if b1 is not None:
            h = h + b1
        out = torch.matmul(self.act(h), w2.transpose(-1, -2))
        return out + b2 if b2 is not None else out

    def _shared(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared experts' output for tokens (T, h); None without shared experts."""
        if self.shared is None:
            return None
        fc, proj = self.shared.fc, self.shared.proj
        return self._mlp(tokens, fc.weight, getattr(fc, "bias", None), proj.weight, getattr(proj, "bias", None))

    def capacity(self, tokens: int) -> Optional[int]:
        """The most assignments an expert takes (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.experts))

    def _run_experts(
        self, rows: torch.Tensor, expert: torch.Tensor, counts: Optional[list[int]] = None
    ) -> torch.Tensor:
        """The outputs of rows (R, h) through this rank's experts (`expert`: each row's, local index;
        `counts`: the rows of each, where the host has them), in the rows' order: the rows grouped by
        expert, each expert's GEMMs over exactly its rows (as Megatron-LM's SequentialMLP). A batched
        matmul over an (E_local, busiest, h) buffer, as before, kept E_local x the busiest expert's
        rows for backward: 1.3-1.9x the routed rows at initialisation, which the planner (routed
        rows) did not count."""
        order = torch.argsort(expert, stable=True)
        if counts is None:  # the split: one copy to the host
            counts = torch.bincount(expert, minlength=self.local_experts).tolist()
        grouped = rows[order].split(counts)
        # The experts' matrices by one unbind each: its backward stacks the E gradients into one tensor,
        # where indexing weight[e] made a zero-filled gradient of the whole stack per expert (E^2 bytes).
        fc, proj = self.fc, self.proj
        w1, w2 = fc.weight.unbind(0), proj.weight.unbind(0)
        b1, b2 = (fc.bias.unbind(0), proj.bias.unbind(0)) if self.bias else ((None,) * len(w1),) * 2
        # Every expert runs, an empty one on zero rows: its weights get a (zero) gradient as before.
        out = torch.cat([self._mlp(part, w1[e], b1[e], w2[e], b2[e]) for e, part in enumerate(grouped)])
        return out[torch.argsort(order)]

    def _exchange(
        self, rows: torch.Tensor, expert: torch.Tensor, meanwhile: Callable[[], Optional[torch.Tensor]]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Expert parallelism: rows (sorted by global `expert`) to their experts' ranks of the expert
        group and their outputs back, in the rows' order (module docstring: steps 1-3); and what
        `meanwhile` computes while the rows travel (the shared experts)."""
        ep, local = self.ep, self.local_experts
        counts = torch.bincount(expert, minlength=self.experts)
        received = torch.empty_like(counts)
        with comm_region(ep.timers, "ep", "all_to_all"):
            dist.all_to_all_single(received, counts, group=ep.group)  # (source, local expert) counts
            host = torch.cat([counts, received]).tolist()  # the split sizes: one copy to the host
        sent, mine = host[: self.experts], host[self.experts :]
        send, recv = ([sum(c[i * local : (i + 1) * local]) for i in range(ep.size)] for c in (sent, mine))
        finish = all_to_all_start(rows, send, recv, ep.group, ep.timers)
        side = meanwhile()
        arrived = finish()  # by source, then expert, then source order
        which = torch.arange(local, device=rows.device).repeat(ep.size)
        expert_of = torch.repeat_interleave(which, received.view(-1))
        out = self._run_experts(arrived, expert_of, [sum(mine[e::local]) for e in range(local)])
        return all_to_all(out, recv, send, ep.group, ep.timers), side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n, k, n_experts = tokens.shape[0], self.top_k, self.experts
        logits = F.linear(tokens, self.router.weight)
        probs, weights, experts = route(logits, k)
        aux, z, z_value = balance_losses(logits, probs, experts, self.tp, self.cp)
        # An assignment's slot is its rank within its expert (token order); beyond the capacity it drops.
        flat = experts.reshape(-1)
        slot, _, order = _slots(flat, n_experts)
        # Evaluation and decoding route every token: a capacity there made a sample's output depend on
        # the other samples of its batch, and differ from the exported (dropless) Mixtral's.
        limit = self.capacity(n) if self.training else None
        src = torch.arange(n, device=x.device).repeat_interleave(k)
        shared: Optional[torch.Tensor] = None
        if self.ep.size == 1:
            kept = torch.arange(n * k, device=x.device) if limit is None else torch.nonzero(slot < limit).view(-1)
            out = self._run_experts(tokens[src[kept]], flat[kept])
        else:  # the kept assignments sorted by expert: the exchange's order
            kept = order if limit is None else order[slot[order] < limit]
            out, shared = self._exchange(tokens[src[kept]], flat[kept], lambda: self._shared(tokens))
        dropped = torch.full((), n * k - kept.numel(), dtype=torch.long, device=x.device)
        in_order = self.ep.size == 1 and kept.numel() == n * k  # every assignment, in assignment order
        picked = out if in_order else out.new_zeros(n * k, shape[-1]).index_copy(0, kept, out)
        y = (picked * weights.reshape(-1, 1).to(out.dtype)).view(n, k, -1).sum(dim=1)
        if self.shared is not None:
            y = y + (shared if shared is not None else self._shared(tokens))
        y = y.view(shape)
        # A recomputation in backward (full activation recompute): its statistics were counted once.
        if torch.is_grad_enabled() and not in_backward():
            self.stats.add(aux, z_value, dropped, n * k)
        extra = self.aux_coef * aux + self.z_coef * z
        if self.cp.size > 1:  # gradients are averaged over cp (`balance_losses`: each rank's part of the whole's)
            extra = extra * self.cp.size
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            y = _AttachLoss.apply(y, extra, self.stats.scale)
        return y


def _slots(expert: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's rank among the rows of its expert, in row order; the rows per expert; the rows
    sorted by expert, stably)."""
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    ranked = torch.arange(expert.numel(), device=expert.device) - starts[expert[order]]
    return torch.empty_like(ranked).scatter_(0, order, ranked), counts, order
