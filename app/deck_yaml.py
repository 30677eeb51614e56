"""Reading deck YAML that nobody vetted: the deck file and `--set` values.

Limits (size, depth, number of values, integer length), no anchors or aliases (522 bytes
of aliases expand to gigabytes), no tags (PyYAML's constructors crash on some), no
duplicate keys (PyYAML silently keeps the last), UTF-8 only: any input ends in a value or
a DeckError naming the file or key, quickly. `app/deck.py` validates the values.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from app.errors import DeckError
from app.schema import named
from app.untrusted import decode_utf8, read_bytes

MAX_DECK_BYTES = 256 * 1024  # real decks are 1-3 KB
MAX_YAML_NODES = 10_000  # values, keys included; stage_layers of 4096 chunks fits
MAX_YAML_DEPTH = 16  # a deck needs 4: the document, a section, a key, a list item
MAX_INT_DIGITS = 100  # PyYAML turns 1:2:3... (base 60) and 0x... into ints of any size
EXAMPLE_DECK = "inputs/gpt_tiny.yaml"


def deck_error(key: Any, value: Any, accepted: str, file: Optional[str] = None) -> DeckError:
    """A DeckError whose key and value print as one short line, whatever the deck held."""
    return DeckError(named(key), value, accepted, file)


def _c_parsed_loader() -> type:
    """SafeLoader's composer, constructor and resolver (so values resolve, and the checks below run,
    exactly as with yaml.SafeLoader) over libyaml's scanner and parser where PyYAML was built with
    it: parsing a deck takes a tenth of the time, and every rank of every job parses its deck and any
    checkpoint's stored deck. Without libyaml: yaml.SafeLoader."""
    if not getattr(yaml, "__with_libyaml__", False):
        return yaml.SafeLoader
    from yaml.composer import Composer
    from yaml.constructor import SafeConstructor
    from yaml.cyaml import CParser
    from yaml.resolver import Resolver

    class CParsed(Composer, CParser, SafeConstructor, Resolver):  # Composer first: its compose_node
        def __init__(self, text: str) -> None:
            CParser.__init__(self, text)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            Composer.__init__(self)

    return CParsed


def dump_yaml(data: Any, **options: Any) -> str:
    """yaml.safe_dump's YAML, by libyaml's emitter where PyYAML has it: 4x faster, the same text for
    every deck in inputs/ (an escaped non-ASCII string may wrap elsewhere), the same values read back."""
    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), **options)


class _DeckLoader(_c_parsed_loader()):  # type: ignore[misc]
    """yaml.SafeLoader for untrusted decks: no anchors or aliases (522 bytes of aliases expand
    to gigabytes), no tags, at most MAX_YAML_DEPTH levels and MAX_YAML_NODES values, no giant ints.
    A refusal names `where`: ("DECK", file) or the `--set` key and its text."""

    def __init__(self, text: str, where: tuple[str, str]) -> None:
        super().__init__(text)
        self.where, self.depth, self.nodes = where, 0, 0

    def refuse(self, mark: Any, what: str) -> DeckError:
        line = f"line {mark.line + 1}: " if self.where[0] == "DECK" or "\n" in self.where[1] else ""
        return deck_error(self.where[0], self.where[1], line + what)

    def too_deep(self, mark: Any) -> DeckError:
        return self.refuse(
            mark, f"nested more than {MAX_YAML_DEPTH} levels deep; a deck is sections of keys (see {EXAMPLE_DECK})"
        )

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise self.refuse(
                event.start_mark, "YAML anchors (&name) and aliases (*name) are not accepted in a deck; "
                "write each value out"
            )  # fmt: skip
        if getattr(event, "tag", None) is not None:
            # PyYAML's constructors crash on some tagged values (`!!bool x`: KeyError); a deck needs none.
            tag = event.tag.replace("tag:yaml.org,2002:", "!!")
            raise self.refuse(
                event.start_mark, f"YAML tags ({tag}) are not accepted in a deck; write the plain value "
                "(quoted for a string)"
            )  # fmt: skip
        self.depth, self.nodes = self.depth + 1, self.nodes + 1
        if self.depth > MAX_YAML_DEPTH:
            raise self.too_deep(event.start_mark)
        if self.nodes > MAX_YAML_NODES:
            raise self.refuse(event.start_mark, f"more than {MAX_YAML_NODES:,} YAML values; a deck has a few dozen")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_INT_DIGITS:
            raise self.refuse(
                node.start_mark, f"an integer of {len(node.value):,} characters; at most {MAX_INT_DIGITS} are read"
            )
        value = super().construct_yaml_int(node)
        self.refuse_surprise(node, value)
        return value

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        self.refuse_surprise(node, value)
        return value

    def refuse_surprise(self, node: yaml.ScalarNode, value: float) -> None:
        """YAML 1.1 reads 0123 as octal 83 and 1:40 as base 60, 100: numbers nobody who wrote them
        meant (`seed: 0123` seeded 83, `micro_batch: 010` ran 8)."""
        text = node.value.replace("_", "")
        if ":" in text:
            fix = f'write the number in decimal, or quote it for a time or a string ("{node.value}")'
            raise self.refuse(node.start_mark, f"{node.value} reads as a base-60 number (YAML 1.1), {value}: {fix}")
        if OCTAL.fullmatch(text) and int(text, 10) != value:  # 07 is 7 either way
            fix = f"write {int(text, 10)} without the leading zero, or quote it for a string"
            raise self.refuse(node.start_mark, f"{node.value} reads as an octal number (YAML 1.1), {value}: {fix}")


_DeckLoader.add_constructor("tag:yaml.org,2002:int", _DeckLoader.construct_yaml_int)
_DeckLoader.add_constructor("tag:yaml.org,2002:float", _DeckLoader.construct_yaml_float)
OCTAL = re.compile(r"[-+]?0[0-7]+")


def _check_duplicates(root: yaml.Node, where: tuple[str, str], prefix: str) -> None:
    """A key given twice in one mapping: PyYAML would silently keep the last."""
    stack = [(root, prefix)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
        if not isinstance(node, yaml.MappingNode):
            continue
        seen: dict[str, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag == "tag:yaml.org,2002:merge":
                # `<<: {steps: 7}` beside `steps: 300` trained 300 steps: which one wins is YAML's
                # rule, not the reader's expectation. A deck writes its keys out.
                raise deck_error(
                    path or "DECK", "<<", f"a YAML merge key (<<) at line {key.start_mark.line + 1}: not accepted "
                    "in a deck; write the keys out"
                )  # fmt: skip
            if not isinstance(key, yaml.ScalarNode):
                continue
            dotted = f"{path}.{key.value}" if path else key.value
            line = key.start_mark.line + 1
            if key.value in seen:
                text = value.value if isinstance(value, yaml.ScalarNode) else f"<a YAML {value.id}>"
                place = where[1] if where[0] == "DECK" else "the --set value"
                raise deck_error(
                    dotted, text, f"given twice, at lines {seen[key.value]} and {line} of {place}; keep one"
                )
            seen[key.value] = line
            stack.append((value, dotted))


def parse_yaml(text: str, where: tuple[str, str], prefix: str = "") -> Any:
    """The value of the YAML `text` (None if it holds no document). DeckError for what a deck
    must not hold; yaml.YAMLError or ValueError (e.g. a bad date) for text that is not YAML."""
    loader = _DeckLoader(text, where)
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as err:
            # libyaml's scanner stops at 1,000 open brackets before any node reaches compose_node.
            if "maximum nesting depth" in str(err.problem) and err.problem_mark is not None:
                raise loader.too_deep(err.problem_mark) from None
            raise
        if node is None:
            return None
        _check_duplicates(node, where, prefix)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def comment_in(text: str) -> Optional[str]:
    """What YAML reads as a comment in the one-value `text` of a `--set` (None if nothing): `#` at its
    start or after a space. A deck file's comments are the writer's; in `--set run.dir=runs/a #2` the
    run would silently go to runs/a (another run's directory, resumed and overwritten)."""
    loader = _DeckLoader(text, ("--set", text))
    try:
        node = loader.get_single_node()
    except (yaml.YAMLError, DeckError):
        return None  # parse_yaml says what is wrong
    finally:
        loader.dispose()
    tail = text[node.end_mark.index :] if node is not None else text
    tail = tail.strip().removeprefix("...").strip()
    return tail if tail.startswith("#") else None


def read_yaml_file(
    path: Union[str, Path], what: str, fail: Callable[[str], Exception], example: str, max_bytes: int = MAX_DECK_BYTES
) -> Any:
    """The YAML value (not None) of an input file nobody vetted (`what`: "deck", "machine file",
    ...): a regular file of at most `max_bytes`, UTF-8, read by the bounded loader (no aliases,
    tags, duplicate keys; limited depth and size). Anything else is `fail(message)`, the message
    naming the problem and, with `example`, what to pass instead; never a hang or a traceback."""
    data = read_bytes(path, what, fail, example, max_bytes, f"YAML {what}")
    return read_yaml_bytes(data, str(path), what, fail, example)


def read_yaml_bytes(
    data: bytes,
    source: str,
    what: str,
    fail: Callable[[str], Exception],
    example: str = "",
    max_bytes: int = MAX_DECK_BYTES,
) -> Any:
    """`read_yaml_file`'s checks of bytes already in memory (`source` names where they came from:
    e.g. a checkpoint's stored deck, which must be bounded like any deck)."""
    if len(data) > max_bytes:
        raise fail(f"the {what} is {len(data):,} bytes; a {what} is at most {max_bytes:,} bytes")
    text = decode_utf8(data, what, fail)
    try:
        raw = parse_yaml(text, ("DECK", source))
    except DeckError as err:  # a deck's names the key; another file's names the file (`fail`)
        if what == "deck":
            raise
        raise fail(f"{named(err.key)}: {err.accepted}" if err.key != "DECK" else err.accepted) from None
    except (yaml.YAMLError, ValueError, RecursionError) as err:
        raise fail(f"not readable YAML ({yaml_reason(err)})") from None
    if raw is None:
        raise fail(f"the {what} is empty" + (f"; see {example}" if example else ""))
    return raw


def yaml_reason(err: Exception) -> str:
    """A YAML parse error on one line: what and where (PyYAML's own message spans four lines,
    quoting the text with a caret under it)."""
    mark = getattr(err, "problem_mark", None)
    if isinstance(err, yaml.MarkedYAMLError) and mark is not None:
        context = f"{err.context}; " if err.context else ""
        return f"{context}{err.problem} at line {mark.line + 1}, column {mark.column + 1}"[:300]
    return " ".join(str(err).split())[:300]


def read_deck_file(path: Union[str, Path]) -> Any:
    """The deck file's YAML value (not None); DeckError naming the file for anything else."""
    return read_yaml_file(path, "deck", lambda message: DeckError("DECK", str(path), message), EXAMPLE_DECK)
