"""The architectures gridlm builds, one registry entry each (`spec.Arch`): `model.arch` names one.

An entry lists what its blocks compute (positions, norm, MLP, biases, grouped-query attention),
the defaults it gives the deck (MLP width, tied embeddings), where it runs (3D tensor
parallelism) and its Hugging Face form; `Arch.stage_params` derives every parameter from it. The
model builder, the planner, the FLOP counter, checkpoint export and import and generation read the
entry, never the architecture's name. A new architecture is a module here and a line below.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from app.archs.gpt2 import GPT2
from app.archs.llama import LLAMA
from app.archs.spec import Arch

# Read-only: tests add an entry by replacing the mapping (pytest's monkeypatch), never by mutation.
REGISTRY: Mapping[str, Arch] = MappingProxyType({a.name: a for a in (GPT2, LLAMA)})


def names() -> tuple[str, ...]:
    """The model.arch values, in registry order."""
    return tuple(REGISTRY)


def get(name: str) -> Arch:
    """The entry `model.arch: name` selects (the deck has checked the name: a KeyError is a bug)."""
    return REGISTRY[name]


def by_model_type(model_type: object) -> list[Arch]:
    """The entries whose Hugging Face form has config.json's `model_type` (import's lookup)."""
    return [a for a in REGISTRY.values() if model_type == a.hf.model_type or model_type in a.hf.also]
