"""`run.init_from: DIR`: a local Hugging Face GPT-2 or Llama directory as a run's initial weights.

DIR holds `config.json` and the weights as safetensors: `model.safetensors`, or shards listed by
`model.safetensors.index.json`. Nothing is downloaded. The deck's model section must describe the
model DIR holds; `HFWeights` checks that first and refuses with every mismatch and the `--set`
keys that fix it (`check_config`), then maps names and layouts with the export's table read
backwards (`app/checkpoint/export.py`, `Rule.place`), so import and export are one table:

- GPT-2 (`GPT2LMHeadModel`, also the `GPT2Model` key names without `transformer.`): Conv1D
  weights transposed, the fused QKV's columns (q/k/v, head, d) regrouped to rows (head, q/k/v,
  d); the position table's first model.seq_len rows (n_positions may be larger).
- Llama (`LlamaForCausalLM`): q/k/v_proj fused into rows (kv head, its query heads, k, v),
  gate_proj and up_proj interleaved.
- Tied heads: a tied HF model into an untied deck starts the head as a copy of the embedding; an
  untied HF model into a tied deck is refused (two matrices cannot become one).
- Vocabulary: model.vocab_size must equal the HF vocab_size (a padded vocabulary would add
  logits HF does not have and change the loss).

Tensors of any floating dtype (fp32, bf16, fp16) are read as fp32, one at a time, memory-mapped
by safetensors; `tensor(name)` gives a gridlm parameter's whole (global) fp32 tensor, and each
rank keeps the part of it that it holds (`app/checkpoint/io.initialise`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from app.checkpoint.export import Rule, dataset_name, mapping
from app.deck import ModelConfig
from app.errors import CheckpointError
from app.untrusted import read_json

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20  # config.json is a few KB; an index of a 400B model is a few MB
# Tensors HF directories may hold that are not parameters: GPT-2's causal-mask buffers, rotary caches.
IGNORED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
# Prefixes the base-model classes (GPT2Model, LlamaModel) save their keys without.
BASE_PREFIX = {"gpt2": "transformer.", "llama": "model."}


def _fail(directory: Path, why: str) -> CheckpointError:
    return CheckpointError(f"run.init_from {directory}: {why}")


def read_config(directory: Path) -> dict[str, Any]:
    """DIR's config.json; CheckpointError naming what is missing or wrong."""
    if not directory.is_dir():
        raise _fail(directory, "no such directory; give a local Hugging Face model directory (config.json and "
                               "model.safetensors; nothing is downloaded)")  # fmt: skip
    if not (directory / CONFIG).exists():
        raise _fail(directory, f"has no {CONFIG}; give a Hugging Face model directory (save_pretrained's)")
    config = read_json(directory / CONFIG, CONFIG, lambda why: _fail(directory, f"{CONFIG}: {why}"), "", MAX_JSON_BYTES)
    if not isinstance(config, dict) or config.get("model_type") not in ("gpt2", "llama"):
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise _fail(directory, f"model_type {kind!r}: gridlm starts from gpt2 or llama models only")
    return config


def _expected(config: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(deck model key, HF config key, the value the deck must have) for each key that shapes the
    model or its numerics; HF's defaults where config.json leaves a key out."""
    if config["model_type"] == "gpt2":
        h = config.get("n_embd", 768)
        inner = config.get("n_inner") or 4 * h
        return [
            ("arch", "model_type", "gpt2"),
            ("vocab_size", "vocab_size", config.get("vocab_size", 50257)),
            ("hidden", "n_embd", h),
            ("layers", "n_layer", config.get("n_layer", 12)),
            ("heads", "n_head", config.get("n_head", 12)),
            ("ffn_hidden", "n_inner", inner),
            ("layernorm_eps", "layer_norm_epsilon", config.get("layer_norm_epsilon", 1e-5)),
            ("tie_embeddings", "tie_word_embeddings", config.get("tie_word_embeddings", True)),
        ]
    heads = config.get("num_attention_heads", 32)
    return [
        ("arch", "model_type", "llama"),
        ("vocab_size", "vocab_size", config.get("vocab_size", 32000)),
        ("hidden", "hidden_size", config.get("hidden_size", 4096)),
        ("layers", "num_hidden_layers", config.get("num_hidden_layers", 32)),
        ("heads", "num_attention_heads", heads),
        ("kv_heads", "num_key_value_heads", config.get("num_key_value_heads") or heads),
        ("ffn_hidden", "intermediate_size", config.get("intermediate_size", 11008)),
        ("layernorm_eps", "rms_norm_eps", config.get("rms_norm_eps", 1e-6)),
        ("rope_theta", "rope_theta", float(_rope(config).get("rope_theta", 10000.0))),
        ("tie_embeddings", "tie_word_embeddings", config.get("tie_word_embeddings", False)),
    ]


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings: transformers 5's `rope_parameters`, or 4's top-level rope_theta and rope_scaling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        return params
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    return {**({"rope_theta": config["rope_theta"]} if "rope_theta" in config else {}), "rope_type": kind}


def _unsupported(config: dict[str, Any], m: ModelConfig) -> Optional[str]:
    """What of the HF model gridlm's blocks do not compute, or None."""
    if config["model_type"] == "gpt2":
        act = config.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            return f"activation_function {act!r}: gridlm's GPT-2 MLP uses GELU with the tanh approximation (gelu_new)"
        if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx", False):
            return (
                "attention scaled other than by 1/sqrt(head_dim) (scale_attn_weights, scale_attn_by_inverse_layer_idx)"
            )
        positions = config.get("n_positions", 1024)
        if positions < m.seq_len:
            return (
                f"n_positions {positions} < model.seq_len {m.seq_len}: it learned fewer positions; lower model.seq_len"
            )
        return None
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            return f"{key}: true; gridlm's llama blocks have no biases"
    kind = _rope(config).get("rope_type", "default")
    if kind != "default":
        return f"rope type {kind!r} (rope_scaling / rope_parameters): gridlm's rotary embedding is unscaled"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r}: gridlm's SwiGLU uses silu"
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * m.heads != m.hidden:
        return f"head_dim {head_dim} x {m.heads} heads != hidden {m.hidden}: gridlm's heads split the width"
    return None


def check_config(directory: Path, config: dict[str, Any], m: ModelConfig) -> None:
    """The deck's model must be DIR's: every mismatch named, with the --set keys that fix them."""
    wrong = []
    for key, hf_key, want in _expected(config):
        if key == "kv_heads" and not m.llama:
            continue
        have = {"ffn_hidden": m.ffn, "kv_heads": m.kv}.get(key, getattr(m, key))
        if key == "tie_embeddings":  # a tied HF model into an untied deck maps; the reverse cannot
            same = want or not have
        else:
            same = math.isclose(have, want, rel_tol=1e-12) if isinstance(want, float) else have == want
        if not same:
            wrong.append((key, hf_key, want, have))
    if wrong:
        said = ", ".join(f"{hf_key} = {want!r} (model.{key} is {have!r})" for key, hf_key, want, have in wrong)
        fix = " ".join(
            f"--set model.{k}={str(want).lower() if isinstance(want, bool) else want}" for k, _, want, _ in wrong
        )
        raise _fail(
            directory, f"the deck's model is not the one in {CONFIG}: {said}; fix: {fix} (or these keys in the "
            "deck's model section)"
        )  # fmt: skip
    why = _unsupported(config, m)
    if why is not None:
        raise _fail(directory, f"{CONFIG} has {why}")


def model_section(m: ModelConfig) -> dict[str, Any]:
    """The export table's model dict for the deck's model (`export.mapping`)."""
    return {
        "arch": m.arch, "vocab_size": m.vocab_size, "seq_len": m.seq_len, "hidden": m.hidden, "heads": m.heads,
        "layers": m.layers, "ffn": m.ffn, "kv": m.kv, "tie_embeddings": m.tie_embeddings,
    }  # fmt: skip


class HFWeights:
    """The parameters of the deck's model from a Hugging Face directory (module docstring)."""

    def __init__(self, directory: Path, m: ModelConfig) -> None:
        self.directory = Path(directory)
        self.config = read_config(self.directory)
        check_config(self.directory, self.config, m)
        self.tied_source = bool(self.config.get("tie_word_embeddings", m.arch == "gpt2"))
        self.files = self._files()
        self.rules = mapping(model_section(m))
        self.prefix = BASE_PREFIX[m.arch]
        self.sources = self._sources()

    def _files(self) -> dict[str, Path]:
        """HF tensor name -> the safetensors file holding it."""
        from safetensors import safe_open

        index = self.directory / INDEX
        if index.is_file():
            index_json = read_json(
                index, INDEX, lambda why: _fail(self.directory, f"{INDEX}: {why}"), "", MAX_JSON_BYTES
            )
            weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
            # Files of the directory only: a name with a path in it is not save_pretrained's.
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and v and v == Path(v).name for v in weight_map.values()
            ):
                raise _fail(self.directory, f"{INDEX} is not a safetensors index (a weight_map of tensor -> file "
                                            "in the directory)")  # fmt: skip
            return {name: self.directory / file for name, file in weight_map.items()}
        single = self.directory / WEIGHTS
        if not single.is_file():
            found = sorted(p.name for p in self.directory.iterdir())[:8]
            raise _fail(
                self.directory, f"has no {WEIGHTS} or {INDEX} (it holds {', '.join(found) or 'nothing'}); save the "
                "model with save_pretrained(DIR, safe_serialization=True): gridlm reads safetensors only"
            )  # fmt: skip
        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        except Exception as err:  # safetensors raises its own error types for a damaged header
            raise _fail(self.directory, f"{WEIGHTS} is not a readable safetensors file ({err})") from None

    def _name(self, hf: str) -> Optional[str]:
        """The name `hf` has in this directory (with or without the base model's prefix), or None."""
        if hf in self.files:
            return hf
        bare = hf.removeprefix(self.prefix)
        return bare if bare in self.files else None

    def _sources(self) -> dict[str, list[tuple[str, Rule]]]:
        """gridlm parameter -> (HF tensor name in this directory, its rule) for each of its parts;
        CheckpointError for a tensor missing, or one the deck's model has no place for."""
        sources: dict[str, list[tuple[str, Rule]]] = {}
        for key, rule in self.rules.items():
            name = self._name(rule.hf)
            if name is None and key == "head" and self.tied_source:
                name = self._name(self.rules["wte.weight"].hf)  # a tied HF model: the head starts as the embedding
            if name is None:
                raise _fail(self.directory, f"has no tensor {rule.hf} (for gridlm's {dataset_name(key)})")
            sources.setdefault(dataset_name(key), []).append((name, rule))
        used = {name for parts in sources.values() for name, _ in parts}
        unused = sorted(n for n in self.files if n not in used and not n.endswith(IGNORED))
        if unused:
            raise _fail(
                self.directory, f"holds tensors the deck's model has no place for ({', '.join(unused[:4])}"
                f"{', ...' if len(unused) > 4 else ''}): not the model the deck describes"
            )  # fmt: skip
        return sources

    def _read(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        if not tensor.is_floating_point():
            raise _fail(self.directory, f"tensor {name} has dtype {tensor.dtype}, not a floating-point type")
        return tensor.float().numpy()

    def tensor(self, name: str) -> np.ndarray:
        """gridlm parameter `name`'s whole fp32 tensor."""
        parts = self.sources[name]
        out = np.empty(parts[0][1].shape, dtype=np.float32)
        for hf, rule in parts:
            x = self._read(hf)
            if rule.more_rows:
                fits = x.shape[1:] == rule.hf_shape[1:] and x.shape[0] >= rule.hf_shape[0]
            else:
                fits = x.shape == rule.hf_shape
            if not fits:
                raise _fail(
                    self.directory, f"tensor {hf} has shape {tuple(x.shape)}; the deck's model needs {rule.hf_shape}"
                )
            rule.place(out, x)
        return out

    def describe(self) -> str:
        arch = (self.config.get("architectures") or [self.config["model_type"]])[0]
        return f"{arch} ({len(set(self.files.values()))} safetensors file(s))"
