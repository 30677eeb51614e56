"""Reading input files nobody vetted: decks, machine and study files, token-file metadata,
tokenizer.json, a Hugging Face config.json, a checkpoint directory's `latest` pointer.

One rule for all of them: a regular file (a FIFO must not block, /dev/zero must not fill
memory), opened without blocking and read up to a cap, UTF-8 where it is text; JSON parsed
only after that. Anything else is the caller's `fail(message)`: an exception naming the file
and what to pass instead, never a hang, a traceback or a blown-up process. The YAML of decks
and machine files goes on to app/deck_yaml.py's bounded loader.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

Fail = Callable[[str], Exception]


def read_bytes(path: Union[str, Path], what: str, fail: Fail, example: str, max_bytes: int, wanted: str = "") -> bytes:
    """At most `max_bytes` of the regular file `path` (`what`: "deck", "tokenizer.json", ...);
    `fail(message)` is raised for a missing, unreadable, oversized or non-regular file, saying to
    pass "the path of a `wanted`" (default: `what`), e.g. `example`."""
    wanted = (wanted or what) + (f", e.g. {example}" if example else "")
    try:
        # O_NONBLOCK: a named pipe given as the file must not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        info = os.fstat(fd)  # before fdopen, which refuses a directory with a bare errno
        if stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode) or stat.S_ISDIR(info.st_mode):
            os.close(fd)
            raise fail(f"is not a file; pass the path of a {wanted}")
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)  # at most: /dev/zero is a file name too
    except FileNotFoundError:
        raise fail(f"file not found; pass the path of a {wanted}") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise fail(f"cannot be read ({err})") from None
    if len(data) > max_bytes:
        size = f"{info.st_size:,}" if stat.S_ISREG(info.st_mode) else f"more than {max_bytes:,}"
        raise fail(f"the {what} is {size} bytes; a {what} is at most {max_bytes:,} bytes")
    return data


def decode_utf8(data: bytes, what: str, fail: Fail) -> str:
    """`data` as UTF-8 text; `fail` names the first bad byte and its line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise fail(
            f"not UTF-8 text: byte 0x{data[err.start]:02x} at byte offset {err.start} (line {line}); save the "
            f"{what} as UTF-8"
        ) from None


def parse_json(data: bytes, what: str, fail: Fail) -> Any:
    """The JSON value of `data` (already bounded in size); `fail` for non-UTF-8 text, bad JSON and
    nesting deeper than the interpreter's recursion limit."""
    text = decode_utf8(data, what, fail)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:  # ValueError: also an integer of over 4,300 digits
        raise fail(f"not valid JSON ({str(err)[:200]})") from None


def read_json(path: Union[str, Path], what: str, fail: Fail, example: str, max_bytes: int) -> Any:
    """`read_bytes`, then `parse_json`."""
    return parse_json(read_bytes(path, what, fail, example, max_bytes, f"JSON {what}"), what, fail)
