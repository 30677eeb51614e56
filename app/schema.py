"""Declared keys: the one engine that checks the deck, machine files and study files.

A file kind declares each of its keys once, as a `Key`: its type, its default or REQUIRED,
one line of help, and its rules (bounds, accepted values, text rules). `check` reads a YAML
mapping against those declarations: unknown keys (naming the accepted ones and a close
match), missing required keys, then each value: its type (a bool is not an int, an int is
accepted for a float, NaN and Inf are not numbers), its bounds and its accepted values. A
mistake is a `Problem` naming the file, the key, the value and what is expected, in one line
of the form `<file>: <key> = <value>: <expected>`; each file kind raises it as its own error
(DeckError, MachineError, StudyError). Rules between keys stay with the file kind.

Standard library only: the deck, the planner and launch/ all read it, none with torch.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

MAX_TEXT = 4096  # characters of a text key (PATH_MAX)
MAX_SHOWN = 200  # characters of a value repeated in a message
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of a key the file must give


@dataclass(frozen=True)
class Key:
    """One declared key.

    `type`: int, float, str, bool, dict, list, list[int], or an Optional / Union of them (a str
    in a Union only stands for `words`). `default`: the value a left-out key takes (applied by
    the file kind's dataclass; here it documents the key) or REQUIRED. Bounds and `choices`
    apply to numbers and strings, and to each item of a list[...]."""

    type: Any
    default: Any = REQUIRED
    help: str = ""
    min: Optional[float] = None
    max: Optional[float] = None
    exclusive_min: bool = False  # `min` itself refused ("must be > 0")
    choices: tuple[Any, ...] = ()
    words: tuple[str, ...] = ()  # strings accepted in place of the type (parallel.dp: auto)
    text: bool = False  # strings reach paths, logs and HDF5 attributes: printable UTF-8, <= MAX_TEXT
    path: bool = False  # a path: not empty
    fix: str = ""  # said instead of "expected TYPE (help)" for a value of the wrong type
    length: Optional[int] = None  # a list[...] of exactly this many items (gemm.tile: [rows, columns])

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def bounds(self) -> str:
        """The accepted range in words: `0.0 .. 10.0`, `> 0`."""
        if self.exclusive_min:
            return f"> {self.min}" + ("" if self.max is None else f" and <= {self.max}")
        return f"{'-inf' if self.min is None else self.min} .. {'inf' if self.max is None else self.max}"


class Problem(Exception):
    """A key of `file` that is unknown, missing or has a bad value. Not a user-facing error by
    itself: the file kind re-raises it as its own (DeckError, MachineError, StudyError)."""

    def __init__(self, file: str, key: str, value: Any, expected: str) -> None:
        self.file, self.key, self.value, self.expected = file, key, value, expected
        # A missing key has no value to show, nor has a file that is not a mapping (key "").
        core = expected if value is REQUIRED or not key else f"{named(key)} = {shown(value)}: {expected}"
        super().__init__(f"{file}: {core}" if file else core)


def named(key: Any) -> str:
    """A key as a message shows it: printable and short, whatever the file held."""
    name = str(key)
    return name if name.isprintable() and len(name) <= 100 else repr(name[:100])


def shown(value: Any) -> str:
    """A value as the deck or machine file writes it: null, true and false as YAML spells them, the
    rest as repr(value), cut to MAX_SHOWN characters, so that a message stays one short line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit limit of int -> str
        return f"<an int of {value.bit_length():,} bits>"
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def type_name(tp: Any) -> str:
    """A declared type in words: int, float, str, bool, mapping, list, list of int; unions joined
    by ` | `, with `null` last when None is accepted."""
    if tp is dict or typing.get_origin(tp) is dict:
        return "mapping"
    if typing.get_origin(tp) is list:
        return "list of " + type_name(typing.get_args(tp)[0])
    if not _is_union(tp):
        return tp.__name__
    args = typing.get_args(tp)
    name = " | ".join(type_name(a) for a in args if a is not type(None))
    return name + " | null" if type(None) in args else name


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def check(
    raw: Any,
    keys: Mapping[str, Key],
    file: str,
    *,
    prefix: str = "",
    noun: str = "key",
    null_is_absent: bool = False,
) -> dict[str, Any]:
    """The keys `raw` gives, checked against `keys` and converted (an int given for a float is a
    float); a Problem naming `file` and `prefix` + key for the first mistake.

    Unknown keys are found first, then missing required ones, then bad values. `noun` names
    the keys in messages (the deck's top level has sections). With `null_is_absent` a null
    value means the key is left out (machine and study files); otherwise null is a value that
    only an Optional type accepts (the deck: `model.ffn_hidden: null`)."""
    if not isinstance(raw, dict):
        raise Problem(file, "", raw, f"expected a mapping of the {noun}s {', '.join(keys)}")
    for name, value in raw.items():
        if name not in keys:
            close = difflib.get_close_matches(str(name), list(keys), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise Problem(
                file, f"{prefix}{name}", value, f"unknown {noun} {shown(name)}; accepted: {', '.join(keys)}{hint}"
            )
    given = [name for name, value in raw.items() if not (null_is_absent and value is None)]
    missing = [name for name, key in keys.items() if key.required and name not in given]
    if missing:
        helps = "; ".join(f"{name}: {keys[name].help}" for name in missing)
        raise Problem(
            file,
            ", ".join(prefix + name for name in missing),
            REQUIRED,
            f"missing {noun}(s) {', '.join(missing)} ({helps})",
        )
    return {name: check_value(keys[name], raw[name], prefix + name, file) for name in given}


def check_value(key: Key, value: Any, name: str, file: str = "") -> Any:
    """`value` converted to `key`'s type, or a Problem naming `file`, `name` and what is accepted."""
    return _value(key, key.type, value, name, file)


def _value(key: Key, tp: Any, value: Any, name: str, file: str) -> Any:
    args = typing.get_args(tp) if _is_union(tp) else ()
    if value is None:
        if type(None) in args:
            return None
        raise Problem(file, name, value, f"a value is required ({type_name(tp)})")
    if isinstance(value, str) and value in key.words:
        return value
    for want in [a for a in args if a is not type(None)] or [tp]:
        item = typing.get_args(want) if typing.get_origin(want) is list else ()
        if want is bool and isinstance(value, bool):
            converted: Any = value
        elif want is int and isinstance(value, int) and not isinstance(value, bool):
            converted = value
        elif want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                converted = float(value)
            except OverflowError:  # an int beyond 1.8e308
                raise Problem(file, name, value, _too_large(key)) from None
        elif want is float and isinstance(value, str):
            # PyYAML reads `3e-4` (no dot) as a string; accept what float() accepts.
            try:
                converted = float(value)
            except ValueError:
                continue
        elif want is str and isinstance(value, str) and not key.words:
            converted = _text(key, value, name, file)
        elif item and isinstance(value, list):
            if key.length is not None and len(value) != key.length:
                raise Problem(file, name, value, f"expected a list of {key.length} items ({key.help})")
            return [_value(key, item[0], v, f"{name}[{i}]", file) for i, v in enumerate(value)]
        elif want in (dict, list) and isinstance(value, want):
            return value
        else:
            continue
        break
    else:
        words = " or ".join(repr(w) for w in key.words)
        accepted = type_name(tp).replace(" | str", "") + (f" or {words}" if words else "")
        raise Problem(file, name, value, key.fix or f"expected {accepted}" + (f" ({key.help})" if key.help else ""))
    return _in_bounds(key, converted, value, name, file)


def _in_bounds(key: Key, converted: Any, value: Any, name: str, file: str) -> Any:
    if key.choices and converted not in key.choices:
        raise Problem(file, name, value, "accepted: " + ", ".join(str(c) for c in key.choices))
    if isinstance(converted, float) and not math.isfinite(converted):
        # NaN passes every comparison below; Inf would overflow whatever uses it.
        raise Problem(file, name, value, f"must be a finite number, {key.bounds()}")
    if not isinstance(converted, (int, float)) or isinstance(converted, bool):
        return converted
    if key.min is not None and (converted <= key.min if key.exclusive_min else converted < key.min):
        raise Problem(file, name, value, f"must be {'>' if key.exclusive_min else '>='} {key.min}")
    if key.max is not None and converted > key.max:
        raise Problem(file, name, value, f"must be <= {key.max}")
    return converted


def _too_large(key: Key) -> str:
    return "must be a finite number" if key.max is None else f"must be <= {key.max}"


def _text(key: Key, value: str, name: str, file: str) -> str:
    """A string value: printable UTF-8 of a sane length for the keys declared `text`; a path is not empty."""
    if key.text:
        _printable(value, name, file)
    if key.path and not value.strip():
        raise Problem(file, name, value, "an empty path; give a path, or leave the key out for the default")
    if key.path and (value.startswith("~") or UNEXPANDED.search(value)):
        # Nothing expands them: files went to ./~/run and ./$HOME/ck, and a memmap prefix
        # under ~ was reported missing, with the advice to prepare the data again.
        raise Problem(
            file, name, value, "~ and $VARIABLE are not expanded in a deck: give the expanded path (a shell "
            "expands an unquoted --set key=$HOME/x; relative paths are from the working directory)"
        )  # fmt: skip
    return value


UNEXPANDED = re.compile(r"\$(\{|[A-Za-z_])")  # $HOME, ${SCRATCH}: a shell variable, not a name


def _printable(value: str, name: str, file: str) -> None:
    if len(value) > MAX_TEXT:
        raise Problem(file, name, value, f"{len(value):,} characters; at most {MAX_TEXT} are accepted")
    bad = CONTROL.search(value)
    if bad:
        raise Problem(
            file, name, value, f"contains the control character {bad.group()!r} at position {bad.start()}; "
            "use printable characters only"
        )  # fmt: skip
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # lone surrogates from undecodable command-line bytes
        raise Problem(file, name, value, f"not valid UTF-8 text at position {err.start}") from None
