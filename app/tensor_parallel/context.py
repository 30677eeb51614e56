"""Context parallelism: each of the cp ranks holds 1/cp of every sequence, and causal attention
runs over the whole sequence by passing key/value blocks around the cp group (ring attention).

The split (Megatron-Core's load-balanced causal split): the sequence is cut into 2 cp chunks
and rank i holds chunks i and 2 cp - 1 - i, so that every rank's queries see as many earlier keys
as every other's (a plain split would give the last rank 2 cp - 1 times the first one's work):

    cp = 2, chunks 0 1 2 3:   rank 0 holds 0 and 3,  rank 1 holds 1 and 2

`split_sequence` cuts a rank's part out of a whole sequence, `merge_sequence` puts the parts of all
the ranks back in order (tests, and whatever needs the whole sequence).

`ring_attention(q, k, v, ring)`: at step s of cp steps, rank r holds the keys and values of rank
r - s; for each of its two query chunks and each of the two key chunks it holds, the block is
skipped (keys after the queries), causal (the same chunk) or full (keys before). Partial results
are merged with their log-sum-exp in fp32 (flash attention's rule), so the output is softmax over
all the keys whatever the order the blocks arrive in. The next block is sent and received while
the current one is computed. Backward circulates the keys and values again, with their gradients
accumulating in fp32 on the way (each hop, too, while the next block is computed): after cp hops each
block's gradient is back on its owner. Per step a rank sends its k and v (input dtype) forward, and
backward also their fp32 gradients.

Attention dropout (model.dropout): each block's probabilities are dropped by a mask drawn from its own
generator, seeded by one draw of torch's generator per call and the block's global (query chunk, key
chunk) (`dropout_mask`), so that backward (and a recomputed forward, which restores the generator)
draws the same masks, and the masks of the whole sequence are one function of that draw whatever
the ring's order. The log-sum-exp stays that of the undropped scores, so the blocks merge as without
dropout. Blocks with dropout run as explicit matmuls (torch's fused CPU kernel takes no mask).

Grouped-query attention: k and v have fewer heads (each serving heads / kv_heads query heads);
they travel unexpanded, and their gradients are summed over the query heads they serve.

`all_to_all_attention(q, k, v, ring)` (DeepSpeed-Ulysses) trades the sequence split for a head
split around attention instead: one all-to-all gives each rank the whole sequence of heads / cp of
the heads, plain causal attention runs on them, and one all-to-all gives the sequence split back
(backward: the same all-to-alls reversed). Its traffic per rank does not grow with cp, but cp must
divide the heads (and the key/value heads, which are otherwise expanded to one per query head first).

The ring's blocks run in fp32 whatever the input dtype (the result is cast back to it): torch's fused
CPU flash kernel, which returns the log-sum-exp and takes it back for the gradients (`fused_kernel`),
or explicit matmuls (scores materialised per block: chunk x chunk per head) on GPUs, until the fused
path is checked on one, and wherever dropout is on. The explicit blocks took 2.1x the fused ones'
time on a 2-core CPU (benchmarks/cp_bench.py, seq 4096 on 4 ranks: 1339 against 633 ms).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.attention import sdpa_kernel

from app.runtime.timers import Pending, StepTimers, comm_region, launch, wait
from app.tensor_parallel.mappings import reduced_copy

SEQ_DIM = 2  # q, k, v: (batch, heads, sequence, head_dim)


@dataclass(frozen=True)
class Ring:
    """A cp group as the ring sees it: its size, this rank's place, the torch group (None when
    cp = 1) and the torch ranks of the next and previous members."""

    size: int = 1
    rank: int = 0
    group: Any = None
    next: int = 0
    prev: int = 0
    # The step timers its messages and all-to-alls are charged to (axis "cp"; None: untimed).
    timers: Optional[StepTimers] = field(default=None, compare=False)

    @classmethod
    def of_group(cls, group: Any, timers: Optional[StepTimers] = None) -> Ring:
        """The ring over every member of a torch group, in group-rank order."""
        if group is None:
            return cls()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size == 1:
            return cls()
        return cls(
            size,
            rank,
            group,
            dist.get_global_rank(group, (rank + 1) % size),
            dist.get_global_rank(group, (rank - 1) % size),
            timers,
        )

    def chunks(self, rank: Optional[int] = None) -> tuple[int, int]:
        """The two chunks (of 2 cp) that `rank` (this one by default) holds."""
        r = self.rank if rank is None else rank
        return r, 2 * self.size - 1 - r


def split_sequence(x: torch.Tensor, ring: Ring, dim: int) -> torch.Tensor:
    """This rank's two chunks of the whole sequence along `dim` (its length a multiple of 2 cp)."""
    if ring.size == 1:
        return x
    if x.shape[dim] % (2 * ring.size):
        raise ValueError(f"sequence of {x.shape[dim]} does not split into 2 x cp = {2 * ring.size} chunks")
    parts = x.chunk(2 * ring.size, dim=dim)
    a, b = ring.chunks()
    return torch.cat((parts[a], parts[b]), dim=dim)


def merge_sequence(parts: list[torch.Tensor], ring: Ring, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's `split_sequence` part (parts[r] from rank r)."""
    if ring.size == 1:
        return parts[0]
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * ring.size)
    for r, part in enumerate(parts):
        a, b = ring.chunks(r)
        chunks[a], chunks[b] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def positions(seq_len: int, ring: Ring, device: Optional[torch.device] = None) -> torch.Tensor:
    """The global positions of this rank's tokens (learned position embeddings, rotary angles)."""
    return split_sequence(torch.arange(seq_len, device=device), ring, 0)


def _blocks(ring: Ring, src: int) -> list[tuple[int, int, bool]]:
    """(query half, key half, causal) for the blocks of this rank's queries that attend to the
    keys held by rank `src` (halves 0 and 1 of each rank's tokens); the others are skipped."""
    out = []
    for qh, qc in enumerate(ring.chunks()):
        for kh, kc in enumerate(ring.chunks(src)):
            if kc < qc:
                out.append((qh, kh, False))
            elif kc == qc:
                out.append((qh, kh, True))
    return out


# Message tags: the keys and values, and their gradients (gloo matches by tag; NCCL ignores tags and
# matches in order, which both sides keep).
KV_TAG, GRAD_TAG = 41, 42


def _exchange(ring: Ring, send: list[torch.Tensor], tag: int) -> tuple[list[torch.Tensor], list[Pending]]:
    """Start sending `send` to the next rank and receiving as many tensors from the previous one
    (charged to the ring's timers, axis cp)."""
    send = [t.contiguous() for t in send]
    recv = [torch.empty_like(t) for t in send]
    # One batch: NCCL runs its sends and receives together. Posted one by one, at cp 2 (next = prev,
    # one pair communicator and stream) both ranks' sends would queue before their receives and a
    # block larger than NCCL's buffers would wait forever. gloo posts them one by one as before.
    ops = [dist.P2POp(dist.isend, t, ring.next, ring.group, tag) for t in send]
    ops += [dist.P2POp(dist.irecv, t, ring.prev, ring.group, tag) for t in recv]
    return recv, [launch(ring.timers, "cp", work, "ring send/receive") for work in dist.batch_isend_irecv(ops)]


def _wait(ring: Ring, pending: list[Pending]) -> None:
    for one in pending:
        wait(ring.timers, one)


def _causal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _held_blocks(ring: Ring, kv: list[torch.Tensor], overlap: bool) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """The ring's steps, forward and backward alike: (the rank whose keys and values this rank
    holds, those tensors), the next block travelling while the caller computes on this one (after
    it, with `overlap` False). A gloo work is waited for once: a second wait hangs."""
    for step in range(ring.size):
        works: list[Pending] = []
        if step < ring.size - 1:
            incoming, works = _exchange(ring, kv, KV_TAG)
            if not overlap:
                _wait(ring, works)
                works = []
        yield (ring.rank - step) % ring.size, kv
        if step < ring.size - 1:
            _wait(ring, works)
            kv = incoming


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """One block's scaled scores q k^T (fp32); the same chunk's keys masked after each query."""
    scores = q @ k.transpose(-1, -2) * scale
    return scores.masked_fill(~_causal_mask(q.shape[SEQ_DIM], q.device), -math.inf) if causal else scores


def fused_kernel(device: torch.device) -> bool:
    """Whether torch has a fused attention kernel on `device` that returns the log-sum-exp and takes
    it back for the gradients: the CPU's flash kernel. Elsewhere (GPUs, until checked on one) a
    block is explicit matmuls, its scores materialised (chunk x chunk per head, in fp32)."""
    return device.type == "cpu"


def dropout_mask(
    seed: int, q_chunk: int, k_chunk: int, shape: tuple[int, ...], p: float, device: torch.device
) -> torch.Tensor:
    """The attention dropout of the block of query chunk `q_chunk` and key chunk `k_chunk` (global
    chunk numbers) for the call that drew `seed`: 1 / (1 - p) where a probability is kept, 0 where it
    is dropped (fp32, `shape` = (batch, heads, chunk, chunk))."""
    block = q_chunk * 65_537 + k_chunk  # chunks < 2 cp <= 8192
    generator = torch.Generator(device=device).manual_seed((seed + block * 0x9E3779B97F4A7C15) % 2**63)
    keep = torch.rand(shape, generator=generator, device=device) >= p
    return keep.float() / (1.0 - p)


def _block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    fused: bool,
    drop: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's softmax(q k^T x scale) v and the log-sum-exp of its scores per query (fp32 in,
    fp32 out; k, v expanded to q's heads); `drop`: the block's `dropout_mask`, on the probabilities."""
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return (probs if drop is None else probs * drop) @ v, lse


def _block_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    fused: bool,
    drop: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv, given the whole attention's output `out` and log-sum-exp
    `lse` of these queries (the softmax over every key: P = exp(S - lse), D = rowsum(dO * out)).
    With dropout's mask Z (`drop`): out = (P * Z) v, so dV = (P * Z)^T dO and dS = P * ((dO v^T) * Z - D)."""
    if fused:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return dq, dk, dv
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dp = grad @ v.transpose(-1, -2)
    kept = p if drop is None else p * drop
    ds = p * ((dp if drop is None else dp * drop) - (grad * out).sum(dim=-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, kept.transpose(-1, -2) @ grad


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: Ring,
        scale: float,
        overlap: bool,
        fused: bool,
        dropout: float,
        seed: int,
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        halves = [h.contiguous() for h in q.float().chunk(2, dim=SEQ_DIM)]
        drop = _drops(ring, halves[0].shape, dropout, seed, q.device)
        out = [torch.zeros_like(h) for h in halves]
        lse = [torch.full(h.shape[:-1], -math.inf, device=q.device) for h in halves]
        for src, kv in _held_blocks(ring, [k, v], overlap):
            keys, values = ([c.contiguous() for c in _expand(t.float(), group).chunk(2, dim=SEQ_DIM)] for t in kv)
            for qh, kh, causal in _blocks(ring, src):
                mask = drop(src, qh, kh)
                block_out, block_lse = _block_forward(halves[qh], keys[kh], values[kh], causal, scale, fused, mask)
                merged = torch.logaddexp(lse[qh], block_lse)
                out[qh] = (out[qh] * torch.exp(lse[qh] - merged).unsqueeze(-1)
                           + block_out * torch.exp(block_lse - merged).unsqueeze(-1))  # fmt: skip
                lse[qh] = merged
        o = torch.cat(out, dim=SEQ_DIM)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=SEQ_DIM))
        ctx.ring, ctx.scale, ctx.overlap, ctx.fused, ctx.dropout, ctx.seed = ring, scale, overlap, fused, dropout, seed
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, o, lse = ctx.saved_tensors
        ring, scale, overlap = ctx.ring, ctx.scale, ctx.overlap
        group = q.shape[1] // k.shape[1]
        b, kv_heads, s, d = k.shape
        q_halves, g_halves, o_halves, lse_halves = (
            [h.contiguous() for h in t.chunk(2, dim=SEQ_DIM)] for t in (q.float(), grad.float(), o, lse)
        )
        dq = [torch.zeros_like(h) for h in q_halves]
        drop = _drops(ring, q_halves[0].shape, ctx.dropout, ctx.seed, q.device)
        grads: Optional[list[torch.Tensor]] = None  # the held block's gradient from the ranks before
        pending: list[Pending] = []
        for src, kv in _held_blocks(ring, [k, v], overlap):
            keys, values = ([c.contiguous() for c in _expand(t.float(), group).chunk(2, dim=SEQ_DIM)] for t in kv)
            dk = torch.zeros(b, kv_heads * group, s, d, device=q.device)
            dv = torch.zeros_like(dk)
            dk_halves, dv_halves = dk.chunk(2, dim=SEQ_DIM), dv.chunk(2, dim=SEQ_DIM)
            for qh, kh, causal in _blocks(ring, src):
                dq_block, dk_block, dv_block = _block_backward(
                    g_halves[qh],
                    q_halves[qh],
                    keys[kh],
                    values[kh],
                    o_halves[qh],
                    lse_halves[qh],
                    causal,
                    scale,
                    ctx.fused,
                    drop(src, qh, kh),
                )
                dq[qh] += dq_block
                dk_halves[kh].add_(dk_block)
                dv_halves[kh].add_(dv_block)
            if group > 1:  # a key/value head's gradient: the sum over the query heads it serves
                dk, dv = (t.view(b, kv_heads, group, s, d).sum(dim=2) for t in (dk, dv))
            _wait(ring, pending)  # arrived while this block was computed
            total = [dk, dv] if grads is None else [grads[0] + dk, grads[1] + dv]
            if ring.size > 1:  # on with the block: after cp hops its gradient is back on its owner
                grads, pending = _exchange(ring, total, GRAD_TAG)
                if not overlap:
                    _wait(ring, pending)
                    pending = []
            else:
                grads = total
        _wait(ring, pending)
        assert grads is not None
        dq_out = torch.cat(dq, dim=SEQ_DIM).to(q.dtype)
        return dq_out, grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None, None


def _drops(
    ring: Ring, half: torch.Size, p: float, seed: int, device: torch.device
) -> Callable[[int, int, int], Optional[torch.Tensor]]:
    """The masks of this rank's blocks with the keys of rank `src`: (src, query half, key half) ->
    `dropout_mask` of their global chunks (None without dropout). `half`: (B, heads, chunk, D)."""
    shape = (*half[:-1], half[-2])

    def mask(src: int, qh: int, kh: int) -> Optional[torch.Tensor]:
        if p == 0.0:
            return None
        return dropout_mask(seed, ring.chunks()[qh], ring.chunks(src)[kh], shape, p, device)

    return mask


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    scale: Optional[float] = None,
    overlap: bool = True,
    fused: Optional[bool] = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal softmax(q k^T x scale) v over the whole sequence, this rank holding its two chunks
    (`split_sequence`) of q (batch, heads, 2 x chunk, head_dim) and of k, v (batch, kv heads, ...);
    returns this rank's part of the output. scale: 1 / sqrt(head_dim) by default. `overlap`: each
    block (and, backward, each block's gradient) travels while the one before is computed; False
    waits for it first (the same results: for measuring what the overlap hides). `fused`: each block
    by torch's fused kernel (`fused_kernel`: the default where there is one) or explicit matmuls.
    `dropout`: the probability of dropping an attention probability (explicit blocks, masks by
    `dropout_mask`; the seed is one draw of torch's CPU generator)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if q.shape[SEQ_DIM] % 2:
        raise ValueError(f"a rank's {q.shape[SEQ_DIM]} tokens are not two equal chunks")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if fused is None:
        fused = fused_kernel(q.device) and dropout == 0.0
    elif fused and (dropout > 0.0 or not fused_kernel(q.device)):
        raise ValueError(
            f"no fused attention kernel with a log-sum-exp and dropout on {q.device.type} here: fused=False"
        )
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout > 0.0 else 0
    return _RingAttention.apply(q, k, v, ring, scale, overlap, fused, dropout, seed)


def _to_heads(x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """(B, heads, own tokens, D) split by sequence -> (B, heads / cp, whole sequence, D) split by heads:
    head slice j goes to rank j, and the chunks received from every rank are put back in order."""
    b, h, s, d = x.shape
    send = x.reshape(b, ring.size, h // ring.size, s, d).transpose(0, 1).contiguous()  # [dst] slices
    recv = torch.empty_like(send)
    with comm_region(ring.timers, "cp", "all_to_all"):
        dist.all_to_all_single(recv, send, group=ring.group)
    return merge_sequence(list(recv.unbind(0)), ring, dim=SEQ_DIM)  # recv[src]: src's two chunks


def _to_sequence(x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """The inverse of `_to_heads`: (B, heads / cp, whole sequence, D) -> (B, heads, own tokens, D)."""
    b, hl, _, d = x.shape
    parts = x.chunk(2 * ring.size, dim=SEQ_DIM)
    send = torch.stack([torch.cat((parts[a], parts[c]), dim=SEQ_DIM) for a, c in map(ring.chunks, range(ring.size))])
    recv = torch.empty_like(send)  # [src]: src's heads of this rank's tokens
    with comm_region(ring.timers, "cp", "all_to_all"):
        dist.all_to_all_single(recv, send.contiguous(), group=ring.group)
    return recv.transpose(0, 1).reshape(b, ring.size * hl, -1, d)


class _Relayout(torch.autograd.Function):
    """Sequence split -> head split (`to_heads`) or back; backward: the other way (a permutation's
    adjoint is its inverse)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ring: Ring, to_heads: bool) -> torch.Tensor:
        ctx.ring, ctx.to_heads = ring, to_heads
        return (_to_heads if to_heads else _to_sequence)(x, ring)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        return (_to_sequence if ctx.to_heads else _to_heads)(grad, ctx.ring), None, None


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    scale: Optional[float] = None,
    dropout: float = 0.0,
    backend: Any = None,
) -> torch.Tensor:
    """Causal attention over the whole sequence, like `ring_attention` (the same inputs and output),
    by two all-to-alls around torch's attention on heads / cp of the heads (module docstring);
    `dropout`: torch's attention dropout on them; `backend`: the SDPA backend to run
    (model.attention_kernel's; None: torch picks)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if heads % ring.size:
        raise ValueError(f"all-to-all context parallelism: cp = {ring.size} must divide the {heads} heads")

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        with sdpa_kernel(backend) if backend is not None else nullcontext():
            return torch.nn.functional.scaled_dot_product_attention(
                q, _expand(k, group), _expand(v, group), dropout_p=dropout, is_causal=True, scale=scale
            )

    if ring.size == 1:
        return attend(q, k, v)
    if kv_heads % ring.size:  # too few key/value heads to split: one per query head
        k, v = _expand(k, heads // kv_heads), _expand(v, heads // kv_heads)
    q, k, v = (_Relayout.apply(t, ring, True) for t in (q, k, v))
    return _Relayout.apply(attend(q, k, v), ring, False)


@dataclass(frozen=True)
class ContextParallel:
    """What the model needs of context parallelism (parallel.cp, parallel.cp_kind): this rank's part
    of each sequence (`split`, `positions`) and causal attention over the whole sequence
    (`attention`). At cp = 1 (`NO_CP`) the model runs as without it."""

    ring: Ring = Ring()
    kind: str = "ring"  # names.CP_KINDS
    overlap: bool = True  # the ring's transfers behind its blocks (False: for measuring the overlap)

    @property
    def size(self) -> int:
        return self.ring.size

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's two chunks of the whole sequence `x` along `dim`."""
        return split_sequence(x, self.ring, dim)

    def split_batches(self, micro_batches: list[tuple[torch.Tensor, Any]]) -> list[tuple[torch.Tensor, Any]]:
        """This rank's two chunks of every sequence of the micro-batches' tokens and targets, (B, S)
        each; targets with loss weights (Goldfish's `CountedTargets`, a NamedTuple of (B, S)
        tensors) are split field by field. Unchanged at cp = 1."""
        if self.size == 1:
            return micro_batches

        def targets(y: Any) -> Any:
            return type(y)(*(self.split(t, 1) for t in y)) if isinstance(y, tuple) else self.split(y, 1)

        return [(self.split(x, 1), targets(y)) for x, y in micro_batches]

    def positions(self, seq_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """The global positions of this rank's tokens of a `seq_len` sequence."""
        return positions(seq_len, self.ring, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A new tensor: x summed over the cp group (a mixture of experts' token sums)."""
        if self.size == 1:
            return x.contiguous().clone()
        return reduced_copy(x, self.ring.group, self.ring.timers, "cp")

    def spans(self, seq_len: int) -> Optional[list[tuple[int, int]]]:
        """This rank's chunks of a `seq_len` sequence as ranges [a, b) of positions, in the order
        `split` keeps them (what the data loader reads, `app.data.get_batch`); None at cp = 1."""
        if self.size == 1:
            return None
        chunk = seq_len // (2 * self.size)
        return [(c * chunk, (c + 1) * chunk) for c in self.ring.chunks()]

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float = 0.0, backend: Any = None
    ) -> torch.Tensor:
        """Causal attention over the whole sequence of this rank's q (B, heads, own tokens, D) and
        k, v (B, kv heads, own tokens, D): the ring or the all-to-all; `dropout` on the probabilities;
        `backend` (model.attention_kernel's SDPA backend) for the all-to-all's attention: the ring
        computes its own blocks."""
        if self.kind == "all_to_all":
            return all_to_all_attention(q, k, v, self.ring, dropout=dropout, backend=backend)
        return ring_attention(q, k, v, self.ring, overlap=self.overlap, dropout=dropout)


NO_CP = ContextParallel()
