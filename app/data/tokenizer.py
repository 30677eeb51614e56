"""Tokenizers of `python -m app.data.prepare`: bytes (no file), or a Hugging Face `tokenizer.json`.

`ByteTokenizer`: ids 0..255 are UTF-8 bytes, 256 is end-of-document; nothing to download.
`HFTokenizer`: a `tokenizer.json` read with the `tokenizers` library, offline (from a file, never
from the Hub). `train_bpe` trains a byte-level BPE on documents with the same library.

Both encode a batch of documents given as UTF-8 bytes to uint32 id arrays (no EOS; prepare
appends it) and describe themselves for the token file's metadata (`describe`): kind, path and
sha256 of the tokenizer.json, vocab_size and EOS id. Token files blended in one run must agree
on that identity (`identity`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import numpy as np

from app.errors import DataError
from app.untrusted import read_bytes

# End-of-document tokens looked for, in order, in a tokenizer.json's special tokens (GPT-2,
# Llama 1/2, Llama 3, Gemma) when --eos does not name one.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BPE_EOS = "<|endoftext|>"  # the special token (id 0) of the BPE that train_bpe makes
# The largest tokenizer.json files of public models are tens of MB (Gemma's 33 MB).
MAX_TOKENIZER_BYTES = 128 << 20
IDENTITY = ("tokenizer", "tokenizer_sha256", "vocab_size", "eos")  # metadata keys that name a tokenizer


class ByteTokenizer:
    """Maps text to UTF-8 byte ids; `EOS` separates documents in token files."""

    EOS = 256
    vocab_size = 257
    name = "byte"

    @property
    def eos(self) -> int:
        return self.EOS

    def encode(self, text: str) -> list[int]:
        """Text -> list of byte ids in [0, 256); no EOS appended."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Byte ids -> text; EOS is skipped, an id outside the bytes (a model whose vocabulary is
        larger than the tokenizer's can sample one) and invalid UTF-8 become U+FFFD."""
        out = bytearray()
        for i in map(int, ids):
            if i == self.EOS:
                continue
            out += bytes((i,)) if 0 <= i < 256 else "\ufffd".encode()
        return out.decode("utf-8", errors="replace")

    def encode_batch(self, documents: list[bytes]) -> list[np.ndarray]:
        """UTF-8 documents (already validated) -> their ids, each a uint8 view of the bytes."""
        return [np.frombuffer(doc, dtype=np.uint8) for doc in documents]

    def describe(self) -> dict[str, Any]:
        """The token file's metadata keys of this tokenizer."""
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eos": self.EOS}


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (any model the `tokenizers` library reads: BPE, Unigram,
    WordPiece). `eos` is the id of the end-of-document token: `eos_token` if given, else the first
    of EOS_NAMES that the file has. Encoding adds no special tokens (no BOS): prepare appends EOS; it
    never truncates or pads, whatever the file says."""

    name = "huggingface"

    def __init__(
        self, path: str, eos_token: Optional[str] = None, text: Optional[str] = None, eos_id: Optional[int] = None
    ) -> None:
        from tokenizers import Tokenizer

        self.path = os.path.abspath(path)
        if text is None:
            fail = lambda message: DataError(  # noqa: E731
                f"tokenizer {path}: {message}; fix: pass --tokenizer byte or the path of a Hugging Face tokenizer.json"
            )
            raw = read_bytes(path, "tokenizer.json", fail, "", MAX_TOKENIZER_BYTES)
        else:
            raw = text.encode("utf-8")
        try:
            self.tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception on a bad file
            # Worded for every tool that reads one (prepare, generate, memorization): no option of one tool only.
            raise DataError(
                f"tokenizer {path} is not a Hugging Face tokenizer.json ({e}); fix: pass --tokenizer byte, the "
                "tokenizer.json of a model (e.g. from its Hugging Face directory) or a tokenizer.json written by "
                "app.data.prepare"
            ) from None
        # A document is its whole text (found in review: a file saved with truncation and padding on cut
        # every document to max_length ids and padded the short ones of a batch with the pad id, silently).
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        # The ids a model must embed: one past the largest, not the count of tokens (a vocabulary
        # may skip ids; counted, a file of ids up to 70000 was written as uint16 and wrapped).
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        # eos_id: the id a token file's metadata recorded (prepare may have been given --eos).
        self.eos = eos_id if eos_id is not None else self._find_eos(eos_token)

    def _find_eos(self, eos_token: Optional[str]) -> int:
        if eos_token is not None:
            found = self.tokenizer.token_to_id(eos_token)
            if found is None:
                raise DataError(
                    f"--eos {eos_token!r} is not a token of {self.path}; fix: name one of its special tokens, e.g. "
                    f"{', '.join(self.special_tokens()[:5]) or '(it has none)'}"
                )
            return int(found)
        for name in EOS_NAMES:
            found = self.tokenizer.token_to_id(name)
            if found is not None:
                return int(found)
        raise DataError(
            f"tokenizer {self.path} has none of the end-of-document tokens {', '.join(EOS_NAMES)}; fix: pass --eos "
            f"TOKEN naming its end-of-document token (its special tokens: {', '.join(self.special_tokens()[:5]) or 'none'})"
        )

    def special_tokens(self) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_batch(self, documents: list[bytes]) -> list[np.ndarray]:
        """UTF-8 documents (already validated) -> their ids as uint32 arrays. The library spreads a
        batch over its own threads; the ids of a document do not depend on the batch. A special
        token's text in a document ("<|endoftext|>" in code or a paper about models) is encoded as
        text, as tiktoken's encode_ordinary does: only prepare ends a document with EOS (found in
        review: the library turned it into the id, a false end of document mid-text)."""
        texts = [doc.decode("utf-8") for doc in documents]
        before = self.tokenizer.encode_special_tokens
        self.tokenizer.encode_special_tokens = True
        try:
            encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        finally:
            self.tokenizer.encode_special_tokens = before
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def describe(self) -> dict[str, Any]:
        return {
            "tokenizer": self.name,
            "tokenizer_path": self.path,
            "tokenizer_sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos": self.eos,
        }


AnyTokenizer = Union[ByteTokenizer, HFTokenizer]


def load_tokenizer(spec: str, eos_token: Optional[str] = None) -> AnyTokenizer:
    """`byte`, or the path of a Hugging Face tokenizer.json."""
    if spec == "byte":
        if eos_token is not None:
            raise DataError("--eos is for a tokenizer.json; the byte tokenizer's end-of-document id is 256")
        return ByteTokenizer()
    if os.path.isdir(spec):  # "no such file" would send the user looking for a path that is there
        raise DataError(
            f"--tokenizer {spec}: a directory, not a file; fix: pass the tokenizer.json file itself (e.g. "
            f"{os.path.join(spec, 'tokenizer.json')}) or --tokenizer byte"
        )
    if not os.path.isfile(spec):
        raise DataError(
            f"--tokenizer {spec}: no such file; fix: pass --tokenizer byte or the path of a Hugging Face "
            "tokenizer.json (nothing is downloaded)"
        )
    return HFTokenizer(spec, eos_token)


def train_bpe(documents: Iterator[bytes], vocab_size: int) -> str:
    """A byte-level BPE of `vocab_size` ids trained on the documents (UTF-8 bytes): the JSON text of
    its tokenizer.json. Id 0 is the end-of-document token BPE_EOS, 1..256 the 256 byte symbols, the
    rest merges. Deterministic: the same documents give the same file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    minimum = 1 + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < minimum:
        raise DataError(
            f"--train-tokenizer {vocab_size}: a byte-level BPE needs at least {minimum} ids (256 bytes and the "
            f"end-of-document token); fix: pass --train-tokenizer N with N >= {minimum}"
        )
    # The library's trainer takes a u32 and raises OverflowError past it; no deck could embed more
    # ids than model.vocab_size allows, so that bound is the one the message gives.
    from app.deck import KEYS

    bound = KEYS["model"]["vocab_size"].max
    assert bound is not None  # the deck declares one (2**24)
    maximum = int(bound)
    if vocab_size > maximum:
        raise DataError(
            f"--train-tokenizer {vocab_size}: more ids than a model embeds (model.vocab_size is at most "
            f"{maximum:,}); fix: pass --train-tokenizer N with N <= {maximum}, e.g. 32000"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((doc.decode("utf-8") for doc in documents), trainer=trainer)
    return tok.to_str()


def identity(meta: dict[str, Any]) -> tuple[Any, ...]:
    """What names the tokenizer of a token file's metadata: files with equal identities hold the
    same ids for the same text."""
    return tuple(meta.get(key) for key in IDENTITY)


def check_tokenized_alike(reference: Any, other: Any, key: str, fix: str) -> None:
    """DataError unless the token files `other` and `reference` (MemmapTokens: their `meta` and
    `prefix`) were prepared with one tokenizer; `key` names where `other` was given, `fix` the fix."""
    if identity(other.meta) == identity(reference.meta):
        return
    differ = [k for k, a, b in zip(IDENTITY, identity(reference.meta), identity(other.meta)) if a != b]
    raise DataError(
        f"{key}: {other.prefix}.json and {reference.prefix}.json were tokenized differently ("
        + ", ".join(f"{k}: {reference.meta.get(k)!r} vs {other.meta.get(k)!r}" for k in differ)
        + f"); fix: {fix}"
    )
