"""Export a gridlm checkpoint to a Hugging Face GPT-2 or Llama directory (`config.json` +
`model.safetensors`). The name mapping (`mapping`) also serves the import (`run.init_from`,
`app/checkpoint/hf_import.py`): each `Rule` has the export's `convert` and its inverse `place`.

Serial and simple: one process opens the file with plain h5py, reads every parameter tensor
whole into memory (from /optimizer/master, the fp32 masters, when the checkpoint has them;
else /model), verifies each against its checksum, converts it to fp32 and writes the
directory. Memory use is about twice the fp32 model size; nothing is written until every
tensor has been read and verified.

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

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from app.checkpoint.slabs import dataset_checksum
from app.errors import CheckpointError

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def read_verified(f: Any, key: str, path: Path) -> np.ndarray:
    """Dataset `key` of the open h5py file, whole, in its stored dtype; CheckpointError when
    it cannot be read or its checksum (if it has one) does not match."""
    dset = f[key]
    try:
        values = dset[()]
    except OSError as err:
        raise CheckpointError(
            f"{path}: cannot read dataset /{key} ({err}): the file is truncated or corrupt; use an older checkpoint"
        ) from None
    want = dset.attrs.get("checksum")
    # Format-version-1 files carry the weak v1 checksum: verified with it.
    if want is not None and values.size and dataset_checksum(values, int(f.attrs["format_version"])) != int(want):
        raise CheckpointError(
            f"{path}: checksum mismatch in dataset /{key}: the file is corrupt; use an older checkpoint "
            f"(`python -m app.checkpoint inspect {path}` lists every damaged dataset)"
        )
    return values


def hf_config(model: dict[str, Any]) -> dict[str, Any]:
    """GPT2Config fields (config.json) for a gridlm model section (see the module docstring), or
    LlamaConfig fields for `arch: llama`."""
    if model.get("arch") == "llama":
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
            "initializer_range": model["init_std"],
            "tie_word_embeddings": bool(model["tie_embeddings"]),
            "bos_token_id": None,
            "eos_token_id": None,
            "torch_dtype": "float32",
        }
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
        "initializer_range": model["init_std"],
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(model["tie_embeddings"]),
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


def _qkv_rows(x: np.ndarray, heads: int) -> np.ndarray:
    """Fused QKV rows (head, q/k/v, d) -> (q/k/v, head, d), the order HF's c_attn splits."""
    rest = x.shape[1:]
    return x.reshape(heads, 3, -1, *rest).swapaxes(0, 1).reshape(x.shape)


def _qkv_rows_back(x: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `_qkv_rows`: rows (q/k/v, head, d) -> (head, q/k/v, d)."""
    rest = x.shape[1:]
    return x.reshape(3, heads, -1, *rest).swapaxes(0, 1).reshape(x.shape)


def _qkv_parts(x: np.ndarray, kv: int, d: int, part: slice) -> np.ndarray:
    """Fused GQA QKV rows (kv head, q... k v, d) -> the heads `part` of each group, group-major
    (q: query head g x group + i; k and v: key/value head g), as LlamaAttention's q/k/v_proj."""
    rest = x.shape[1:]
    return x.reshape(kv, -1, d, *rest)[:, part].reshape(-1, *rest)


def _put(out: np.ndarray, x: np.ndarray) -> None:
    out[...] = x


def _put_t(out: np.ndarray, x: np.ndarray) -> None:
    out[...] = x.T


@dataclass(frozen=True)
class Rule:
    """One Hugging Face tensor of a gridlm parameter: `convert` makes it from the gridlm tensor
    (export), `place` writes it into the gridlm tensor (import, `run.init_from`: the inverse)."""

    hf: str  # Hugging Face name
    shape: tuple[int, ...]  # gridlm (global) shape
    convert: Callable[[np.ndarray], np.ndarray]
    hf_shape: tuple[int, ...]  # the Hugging Face tensor's shape
    place: Callable[[np.ndarray, np.ndarray], None] = _put  # (gridlm tensor, HF tensor): fill its part
    more_rows: bool = False  # the HF tensor may have more rows, of which the first are used (positions)


def mapping(model: dict[str, Any]) -> dict[str, Rule]:
    """gridlm parameter name -> Rule, for every parameter of the model (the table above)."""
    if model.get("arch") == "llama":
        return _llama_mapping(model)
    h, f, v, s, n = model["hidden"], model["ffn"], model["vocab_size"], model["seq_len"], model["heads"]
    same = lambda x: x  # noqa: E731
    t = lambda x: x.T  # noqa: E731

    def first_rows(out: np.ndarray, x: np.ndarray) -> None:  # HF's n_positions may exceed seq_len
        out[...] = x[: out.shape[0]]

    def qkv_weight(out: np.ndarray, x: np.ndarray) -> None:
        out[...] = _qkv_rows_back(x.T, n)

    def qkv_bias(out: np.ndarray, x: np.ndarray) -> None:
        out[...] = _qkv_rows_back(x, n)

    rules = {
        "wte.weight": Rule("transformer.wte.weight", (v, h), same, (v, h)),
        "wpe": Rule("transformer.wpe.weight", (s, h), same, (s, h), first_rows, more_rows=True),
        "ln_f.weight": Rule("transformer.ln_f.weight", (h,), same, (h,)),
        "ln_f.bias": Rule("transformer.ln_f.bias", (h,), same, (h,)),
    }
    if not model["tie_embeddings"]:
        rules["head"] = Rule("lm_head.weight", (v, h), same, (v, h))
    for i in range(model["layers"]):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        rules.update({
            ours + "ln1.weight": Rule(hf + "ln_1.weight", (h,), same, (h,)),
            ours + "ln1.bias": Rule(hf + "ln_1.bias", (h,), same, (h,)),
            ours + "attn.qkv.weight": Rule(hf + "attn.c_attn.weight", (3 * h, h), lambda x: _qkv_rows(x, n).T,
                                           (h, 3 * h), qkv_weight),
            ours + "attn.qkv.bias": Rule(hf + "attn.c_attn.bias", (3 * h,), lambda x: _qkv_rows(x, n), (3 * h,),
                                         qkv_bias),
            ours + "attn.proj.weight": Rule(hf + "attn.c_proj.weight", (h, h), t, (h, h), _put_t),
            ours + "attn.proj.bias": Rule(hf + "attn.c_proj.bias", (h,), same, (h,)),
            ours + "ln2.weight": Rule(hf + "ln_2.weight", (h,), same, (h,)),
            ours + "ln2.bias": Rule(hf + "ln_2.bias", (h,), same, (h,)),
            ours + "mlp.fc.weight": Rule(hf + "mlp.c_fc.weight", (f, h), t, (h, f), _put_t),
            ours + "mlp.fc.bias": Rule(hf + "mlp.c_fc.bias", (f,), same, (f,)),
            ours + "mlp.proj.weight": Rule(hf + "mlp.c_proj.weight", (h, f), t, (f, h), _put_t),
            ours + "mlp.proj.bias": Rule(hf + "mlp.c_proj.bias", (h,), same, (h,)),
        })  # fmt: skip
    return rules


def _llama_mapping(model: dict[str, Any]) -> dict[str, Rule]:
    """llama: gridlm name -> LlamaForCausalLM tensor (`nn.Linear` (out, in) both sides)."""
    h, f, v, n, kv = model["hidden"], model["ffn"], model["vocab_size"], model["heads"], model["kv"]
    d, group = h // n, n // kv
    same = lambda x: x  # noqa: E731
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

        return (lambda x: _qkv_parts(x, kv, d, part)), place

    def rows(start: int) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray, np.ndarray], None]]:
        def place(out: np.ndarray, x: np.ndarray) -> None:
            out[start::2] = x

        return (lambda x: x[start::2]), place

    q, k, vv = qkv_part(slice(0, group)), qkv_part(slice(group, group + 1)), qkv_part(slice(group + 1, group + 2))
    gate, up = rows(0), rows(1)
    for i in range(model["layers"]):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        # One Rule per HF tensor: the fused gridlm tensors appear under the names "...#q" etc.
        rules.update({
            ours + "ln1.weight": Rule(hf + "input_layernorm.weight", (h,), same, (h,)),
            ours + "attn.qkv.weight#q": Rule(hf + "self_attn.q_proj.weight", (qkv, h), q[0], (n * d, h), q[1]),
            ours + "attn.qkv.weight#k": Rule(hf + "self_attn.k_proj.weight", (qkv, h), k[0], (kv * d, h), k[1]),
            ours + "attn.qkv.weight#v": Rule(hf + "self_attn.v_proj.weight", (qkv, h), vv[0], (kv * d, h), vv[1]),
            ours + "attn.proj.weight": Rule(hf + "self_attn.o_proj.weight", (h, h), same, (h, h)),
            ours + "ln2.weight": Rule(hf + "post_attention_layernorm.weight", (h,), same, (h,)),
            ours + "mlp.fc.weight#gate": Rule(hf + "mlp.gate_proj.weight", (2 * f, h), gate[0], (f, h), gate[1]),
            ours + "mlp.fc.weight#up": Rule(hf + "mlp.up_proj.weight", (2 * f, h), up[0], (f, h), up[1]),
            ours + "mlp.proj.weight": Rule(hf + "mlp.down_proj.weight", (h, f), same, (h, f)),
        })  # fmt: skip
    return rules


def dataset_name(rule_key: str) -> str:
    """The gridlm dataset a mapping key reads ("blocks.0.attn.qkv.weight#q" -> its fused tensor)."""
    return rule_key.split("#")[0]


@dataclass
class Exported:
    directory: Path
    step: int
    source: str  # the checkpoint group the values came from
    parameters: int
    bytes: int


def check_target(directory: Path, force: bool) -> None:
    """DIR may be new or empty; a non-empty one only with --force (its two files are replaced)."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"export target {directory} exists and is not a directory; choose another DIR")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise CheckpointError(
            f"export target {directory} exists and is not empty; choose a new or empty DIR, or pass --force to "
            f"overwrite its {CONFIG} and {WEIGHTS}"
        )


def export_hf(path: Path, directory: Path, *, force: bool = False) -> Exported:
    """Write checkpoint `path` as a Hugging Face GPT-2 directory (module docstring). Reads every
    parameter tensor whole into memory on this one process."""
    path, directory = Path(path), Path(directory)
    check_target(directory, force)  # before the (possibly long) read, and before importing torch
    import h5py

    from app.checkpoint.io import decode, model_section, read_header, require_dataset
    from app.shards import MASTER, MODEL

    header = read_header(path)
    model = model_section(header, path)
    rules = mapping(model)
    catalogue = header["datasets"]
    # Like io.load: the fp32 masters when the checkpoint has them, else the parameters.
    names = {dataset_name(key) for key in rules}
    source = MASTER if all(f"{MASTER}/{name}" in catalogue for name in names) else MODEL
    unknown = sorted(key for key in catalogue if key.startswith(f"{MODEL}/") and key[len(MODEL) + 1 :] not in names)
    if unknown:
        raise CheckpointError(
            f"{path} has dataset /{unknown[0]}, which the {hf_config(model)['architectures'][0]} export does not "
            f"know: not a checkpoint of the model its deck describes"
        )
    for key, rule in rules.items():
        require_dataset(path, catalogue, f"{source}/{dataset_name(key)}", rule.shape, "its deck's model")

    tensors: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        read: dict[str, np.ndarray] = {}  # a fused tensor is read once for its HF parts
        for name, rule in rules.items():
            key = f"{source}/{dataset_name(name)}"
            if key not in read:
                read[key] = decode(read_verified(f, key, path), catalogue[key]["dtype"]).numpy()
            tensors[rule.hf] = np.ascontiguousarray(rule.convert(read[key]), dtype=np.float32)

    _write(directory, hf_config(model), tensors, {"format": "pt", "gridlm_checkpoint": str(path)})
    return Exported(
        directory,
        int(header["step"]),
        source,
        sum(t.size for t in tensors.values()),
        sum(t.nbytes for t in tensors.values()),
    )


def _write(directory: Path, config: dict[str, Any], tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Each file written under a temporary name and renamed: never a half-written file under its name."""
    from safetensors.numpy import save_file

    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (WEIGHTS + ".tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # safetensors creates 0600; the model is meant to be shared like config.json
        os.replace(tmp, directory / WEIGHTS)
        tmp = directory / (CONFIG + ".tmp")
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, directory / CONFIG)
    except OSError as err:
        raise CheckpointError(f"cannot write to {directory}: {err.strerror or err}; choose a writable DIR") from None
