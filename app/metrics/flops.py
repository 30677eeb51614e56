"""FLOPs of one training step of a GPT: model FLOPs, and hardware FLOPs with recomputation.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC21, Appendix (eq. 3). Counting 2 FLOPs per multiply-add, forward
= 1 and backward = 2 units of GEMM work, with no activation recomputation, a step over a
global batch of B sequences of length s through l layers of width h with vocabulary V is

    F = 72 * B * s * l * h^2 * (1 + s / (6 h) + V / (12 l h))

These *model* FLOPs (MFU) do not depend on how the step is run. *Hardware* FLOPs (HFU)
add what activation recomputation executes again: with full recomputation one more
forward of every transformer layer (not the head),

    96 * B * s * l * h^2 * (1 + s / (6 h) + V / (16 l h))

(same paper; less a dense block's MLP output GEMM where gridlm's recomputation does not run it
again, `step_flops`), and with selective recomputation (Korthikanti et al. 2022) one more
forward of the attention core only, the score and context GEMMs: 4 * s * h per token and
layer. The formulas assume an MLP width of 4h and count the full (not causally halved)
attention score and context GEMMs, like the paper; LayerNorm, softmax, GELU and the
embedding lookups are ignored. `gpt_step_flops` and `gpt_hardware_step_flops` give the
same counts for any MLP width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from app.deck import Deck, ModelConfig

# Said in every output that reports FLOP/s (log, summary.json, TensorBoard tags, dry run, postprocess).
FLOPS_CONVENTION = (
    "model FLOPs (TFLOP/s, MFU): Megatron SC21 count, 2 FLOPs per multiply-add, backward = 2 x forward, "
    "full (not causally halved) attention; hardware FLOPs (HFU) add what train.recompute re-executes; mixture of "
    "experts: the router and the top-k experts a token is routed to (active parameters)"
)


def megatron_step_flops(global_batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """The SC21 formula above, exactly as published (MLP width 4h, no recompute)."""
    b, s, n, h, v = global_batch, seq_len, layers, hidden, vocab  # n: the formula's l
    return 72.0 * b * s * n * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * n * h))


def megatron_recompute_step_flops(global_batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """The SC21 hardware-FLOPs formula with full recomputation, as published (MLP width 4h)."""
    b, s, n, h, v = global_batch, seq_len, layers, hidden, vocab
    return 96.0 * b * s * n * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * n * h))


def arch_flops_args(model: ModelConfig) -> dict[str, Any]:
    """The keyword arguments of `gpt_step_flops` and `gpt_hardware_step_flops` that describe a deck's
    `model` beyond its sizes: the key/value width (grouped-query attention) and a gated (SwiGLU) MLP."""
    return {"kv_hidden": model.kv * model.head_dim, "gated": model.spec.gated}


def _layer_forward(h: int, ffn: int, kv_hidden: Optional[int], gated: bool) -> float:
    """Forward GEMM FLOPs per token of a layer's Linears: QKV 2 h (h + 2 kv), the output projection
    2 h^2, the MLP 2 h ffn per matrix (2 matrices; 3 gated: gate, up and down)."""
    kv = h if kv_hidden is None else kv_hidden
    return 2.0 * h * (h + 2 * kv) + 2.0 * h * h + (3 if gated else 2) * 2.0 * h * ffn


def moe_layers(model: ModelConfig) -> int:
    """Blocks with experts (`ModelConfig.is_moe`): 0, moe_every, 2 moe_every, ..."""
    return sum(model.is_moe(i) for i in range(model.layers)) if model.moe_experts else 0


def mlp_forward(model: ModelConfig, moe: bool) -> float:
    """Forward GEMM FLOPs per token of a block's MLP: the dense one (2 h ffn per matrix), or a mixture
    of experts' router (2 h E), its top-k experts and its shared ones (active parameters: what a
    token runs)."""
    matrices = 3 if model.spec.gated else 2
    if not moe:
        return matrices * 2.0 * model.hidden * model.ffn
    routed = (model.moe_top_k + model.moe_shared_experts) * matrices * 2.0 * model.hidden * model.expert_ffn
    return routed + 2.0 * model.hidden * model.moe_experts


def moe_step_delta(model: ModelConfig, tokens: int) -> float:
    """Forward + backward FLOPs a step's MoE layers add over dense MLPs of width model.ffn (`tokens`:
    the step's)."""
    return 3.0 * tokens * moe_layers(model) * (mlp_forward(model, True) - mlp_forward(model, False))


def linear_step_flops(model: ModelConfig, tokens: int) -> float:
    """Forward + backward FLOPs of one block's Linears over `tokens` tokens: the dense part of a
    layer, which 3D tensor parallelism splits over X and Y (the attention core only over Y)."""
    args = arch_flops_args(model)
    return 3.0 * tokens * _layer_forward(model.hidden, model.ffn, args["kv_hidden"], args["gated"])


def gpt_step_flops(
    global_batch: int, seq_len: int, layers: int, hidden: int, vocab: int, ffn: int,
    causal: bool = False, kv_hidden: Optional[int] = None, gated: bool = False,
) -> float:  # fmt: skip
    """Model FLOPs per step term by term (forward x 3 for forward + backward).

    Per layer and token, forward: QKV 2*3h^2, output projection 2h^2, MLP 2*2*h*ffn,
    attention scores and context 2*2*s*h. Output head: 2*h*V per token.
    Equals `megatron_step_flops` when ffn == 4h. `causal=True` halves the score and context
    GEMMs (only the lower triangle is needed), the convention of e.g. FlashAttention's and
    torchtitan's counts; gridlm reports the full count (`FLOPS_CONVENTION`), like Megatron.
    llama (`arch_flops_args`): QKV 2 h (h + 2 kv_hidden) with grouped-query attention, and the
    SwiGLU MLP's three matrices 3 x 2 h ffn.
    """
    b, s, n, h, v = global_batch, seq_len, layers, hidden, vocab
    attention = (2.0 if causal else 4.0) * s * h
    per_token_layer = _layer_forward(h, ffn, kv_hidden, gated) + attention
    forward = b * s * (n * per_token_layer + 2.0 * h * v)
    return 3.0 * forward


def gpt_hardware_step_flops(
    global_batch: int, seq_len: int, layers: int, hidden: int, vocab: int, ffn: int, recompute: str,
    kv_hidden: Optional[int] = None, gated: bool = False,
) -> float:  # fmt: skip
    """FLOPs executed per step: `gpt_step_flops` plus the forward work recomputation repeats.

    recompute: "none" (= model FLOPs), "full" (every layer's forward again; equals
    `megatron_recompute_step_flops` when ffn == 4h) or "selective" (the attention core's).
    """
    h = hidden
    core = 4.0 * seq_len * h  # per token and layer: scores q k^T and context p v, 2 s h each
    again = {"none": 0.0, "full": _layer_forward(h, ffn, kv_hidden, gated) + core, "selective": core}
    if recompute not in again:
        raise ValueError(f"recompute={recompute!r}: expected one of {', '.join(again)}")
    tokens = global_batch * seq_len
    model = gpt_step_flops(global_batch, seq_len, layers, hidden, vocab, ffn, kv_hidden=kv_hidden, gated=gated)
    return model + tokens * layers * again[recompute]


def step_flops(deck: Deck, gpu: Optional[bool] = None) -> dict[str, float]:
    """Model FLOPs (MFU) and hardware FLOPs (with the deck's recomputation) of one optimizer step of
    the deck's model and global batch: the run's report, the dry run and the performance model.
    `gpu`: whether the ranks are GPUs (where train.fuse_grad_accumulation is null; None: as GPUs).

    Full recomputation re-runs each block's forward only until the tensors its backward saved are
    rebuilt (torch's non-reentrant checkpoint stops early): a dense block's MLP output GEMM, whose
    saved input its GELU or SwiGLU already rebuilt, runs again only where its weight gradient is
    fused (a custom autograd function saves its tensors after its GEMM) or dropout follows it (its
    mask is saved), so hardware FLOPs leave it out where neither (CPU ranks by default, without
    dropout) and count it where either (GPUs), as measured with
    torch's FlopCounterMode. Mixture-of-experts blocks (their output feeds the gate weights, which
    save it) and 3D tensor parallelism (custom functions) re-run the whole forward. Selective
    recomputation re-runs a fused attention kernel whole (one op that saves its output), and of
    the math kernel only the scores (its context GEMM's inputs were saved before it ran). The
    experts count the tokens routed to them: their batched GEMM runs every expert over the most
    tokens any one got (`MoE._run_experts`), so an unbalanced router executes more than counted
    (+14% measured on a 4-expert top-2 llama at initialisation)."""
    m, tr = deck.model, deck.train
    size = (tr.global_batch, m.seq_len, m.layers, m.hidden, m.vocab_size, m.ffn)
    arch = arch_flops_args(m)
    tokens = tr.global_batch * m.seq_len
    moe = moe_step_delta(m, tokens)  # the experts' GEMMs for the dense MLP's
    again = moe / 3 if tr.recompute == "full" else 0.0  # full recomputation runs their forward again
    on_gpu = True if gpu is None else gpu
    unfused = not tr.fuses_grad_accumulation(on_gpu) and deck.parallel.tensor3d is None
    if tr.recompute == "full" and m.dropout == 0 and unfused:
        again -= tokens * (m.layers - moe_layers(m)) * 2.0 * m.hidden * m.ffn  # the output GEMM not re-run
    if tr.recompute == "selective" and m.attention_on(on_gpu) == "math":
        # The math core's context GEMM (p v) saved its inputs before it ran: only the scores run again.
        again -= tokens * m.layers * 2.0 * m.seq_len * m.hidden
    return {
        "model": gpt_step_flops(*size, **arch) + moe,
        "hardware": gpt_hardware_step_flops(*size, tr.recompute, **arch) + moe + again,
    }
