"""The documents of `python -m app.data.prepare`: which inputs, in what order, split into work.

Inputs are text files (one document each), directories (every file below them whose name matches
`--include`, recursed, in sorted path order) or, with `--field NAME`, JSONL files (one document
per non-blank line: the string under NAME). The document order is the order of the inputs on
the command line, then the sorted order inside each directory, then line order.

A `Source` is a byte range of one file: a whole text file, or a run of whole lines of a JSONL
file. `plan_sources` cuts big JSONL files into such runs, so that the ranks can share one file;
`split_sources` gives each rank a contiguous run of sources of about equal bytes. Neither changes
the documents or their order, so the output does not depend on the number of ranks.

Errors name the file (and line, for JSONL) and the fix: a missing input, bytes that are not
UTF-8, a line that is not JSON or lacks the field.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

from app.errors import DataError

FIX_INPUTS = (
    "fix: pass existing text files, directories or JSONL files to `python -m app.data.prepare INPUT... --out PREFIX`"
)
FIX_UTF8 = "fix: convert it to UTF-8 (e.g. `iconv -t utf-8`)"


@dataclass(frozen=True)
class Source:
    """Bytes [start, stop) of `path`: a whole text file (one document) or whole lines of a JSONL file."""

    path: str
    start: int
    stop: int
    jsonl: bool

    @property
    def size(self) -> int:
        return self.stop - self.start


def list_files(inputs: list[str], include: str = "*") -> list[str]:
    """The input files in document order: each file as given, each directory's files (names matching
    `include`) recursed in sorted path order. Symbolic links to files count; links to directories
    are not followed (no loops)."""
    if not inputs:
        raise DataError(f"no inputs given; {FIX_INPUTS}")
    files: list[str] = []
    for given in inputs:
        if os.path.isfile(given):
            files.append(given)
        elif os.path.isdir(given):
            found = [
                os.path.join(root, name)
                for root, _, names in os.walk(given)
                for name in names
                if fnmatch.fnmatch(name, include) and os.path.isfile(os.path.join(root, name))
            ]
            if not found:
                raise DataError(
                    f"directory {given} holds no files matching --include {include!r}; fix: pass a directory with "
                    "text files, or another --include pattern"
                )
            files += sorted(found)
        elif os.path.exists(given):  # a pipe (`<(zcat ...)`), socket or device: no size to plan or share by
            raise DataError(
                f"input {given} is not a regular file (a pipe, socket or device); fix: write it to a file first "
                "and pass that file"
            )
        else:
            raise DataError(f"input {given} does not exist; {FIX_INPUTS}")
    return files


def plan_sources(files: list[str], jsonl: bool, chunk_bytes: int) -> list[Source]:
    """The files as sources; JSONL files larger than `chunk_bytes` are cut into runs of whole lines
    of about that size (at the first newline after each multiple of it)."""
    sources = []
    for path in files:
        size = os.path.getsize(path)
        if not jsonl or size <= chunk_bytes:
            sources.append(Source(path, 0, size, jsonl))
            continue
        start = 0
        with open(path, "rb") as f:
            while start < size:
                f.seek(min(start + chunk_bytes, size) - 1)
                while True:  # to just after the next newline (or the end)
                    block = f.read(1 << 16)
                    cut = block.find(b"\n")
                    if not block or cut >= 0:
                        stop = size if not block else f.tell() - len(block) + cut + 1
                        break
                sources.append(Source(path, start, stop, True))
                start = stop
    return sources


def split_sources(sources: list[Source], ranks: int) -> list[list[Source]]:
    """Contiguous runs of sources, one per rank, of about equal bytes (a source is never split)."""
    total = sum(s.size for s in sources) or 1
    shares: list[list[Source]] = [[] for _ in range(ranks)]
    done = 0
    for s in sources:
        # A source goes to the rank whose byte range holds its middle.
        rank = min(ranks - 1, (2 * done + s.size) * ranks // (2 * total))
        shares[rank].append(s)
        done += s.size
    return shares


def read_documents(source: Source, field: Optional[str]) -> Iterator[bytes]:
    """The documents of a source as validated UTF-8 bytes: the whole file, or the `field` of each
    non-blank JSONL line."""
    try:
        with open(source.path, "rb") as f:
            f.seek(source.start)
            data = f.read(source.size)
    except OSError as e:
        raise DataError(f"input {source.path} cannot be read ({e.strerror}); {FIX_INPUTS}") from None
    if not source.jsonl:
        try:
            data.decode("utf-8")  # the byte tokens of valid UTF-8 equal ByteTokenizer.encode(text)
        except UnicodeDecodeError as e:
            raise DataError(f"text file {source.path} is not UTF-8 (byte {e.start}: {e.reason}); {FIX_UTF8}") from None
        yield data
        return
    for number, line in enumerate(data.split(b"\n")):
        if line.strip():
            yield _field(line, field, source, number)


def _field(line: bytes, field: Optional[str], source: Source, number: int) -> bytes:
    """The `field` string of one JSONL line, as UTF-8 bytes."""
    where = lambda: f"{source.path}:{_line_number(source, number)}"  # noqa: E731 (counted only on error)
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(f"JSONL line {where()} is not UTF-8 ({e.reason}); {FIX_UTF8}") from None
    except ValueError as e:
        raise DataError(
            f"JSONL line {where()} is not valid JSON ({e}); fix: make every non-blank line one JSON object"
        ) from None
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"JSONL line {where()} has no field {field!r} (it has: {keys}); fix: pass --field NAME naming the "
            "text field of every line"
        )
    text = record[field]
    if not isinstance(text, str):
        raise DataError(
            f"JSONL line {where()}: field {field!r} is not a string (it is {json.dumps(text)[:40]}); fix: pass "
            "--field NAME naming the text field, a string on every line"
        )
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escaped in the JSON ("\ud800")
        raise DataError(
            f"JSONL line {where()}: field {field!r} is not valid Unicode ({e.reason}); {FIX_UTF8}"
        ) from None


def _line_number(source: Source, number: int) -> int:
    """The 1-based line number in the file of line `number` of the source (the lines before the
    source are counted only here, for an error message)."""
    before = 0
    if source.start:
        with open(source.path, "rb") as f:
            remaining = source.start
            while remaining:
                block = f.read(min(remaining, 1 << 20))
                before += block.count(b"\n")
                remaining -= len(block)
    return before + number + 1
