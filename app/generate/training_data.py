"""A checkpoint's training data as the inference tools see it: the first token file of its deck's
data section (a blend's files share one tokenizer), read where it still is.

`training_file` opens its metadata (None for synthetic data or a file that is gone), which names
the tokenizer it was prepared with (`tokenizer_words`, `tokenizer_file`: the recorded
tokenizer.json, else `<prefix>.tokenizer.json` beside the token file, where `prepare
--train-tokenizer` writes it, with the recorded sha256). `check_tokenizer` refuses a --tokenizer of
another kind or sha256; `training_match` says whether a --data file is one the run trained on.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from app.errors import DataError

if TYPE_CHECKING:
    from app.data.tokenizer import AnyTokenizer
    from app.deck import DataConfig

ANY_TOKENIZER = "--any-tokenizer"  # the override, where the token file was prepared again since the training


class TokenFile(NamedTuple):
    """A token file's PREFIX and its metadata (PREFIX.json), as `check_tokenized_alike` reads them."""

    prefix: str
    meta: dict[str, Any]


def training_file(data: DataConfig) -> tuple[Optional[TokenFile], str]:
    """The run's first token file (data.path, or data.paths' first) and its metadata; else None and
    why, in words (synthetic data, or the file cannot be read)."""
    from app.data.memmap import load_metadata

    if data.kind != "memmap" or not data.blend:
        return None, "was trained on synthetic data, which has no tokenizer"
    prefix = data.blend[0][1]
    try:
        return TokenFile(prefix, load_metadata(prefix)), ""
    except DataError as err:  # its own fix (prepare, set data.path) is training's, not a tool's
        return None, f"was trained on {prefix}, which cannot be read here ({str(err).split('; fix:')[0]})"


def tokenizer_words(meta: dict[str, Any]) -> str:
    """The tokenizer a token file's metadata names: `byte`, `huggingface PATH (sha256 ...)`, or unknown."""
    kind = meta.get("tokenizer")
    if kind == "huggingface":
        return f"huggingface {meta.get('tokenizer_path')} (sha256 {meta.get('tokenizer_sha256')})"
    return str(kind) if kind else "unknown (its metadata names none)"


def _sha256(path: str) -> Optional[str]:
    """The sha256 of a file's bytes, None when it cannot be read (or is too large to be a tokenizer.json)."""
    from app.data.tokenizer import MAX_TOKENIZER_BYTES
    from app.untrusted import read_bytes

    try:
        return hashlib.sha256(read_bytes(path, "tokenizer.json", DataError, "", MAX_TOKENIZER_BYTES)).hexdigest()
    except DataError:  # missing, not a regular file, unreadable or oversized
        return None


def tokenizer_file(found: TokenFile) -> tuple[Optional[str], list[str]]:
    """The tokenizer.json a huggingface token file was prepared with: the recorded path, else
    `<prefix>.tokenizer.json` beside the token file, whichever holds the recorded sha256; and the
    candidates that exist but hold other bytes (named in the message when none fits)."""
    recorded, want = found.meta.get("tokenizer_path", ""), found.meta.get("tokenizer_sha256")
    beside = found.prefix + ".tokenizer.json"
    other = []
    for path in dict.fromkeys(p for p in (recorded, beside) if p):  # once each, recorded first
        sha = _sha256(path)
        if sha is not None and sha == want:
            return path, other
        if sha is not None:
            other.append(path)
    return None, other


def recorded_eos(spec: str, found: Optional[TokenFile]) -> Optional[int]:
    """The end-of-document id the training data (`found`) recorded, where the tokenizer.json `spec` is
    the one it names (its sha256): prepare may have been given --eos, which the usual names do not find
    (a Llama 3 tokenizer with --eos '<|eot_id|>' has <|end_of_text|> too). None otherwise."""
    if spec == "byte" or found is None or found.meta.get("tokenizer") != "huggingface" or "eos" not in found.meta:
        return None
    sha = _sha256(spec)
    return int(found.meta["eos"]) if sha is not None and sha == found.meta.get("tokenizer_sha256") else None


def missing_tokenizer(data: DataConfig) -> str:
    """Why the training data gives no tokenizer, and the fix, in words (for a --prompt without --tokenizer)."""
    found, why = training_file(data)
    if found is None:
        fix = "" if data.kind != "memmap" else "pass --tokenizer byte|PATH, or "
        return f"this checkpoint {why}; fix: {fix}pass token ids with --prompt-ids"
    if found.meta.get("tokenizer") != "huggingface":
        return (
            f"the checkpoint's training data {found.prefix}.json names no tokenizer (written by another tool); fix: "
            "pass --tokenizer byte|PATH, or token ids with --prompt-ids"
        )
    recorded, beside = found.meta.get("tokenizer_path"), found.prefix + ".tokenizer.json"
    nor = "" if recorded and os.path.abspath(recorded) == os.path.abspath(beside) else f", nor is {beside}"
    return (
        f"the checkpoint's training data {found.prefix} was prepared with the tokenizer {recorded} (sha256 "
        f"{found.meta.get('tokenizer_sha256')}), which is not there{nor}; fix: pass --tokenizer PATH of that "
        "tokenizer.json (its sha256 is checked), or token ids with --prompt-ids"
    )


def check_tokenizer(tokenizer: AnyTokenizer, given: str, found: Optional[TokenFile]) -> None:
    """DataError unless --tokenizer `given` is the one the training data (`found`) names: its kind and,
    for a tokenizer.json, its sha256 (ids of another tokenizer decode as other text). Nothing to check
    when the training data is gone or names no tokenizer."""
    if found is None or not found.meta.get("tokenizer"):
        return
    kind, sha = found.meta["tokenizer"], found.meta.get("tokenizer_sha256")
    if tokenizer.name == kind and (kind != "huggingface" or getattr(tokenizer, "sha256", None) == sha):
        return
    mine = tokenizer.name if tokenizer.name != "huggingface" else f"huggingface (sha256 {tokenizer.sha256})"  # type: ignore[union-attr]
    raise DataError(
        f"--tokenizer {given} ({mine}) is not the tokenizer the checkpoint's training data {found.prefix} was "
        f"prepared with ({tokenizer_words(found.meta)}): its ids would read as other text; fix: leave out "
        f"--tokenizer (the training data's is the default), or pass {ANY_TOKENIZER} if {found.prefix} was "
        "prepared again since the training"
    )


def training_match(data: DataConfig, prefix: str, meta: dict[str, Any]) -> Optional[str]:
    """The run's token file that the token file `prefix` (its metadata `meta`) is: the same file, or a
    copy (equal metadata, which records the counts and the tokenizer); None when it is none of them
    (or they cannot be read to compare)."""
    from app.data.memmap import load_metadata

    if data.kind != "memmap":
        return None
    for _, trained in data.blend:
        try:
            if os.path.samefile(trained + ".bin", prefix + ".bin"):
                return trained
        except OSError:
            pass
        try:
            if load_metadata(trained) == meta:
                return trained
        except DataError:
            continue
    return None
