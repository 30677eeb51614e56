"""Export a gridlm checkpoint to a Hugging Face GPT-2 or Llama directory (`config.json` +
`model.safetensors`). The name mapping (`mapping`) also serves the import (`run.init_from`,
`app/checkpoint/hf_import.py`): each `Rule` has the export's `convert` and its inverse `place`.

Serial and simple: one process opens the file with plain h5py, reads every parameter tensor
whole into memory (from /optimizer/master, the fp32 masters, when the checkpoint has them;
else /model), verifies each against its checksum, converts it to fp32 and writes the
directory. Memory use is about twice the fp32 model size; nothing is written until every
tensor has been read and verified.

The name and layout table of each architecture is its registry entry's (`app/archs/gpt2.py` for
GPT-2's `Conv1D` transposes and QKV permutation, `app/archs/llama.py` for Llama's split q/k/v and
gate/up); `hf_config` and `mapping` read the entry the checkpoint's `model.arch` names.
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app import archs
from app.archs.hf import Rule
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
    """config.json for a checkpoint's model section: its architecture's (`app/archs/`)."""
    return archs.get(model["arch"]).hf.config(model)


def mapping(model: dict[str, Any]) -> dict[str, Rule]:
    """gridlm parameter name -> Rule, for every parameter of the model (its architecture's table)."""
    return archs.get(model["arch"]).hf.rules(model)


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
    removed: tuple[str, ...] = ()  # files of an earlier model that --force took away (STALE)


# What an earlier model's directory may hold that would contradict the export: transformers' generate
# takes its token ids and defaults from generation_config.json over config.json's.
STALE = ("generation_config.json",)


def check_target(directory: Path, force: bool) -> None:
    """DIR may be new or empty; a non-empty one only with --force (its two files are replaced, and an
    earlier model's STALE files removed)."""
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

    from app.checkpoint.io import decode, masters_group, model_section, read_header, require_dataset
    from app.shards import MODEL

    header = read_header(path)
    model = model_section(header, path)
    why = archs.get(model["arch"]).hf.unexportable(model)
    if why is not None:
        raise CheckpointError(f"{path}: no Hugging Face form for this model: {why}")
    rules = mapping(model)
    catalogue = header["datasets"]
    # As io.load: the fp32 masters when the checkpoint has them, else the parameters.
    names = {dataset_name(key) for key in rules}
    source = masters_group(header)
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
    removed = tuple(name for name in STALE if (directory / name).is_file())
    try:
        for name in removed:
            (directory / name).unlink()
    except OSError as err:
        raise CheckpointError(
            f"exported to {directory}, but its {err.filename} (an earlier model's) cannot be removed "
            f"({err.strerror}); remove it: transformers would take its token ids over config.json's"
        ) from None
    return Exported(
        directory,
        int(header["step"]),
        source,
        sum(t.size for t in tensors.values()),
        sum(t.nbytes for t in tensors.values()),
        removed,
    )


def _write(directory: Path, config: dict[str, Any], tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Each file written under a temporary name, both before either is renamed: never a half-written
    file under its name, nor new weights beside an earlier export's config.json after a failed write."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    tmps = (directory / (WEIGHTS + ".tmp"), directory / (CONFIG + ".tmp"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmps[0]), metadata=metadata)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmps[0], 0o666 & ~mask)  # safetensors creates 0600; the model is meant to be shared like config.json
        tmps[1].write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmps[0], directory / WEIGHTS)
        os.replace(tmps[1], directory / CONFIG)
    except (OSError, SafetensorError) as err:  # safetensors reports an I/O error (EROFS, ENOSPC) as its own
        with suppress(OSError):
            for tmp in tmps:
                tmp.unlink(missing_ok=True)
        why = getattr(err, "strerror", None) or str(err).removeprefix("Error while serializing: ")
        raise CheckpointError(f"cannot write to {directory}: {why}; choose a writable DIR with free space") from None
