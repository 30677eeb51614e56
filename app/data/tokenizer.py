"""Byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256 is end-of-document. No download."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Maps text to UTF-8 byte ids; `EOS` separates documents in token files."""

    EOS = 256
    vocab_size = 257
    name = "byte"

    def encode(self, text: str) -> list[int]:
        """Text -> list of byte ids in [0, 256); no EOS appended."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Byte ids -> text; EOS is skipped and invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) != self.EOS).decode("utf-8", errors="replace")
