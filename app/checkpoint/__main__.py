"""`python -m app.checkpoint inspect|export`: look into a checkpoint, or convert it to a Hugging Face model.

Both are serial tools: one process, plain h5py, no MPI launch (run them on a login node).

    python -m app.checkpoint inspect FILE [--no-verify] [--json]
    python -m app.checkpoint export FILE --to hf DIR [--force]

`inspect` prints the header (step, consumed samples, precision, the grid that wrote the
file, created, versions) and a tree of the datasets with global shape, logical dtype,
size and checksum status. Verifying the checksums reads the whole file, one dataset at a
time; --no-verify reads only the metadata. Exit status: 0 all ok, 1 a checksum mismatch
or an unreadable dataset (named on stderr), 2 a user mistake (missing file, not a gridlm
checkpoint, incomplete file), reported as one `gridlm: ...` line without a traceback.

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
        epilog="Exit status: 0 ok, 1 checksum mismatch (inspect), 2 user mistake (message on stderr).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    inspect = commands.add_parser(
        "inspect",
        help="print the header and the datasets, verifying checksums",
        description="Print a checkpoint's header (step, consumed samples, precision, grid that wrote it, created, "
        "versions) and a tree of its datasets with global shape, logical dtype, size (MB = 10^6 bytes) and checksum "
        "status. Verification reads the whole file, one dataset at a time.",
        epilog="Exit status: 0 all checksums ok, 1 a checksum mismatch or unreadable dataset (named on stderr), "
        "2 missing file, not a gridlm checkpoint or incomplete.",
    )
    inspect.add_argument("file", metavar="FILE", help="checkpoint file, e.g. runs/x/checkpoints/step_0000020.h5")
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
    """The FILE argument as a path that exists and is a file; CheckpointError naming the fix otherwise."""
    from app.checkpoint.store import committed
    from app.errors import CheckpointError

    path = Path(arg)
    if path.is_dir():
        found = committed(path)
        hint = f", e.g. {found[-1][1]}" if found else ""
        raise CheckpointError(f"{path} is a directory; pass a checkpoint file (step_NNNNNNN.h5){hint}")
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such file; pass the path of a checkpoint file, e.g. runs/<name>/checkpoints/step_0000020.h5 "
            f"(its `latest` file names the newest)"
        )
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


def inspect_file(path: Path, verify: bool = True) -> dict[str, Any]:
    """The report `inspect` prints. With `verify`, reads every dataset whole (the whole file)."""
    import h5py

    from app.checkpoint.io import model_section, read_header
    from app.checkpoint.slabs import V1_NOTE, dataset_checksum

    header = read_header(path)  # CheckpointError for anything but a committed gridlm checkpoint
    found: list[tuple[str, Any]] = []
    datasets = []
    version = int(header["format_version"])  # 1: verified with the weak v1 checksum
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.append((name, obj)) if isinstance(obj, h5py.Dataset) else None)
        for name, dset in sorted(found, key=lambda item: _natural(item[0])):
            want = dset.attrs.get("checksum")
            status = "no checksum" if want is None else "not verified"
            if verify and want is not None:
                try:
                    values = dset[()]
                    ok = values.size == 0 or dataset_checksum(values, version) == int(want)
                    status = "ok" if ok else "MISMATCH"
                except OSError:
                    status = "UNREADABLE"
            logical = dset.attrs.get("dtype", dset.dtype.name)
            datasets.append({
                "name": "/" + name, "shape": list(dset.shape), "dtype": str(logical), "stored": dset.dtype.str,
                "bytes": int(dset.size * dset.dtype.itemsize), "checksum": None if want is None else int(want),
                "status": status,
            })  # fmt: skip
    statuses = [d["status"] for d in datasets]
    bad = [d["name"] for d in datasets if d["status"] in ("MISMATCH", "UNREADABLE")]
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
        "parameters": sum(math.prod(d["shape"]) for d in datasets if d["name"].startswith("/model/")),
        "sampler": _parsed(header.get("sampler")),
        "created": header.get("created"),
        "versions": _parsed(header.get("versions")),
        "verified": verify,
        "note": V1_NOTE if version < 2 else None,
        "datasets": datasets,
        "total": {
            "datasets": len(datasets),
            "bytes": sum(d["bytes"] for d in datasets),
            **{
                key.replace(" ", "_").lower(): statuses.count(key)
                for key in ("ok", "MISMATCH", "UNREADABLE", "not verified", "no checksum")
            },
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
        shape = "(" + ", ".join(map(str, d["shape"])) + ("," if len(d["shape"]) == 1 else "") + ")"
        rows.append(("  " + leaf, shape, d["dtype"], f"{d['bytes'] / 1e6:.3f}", d["status"]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append(
            f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}".rstrip()
        )
    t = report["total"]
    counts = ", ".join(f"{t[k]} {label}" for k, label in (
        ("ok", "ok"), ("mismatch", "MISMATCH"), ("unreadable", "UNREADABLE"),
        ("not_verified", "not verified"), ("no_checksum", "no checksum"),
    ) if t[k])  # fmt: skip
    lines.append(f"total: {t['datasets']} datasets, {t['bytes'] / 1e6:.3f} MB | {counts}")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    report = inspect_file(checkpoint_file(args.file), args.verify)
    print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    bad = report["damaged"]
    if bad:
        print(
            f"gridlm: {args.file}: checksum mismatch or unreadable data in {len(bad)} dataset(s): {', '.join(bad)}; "
            f"the file is corrupt: resume from an older checkpoint (run.resume: <file>)",
            file=sys.stderr,
        )
        return CORRUPT
    return OK


def _export(args: argparse.Namespace) -> int:
    from app.checkpoint.export import export_hf
    from app.checkpoint.io import read_header
    from app.checkpoint.slabs import V1_NOTE

    done = export_hf(checkpoint_file(args.file), Path(args.dir), force=args.force)
    print(
        f"gridlm: exported step {done.step} of {args.file} (/{done.source}, as fp32) -> {done.directory}: "
        f"config.json, model.safetensors | {done.parameters:,} parameters, {done.bytes / 1e6:.1f} MB"
        + (f" | removed the earlier model's {', '.join(done.removed)}" if done.removed else "")
    )
    if int(read_header(Path(args.file))["format_version"]) < 2:  # it was verified with the v1 checksum
        print(f"gridlm: {args.file}: {V1_NOTE}")
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
