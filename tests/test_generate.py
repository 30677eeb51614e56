"""`python -m app.generate`: greedy decoding with a KV cache equal to Hugging Face's
`generate(do_sample=False)` on the exported weights (gpt2 and llama with grouped-query attention),
the same tokens on 1 rank and tensor parallel over 2, the cache equal to recomputing the whole
sequence, sampling within the top k, and the mistakes it refuses.

The checkpoints are small models with a wide initialisation (init_std 0.2) trained 3 steps at a
high learning rate: their greedy continuations vary from token to token (a model near its init
repeats one token, which any decoder reproduces), and their logits are spread enough that the
argmax does not hinge on the last bits (the tp and Hugging Face sums differ in order only).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.model.gpt import GPT, KVCache
from conftest import REPO, app_env, run_app, run_mpi

TINY = "inputs/gpt_tiny.yaml"
SMALL = tuple(arg for a in (
    "model.hidden=64", "model.layers=2", "model.heads=4", "model.seq_len=32", "model.init_std=0.2",
    "train.global_batch=4", "train.micro_batch=2", "train.steps=3", "run.resume=none",
    "optim.lr=0.05", "optim.warmup_steps=0",
) for arg in ("--set", a))  # fmt: skip
PROMPT = "3,1,4,1,5,9,2,6"
NEW = 20  # 8 + 20 positions of the 32 a gpt2 model learned


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str, *overrides: str) -> Path:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    sets = tuple(arg for a in overrides for arg in ("--set", a))
    out = run_app(1, TINY, *SMALL, *sets, "--set", f"run.dir={run_dir}")
    assert out.returncode == 0, out.stdout + out.stderr
    return run_dir / "checkpoints"


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    return _checkpoint(
        tmp_path_factory, "gpt2", "model.vocab_size=258"
    )  # covers the byte tokenizer (257), splits over tp 2


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "llama", "model.arch=llama", "model.kv_heads=2", "model.vocab_size=128")


def generate(ranks: int, *args: str) -> subprocess.CompletedProcess:
    return run_mpi(ranks, sys.executable, "-m", "app.generate", *map(str, args))


def generated(ranks: int, *args: str) -> dict:
    out = generate(ranks, *args, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def hf_greedy(ckpt: Path, tmp_path: Path, prompt: list[int], new: int) -> list[int]:
    import transformers

    from app.checkpoint.export import export_hf
    from app.checkpoint.store import read_latest

    path = read_latest(ckpt)
    assert path is not None
    export_hf(path, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_equals_transformers_generate_on_one_rank_and_tp2(arch, gpt2_ckpt, llama_ckpt, tmp_path):
    ckpt = gpt2_ckpt if arch == "gpt2" else llama_ckpt
    prompt = [int(t) for t in PROMPT.split(",")]
    theirs = hf_greedy(ckpt, tmp_path, prompt, NEW)
    assert len(set(theirs)) >= 4, theirs  # a continuation that varies: a meaningful comparison
    one = generated(1, ckpt, "--prompt-ids", PROMPT, "--max-new-tokens", NEW, "--ignore-eos")
    assert one["ids"] == theirs
    assert (one["prompt_ids"], one["tp"], one["greedy"], one["step"]) == (prompt, 1, True, 3)
    # tp 2: the heads (llama: the 2 key/value groups) and the vocabulary split over the ranks.
    two = generated(2, ckpt, "--prompt-ids", PROMPT, "--max-new-tokens", NEW, "--ignore-eos")
    assert two["ids"] == theirs and two["tp"] == 2


def test_text_prompt_with_the_byte_tokenizer_prints_prompt_and_continuation(gpt2_ckpt):
    args = (gpt2_ckpt, "--prompt", "héllo", "--tokenizer", "byte", "--max-new-tokens", 5, "--ignore-eos")
    out = generate(1, *args)
    assert out.returncode == 0, out.stderr
    shown, stats = out.stdout.rsplit("\ngridlm: generate | ", 1)  # the text may hold newlines
    assert "6 prompt + 5 new tokens, greedy" in stats  # é is two UTF-8 bytes
    record = generated(1, *args)
    assert record["prompt_ids"] == list("héllo".encode()) and len(record["ids"]) == 5
    assert record["text"] == bytes(i for i in record["ids"] if i < 256).decode("utf-8", errors="replace")
    assert shown == bytes(i for i in record["prompt_ids"] + record["ids"] if i < 256).decode("utf-8", errors="replace")


def test_sampling_is_reproducible_by_seed_and_the_same_on_tp2(llama_ckpt):
    args = (llama_ckpt, "--prompt-ids", PROMPT, "--max-new-tokens", 12, "--temperature", "1.5", "--top-k", 20)
    a = generated(1, *args, "--seed", 1)
    assert a["greedy"] is False and len(a["ids"]) == 12
    assert generated(1, *args, "--seed", 2)["ids"] != a["ids"]
    # The same seed in another job, here on tp 2, draws the same tokens: tp 2 draws once (the group's
    # first rank) and broadcasts, so the ranks agree, and the draw is the 1-rank one (its logits differ
    # from the 1-rank ones by summation order only).
    assert generated(2, *args, "--seed", 1)["ids"] == a["ids"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--prompt", "hi"), "--prompt needs a tokenizer"),
        pytest.param(("--prompt-ids", "1,x"), "expected comma-separated token ids", marks=pytest.mark.full),
        (("--prompt-ids", "1,999"), "id 999 is outside the model's vocabulary 0 .. 127"),
        # A rotary model has no position limit: its KV cache (5 TB here) is measured against free memory.
        (("--prompt-ids", "1", "--max-new-tokens", str(10**10)), "the KV cache of 10,000,000,001 positions"),
        pytest.param(("--prompt-ids", "1", "--seed", str(2**64)), "is not a seed", marks=pytest.mark.full),
        pytest.param(
            ("--prompt-ids", "1", "--set", "parallel.tp=2"), "only run.* keys can be set", marks=pytest.mark.full
        ),
        pytest.param(
            ("--prompt-ids", "1", "--tokenizer", "byte"),
            "the tokenizer has 257 ids but the model's vocabulary is 128",
            marks=pytest.mark.full,
        ),
    ],
)
def test_user_mistakes_exit_2_with_one_message(llama_ckpt, args, message):
    out = generate(1, llama_ckpt, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.full
def test_gpt2_positions_and_grids_the_model_cannot_take_are_refused(gpt2_ckpt, tmp_path):
    # The last new token is not run through the model (found in review, 2026-11-30: 8 + 25 was refused,
    # and a 32-token prompt's fix, --max-new-tokens 0, was not an option).
    out = generate(1, gpt2_ckpt, "--prompt-ids", PROMPT, "--max-new-tokens", 26)
    assert out.returncode == 2 and "need 33 positions; this gpt2 model learned 32" in out.stderr, out.stderr
    assert "--max-new-tokens 25" in out.stderr
    assert generate(1, gpt2_ckpt, "--prompt-ids", PROMPT, "--max-new-tokens", 25).returncode == 0
    out = generate(3, gpt2_ckpt, "--prompt-ids", PROMPT)  # 4 heads over 3 ranks
    assert out.returncode == 2 and "splits the model over all 3 ranks" in out.stderr, out.stderr
    assert out.stderr.count("gridlm:") == 1 and "Traceback" not in out.stderr
    out = generate(1, tmp_path / "none", "--prompt-ids", "1")
    assert out.returncode == 2 and "no such file" in out.stderr, out.stderr


@pytest.mark.parametrize("trained", [("parallel.cp=2",), ("model.moe_experts=4", "parallel.ep=2")], ids=["cp2", "ep2"])
def test_a_model_trained_with_context_or_expert_parallelism_generates(tmp_path_factory, trained):
    """Found in review (2026-11-30): the inference grid kept the checkpoint's parallel.cp and
    parallel.ep, so no world size resolved (tp x cp must divide it; ep must divide dp = 1) and every
    such checkpoint was refused. It generates on 1 rank and on tp 2, the same tokens."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    sets = tuple(arg for a in (*trained, "model.vocab_size=128", f"run.dir={run_dir}") for arg in ("--set", a))
    out = run_app(2, TINY, *SMALL, *sets)
    assert out.returncode == 0, out.stdout + out.stderr
    one = generated(1, "--prompt-ids", PROMPT, "--max-new-tokens", 6, run_dir / "checkpoints")
    two = generated(2, "--prompt-ids", PROMPT, "--max-new-tokens", 6, run_dir / "checkpoints")
    assert len(one["ids"]) == 6 and one["ids"] == two["ids"], (one, two)


def _restamped(checkpoint: Path, out: Path, **changes: str) -> Path:
    """A copy of `checkpoint` (a file, or a directory's latest) whose stored deck has `changes`
    ("section.key": value) and a header digest recomputed for them (as a run with that deck wrote it)."""
    import shutil

    import h5py
    import yaml

    from app.checkpoint.io import HEADER_DIGEST, header_digest, root_attributes
    from app.checkpoint.store import read_latest

    source = read_latest(checkpoint) if checkpoint.is_dir() else checkpoint
    assert source is not None
    shutil.copyfile(source, out)
    with h5py.File(out, "r+") as f:
        deck = yaml.safe_load(f.attrs["deck"])
        for dotted, value in changes.items():
            section, key = dotted.split(".")
            deck[section][key] = value
        f.attrs["deck"] = yaml.safe_dump(deck, sort_keys=False)
        f.attrs[HEADER_DIGEST] = header_digest(root_attributes(f, out))
    return out


def test_a_checkpoint_trained_with_a_gpu_only_kernel_and_nccl_generates_on_cpu_ranks(llama_ckpt, tmp_path):
    """Found in review: the inference grid kept the trained model.attention_kernel and parallel.backend,
    and only run.* keys can be --set: a checkpoint of a cudnn (or flash) run ended on CPU ranks in
    "RuntimeError: No viable backend" (a traceback, even with --set run.device=cpu), and one of an
    nccl run was refused with a fix --set could not give. Neither changes what the model computes: the
    inference grid takes the device's (auto). The tokens are the unchanged checkpoint's."""
    gpu_trained = _restamped(
        llama_ckpt, tmp_path / "step_0000003.h5", **{"model.attention_kernel": "cudnn", "parallel.backend": "nccl"}
    )
    args = ("--prompt-ids", PROMPT, "--max-new-tokens", 6, "--ignore-eos")
    assert generated(1, gpu_trained, *args, "--set", "run.device=cpu")["ids"] == generated(1, llama_ckpt, *args)["ids"]


def test_a_world_the_model_cannot_split_over_names_the_limit_and_a_rank_count_that_fits(gpt2_ckpt):
    """Found in review: the fix always said "a divisor of model.heads", also where the limit was the
    vocabulary (258 ids over 4 ranks; its 4 heads split)."""
    from app.checkpoint.store import read_latest
    from app.errors import LaunchError
    from app.generate import generation_deck

    path = read_latest(gpt2_ckpt)
    assert path is not None
    with pytest.raises(
        LaunchError, match=re.escape("launch fewer ranks: 2 (the rank count must divide model.vocab_size = 258)")
    ):
        generation_deck(path, 4)


@pytest.mark.parametrize("damage", ["latest names a missing file", "truncated file"])
def test_a_missing_or_damaged_checkpoint_is_told_the_tools_fix_not_a_resumes(llama_ckpt, tmp_path, damage):
    """Found in review: generate (and eval) said "set run.resume to one of no committed checkpoint or
    run.resume: none" for a `latest` naming a missing file, and "resume from an older checkpoint
    (run.resume: <file>)" for a truncated one: a tool has no run.resume."""
    if damage == "latest names a missing file":
        given = tmp_path / "checkpoints"
        given.mkdir()
        (given / "latest").write_text("step_0000009.h5\n")
        says = "names step_0000009.h5, which does not exist; it holds no committed checkpoint"
    else:
        given = tmp_path / "step_0000003.h5"
        whole = (llama_ckpt / "step_0000003.h5").read_bytes()
        given.write_bytes(whole[: len(whole) // 3])
        says = "it may be truncated or corrupt: use an older checkpoint of its directory"
    out = generate(1, given, "--prompt-ids", "1,2")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert says in out.stderr and "run.resume" not in out.stderr, out.stderr


def test_help_answers_without_loading_mpi_or_torch():
    code = "import sys; from app.generate.__main__ import parse_args; import app.generate; " \
        "print(sorted(m for m in ('torch', 'mpi4py', 'h5py') if m in sys.modules))"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=app_env(), capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---- the KV cache against recomputing the sequence (in process, 1 rank) ----


def _model(arch: str) -> GPT:
    from app.deck import ModelConfig

    kv = {"kv_heads": 2} if arch == "llama" else {}
    cfg = ModelConfig(arch=arch, vocab_size=96, seq_len=32, layers=2, hidden=64, heads=4, init_std=0.2, **kv)
    return GPT(cfg, seed=3).eval()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cached_decoding_equals_recomputing_the_whole_sequence(arch):
    """Each position's logits from the cache equal those of a forward pass over the whole sequence
    so far, within 1e-5 (fp32; only the attention's reduction order differs: one query row against
    the cache instead of a causal block), for the prompt, one token at a time, and several tokens
    after cached ones (the offset causal mask). A cache that lost a position, or rotary angles at
    the wrong offset, moves them by 1e-1 and more."""
    model = _model(arch)
    tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)  # (B, S, V): position t's logits see tokens 0 .. t
    cache = KVCache(20)
    steps = [(0, 8), (8, 9), (9, 10), (10, 15), (15, 20)]
    for start, stop in steps:
        logits = model.decode(tokens[:, start:stop], cache, start)
        torch.testing.assert_close(logits, full[:, stop - 1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot hold position 20"):
        model.decode(tokens[:, :1], cache, 20)


def test_sampling_draws_only_among_the_top_k():
    from app.generate import Sampling, _pick

    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    assert _pick(logits, Sampling(), gen).tolist() == [1]
    drawn = {int(_pick(logits, Sampling(temperature=5.0, top_k=3), gen)) for _ in range(300)}
    assert drawn == {1, 2, 3}  # a high temperature flattens them: all three drawn, nothing else
    assert {int(_pick(logits, Sampling(temperature=1.0, top_k=1), gen)) for _ in range(20)} == {1}
    # A tiny temperature is greedy, not nan (found in review, 2026-11-30: logits / 1e-40 overflowed
    # to inf, whose softmax is nan, and multinomial raised).
    assert {int(_pick(logits, Sampling(temperature=1e-40), gen)) for _ in range(20)} == {1}
    # Nor one that rounds to 0 in float32 (found in review, 2026-12-01: --temperature 1e-46 divided 0 by 0).
    for tiny in (1e-46, 5e-324):
        assert {int(_pick(logits, Sampling(temperature=tiny), gen)) for _ in range(5)} == {1}


def test_the_default_tokenizer_is_the_one_the_training_data_names(tmp_path):
    """A token file's metadata names its tokenizer: byte, or a tokenizer.json (checked by sha256), whose
    end-of-document id is the recorded one (prepare may have been given --eos)."""
    import hashlib

    from test_goldfish import write_tokens

    from app.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
    from app.deck import load_deck
    from app.errors import DataError
    from app.generate import default_tokenizer

    prefix = tmp_path / "data"
    write_tokens(str(prefix), [[1, 2, 3] * 20])

    def deck(*sets: str):
        return load_deck(REPO / "inputs/gpt_tiny.yaml", ("data.kind=memmap", f"data.path={prefix}", *sets))

    assert isinstance(default_tokenizer(deck()), ByteTokenizer)
    assert default_tokenizer(load_deck(REPO / "inputs/gpt_tiny.yaml")) is None  # synthetic data
    # Its end-of-document token renamed to one of no standard name (as `prepare --eos '<|doc|>'` takes).
    text = train_bpe(iter([b"hello world, hello gridlm"] * 10), 300).replace("<|endoftext|>", "<|doc|>")
    (tmp_path / "tok.json").write_text(text)
    meta = json.loads((tmp_path / "data.json").read_text())
    meta.update(tokenizer="huggingface", tokenizer_path=str(tmp_path / "tok.json"), eos=0, vocab_size=300,
                tokenizer_sha256=hashlib.sha256(text.encode()).hexdigest())  # fmt: skip
    (tmp_path / "data.json").write_text(json.dumps(meta))
    tokenizer = default_tokenizer(deck())
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos == 0 and tokenizer.tokenizer.id_to_token(0) == "<|doc|>"
    (tmp_path / "tok.json").write_text(text + " ")  # another file at the recorded path
    with pytest.raises(DataError, match="is not the tokenizer the training data"):
        default_tokenizer(deck())


def test_a_token_file_that_names_no_tokenizer_gives_none_and_bytes_decode_any_id(tmp_path):
    """A token file whose metadata has no `tokenizer` key (written by another tool) names no
    tokenizer: generation then needs --tokenizer for text and works with --prompt-ids (it assumed
    bytes and died on an id >= 256 of a 512-id model). The byte tokenizer decodes an id outside
    the bytes as U+FFFD instead of raising."""
    from test_goldfish import write_tokens

    from app.data.tokenizer import ByteTokenizer
    from app.deck import load_deck
    from app.generate import default_tokenizer

    prefix = tmp_path / "data"
    write_tokens(str(prefix), [[1, 2, 3] * 20], vocab_size=512)
    meta = json.loads((tmp_path / "data.json").read_text())
    del meta["tokenizer"]
    (tmp_path / "data.json").write_text(json.dumps(meta))
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", ("data.kind=memmap", f"data.path={prefix}"))
    assert default_tokenizer(deck) is None
    assert ByteTokenizer().decode([104, 300, 256, 105, -1]) == "h\ufffdi\ufffd"


def test_eos_names_the_end_token_of_a_tokenizer_that_has_none_of_the_known_ones(tmp_path):
    """Found in review (2026-11-30): with --tokenizer PATH of a tokenizer without <|endoftext|>, </s>, ...
    generate refused with "fix: pass --eos TOKEN", an option it did not have. It has it now (as
    prepare's); without --tokenizer it is refused, naming the fix."""
    from test_prepare import word_level

    from app.deck import load_deck
    from app.errors import DataError
    from app.generate import resolve_tokenizer
    from app.generate.__main__ import parse_args

    path = word_level(tmp_path / "tok.json", 10, eos="<|stop|>")
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml")
    with pytest.raises(DataError, match=r"--eos TOKEN"):
        resolve_tokenizer(path, deck)
    args = parse_args(["ckpt.h5", "--prompt", "w1", "--tokenizer", path, "--eos", "<|stop|>"])
    assert resolve_tokenizer(args.tokenizer, deck, args.eos).eos == 11
    with pytest.raises(DataError, match="pass --tokenizer too"):
        resolve_tokenizer(None, deck, "<|stop|>")


def _bpe_token_file(tmp_path: Path) -> tuple[Path, Path, str]:
    """A token file prepared with a BPE tokenizer.json written beside it (as `prepare --train-tokenizer`
    writes PREFIX.tokenizer.json): its prefix, the tokenizer.json and its sha256."""
    import hashlib

    from test_goldfish import write_tokens

    from app.data.tokenizer import train_bpe

    prefix = tmp_path / "data"
    write_tokens(str(prefix), [[1, 2, 3] * 20], vocab_size=300)
    text = train_bpe(iter([b"hello world, hello gridlm"] * 10), 300)
    tokenizer = tmp_path / "data.tokenizer.json"
    tokenizer.write_text(text)
    sha = hashlib.sha256(text.encode()).hexdigest()
    meta = json.loads((tmp_path / "data.json").read_text())
    meta.update(tokenizer="huggingface", tokenizer_path=str(tokenizer), tokenizer_sha256=sha, eos=0, vocab_size=300)
    (tmp_path / "data.json").write_text(json.dumps(meta))
    return prefix, tokenizer, sha


def _memmap_deck(prefix: Path):
    from app.deck import load_deck

    return load_deck(REPO / "inputs/gpt_tiny.yaml", ("data.kind=memmap", f"data.path={prefix}", "model.vocab_size=320"))


def test_a_tokenizer_other_than_the_one_the_training_data_names_is_refused_unless_any_tokenizer(tmp_path):
    """Found in review: --tokenizer byte on a checkpoint trained on BPE ids passed the vocabulary check
    and printed the ids' bytes as text. The kind and sha256 the training data's metadata records are
    compared with --tokenizer; --any-tokenizer takes it anyway (a token file prepared again since)."""
    from app.data.tokenizer import ByteTokenizer, HFTokenizer
    from app.errors import DataError
    from app.generate import resolve_tokenizer

    prefix, tokenizer, _ = _bpe_token_file(tmp_path)
    deck = _memmap_deck(prefix)
    with pytest.raises(DataError, match=r"--tokenizer byte \(byte\) is not the tokenizer the checkpoint's training"):
        resolve_tokenizer("byte", deck)
    assert isinstance(resolve_tokenizer("byte", deck, any_tokenizer=True), ByteTokenizer)
    other = tmp_path / "other.json"
    other.write_text(tokenizer.read_text() + " ")  # another tokenizer.json: other bytes, another sha256
    with pytest.raises(DataError, match="--any-tokenizer"):
        resolve_tokenizer(str(other), deck)
    assert isinstance(resolve_tokenizer(str(tokenizer), deck), HFTokenizer)  # the one it names


def test_a_moved_tokenizer_is_found_beside_its_token_file_or_named_with_its_sha256(tmp_path):
    """Found in review: a tokenizer.json no longer at its recorded path gave "names none (synthetic data,
    or its token file is gone)" and the fix --tokenizer byte, wrong for BPE. PREFIX.tokenizer.json
    beside the token file (where prepare writes a trained one) is taken when its sha256 is the recorded
    one; without it, the message names the recorded path and sha256."""
    from app.data.tokenizer import HFTokenizer
    from app.generate import default_tokenizer
    from app.generate.training_data import missing_tokenizer

    prefix, tokenizer, sha = _bpe_token_file(tmp_path)
    meta = json.loads((tmp_path / "data.json").read_text())
    meta["tokenizer_path"] = str(tmp_path / "moved-away" / "tokenizer.json")  # where it was when prepared
    (tmp_path / "data.json").write_text(json.dumps(meta))
    deck = _memmap_deck(prefix)
    found = default_tokenizer(deck)
    assert isinstance(found, HFTokenizer) and found.path == str(tokenizer) and found.eos == 0
    tokenizer.unlink()
    assert default_tokenizer(deck) is None
    said = missing_tokenizer(deck.data)
    assert f"{tmp_path / 'moved-away' / 'tokenizer.json'} (sha256 {sha}), which is not there" in said, said
    assert "--tokenizer PATH of that tokenizer.json" in said and "--tokenizer byte" not in said, said
