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

from app import archs
from app.archs.hf import Rule
from app.checkpoint.export import dataset_name, mapping
from app.deck import ModelConfig
from app.errors import CheckpointError
from app.untrusted import read_json

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20  # config.json is a few KB; an index of a 400B model is a few MB
# Tensors HF directories may hold that are not parameters: GPT-2's causal-mask buffers, rotary caches.
IGNORED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


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
    kind = config.get("model_type") if isinstance(config, dict) else None
    if not archs.by_model_type(kind):
        known = sorted({t for a in archs.names() for t in (archs.get(a).hf.model_type, *archs.get(a).hf.also)})
        raise _fail(directory, f"model_type {kind!r}: gridlm starts from {' or '.join(known)} models only")
    return config


def check_config(directory: Path, config: dict[str, Any], m: ModelConfig) -> None:
    """The deck's model must be DIR's: every mismatch named, with the --set keys that fix them."""
    wrong, fixes = [], []
    # The deck's architecture reads config.json when it has this model_type, else the first that has.
    same_type = [a for a in archs.by_model_type(config["model_type"]) if a.name == m.arch]
    target = (same_type or archs.by_model_type(config["model_type"]))[0]
    try:
        expected = target.hf.expected(config)
    except ValueError as err:  # a value of the wrong type where the deck's key has a number (rope_theta: null)
        raise _fail(directory, f"{CONFIG}: {err}") from None
    # A deck of another architecture: its derived values (ffn_hidden, tie_embeddings: null) are that
    # architecture's defaults and change with model.arch, so the fix sets every compared key.
    new_arch = next((want for key, _, want in expected if key == "arch"), m.arch)
    switching = new_arch != m.arch
    for key, hf_key, want in expected:
        if key == "kv_heads" and not target.grouped_query:
            continue
        have = {"ffn_hidden": m.ffn, "kv_heads": m.kv, "moe_ffn_hidden": m.expert_ffn}.get(key, getattr(m, key))
        if key == "tie_embeddings":  # a tied HF model into an untied deck maps; the reverse cannot
            same = want or not have
        else:
            same = math.isclose(have, want, rel_tol=1e-12) if isinstance(want, float) else have == want
        if not same:
            wrong.append((key, hf_key, want, have))
        if not same or switching:
            fixes.append((key, want))
    grouped = archs.get(new_arch).grouped_query if new_arch in archs.names() else True
    if wrong and switching and not grouped and m.kv_heads not in (None, m.heads):
        fixes.append(("kv_heads", None))  # the deck refuses kv_heads on an architecture without GQA
    if wrong:
        said = ", ".join(f"{hf_key} = {want!r} (model.{key} is {have!r})" for key, hf_key, want, have in wrong)
        fix = " ".join(
            f"--set model.{k}={'null' if want is None else str(want).lower() if isinstance(want, bool) else want}"
            for k, want in fixes
        )
        raise _fail(
            directory, f"the deck's model is not the one in {CONFIG}: {said}; fix: {fix} (or these keys in the "
            "deck's model section)"
        )  # fmt: skip
    why = target.hf.unsupported(config, m)
    if why is not None:
        raise _fail(directory, f"{CONFIG} has {why}")


def model_section(m: ModelConfig) -> dict[str, Any]:
    """The export table's model dict for the deck's model (`export.mapping`)."""
    return {
        "arch": m.arch, "vocab_size": m.vocab_size, "seq_len": m.seq_len, "hidden": m.hidden, "heads": m.heads,
        "layers": m.layers, "ffn": m.ffn, "kv": m.kv, "tie_embeddings": m.tie_embeddings,
        "moe_experts": m.moe_experts, "moe_top_k": m.moe_top_k, "expert_ffn": m.expert_ffn, "moe_every": m.moe_every,
        "moe_shared_experts": m.moe_shared_experts,
    }  # fmt: skip


class HFWeights:
    """The parameters of the deck's model from a Hugging Face directory (module docstring)."""

    def __init__(self, directory: Path, m: ModelConfig) -> None:
        self.directory = Path(directory)
        self.config = read_config(self.directory)
        check_config(self.directory, self.config, m)
        self.tied_source = bool(self.config.get("tie_word_embeddings", m.spec.tie_embeddings))  # HF default: the arch's
        self.files = self._files()
        self.rules = mapping(model_section(m))
        self.prefix = m.spec.hf.prefix  # the base model class's keys (GPT2Model, LlamaModel) lack it
        self.sources = self._sources()

    def _files(self) -> dict[str, Path]:
        """HF tensor name -> the safetensors file holding it."""
        from safetensors import safe_open

        # model.safetensors first, as transformers' from_pretrained takes it: an index beside it is
        # an earlier sharded model's (an export --force into its directory), not this one's.
        index = self.directory / INDEX
        if index.is_file() and not (self.directory / WEIGHTS).is_file():
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
            files = {name: self.directory / file for name, file in weight_map.items()}
            self._check_shards(files)
            return files
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

    def _check_shards(self, files: dict[str, Path]) -> None:
        """Each shard the index lists is a readable safetensors file holding the tensors it maps to it
        (its header only is read): a missing, damaged or short shard is named here, not at its first read."""
        from safetensors import safe_open

        wanted: dict[Path, list[str]] = {}
        for name, file in files.items():
            wanted.setdefault(file, []).append(name)
        for file, names in wanted.items():
            if not file.is_file():
                raise _fail(
                    self.directory, f"{INDEX} lists the shard {file.name}, which is not there ({len(names)} tensors, "
                    f"e.g. {names[0]}); copy the whole model directory (every shard the index lists)"
                )  # fmt: skip
            try:
                with safe_open(str(file), framework="pt") as f:
                    held = set(f.keys())
            except Exception as err:  # safetensors raises its own error types for a damaged header
                raise _fail(self.directory, f"shard {file.name} is not a readable safetensors file ({err})") from None
            missing = [n for n in names if n not in held]
            if missing:
                raise _fail(
                    self.directory, f"shard {file.name} has no tensor {missing[0]}"
                    f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which {INDEX} places "
                    "there: the index is another model's, or the shard is; copy the model directory again"
                )  # fmt: skip

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
