"""llama: Llama (Touvron et al. 2023) — rotary positions, pre-RMSNorm, SwiGLU MLP, grouped-query
attention, no biases, an untied head by default, an MLP width of 8/3 x hidden rounded up to a
multiple of 64. 1D tensor parallelism only (no 3D layout of the fused rows yet).

Its Hugging Face form is `LlamaForCausalLM` (`HFFormat` below): `nn.Linear` (out, in) weights both
sides; q/k/v_proj fused into gridlm's rows (kv head, its query heads, k, v) and gate_proj and
up_proj interleaved (row 2j gate feature j, 2j + 1 up), so one tensor-parallel split keeps each
group and each feature's pair on one rank (`app/model/gpt.py`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from app.archs.hf import Rule, config_tail, qkv_parts, same
from app.archs.spec import Arch, HFFormat


def hf_config(model: dict[str, Any]) -> dict[str, Any]:
    """LlamaConfig fields (config.json) for a checkpoint's model section; MixtralConfig's for one with
    experts (in every block: `mixtral_blocks`)."""
    if model.get("moe_experts"):
        return {
            **_llama_config(model),
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": model["expert_ffn"],
            "num_local_experts": model["moe_experts"],
            "num_experts_per_tok": model["moe_top_k"],
            "router_aux_loss_coef": hf_aux_loss_coef(model),
            "output_router_logits": False,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    return _llama_config(model)


def hf_aux_loss_coef(model: dict[str, Any]) -> float:
    """Mixtral's `router_aux_loss_coef` that weighs its balancing loss as `model.moe_aux_loss_coef`
    weighs gridlm's. gridlm adds coef x E sum_e f_e P_e per MoE layer, f_e a share of the assignments
    (summing to 1); Hugging Face adds coef x E sum_e f_e P_e once, pooled over the layers, f_e a share
    of the tokens (summing to top_k). With the layers alike the two differ by layers / top_k; they
    differ only in pooling otherwise (docs/MODELS.md)."""
    coef = model.get("moe_aux_loss_coef", 0.0)
    return coef * model["layers"] / model["moe_top_k"] if coef else 0.0


def mixtral_blocks(model: dict[str, Any]) -> Optional[str]:
    """Why a model with experts has no Mixtral form, or None: Mixtral has experts in every block and
    no shared experts."""
    if model.get("moe_experts") and model.get("moe_every", 1) != 1:
        return f"model.moe_every = {model['moe_every']}: a Mixtral has experts in every block (moe_every 1)"
    if model.get("moe_experts") and model.get("moe_shared_experts"):
        return f"model.moe_shared_experts = {model['moe_shared_experts']}: a Mixtral has no shared experts"
    return None


def _llama_config(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden"],
        "intermediate_size": model["ffn"],
        "num_hidden_layers": model["layers"],
        "num_attention_heads": model["heads"],
        "num_key_value_heads": model["kv"],
        "head_dim": model["hidden"] // model["heads"],
        "max_position_embeddings": model["seq_len"],
        "hidden_act": "silu",
        "rms_norm_eps": model["layernorm_eps"],
        "rope_theta": model["rope_theta"],
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": model["dropout"],
        **config_tail(model),
    }


def hf_rules(model: dict[str, Any]) -> dict[str, Rule]:
    """llama: gridlm name -> LlamaForCausalLM tensor (`nn.Linear` (out, in) both sides)."""
    h, f, v, n, kv = model["hidden"], model["ffn"], model["vocab_size"], model["heads"], model["kv"]
    d, group = h // n, n // kv
    rules = {
        "wte.weight": Rule("model.embed_tokens.weight", (v, h), same, (v, h)),
        "ln_f.weight": Rule("model.norm.weight", (h,), same, (h,)),
    }
    if not model["tie_embeddings"]:
        rules["head"] = Rule("lm_head.weight", (v, h), same, (v, h))
    qkv = (n + 2 * kv) * d

    def qkv_part(part: slice) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray, np.ndarray], None]]:
        def place(out: np.ndarray, x: np.ndarray) -> None:
            out.reshape(kv, group + 2, d, h)[:, part] = x.reshape(kv, -1, d, h)

        return (lambda x: qkv_parts(x, kv, d, part)), place

    def rows(start: int) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray, np.ndarray], None]]:
        def place(out: np.ndarray, x: np.ndarray) -> None:
            out[start::2] = x

        return (lambda x: x[start::2]), place

    q, k, vv = qkv_part(slice(0, group)), qkv_part(slice(group, group + 1)), qkv_part(slice(group + 1, group + 2))
    gate, up = rows(0), rows(1)
    experts = model.get("moe_experts") or 0
    for i in range(model["layers"]):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        if experts:  # MixtralForCausalLM's saved form: a router and each expert's w1 (gate), w3 (up), w2 (down)
            rules.update(_expert_rules(ours, hf, experts, model["expert_ffn"], h))
        # One Rule per HF tensor: the fused gridlm tensors appear under the names "...#q" etc.
        rules.update({
            ours + "ln1.weight": Rule(hf + "input_layernorm.weight", (h,), same, (h,)),
            ours + "attn.qkv.weight#q": Rule(hf + "self_attn.q_proj.weight", (qkv, h), q[0], (n * d, h), q[1]),
            ours + "attn.qkv.weight#k": Rule(hf + "self_attn.k_proj.weight", (qkv, h), k[0], (kv * d, h), k[1]),
            ours + "attn.qkv.weight#v": Rule(hf + "self_attn.v_proj.weight", (qkv, h), vv[0], (kv * d, h), vv[1]),
            ours + "attn.proj.weight": Rule(hf + "self_attn.o_proj.weight", (h, h), same, (h, h)),
            ours + "ln2.weight": Rule(hf + "post_attention_layernorm.weight", (h,), same, (h,)),
        })  # fmt: skip
        if not experts:
            rules.update({
                ours + "mlp.fc.weight#gate": Rule(hf + "mlp.gate_proj.weight", (2 * f, h), gate[0], (f, h), gate[1]),
                ours + "mlp.fc.weight#up": Rule(hf + "mlp.up_proj.weight", (2 * f, h), up[0], (f, h), up[1]),
                ours + "mlp.proj.weight": Rule(hf + "mlp.down_proj.weight", (h, f), same, (h, f)),
            })  # fmt: skip
    return rules


def _expert_rules(ours: str, hf: str, experts: int, f: int, h: int) -> dict[str, Rule]:
    """A block's experts: gridlm's router (E, h) and stacked experts, fc (E, 2f, h) with gate and up
    rows interleaved and proj (E, h, f), against Mixtral's block_sparse_moe.gate and per expert
    w1 (gate, (f, h)), w3 (up) and w2 (down, (h, f))."""
    moe = hf + "block_sparse_moe."
    rules = {ours + "mlp.router.weight": Rule(moe + "gate.weight", (experts, h), same, (experts, h))}

    def part(j: int, start: Optional[int]) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[..., None]]:
        """Expert j's slice of a stacked tensor: its gate (start 0) or up (1) rows, or all of it."""
        rows = slice(None) if start is None else slice(start, None, 2)

        def place(out: np.ndarray, x: np.ndarray) -> None:
            out[j, rows] = x

        return (lambda x: x[j, rows]), place

    for j in range(experts):
        w1, w3, w2 = part(j, 0), part(j, 1), part(j, None)
        rules.update({
            f"{ours}mlp.fc.weight#w1.{j}": Rule(f"{moe}experts.{j}.w1.weight", (experts, 2 * f, h), w1[0], (f, h), w1[1]),
            f"{ours}mlp.fc.weight#w3.{j}": Rule(f"{moe}experts.{j}.w3.weight", (experts, 2 * f, h), w3[0], (f, h), w3[1]),
            f"{ours}mlp.proj.weight#w2.{j}": Rule(f"{moe}experts.{j}.w2.weight", (experts, h, f), w2[0], (h, f), w2[1]),
        })  # fmt: skip
    return rules


def rope(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings: transformers 5's `rope_parameters`, or 4's top-level rope_theta and rope_scaling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        return params
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    return {**({"rope_theta": config["rope_theta"]} if "rope_theta" in config else {}), "rope_type": kind}


def hf_expected(config: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(deck model key, HF config key, the value the deck must have) for each key that shapes the
    model or its numerics; HF's defaults where config.json leaves a key out."""
    heads = config.get("num_attention_heads", 32)
    if config.get("model_type") == "mixtral":  # the experts' width is intermediate_size
        return [
            # MixtralConfig's defaults where config.json leaves a key out (not LlamaConfig's; found in review)
            *(e for e in _llama_expected(config, heads, eps=1e-5, theta=1e6, kv=8) if e[0] != "ffn_hidden"),
            ("moe_experts", "num_local_experts", config.get("num_local_experts", 8)),
            ("moe_top_k", "num_experts_per_tok", config.get("num_experts_per_tok", 2)),
            ("moe_ffn_hidden", "intermediate_size", config.get("intermediate_size", 14336)),
        ]
    return [*_llama_expected(config, heads), ("moe_experts", "num_local_experts", 0)]


def _llama_expected(
    config: dict[str, Any], heads: int, eps: float = 1e-6, theta: float = 10000.0, kv: Optional[int] = None
) -> list[tuple[str, str, Any]]:
    """LlamaConfig's defaults (`eps`, `theta`, `kv`: num_key_value_heads left out; null is `heads`)."""
    return [
        ("arch", "model_type", "llama"),
        ("vocab_size", "vocab_size", config.get("vocab_size", 32000)),
        ("hidden", "hidden_size", config.get("hidden_size", 4096)),
        ("layers", "num_hidden_layers", config.get("num_hidden_layers", 32)),
        ("heads", "num_attention_heads", heads),
        ("kv_heads", "num_key_value_heads", config.get("num_key_value_heads", kv) or heads),
        ("ffn_hidden", "intermediate_size", config.get("intermediate_size", 11008)),
        ("layernorm_eps", "rms_norm_eps", config.get("rms_norm_eps", eps)),
        ("rope_theta", "rope_theta", _theta(rope(config).get("rope_theta", theta))),
        ("tie_embeddings", "tie_word_embeddings", config.get("tie_word_embeddings", False)),
    ]


def _theta(value: Any) -> float:
    """rope_theta as a number; ValueError naming it otherwise (null, a string: no base of frequencies)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"rope_theta = {value!r} is not a positive number (the base of the rotary frequencies)")
    return float(value)


def hf_unsupported(config: dict[str, Any], m: Any) -> Optional[str]:
    """What of the HF Llama gridlm's blocks do not compute, or None (`m`: the deck's ModelConfig)."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            return f"{key}: true; gridlm's llama blocks have no biases"
    kind = rope(config).get("rope_type", "default")
    if kind != "default":
        return f"rope type {kind!r} (rope_scaling / rope_parameters): gridlm's rotary embedding is unscaled"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r}: gridlm's SwiGLU uses silu"
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * m.heads != m.hidden:
        return f"head_dim {head_dim} x {m.heads} heads != hidden {m.hidden}: gridlm's heads split the width"
    if config.get("model_type") == "mixtral":
        if m.moe_every != 1:
            return f"experts in every block; model.moe_every is {m.moe_every}: set it to 1"
        if m.moe_shared_experts:
            return f"no shared experts; model.moe_shared_experts is {m.moe_shared_experts}: set it to 0"
        window = config.get("sliding_window")
        if window is not None and (type(window) is not int or window < 1):
            return f"sliding_window {str(window)[:40]!r} is not null or a positive integer"
        if window is not None and window < m.seq_len:
            return f"sliding_window {window} < model.seq_len {m.seq_len}: gridlm's attention is full causal"
    return None


HF = HFFormat("llama", "model.", hf_config, hf_rules, hf_expected, hf_unsupported, also=("mixtral",),
              unexportable=mixtral_blocks)  # fmt: skip

LLAMA = Arch(
    name="llama", summary="rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases",
    positions="rotary", norm="rmsnorm", mlp="swiglu", bias=False, grouped_query=True,
    tensor3d=False, tie_embeddings=False, ffn=lambda hidden: -(-8 * hidden // (3 * 64)) * 64, hf=HF,
)  # fmt: skip
