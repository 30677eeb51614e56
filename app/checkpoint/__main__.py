"""`python -m app.checkpoint inspect|export`: look into a checkpoint, or convert it to a Hugging Face model.

Both are serial tools: one process, plain h5py, no MPI launch (run them on a login node).

    python -m app.checkpoint inspect FILE [--no-verify] [--json]
    python -m app.checkpoint export FILE --to hf DIR [--force]

`inspect` prints the header (step, consumed samples, precision, the grid that wrote the
file, created, versions) and a tree of the datasets with global shape, logical dtype,
size and checksum status. Verifying the checksums reads the whole file, one dataset at a
time; --no-verify reads only the metadata. The datasets are also judged as a resume judges
them: their metadata, and against the model of the stored deck. FILE may be a `latest` pointer
or a checkpoint directory (as run.resume). Exit status: 0 all ok, 1 a damaged dataset (a
checksum mismatch, unreadable values, damaged metadata, missing, unexpected or of another
shape; named on stderr), 2 a user mistake (missing file, not a gridlm checkpoint, incomplete
file) or a damaged header, reported as one `gridlm: ...` line without a traceback.

`export` is `app/checkpoint/export.py` (each architecture's name mapping is its entry's, app/archs/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

from app.runtime.process import exit_now
from app.shards import GROUPS

OK, CORRUPT, USAGE = 0, 1, 2
ORDER = (*GROUPS, "rng")


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors end like every other user mistake: `gridlm: ...`, status 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(USAGE, f"gridlm: {message}; see `{self.prog} --help`\n")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m app.checkpoint",
        description="Inspect a gridlm checkpoint or export it to a Hugging Face model (serial: no MPI launch).",
        epilog="Exit status: 0 ok, 1 a damaged dataset (inspect), 2 user mistake (message on stderr).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    inspect = commands.add_parser(
        "inspect",
        help="print the header and the datasets, verifying checksums",
        description="Print a checkpoint's header (step, consumed samples, precision, grid that wrote it, created, "
        "versions) and a tree of its datasets with global shape, logical dtype, size (MB = 10^6 bytes) and checksum "
        "status. Verification reads the whole file, one dataset at a time.",
        epilog="Exit status: 0 all ok, 1 a damaged dataset: checksum mismatch, unreadable, damaged metadata, "
        "missing, unexpected or of another shape than the stored deck's model (named on stderr), 2 missing file, "
        "not a gridlm checkpoint, incomplete or a damaged header.",
    )
    inspect.add_argument(
        "file",
        metavar="FILE",
        help="checkpoint file, e.g. runs/x/checkpoints/step_0000020.h5, or a `latest` or its directory",
    )
    inspect.add_argument(
        "--no-verify", dest="verify", action="store_false", help="skip the checksums (reads only metadata)"
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    export = commands.add_parser(
        "export",
        help="write a Hugging Face model directory (GPT-2, Llama or Mixtral: config.json, model.safetensors)",
        description="Write the checkpoint's model as a Hugging Face directory (GPT2LMHeadModel, LlamaForCausalLM "
        "or MixtralForCausalLM, by its model.arch and experts): config.json and "
        "model.safetensors in fp32 (the fp32 masters of a bf16/fp16 checkpoint). Reads every parameter tensor "
        "whole into memory on this one process (about twice the fp32 model size) and verifies its checksum "
        "before writing anything. Load it with transformers.AutoModelForCausalLM.from_pretrained(DIR).",
    )
    export.add_argument("file", metavar="FILE", help="checkpoint file, e.g. runs/x/checkpoints/step_0000020.h5")
    export.add_argument("--to", required=True, choices=["hf"], help="target format: hf (Hugging Face transformers)")
    export.add_argument("dir", metavar="DIR", help="output directory; must be new or empty unless --force")
    export.add_argument("--force", action="store_true", help="write into a non-empty DIR (replaces its two files)")
    return parser.parse_args(argv)


def checkpoint_file(arg: str) -> Path:
    """The FILE argument as a checkpoint file: a file, or the one a `latest` pointer (or a directory's)
    names, as run.resume takes them; CheckpointError naming the fix otherwise."""
    from app.checkpoint.store import LATEST, TOOL_PICK, committed, named_checkpoint
    from app.errors import CheckpointError

    path = Path(arg)
    if path.is_dir() and not os.path.lexists(path / LATEST):
        found = committed(path)
        hint = f", e.g. {found[-1][1]}" if found else ""
        raise CheckpointError(f"{path} is a directory; pass a checkpoint file (step_NNNNNNN.h5){hint}")
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such file; pass the path of a checkpoint file, e.g. runs/<name>/checkpoints/step_0000020.h5 "
            f"(its `latest` file names the newest)"
        )
    if path.is_dir() or (path.name == LATEST and path.is_file()):  # the checkpoint the pointer names
        return named_checkpoint(arg, arg, "no such file", TOOL_PICK)
    return path


def _natural(name: str) -> tuple:
    """Sort key: the group in ORDER, then names with numbers compared as numbers (blocks.2 < blocks.10)."""
    group, _, leaf = name.rpartition("/")
    rank = ORDER.index(group) if group in ORDER else len(ORDER)
    return (rank, group, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", leaf)])


def _parsed(value: Any) -> Any:
    """A JSON header attribute, parsed (as is when it is not JSON)."""
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value


# Statuses of a damaged dataset (inspect exits 1): its values, its metadata, or the file against its deck's model.
DAMAGE = ("MISMATCH", "UNREADABLE", "DAMAGED", "MISSING", "UNEXPECTED", "WRONG SHAPE")
STATUSES = ("ok", *DAMAGE, "not verified", "no checksum")


def _shape(shape: Any) -> str:
    """A shape as the table shows it: (3,), (64, 32), (2, ?) for a size not known in advance."""
    shown = ["?" if n is None else str(n) for n in shape]
    return "(" + ", ".join(shown) + ("," if len(shown) == 1 else "") + ")"


def _fits(shape: Optional[tuple], want: tuple) -> bool:
    """A dataset's shape is the one expected (None in `want`: any size)."""
    return shape is not None and len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def inspect_file(path: Path, verify: bool = True) -> dict[str, Any]:
    """The report `inspect` prints. With `verify`, reads every dataset whole (the whole file). Besides
    the checksums, the catalogue is judged as a resume judges it: each dataset's metadata (its type,
    dtype and checksum attributes: `io.dataset_damage`) and the datasets against the stored deck's
    model (`io.expected_datasets`): one missing, of another shape, or that the model has no place for."""
    import h5py
    import numpy as np

    from app.checkpoint.io import expected_datasets, model_section, read_header
    from app.checkpoint.slabs import V1_NOTE, dataset_checksum

    # CheckpointError for anything but a committed gridlm checkpoint; damaged datasets are listed, not refused.
    header = read_header(path, damaged_ok=True)
    catalogue = header["datasets"]
    expected = expected_datasets(header, path)
    version = int(header["format_version"])  # 1: verified with the weak v1 checksum
    problems = {key: ("DAMAGED", why) for key, why in header["damaged"].items()}
    for key, want in expected.items():
        shape = catalogue[key]["shape"] if key in catalogue else None
        if key not in catalogue:
            problems[key] = ("MISSING", "the model of its deck has it, a resume reads it")
        elif key not in problems and not _fits(shape, want):
            problems[key] = ("WRONG SHAPE", f"the model of its deck has shape {_shape(want)}")
    for key in catalogue:
        if key not in expected and key not in problems:
            problems[key] = ("UNEXPECTED", "not a dataset of the model of its deck")
    datasets = []
    with h5py.File(path, "r") as f:
        for key in sorted({*catalogue, *expected}, key=_natural):
            entry = catalogue.get(key)
            want = None if entry is None else entry["checksum"]
            status, problem = problems.get(key, ("not verified" if want is not None else "no checksum", None))
            if verify and want is not None and key not in problems:
                try:
                    values = f[key][()]
                    ok = values.size == 0 or dataset_checksum(values, version) == want
                    status = "ok" if ok else "MISMATCH"
                except (OSError, ValueError, KeyError, TypeError) as err:  # damaged data or metadata, named
                    status, problem = "UNREADABLE", f"{type(err).__name__}: {err}"
            shape = entry["shape"] if entry is not None and entry["shape"] is not None else expected.get(key, ())
            stored = None if entry is None else entry["stored"]
            known = stored is not None and None not in shape
            datasets.append({
                "name": "/" + key, "shape": list(shape), "dtype": "" if entry is None else str(entry["dtype"] or ""),
                "stored": stored, "bytes": math.prod(shape) * np.dtype(stored).itemsize if known else 0,
                "checksum": want, "status": status, "problem": problem,
            })  # fmt: skip
    statuses = [d["status"] for d in datasets]
    bad = [d["name"] for d in datasets if d["status"] in DAMAGE]
    return {
        "path": str(path),
        "format": header.get("format"),
        "format_version": header.get("format_version"),
        "step": header.get("step"),
        "consumed_samples": header.get("consumed_samples"),
        "optimizer_steps": header.get("optimizer_steps"),
        "precision": header.get("precision"),
        "loss_scaler": _parsed(header.get("loss_scaler")),
        "grid": _parsed(header.get("grid")),
        "model": model_section(header, path),
        "parameters": sum(
            math.prod(d["shape"]) for d in datasets if d["name"].startswith("/model/") and d["status"] != "MISSING"
        ),
        "sampler": _parsed(header.get("sampler")),
        "created": header.get("created"),
        "versions": _parsed(header.get("versions")),
        "verified": verify,
        "note": V1_NOTE if version < 2 else None,
        "datasets": datasets,
        "total": {
            "datasets": len(datasets) - statuses.count("MISSING"),
            "bytes": sum(d["bytes"] for d in datasets),
            **{key.replace(" ", "_").lower(): statuses.count(key) for key in STATUSES},
        },
        "damaged": bad,
    }


def _grid_line(recorded: Any) -> str:
    """The header's grid signature (JSON, as the file has it)."""
    from app.checkpoint.io import describe_grid  # loaded already: the header was read through it

    grid = recorded
    if not isinstance(grid, dict):
        return str(grid)
    return (
        f"{describe_grid(grid)} ({grid.get('order')}) | "
        f"virtual stages {grid.get('virtual_stages')} | sequence parallel "
        f"{'on' if grid.get('sequence_parallel') else 'off'} | ZeRO-{grid.get('zero')} | "
        f"world size {grid.get('world_size')}"
    )


def _scaler_line(recorded: Any) -> str:
    """The header's loss-scaler record (JSON, as the file has it)."""
    scaler = recorded
    if not isinstance(scaler, dict):
        return "loss scaler none" if scaler is None else f"loss scaler {scaler}"
    return f"loss scale {scaler.get('scale'):g} (clean steps {scaler.get('clean')}, skipped {scaler.get('skipped')})"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of `inspect_file`'s report."""
    m = report["model"]
    versions = report["versions"]
    if isinstance(versions, dict):
        versions = " | ".join(f"{k} {str(v).rstrip(chr(0))}" for k, v in versions.items())
    lines = [
        f"checkpoint  {report['path']} ({report['format']} v{report['format_version']})",
        f"step        {report['step']} | optimizer steps {report['optimizer_steps']} | "
        f"consumed samples {report['consumed_samples']}",
        f"precision   {report['precision']} | {_scaler_line(report['loss_scaler'])}",
        f"grid        {_grid_line(report['grid'])}",
        f"model       {m['arch']} | {report['parameters']:,} parameters | vocab {m['vocab_size']} | "
        f"seq {m['seq_len']} | layers {m['layers']} | hidden {m['hidden']} | heads {m['heads']}"
        + (f" ({m['kv']} kv)" if m["kv"] != m["heads"] else "")
        + f" | ffn {m['ffn']}"
        + (f" | {m['moe_experts']} experts of {m['expert_ffn']}, top-{m.get('moe_top_k')}" if m["moe_experts"] else "")
        + f" | {'tied' if m['tie_embeddings'] else 'untied'} embeddings",
        f"created     {report['created']}",
        f"versions    {versions}",
        *([f"note        {report['note']}"] if report.get("note") else []),
        "",
    ]
    rows = [("dataset", "shape", "dtype", "MB", "checksum")]
    group = None
    for d in report["datasets"]:
        parent, _, leaf = d["name"].rpartition("/")
        if parent != group:
            group = parent
            rows.append((parent + "/", "", "", "", ""))
        status = d["status"] + (f" ({d['problem']})" if d.get("problem") else "")
        rows.append(("  " + leaf, _shape(d["shape"]), d["dtype"], f"{d['bytes'] / 1e6:.3f}", status))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append(
            f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}".rstrip()
        )
    t = report["total"]
    counts = ", ".join(f"{t[key]} {label}" for label in STATUSES if t[key := label.replace(" ", "_").lower()])
    lines.append(f"total: {t['datasets']} datasets, {t['bytes'] / 1e6:.3f} MB | {counts}")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    from app.checkpoint.io import OLDER

    path = checkpoint_file(args.file)
    report = inspect_file(path, args.verify)
    print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    bad = [d for d in report["datasets"] if d["status"] in DAMAGE]
    if bad:
        named = ", ".join(f"{d['name']} ({d['status'].lower()})" for d in bad[:8])
        named += f" and {len(bad) - 8} more (listed above)" if len(bad) > 8 else ""
        print(f"gridlm: {path}: {len(bad)} damaged dataset(s): {named}; the file is corrupt: {OLDER}", file=sys.stderr)
        return CORRUPT
    return OK


def _export(args: argparse.Namespace) -> int:
    from app.checkpoint.export import export_hf
    from app.checkpoint.io import read_header
    from app.checkpoint.slabs import V1_NOTE

    path = checkpoint_file(args.file)
    done = export_hf(path, Path(args.dir), force=args.force)
    print(
        f"gridlm: exported step {done.step} of {path} (/{done.source}, as fp32) -> {done.directory}: "
        f"config.json, model.safetensors | {done.parameters:,} parameters, {done.bytes / 1e6:.1f} MB"
        + (f" | removed the earlier model's {', '.join(done.removed)}" if done.removed else "")
    )
    if int(read_header(path)["format_version"]) < 2:  # it was verified with the v1 checksum
        print(f"gridlm: {path}: {V1_NOTE}")
    return OK


def run(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from app.errors import GridlmError  # after parsing: --help answers without loading anything heavy

    try:
        return {"inspect": _inspect, "export": _export}[args.command](args)
    except GridlmError as err:
        print(f"gridlm: {err}", file=sys.stderr, flush=True)
        return USAGE
    except BrokenPipeError:
        # `inspect FILE | head`: the reader left; no traceback (and none at interpreter exit either).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as a shell reports a process killed by SIGPIPE


def main() -> None:
    exit_now(run())


if __name__ == "__main__":
    main()
