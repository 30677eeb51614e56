"""Faults found in the review of the training-data pipeline (app/data: prepare, sources, tokenizer,
memmap, blend), each pinned by the test that showed it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from app.data.prepare import prepare
from app.data.tokenizer import HFTokenizer, train_bpe
from app.errors import DataError

TEXTS = [
    "the quick brown fox jumps over the lazy dog, " * 6,
    "a short one",
    "pack my box with five dozen liquor jugs. " * 4,
]


def documents(prefix: str) -> list[np.ndarray]:
    """The documents of a token file (ids with their EOS), by its .idx.npy."""
    meta = json.loads(Path(prefix + ".json").read_text())
    tokens = np.fromfile(prefix + ".bin", dtype=meta["dtype"])
    idx = np.load(prefix + ".idx.npy")
    return [tokens[a:b] for a, b in zip(idx[:-1], idx[1:])]


def test_a_tokenizer_json_saved_with_truncation_and_padding_still_tokenizes_whole_documents(tmp_path):
    """Found in review: a tokenizer.json saved with truncation (max_length) and padding switched on (as
    `save_pretrained` keeps them after a call with truncation=True, padding=True) cut every document
    to max_length tokens and padded the short ones of a batch with the pad id, silently: prepare
    wrote 8 tokens a document whatever the text. A document is the whole text, nothing more."""
    config = json.loads(train_bpe((t.encode() for t in TEXTS), 300))
    config["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    config["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 5,
        "pad_type_id": 0,
        "pad_token": "x",
    }
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps(config))
    paths = []
    for i, text in enumerate(TEXTS):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(text)
    prefix = str(tmp_path / "out")
    prepare([str(p) for p in paths], prefix, tokenizer=str(tokenizer))
    tok = HFTokenizer(str(tokenizer))
    docs = documents(prefix)
    assert [tok.decode(d[:-1]) for d in docs] == TEXTS
    assert max(len(d) for d in docs) > 9  # the long texts are longer than max_length + EOS
    assert tok.encode(TEXTS[0]) == [int(i) for i in docs[0][:-1]]  # generate's encode: the same ids


def test_an_input_that_out_would_overwrite_is_refused_and_left_intact(tmp_path):
    """Found in review: `prepare train.json --field text --out train` (a JSONL file named .json, as
    `datasets.Dataset.to_json` writes them) read the input, then replaced it with the token file's
    metadata: the corpus was gone. An input that is one of the files --out writes is refused, naming
    it and the fix, before anything is written."""
    corpus = tmp_path / "train.json"
    lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS)
    corpus.write_text(lines)
    with pytest.raises(DataError, match=r"train\.json is a file that --out .*train writes; fix: "):
        prepare([str(corpus)], str(tmp_path / "train"), field="text")
    assert corpus.read_text() == lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.json"]


def test_prepare_run_again_into_a_prefix_inside_its_input_directory_names_the_old_output(tmp_path):
    """Found in review: the second `prepare data --out data/corpus` read the first one's output as
    documents and stopped at its .idx.npy with "is not UTF-8; fix: convert it to UTF-8": the wrong
    file to fix. The old output is named as what --out writes, and the old dataset is kept."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text(TEXTS[0])
    prefix = str(data / "corpus")
    prepare([str(data)], prefix)
    before = Path(prefix + ".bin").read_bytes()
    with pytest.raises(DataError, match=r"corpus\.bin is a file that --out .*corpus writes; fix: "):
        prepare([str(data)], prefix)
    assert Path(prefix + ".bin").read_bytes() == before
    meta = prepare([str(data)], prefix, include="*.txt")  # the fix the message gives
    assert meta["num_documents"] == 1


def test_a_pipe_given_as_input_is_named_as_not_a_regular_file_not_as_missing(tmp_path):
    """Found in review: `prepare <(zcat corpus.txt.gz) --out P` said "input /dev/fd/63 does not exist",
    which it does: it is a pipe, which prepare cannot size or share between ranks."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(DataError) as e:
        prepare([str(fifo)], str(tmp_path / "out"))
    assert "is not a regular file" in str(e.value) and "does not exist" not in str(e.value)
    assert "fix: write it to a file" in str(e.value)


def test_the_window_order_is_numpys_permutation_held_in_half_the_memory():
    """Every rank holds an epoch's window order per file it reads (4 GB as int64 for the 500M windows
    of a trillion tokens at sequence 2048): uint32 where the windows fit, and the very order numpy's
    permutation gives, so runs and resumes across this change read the same samples."""
    from app.data.memmap import window_order

    for windows in (1, 7, 1000, 100_003):
        for seed, epoch in ((0, 0), (1234, 3)):
            order = window_order(seed, epoch, windows)
            assert order.dtype == np.uint32 and order.nbytes == 4 * windows
            assert np.array_equal(order, np.random.default_rng([seed, epoch]).permutation(windows))
