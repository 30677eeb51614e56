"""gpt2: GPT-2 (Radford et al. 2019) — learned positions, pre-LayerNorm, GELU MLP (tanh
approximation), biases, the embedding tied to the head by default, an MLP width of 4 x hidden.

Its Hugging Face form is `GPT2LMHeadModel` (`HFFormat` below: export and `run.init_from`).
Tensor names and layouts (h = hidden, f = ffn_hidden or 4h, V = vocab_size, S = seq_len,
n = heads, d = h / n; gridlm stores `nn.Linear` weights as (out, in), Hugging Face's GPT-2
uses `Conv1D`, whose weight is (in, out)):

| gridlm dataset (`/model/…` or `/optimizer/master/…`) | shape | Hugging Face GPT-2 tensor | shape | conversion |
|---|---|---|---|---|
| `wte.weight` | (V, h) | `transformer.wte.weight` | (V, h) | as is |
| `wpe` | (S, h) | `transformer.wpe.weight` | (S, h) | as is (`n_positions` = S) |
| `blocks.{i}.ln1.weight`, `.bias` | (h,) | `transformer.h.{i}.ln_1.weight`, `.bias` | (h,) | as is |
| `blocks.{i}.attn.qkv.weight` | (3h, h), rows (n, 3, d) | `transformer.h.{i}.attn.c_attn.weight` | (h, 3h), columns (3, n, d) | rows permuted from (head, q/k/v, d) to (q/k/v, head, d), then transposed |
| `blocks.{i}.attn.qkv.bias` | (3h,), (n, 3, d) | `transformer.h.{i}.attn.c_attn.bias` | (3h,), (3, n, d) | the same permutation |
| `blocks.{i}.attn.proj.weight` | (h, h) | `transformer.h.{i}.attn.c_proj.weight` | (h, h) | transposed |
| `blocks.{i}.attn.proj.bias` | (h,) | `transformer.h.{i}.attn.c_proj.bias` | (h,) | as is |
| `blocks.{i}.ln2.weight`, `.bias` | (h,) | `transformer.h.{i}.ln_2.weight`, `.bias` | (h,) | as is |
| `blocks.{i}.mlp.fc.weight` | (f, h) | `transformer.h.{i}.mlp.c_fc.weight` | (h, f) | transposed |
| `blocks.{i}.mlp.fc.bias` | (f,) | `transformer.h.{i}.mlp.c_fc.bias` | (f,) | as is |
| `blocks.{i}.mlp.proj.weight` | (h, f) | `transformer.h.{i}.mlp.c_proj.weight` | (f, h) | transposed |
| `blocks.{i}.mlp.proj.bias` | (h,) | `transformer.h.{i}.mlp.c_proj.bias` | (h,) | as is |
| `ln_f.weight`, `.bias` | (h,) | `transformer.ln_f.weight`, `.bias` | (h,) | as is |
| `head` (only with `tie_embeddings: false`) | (V, h) | `lm_head.weight` | (V, h) | as is; with tied embeddings it is not written and Hugging Face ties `lm_head` to `transformer.wte` |

`config.json` (a `GPT2Config`) from the checkpoint's deck: `vocab_size` = model.vocab_size,
`n_positions` = model.seq_len, `n_embd` = model.hidden, `n_layer` = model.layers,
`n_head` = model.heads, `n_inner` = f, `activation_function` = "gelu_new" (GELU, tanh
approximation), `layer_norm_epsilon` = model.layernorm_eps, `resid_pdrop` = `embd_pdrop` =
`attn_pdrop` = model.dropout, `initializer_range` = model.init_std, `tie_word_embeddings` =
model.tie_embeddings, `torch_dtype` "float32"; `scale_attn_weights` true (1/sqrt(d), as
gridlm), `bos_token_id` / `eos_token_id` null (gridlm has no special tokens).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from app.archs.hf import Rule, config_tail, put_transposed, qkv_rows, qkv_rows_back, same, transposed
from app.archs.spec import Arch, HFFormat


def hf_config(model: dict[str, Any]) -> dict[str, Any]:
    """GPT2Config fields (config.json) for a checkpoint's model section (module docstring)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model["vocab_size"],
        "n_positions": model["seq_len"],
        "n_embd": model["hidden"],
        "n_layer": model["layers"],
        "n_head": model["heads"],
        "n_inner": model["ffn"],
        "activation_function": "gelu_new",  # GELU with the tanh approximation, as gridlm's MLP
        "layer_norm_epsilon": model["layernorm_eps"],
        "resid_pdrop": model["dropout"],
        "embd_pdrop": model["dropout"],
        "attn_pdrop": model["dropout"],
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        **config_tail(model),
    }


def hf_rules(model: dict[str, Any]) -> dict[str, Rule]:
    """gridlm parameter name -> Rule, for every parameter of the model (the table above)."""
    h, f, v, s, n = model["hidden"], model["ffn"], model["vocab_size"], model["seq_len"], model["heads"]

    def first_rows(out: np.ndarray, x: np.ndarray) -> None:  # HF's n_positions may exceed seq_len
        out[...] = x[: out.shape[0]]

    def qkv_weight(out: np.ndarray, x: np.ndarray) -> None:
        out[...] = qkv_rows_back(x.T, n)

    def qkv_bias(out: np.ndarray, x: np.ndarray) -> None:
        out[...] = qkv_rows_back(x, n)

    rules = {
        "wte.weight": Rule("transformer.wte.weight", (v, h), same, (v, h)),
        "wpe": Rule("transformer.wpe.weight", (s, h), same, (s, h), first_rows, more_rows=True),
        "ln_f.weight": Rule("transformer.ln_f.weight", (h,), same, (h,)),
        "ln_f.bias": Rule("transformer.ln_f.bias", (h,), same, (h,)),
    }
    if not model["tie_embeddings"]:
        rules["head"] = Rule("lm_head.weight", (v, h), same, (v, h))
    t = transposed
    for i in range(model["layers"]):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        rules.update({
            ours + "ln1.weight": Rule(hf + "ln_1.weight", (h,), same, (h,)),
            ours + "ln1.bias": Rule(hf + "ln_1.bias", (h,), same, (h,)),
            ours + "attn.qkv.weight": Rule(hf + "attn.c_attn.weight", (3 * h, h), lambda x: qkv_rows(x, n).T,
                                           (h, 3 * h), qkv_weight),
            ours + "attn.qkv.bias": Rule(hf + "attn.c_attn.bias", (3 * h,), lambda x: qkv_rows(x, n), (3 * h,),
                                         qkv_bias),
            ours + "attn.proj.weight": Rule(hf + "attn.c_proj.weight", (h, h), t, (h, h), put_transposed),
            ours + "attn.proj.bias": Rule(hf + "attn.c_proj.bias", (h,), same, (h,)),
            ours + "ln2.weight": Rule(hf + "ln_2.weight", (h,), same, (h,)),
            ours + "ln2.bias": Rule(hf + "ln_2.bias", (h,), same, (h,)),
            ours + "mlp.fc.weight": Rule(hf + "mlp.c_fc.weight", (f, h), t, (h, f), put_transposed),
            ours + "mlp.fc.bias": Rule(hf + "mlp.c_fc.bias", (f,), same, (f,)),
            ours + "mlp.proj.weight": Rule(hf + "mlp.c_proj.weight", (h, f), t, (f, h), put_transposed),
            ours + "mlp.proj.bias": Rule(hf + "mlp.c_proj.bias", (h,), same, (h,)),
        })  # fmt: skip
    return rules


def hf_expected(config: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(deck model key, HF config key, the value the deck must have) for each key that shapes the
    model or its numerics; HF's defaults where config.json leaves a key out."""
    h = config.get("n_embd", 768)
    return [
        ("arch", "model_type", "gpt2"),
        ("vocab_size", "vocab_size", config.get("vocab_size", 50257)),
        ("hidden", "n_embd", h),
        ("layers", "n_layer", config.get("n_layer", 12)),
        ("heads", "n_head", config.get("n_head", 12)),
        ("ffn_hidden", "n_inner", config.get("n_inner") or 4 * h),
        ("layernorm_eps", "layer_norm_epsilon", config.get("layer_norm_epsilon", 1e-5)),
        ("tie_embeddings", "tie_word_embeddings", config.get("tie_word_embeddings", True)),
    ]


def hf_unsupported(config: dict[str, Any], m: Any) -> Optional[str]:
    """What of the HF GPT-2 gridlm's blocks do not compute, or None (`m`: the deck's ModelConfig)."""
    act = config.get("activation_function", "gelu_new")
    # The three names of the tanh approximation in transformers (gelu_fast's constant is sqrt(2/pi)
    # rounded to 1e-10: the same function to fp32 rounding).
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return f"activation_function {act!r}: gridlm's GPT-2 MLP uses GELU with the tanh approximation (gelu_new)"
    if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx", False):
        return "attention scaled other than by 1/sqrt(head_dim) (scale_attn_weights, scale_attn_by_inverse_layer_idx)"
    positions = config.get("n_positions", 1024)
    if positions < m.seq_len:
        return f"n_positions {positions} < model.seq_len {m.seq_len}: it learned fewer positions; lower model.seq_len"
    return None


HF = HFFormat("gpt2", "transformer.", hf_config, hf_rules, hf_expected, hf_unsupported)

GPT2 = Arch(
    name="gpt2", summary="learned positions, LayerNorm, GELU MLP, biases",
    positions="learned", norm="layernorm", mlp="gelu", bias=True, grouped_query=False,
    tensor3d=True, tie_embeddings=True, ffn=lambda hidden: 4 * hidden, hf=HF,
)  # fmt: skip
