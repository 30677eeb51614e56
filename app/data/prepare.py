"""Tokenise text files into a gridlm token dataset (see app/data/memmap.py for the format).

    python -m app.data.prepare TEXT_FILES... --out PREFIX [--dtype uint16|uint32]

Each file is one document, byte-tokenised and followed by EOS. Outputs are written under
temporary names and renamed at the end, so a crash never leaves a half-written dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from app.data.memmap import DTYPES, FORMAT, VERSION
from app.data.tokenizer import ByteTokenizer
from app.errors import DataError


def read_document(path: str) -> np.ndarray:
    """One text file -> its byte tokens as uint8, shape (num_bytes,)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")  # byte tokens of valid UTF-8 equal ByteTokenizer.encode(text)
    except UnicodeDecodeError as e:
        raise DataError(f"text file {path} is not UTF-8 ({e}); fix: convert it to UTF-8 (e.g. `iconv -t utf-8`)") from e
    return np.frombuffer(data, dtype=np.uint8)


def prepare(paths: list[str], out_prefix: str, dtype: str = "uint16") -> dict:
    """Writes out_prefix.{bin,json,idx.npy} from the text files; returns the json metadata."""
    tok = ByteTokenizer()
    if dtype not in DTYPES:
        raise DataError(f"--dtype {dtype!r} is not supported; fix: use one of {sorted(DTYPES)}")
    if not paths:
        raise DataError("no text files given; fix: pass one or more TEXT files to prepare")
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(
                f"text file {path} does not exist; fix: pass existing text files to "
                "`python -m app.data.prepare TEXT... --out PREFIX`"
            )
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    finals = [out_prefix + ext for ext in (".bin", ".idx.npy", ".json")]
    tmps = [f + ".tmp" for f in finals]
    offsets, max_id = [0], 0
    try:
        with open(tmps[0], "wb") as f:
            for path in paths:  # streamed: only one document is in memory at a time
                doc = np.append(read_document(path), tok.EOS).astype(DTYPES[dtype])
                f.write(doc.tobytes())
                offsets.append(offsets[-1] + len(doc))
                max_id = max(max_id, int(doc.max()))  # checked against model.vocab_size at open
        with open(tmps[1], "wb") as f:
            np.save(f, np.array(offsets, dtype=np.int64))  # file object: np.save keeps the name
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype,
            "vocab_size": tok.vocab_size,
            "num_tokens": offsets[-1],
            "num_documents": len(paths),
            "tokenizer": tok.name,
            "eos": tok.EOS,
            "max_token_id": max_id,
        }
        with open(tmps[2], "w") as f:
            json.dump(meta, f, indent=1)
        for tmp, final in zip(tmps, finals):  # json last: it marks the dataset complete
            os.replace(tmp, final)
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
    return meta


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status (2 on a user error)."""
    parser = argparse.ArgumentParser(
        prog="python -m app.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text_files", nargs="+", metavar="TEXT", help="UTF-8 text files")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="output path prefix")
    parser.add_argument("--dtype", default="uint16", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.text_files, args.out, args.dtype)
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"prepared {meta['num_documents']} documents, {meta['num_tokens']} tokens "
        f"({args.dtype}) -> {args.out}.bin, {args.out}.json, {args.out}.idx.npy"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
