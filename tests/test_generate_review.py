"""`python -m app.generate`'s prompt and tokenizer, found in review: ids separated by spaces, a
prompt that is not UTF-8, and the end-of-document token of a --tokenizer that prepare was given
--eos for. In process, no checkpoint: the functions the command runs on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import DataError
from conftest import REPO


def test_prompt_ids_separated_by_spaces_are_refused_not_joined_into_one_id():
    """Found in review: `--prompt-ids "3 1 4"` dropped the spaces and continued the one token 314
    (or, where 314 is past the vocabulary, said "id 314 is outside the model's vocabulary")."""
    from app.generate.__main__ import prompt_ids

    with pytest.raises(DataError, match=r"--prompt-ids '3 1 4': expected comma-separated token ids"):
        prompt_ids("3 1 4")
    assert prompt_ids("3, 1 ,4,") == [3, 1, 4]  # spaces around an id, a trailing comma: still taken


def test_a_prompt_that_is_not_utf8_is_a_message_not_a_traceback():
    """Found in review: `--prompt $'caf\\xe9'` (a Latin-1 terminal) reaches Python as a lone surrogate,
    which the byte tokenizer's UTF-8 encode (UnicodeEncodeError) and a tokenizer.json's (TypeError)
    raised as a traceback on every rank, exit 1, instead of one message and exit 2."""
    import os

    from app.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
    from app.generate.__main__ import prompt_text_ids

    latin1 = os.fsdecode(b"caf\xe9")  # as Python decodes such an argument (surrogateescape)
    bpe = HFTokenizer("bpe.json", text=train_bpe(iter([b"hello world"] * 10), 300))
    for tokenizer in (ByteTokenizer(), bpe):
        with pytest.raises(DataError, match=r"--prompt is not UTF-8 text: byte 0xe9 at character 3"):
            prompt_text_ids(latin1, tokenizer)
    assert prompt_text_ids("café", ByteTokenizer()) == list("café".encode())


def test_a_tokenizer_path_takes_the_end_of_document_id_the_training_data_recorded(tmp_path: Path):
    """Found in review: data prepared with `prepare --tokenizer tok.json --eos '<|doc|>'` records that
    token's id as its end of document, which the default tokenizer (no --tokenizer) uses; `--tokenizer
    tok.json`, the fix the tool gives where the tokenizer moved, took the first of the usual names the
    file has (<|endoftext|>) instead, so generation ran on past the model's end of document and
    stopped at a token the model never saw end one. The same file (its sha256) takes the recorded id;
    another one (--any-tokenizer) and an explicit --eos keep theirs."""
    from tokenizers import Tokenizer

    from app.data.prepare import prepare
    from app.data.tokenizer import train_bpe
    from app.deck import load_deck
    from app.generate import default_tokenizer, resolve_tokenizer

    tok = Tokenizer.from_str(train_bpe(iter([b"hello world, hello gridlm"] * 10), 300))
    tok.add_special_tokens(["<|doc|>"])  # beside <|endoftext|> (id 0)
    doc = tok.token_to_id("<|doc|>")
    path = tmp_path / "tok.json"
    tok.save(str(path))
    (tmp_path / "a.txt").write_text("hello world\n")
    meta = prepare([str(tmp_path / "a.txt")], str(tmp_path / "data"), tokenizer=str(path), eos="<|doc|>")
    assert meta["eos"] == doc != 0
    deck = load_deck(
        REPO / "inputs/gpt_tiny.yaml", ("data.kind=memmap", f"data.path={tmp_path / 'data'}", "model.vocab_size=320")
    )
    assert default_tokenizer(deck).eos == doc  # type: ignore[union-attr]
    assert resolve_tokenizer(str(path), deck).eos == doc  # type: ignore[union-attr]
    assert resolve_tokenizer(str(path), deck, "<|endoftext|>").eos == 0  # type: ignore[union-attr]
    other = tmp_path / "other.json"
    other.write_text(path.read_text() + " ")  # another sha256: its own end of document, the usual name
    assert resolve_tokenizer(str(other), deck, any_tokenizer=True).eos == 0  # type: ignore[union-attr]


def test_a_tokenizer_path_of_no_usual_end_token_takes_the_recorded_one_without_eos(tmp_path: Path):
    """The same fault where the tokenizer.json has none of the usual names: `--tokenizer tok.json`
    (the tool's own fix for a moved tokenizer) was refused with "fix: pass --eos TOKEN", though the
    training data records which token it is."""
    from test_prepare import word_level

    from app.data.prepare import prepare
    from app.deck import load_deck
    from app.generate import resolve_tokenizer

    path = word_level(tmp_path / "tok.json", 10, eos="<|stop|>")  # w0..w9, [UNK] 10, <|stop|> 11
    (tmp_path / "a.txt").write_text("w1 w2 w3\n")
    assert prepare([str(tmp_path / "a.txt")], str(tmp_path / "data"), tokenizer=path, eos="<|stop|>")["eos"] == 11
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", ("data.kind=memmap", f"data.path={tmp_path / 'data'}"))
    assert resolve_tokenizer(path, deck).eos == 11  # type: ignore[union-attr]


def test_a_kv_cache_above_the_free_memory_names_the_largest_max_new_tokens_that_fits():
    """Found in review: the KV cache is allocated whole before the first token, and a rotary model has
    no position limit, so --max-new-tokens 1000000000 died in the allocator's traceback (128 GB)."""
    from app.deck import load_deck
    from app.generate import check_cache_memory, kv_cache_bytes

    deck = load_deck(None, ("model.arch=llama", "model.layers=2", "model.hidden=64", "model.heads=4",
                            "model.kv_heads=2"))  # fmt: skip
    per_position = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head size 16, fp32
    assert kv_cache_bytes(deck, 1, 1, 1) == per_position and kv_cache_bytes(deck, 2, 3, 5) == per_position // 2 * 15
    check_cache_memory(deck, 1, 8, 92, 100 * per_position, "here")  # exactly fits: no error
    check_cache_memory(deck, 1, 8, 10**9, None, "here")  # free memory unknown: not refused
    with pytest.raises(
        DataError, match=r"KV cache of 101 positions .* on each rank, but here has .*--max-new-tokens 92"
    ):
        check_cache_memory(deck, 1, 8, 93, 100 * per_position, "here")
    with pytest.raises(DataError, match=r"fix: a shorter prompt, or more ranks"):
        check_cache_memory(deck, 1, 100, 1, 100 * per_position, "here")
