"""app.data.prepare: inputs (files, directories, JSONL), tokenizers (bytes, a Hugging Face
tokenizer.json, a trained BPE) and their metadata, and parallel preparation under mpirun: the
same bytes for 1, 2 and 4 ranks, and an error on one rank ending every rank (serial tests that
launch mpirun, and MPI tests that share one JSONL file between the ranks)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from app.data import ByteTokenizer, MemmapTokens
from app.data import prepare as prepare_module
from app.data.prepare import prepare
from app.data.sources import Source, list_files, plan_sources, read_documents, split_sources
from app.data.tokenizer import BPE_EOS, HFTokenizer, load_tokenizer, train_bpe
from app.errors import DataError
from conftest import run_mpi

STDLIB_JSON = os.path.dirname(json.__file__)  # real text that every Python has: the json package's sources
OUTPUTS = (".bin", ".idx.npy", ".json")


def documents(prefix: str) -> list[np.ndarray]:
    """The documents of a token file (ids with their EOS), by its .idx.npy."""
    meta = json.loads(Path(prefix + ".json").read_text())
    tokens = np.fromfile(prefix + ".bin", dtype=meta["dtype"])
    idx = np.load(prefix + ".idx.npy")
    return [tokens[a:b] for a, b in zip(idx[:-1], idx[1:])]


def digests(prefix: str) -> dict[str, str]:
    return {ext: hashlib.sha256(Path(prefix + ext).read_bytes()).hexdigest() for ext in OUTPUTS}


def stdlib_texts() -> list[bytes]:
    return [Path(p).read_bytes() for p in list_files([STDLIB_JSON], "*.py")]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> str:
    """A byte-level BPE of 400 ids trained on the json package's sources, as a tokenizer.json."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_text(train_bpe(iter(stdlib_texts()), 400), encoding="utf-8")
    return str(path)


def write(path: Path, text: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


# ---- inputs -----------------------------------------------------------------------------


def test_a_directory_is_recursed_in_sorted_path_order_with_include(tmp_path):
    for name in ("b.txt", "a/z.txt", "a/c.txt", "a/skip.bin", "a/d/e.txt"):
        write(tmp_path / "in" / name, name)
    prefix = str(tmp_path / "t")
    meta = prepare([str(tmp_path / "in"), str(tmp_path / "in" / "a" / "skip.bin")], prefix, include="*.txt")
    tok = ByteTokenizer()
    got = [tok.decode(d) for d in documents(prefix)]
    assert got == ["a/c.txt", "a/d/e.txt", "a/z.txt", "b.txt", "a/skip.bin"]  # dir sorted, then the file given
    assert all(d[-1] == tok.EOS for d in documents(prefix)) and meta["num_documents"] == 5


def test_jsonl_gives_one_document_per_non_blank_line_in_order(tmp_path):
    lines = [{"text": "first"}, {"text": "naïve ✓", "id": 2}, {"text": ""}, {"text": "last\nline"}]
    path = write(tmp_path / "c.jsonl", "\n".join(json.dumps(r) for r in lines[:2]) + "\n\n  \n"
                 + "\n".join(json.dumps(r) for r in lines[2:]) + "\n")  # fmt: skip
    prefix = str(tmp_path / "t")
    prepare([path], prefix, field="text")
    assert [ByteTokenizer().decode(d) for d in documents(prefix)] == [r["text"] for r in lines]


def test_jsonl_cut_into_runs_of_lines_reads_the_same_documents(tmp_path):
    path = write(tmp_path / "c.jsonl", "".join(json.dumps({"t": "x" * (i % 7) + str(i)}) + "\n" for i in range(50)))
    whole = list(read_documents(Source(path, 0, os.path.getsize(path), True), "t"))
    for chunk in (1, 10, 37, 100):
        sources = plan_sources([path], jsonl=True, chunk_bytes=chunk)
        assert sources[0].start == 0 and sources[-1].stop == os.path.getsize(path)
        assert all(a.stop == b.start for a, b in zip(sources, sources[1:]))
        assert [d for s in sources for d in read_documents(s, "t")] == whole
    assert len(plan_sources([path], jsonl=True, chunk_bytes=37)) > 10


@pytest.mark.parametrize("ranks", [1, 2, 3, 7, 40])
def test_ranks_get_contiguous_runs_of_sources_of_about_equal_bytes(ranks):
    sizes = [5, 100, 3, 3, 40, 40, 8, 1, 60, 20, 9, 30]
    sources = [Source(f"f{i}", 0, n, False) for i, n in enumerate(sizes)]
    shares = split_sources(sources, ranks)
    assert len(shares) == ranks and [s for share in shares for s in share] == sources
    total, done = sum(sizes), 0
    for rank, share in enumerate(shares):
        for s in share:  # each source goes to the rank whose equal part of the bytes holds its middle
            assert rank * total <= (done + s.size / 2) * ranks < (rank + 1) * total or rank == ranks - 1
            done += s.size


BAD_INPUTS = {
    "missing": ({}, "nope.txt", "nope.txt does not exist"),
    "not-utf8": ({"a.txt": b"caf\xe9\n"}, "a.txt", "a.txt is not UTF-8 (byte 3"),
    "bad-json": ({"c.jsonl": '{"text": "ok"}\n{"text": oops}\n'}, "c.jsonl", "c.jsonl:2 is not valid JSON"),
    "no-field": ({"c.jsonl": '{"text": "ok"}\n\n{"body": "x"}\n'}, "c.jsonl", "c.jsonl:3 has no field 'text' (it has: body)"),
    "not-a-string": ({"c.jsonl": '{"text": 5}\n'}, "c.jsonl", "field 'text' is not a string (it is 5)"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_name_the_file_the_line_and_the_fix_and_leave_nothing(tmp_path, case):
    files, given, says = BAD_INPUTS[case]
    for name, text in files.items():
        write(tmp_path / "in" / name, text)
    field = "text" if given.endswith(".jsonl") else None
    with pytest.raises(DataError, match="fix: ") as e:
        prepare([str(tmp_path / "in" / given)], str(tmp_path / "out" / "t"), field=field)
    assert says in str(e.value)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


# ---- tokenizers ---------------------------------------------------------------------------


def test_a_tokenizer_json_is_recorded_in_the_metadata_and_its_ids_decode_to_the_text(tmp_path, bpe_file):
    prefix = str(tmp_path / "t")
    meta = prepare([STDLIB_JSON], prefix, tokenizer=bpe_file, include="*.py")
    tok = HFTokenizer(bpe_file)
    assert meta["tokenizer"] == "huggingface" and meta["tokenizer_path"] == os.path.abspath(bpe_file)
    assert meta["tokenizer_sha256"] == hashlib.sha256(Path(bpe_file).read_bytes()).hexdigest()
    assert meta["vocab_size"] == 400 and meta["eos"] == tok.eos == 0 and meta["dtype"] == "uint16"
    docs = documents(prefix)
    texts = stdlib_texts()
    assert [tok.decode(d[:-1]) for d in docs] == [t.decode() for t in texts]
    assert all(d[-1] == 0 and 0 not in d[:-1] for d in docs)
    assert sum(map(len, docs)) < sum(map(len, texts)) / 2  # BPE: fewer ids than bytes
    assert meta["max_token_id"] == max(int(d.max()) for d in docs) < 400


def test_a_special_tokens_text_inside_a_document_is_text_not_its_end(tmp_path, bpe_file):
    """Found in review (2026-11-30): the library turned "<|endoftext|>" written inside a document (code,
    a paper about language models) into the EOS id: a false end of document mid-text. Only prepare
    ends a document; the text round-trips."""
    text = "before <|endoftext|> after"
    source = tmp_path / "doc.txt"
    source.write_text(text)
    prefix = str(tmp_path / "t")
    prepare([str(source)], prefix, tokenizer=bpe_file)
    (doc,) = documents(prefix)
    tok = HFTokenizer(bpe_file)
    assert doc[-1] == tok.eos and tok.eos not in doc[:-1], doc
    assert tok.decode(doc[:-1]) == text


def test_train_tokenizer_saves_a_bpe_beside_the_output_and_is_deterministic(tmp_path):
    for run in ("a", "b"):
        meta = prepare([STDLIB_JSON], str(tmp_path / run / "t"), include="*.py", train_tokenizer=300)
        assert meta["tokenizer_path"] == str(tmp_path / run / "t.tokenizer.json") and meta["vocab_size"] == 300
    a, b = (Path(tmp_path / run / "t.tokenizer.json").read_bytes() for run in ("a", "b"))
    assert a == b and hashlib.sha256(a).hexdigest() == meta["tokenizer_sha256"]
    assert HFTokenizer(str(tmp_path / "a" / "t.tokenizer.json")).special_tokens() == [BPE_EOS]
    assert digests(str(tmp_path / "a" / "t"))[".bin"] == digests(str(tmp_path / "b" / "t"))[".bin"]
    with pytest.raises(DataError, match="N >= 257"):
        prepare([STDLIB_JSON], str(tmp_path / "c" / "t"), include="*.py", train_tokenizer=100)


def word_level(path: Path, words: int, eos: str | None = "</s>") -> str:
    """A WordLevel tokenizer.json of `words` ids (w0, w1, ...; [UNK] and eos added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(words)}
    vocab["[UNK]"] = words
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if eos:
        tok.add_special_tokens([eos])
    tok.save(str(path))
    return str(path)


def test_a_vocabulary_above_65536_ids_is_written_as_uint32(tmp_path):
    tok = word_level(tmp_path / "big.json", 70000)
    text = write(tmp_path / "a.txt", "w1 w69999 w65536 nope w0")
    meta = prepare([text], str(tmp_path / "t"), tokenizer=tok)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70002 and meta["eos"] == 70001
    assert documents(str(tmp_path / "t"))[0].tolist() == [1, 69999, 65536, 70000, 0, 70001]
    with pytest.raises(DataError, match="--dtype uint16 holds ids below 65536 but the tokenizer has 70002"):
        prepare([text], str(tmp_path / "u"), "uint16", tokenizer=tok)


def test_a_vocabulary_with_a_gap_up_to_id_70000_is_written_as_uint32_not_wrapped(tmp_path):
    """Found in review (2026-11-30): the vocabulary size was the count of tokens (4 here), so --dtype
    auto chose uint16 and id 70000 was written as 4464. It is one past the largest id; and an id the
    chosen dtype cannot hold is refused, not cast."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "gap.json"
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "</s>": 2, "b": 70000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    text = write(tmp_path / "a.txt", "a b a b")
    meta = prepare([text], str(tmp_path / "t"), tokenizer=str(path), eos="</s>")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70001, meta
    assert documents(str(tmp_path / "t"))[0].tolist() == [0, 70000, 0, 70000, 2]
    with pytest.raises(DataError, match="--dtype uint16 holds ids below 65536 but the tokenizer has 70001"):
        prepare([text], str(tmp_path / "u"), "uint16", tokenizer=str(path), eos="</s>")


def test_a_tokenizer_without_a_known_end_token_needs_eos(tmp_path):
    tok = word_level(tmp_path / "tok.json", 10, eos="<|stop|>")
    text = write(tmp_path / "a.txt", "w1 w2")
    with pytest.raises(DataError, match=r"none of the end-of-document tokens.*--eos TOKEN.*<\|stop\|>"):
        prepare([text], str(tmp_path / "t"), tokenizer=tok)
    meta = prepare([text], str(tmp_path / "t"), tokenizer=tok, eos="<|stop|>")
    assert meta["eos"] == 11 and documents(str(tmp_path / "t"))[0].tolist() == [1, 2, 11]
    with pytest.raises(DataError, match="--eos 'nope' is not a token"):
        load_tokenizer(tok, "nope")


@pytest.mark.parametrize("bad", ["missing", "not-json"])
def test_a_bad_tokenizer_path_names_the_fix(tmp_path, bad):
    path = tmp_path / "tok.json"
    if bad == "not-json":
        path.write_text("{")
    with pytest.raises(DataError, match="fix: pass --tokenizer byte"):
        prepare([write(tmp_path / "a.txt", "x")], str(tmp_path / "t"), tokenizer=str(path))


def test_model_vocab_below_the_tokenizer_vocab_is_refused_naming_the_key_and_tokenizer(tmp_path, bpe_file):
    prefix = str(tmp_path / "t")
    prepare([STDLIB_JSON], prefix, tokenizer=bpe_file, include="*.py")
    with pytest.raises(DataError) as e:
        MemmapTokens(prefix, seq_len=8, vocab_size=256, seed=0)
    message = str(e.value)
    assert "vocab_size 400 (its tokenizer: huggingface " + os.path.abspath(bpe_file) in message
    assert "model.vocab_size is 256" in message and "fix: set model.vocab_size >= 400" in message
    MemmapTokens(prefix, seq_len=8, vocab_size=400, seed=0)


# ---- under mpirun ----------------------------------------------------------------------------


def run_prepare_mpi(ranks: int, *args: object):
    return run_mpi(ranks, sys.executable, "-m", "app.data.prepare", *map(str, args), timeout=120)


def test_mpirun_with_1_2_and_4_ranks_writes_the_same_bytes_as_one_process(tmp_path, bpe_file):
    reference = str(tmp_path / "serial")
    prepare([STDLIB_JSON], reference, tokenizer=bpe_file, include="*.py")
    for ranks in (1, 2, 4):
        prefix = tmp_path / f"n{ranks}"
        out = run_prepare_mpi(ranks, STDLIB_JSON, "--include", "*.py", "--tokenizer", bpe_file, "--out", prefix)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("prepared ") == 1 and f"on {ranks} rank(s)" in out.stdout
        assert digests(str(prefix)) == digests(reference), f"{ranks} ranks"
        assert sorted(os.listdir(tmp_path)) == sorted(
            [f"serial{e}" for e in OUTPUTS] + [f"n{n}{e}" for n in (1, 2, 4) if n <= ranks for e in OUTPUTS]
        )  # no temporary or part file left


@pytest.mark.parametrize("case", ["not-utf8-on-rank-1", "bad-jsonl-line"])
def test_mpirun_an_error_on_one_rank_ends_every_rank_with_status_2_and_one_message(tmp_path, case):
    if case == "not-utf8-on-rank-1":
        for i in range(4):  # the last file (rank 1's share) is not UTF-8
            write(tmp_path / "in" / f"doc{i}.txt", b"ok " * 100 if i < 3 else b"bad \xff")
        args, says = (tmp_path / "in",), f"text file {tmp_path / 'in' / 'doc3.txt'} is not UTF-8"
    else:
        path = write(tmp_path / "in" / "c.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text" "c"}\n')
        args, says = (path, "--field", "text"), f"JSONL line {path}:3 is not valid JSON"
    out = run_prepare_mpi(2, *args, "--out", tmp_path / "out" / "t")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("gridlm: ") == 1 and says in out.stderr and "fix: " in out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.mpi(min_size=2)
def test_ranks_share_a_jsonl_file_cut_into_runs_of_lines(tmp_path, shared_tmp, monkeypatch):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = shared_tmp / "c.jsonl"
    if comm.rank == 0:
        rng = np.random.default_rng(0)
        lines = [json.dumps({"text": "".join(rng.choice(list("abcé ✓\n"), rng.integers(0, 40)))}) for _ in range(300)]
        path.write_text("\n".join(lines) + "\n")
    comm.Barrier()
    monkeypatch.setattr(prepare_module, "CHUNK_BYTES", 500)  # ~20 runs of lines over the ranks
    reference = prepare([str(path)], str(tmp_path / "serial"), field="text")
    shared = prepare([str(path)], str(shared_tmp / "out" / "t"), field="text", comm=comm)
    assert shared == reference and reference["num_documents"] == 300
    assert digests(str(shared_tmp / "out" / "t")) == digests(str(tmp_path / "serial"))
    assert len(split_sources(plan_sources([str(path)], True, 500), comm.size)[-1]) > 0  # the last rank had work


@pytest.mark.mpi(min_size=2)
def test_a_bad_line_in_the_last_ranks_share_raises_the_same_error_on_every_rank(shared_tmp, monkeypatch):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = shared_tmp / "c.jsonl"
    if comm.rank == 0:
        path.write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(199)) + '{"text": 1}\n')
    comm.Barrier()
    monkeypatch.setattr(prepare_module, "CHUNK_BYTES", 300)
    with pytest.raises(DataError) as e:
        prepare([str(path)], str(shared_tmp / "out" / "t"), field="text", comm=comm)
    messages = comm.allgather(str(e.value))
    assert len(set(messages)) == 1 and f"{path}:200: field 'text' is not a string" in messages[0]
    comm.Barrier()
    assert os.listdir(shared_tmp / "out") == []


def test_rank_0_reports_progress_lines_and_one_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "PROGRESS_S", 0.0)  # a progress line after every source
    lines: list[str] = []
    meta = prepare([STDLIB_JSON], str(tmp_path / "t"), include="*.py", report=lines.append)
    progress, summary = lines[:-1], lines[-1]
    assert len(progress) == meta["num_documents"] and progress[-1].startswith(
        f"prepare: rank 0: {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens, "
    )
    assert progress[-1].endswith("MB/s (100% of its share, 1/1 of the input)")
    assert summary.startswith(f"prepared {meta['num_documents']} documents, {meta['num_tokens']} tokens (uint16")
