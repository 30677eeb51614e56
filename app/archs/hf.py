"""The Hugging Face side of an architecture, shared by the entries: `Rule`, one Hugging Face tensor
of a gridlm parameter, and the row permutations the fused gridlm tensors need. numpy only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


def config_tail(model: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields every entry ends with alike: the init std, tying, no special tokens, and
    float32 weights (what an export writes)."""
    return {
        "initializer_range": model["init_std"],
        "tie_word_embeddings": bool(model["tie_embeddings"]),
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


def same(x: np.ndarray) -> np.ndarray:
    return x


def transposed(x: np.ndarray) -> np.ndarray:
    return x.T


def qkv_rows(x: np.ndarray, heads: int) -> np.ndarray:
    """Fused QKV rows (head, q/k/v, d) -> (q/k/v, head, d), the order HF GPT-2's c_attn splits."""
    rest = x.shape[1:]
    return x.reshape(heads, 3, -1, *rest).swapaxes(0, 1).reshape(x.shape)


def qkv_rows_back(x: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `qkv_rows`: rows (q/k/v, head, d) -> (head, q/k/v, d)."""
    rest = x.shape[1:]
    return x.reshape(3, heads, -1, *rest).swapaxes(0, 1).reshape(x.shape)


def qkv_parts(x: np.ndarray, kv: int, d: int, part: slice) -> np.ndarray:
    """Fused GQA QKV rows (kv head, q... k v, d) -> the heads `part` of each group, group-major
    (q: query head g x group + i; k and v: key/value head g), as LlamaAttention's q/k/v_proj."""
    rest = x.shape[1:]
    return x.reshape(kv, -1, d, *rest)[:, part].reshape(-1, *rest)


def put(out: np.ndarray, x: np.ndarray) -> None:
    out[...] = x


def put_transposed(out: np.ndarray, x: np.ndarray) -> None:
    out[...] = x.T


@dataclass(frozen=True)
class Rule:
    """One Hugging Face tensor of a gridlm parameter: `convert` makes it from the gridlm tensor
    (export), `place` writes it into the gridlm tensor (import, `run.init_from`: the inverse)."""

    hf: str  # Hugging Face name
    shape: tuple[int, ...]  # gridlm (global) shape
    convert: Callable[[np.ndarray], np.ndarray]
    hf_shape: tuple[int, ...]  # the Hugging Face tensor's shape
    place: Callable[[np.ndarray, np.ndarray], None] = put  # (gridlm tensor, HF tensor): fill its part
    more_rows: bool = False  # the HF tensor may have more rows, of which the first are used (positions)
