"""`python -m app.checkpoint inspect|export` on real checkpoints written by `python -m app`.

Serial tests (the app runs as an MPI subprocess; the tools are plain serial processes).
Two small checkpoints, each made once per module: fp32 with tied embeddings, and bf16 with
an untied head (fp32 masters next to the bf16 parameters).
transformers and safetensors are imported inside the tests: the MPI test groups collect
this module too and should not pay for the import.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from app.checkpoint.__main__ import run as checkpoint_cli
from app.checkpoint.export import export_hf
from app.checkpoint.io import decode, read_header
from app.checkpoint.slabs import storage_of
from app.deck import load_deck
from app.errors import CheckpointError
from app.model.gpt import GPT
from conftest import REPO, app_env, run_app

TINY = "inputs/gpt_tiny.yaml"
# A high learning rate without warm-up: after 3 Adam steps every parameter, biases and
# LayerNorm gains included, is ~0.1 away from its initial value, so a misplaced tensor
# (say a bias in the wrong permutation) changes the logits far beyond the tolerance.
SMALL = tuple(arg for a in (
    "model.hidden=64", "model.layers=2", "model.heads=4", "model.seq_len=32", "model.vocab_size=128",
    "train.global_batch=4", "train.micro_batch=2", "train.steps=3", "run.resume=none",
    "optim.lr=0.05", "optim.warmup_steps=0",
) for arg in ("--set", a))  # fmt: skip


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str, *overrides: str) -> Path:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    sets = tuple(arg for a in overrides for arg in ("--set", a))
    out = run_app(1, TINY, *SMALL, *sets, "--set", f"run.dir={run_dir}")
    assert out.returncode == 0, out.stdout + out.stderr
    path = run_dir / "checkpoints" / "step_0000003.h5"  # checkpoint.at_exit
    assert path.is_file(), sorted(p.name for p in run_dir.rglob("*"))
    return path


@pytest.fixture(scope="module")
def fp32_ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "fp32")


@pytest.fixture(scope="module")
def bf16_untied_ckpt(tmp_path_factory):
    # One app run serves both the untied-head and the bf16 tests (each app run costs seconds).
    return _checkpoint(tmp_path_factory, "bf16-untied", "train.precision=bf16", "model.tie_embeddings=false")


def cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m app.checkpoint args...` as a user runs it: a plain process, no mpirun."""
    cmd = [sys.executable, "-m", "app.checkpoint", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=120, check=False)


def table(stdout: str) -> dict[str, str]:
    """inspect's tree -> {"/group/name": status}: group lines end with "/", dataset lines are indented."""
    rows, group = {}, None
    for line in stdout.splitlines():
        if line.startswith("/") and line.endswith("/"):
            group = line
        elif group and line.startswith("  "):
            rows[group + line.split()[0]] = line.rsplit("  ", 1)[1].strip()
        elif line.startswith("total:"):
            group = None
    return rows


def all_datasets(path: Path) -> set[str]:
    found: list[str] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.append("/" + name) if isinstance(obj, h5py.Dataset) else None)
    return set(found)


def gridlm_model(path: Path, tmp_path: Path, source: str = "model") -> GPT:
    """The 1-rank GPT of the checkpoint's deck, holding the checkpoint's `source` tensors."""
    header = read_header(path)
    deck_file = tmp_path / "saved_deck.yaml"
    deck_file.write_text(header["deck"])
    deck = load_deck(deck_file)
    model = GPT(deck.model, seed=0)
    with h5py.File(path, "r") as f, torch.no_grad():
        for name, param in model.named_parameters():
            dset = f[f"{source}/{name}"]
            param.copy_(decode(dset[()], dset.attrs["dtype"]).view(param.shape))
    return model.eval()


def hf_model(directory: Path, kind: str = "GPT2LMHeadModel"):
    import transformers

    model, info = getattr(transformers, kind).from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def assert_same_logits(ours: GPT, hf, vocab: int, seq: int) -> None:
    tokens = torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        mine = ours(tokens)
        theirs = hf(tokens).logits
    assert theirs.shape == mine.shape == (3, seq, vocab)
    assert mine.abs().max() > 1.0  # logits of a model trained away from its init, not ~0
    # Same fp32 weights and math; only the op order differs (HF's Conv1D addmm vs F.linear, its
    # attention vs SDPA): a few ulp per op through 2 blocks. Measured max |diff| 6e-7 on logits
    # up to ~2; 1e-5 leaves margin. Misplacing one tensor kind (QKV rows unpermuted, the QKV bias
    # unpermuted, a zeroed LayerNorm bias, a reversed MLP bias) moves the logits by 5e-2 to 1.
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)


# ---- inspect --------------------------------------------------------------------------


def test_inspect_lists_every_dataset_verified_ok_and_exits_0(fp32_ckpt, capsys):
    out = cli("inspect", fp32_ckpt)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "step        3 | optimizer steps 3 | consumed samples 12" in out.stdout
    assert "precision   fp32" in out.stdout
    assert "tp=1 pp=1 dp=1 (tp-dp-pp)" in out.stdout and "world size 1" in out.stdout
    rows = table(out.stdout)
    assert set(rows) == all_datasets(fp32_ckpt)
    checksummed = {"/" + key for key in read_header(fp32_ckpt)["datasets"]}
    # /model and the two moments (fp32: no masters), 28 tensors each, and the RNG rows.
    assert len(checksummed) == 3 * 28 + 1
    assert {rows[name] for name in checksummed} == {"ok"}
    assert f"total: {len(rows)} datasets" in out.stdout and f"{len(checksummed)} ok" in out.stdout

    # --json: the same facts as one object; --no-verify: nothing verified.
    assert checkpoint_cli(["inspect", str(fp32_ckpt), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 3 and report["precision"] == "fp32" and report["grid"]["world_size"] == 1
    assert {d["name"]: d["status"] for d in report["datasets"]} == rows
    assert report["total"]["ok"] == len(checksummed) and report["total"]["mismatch"] == 0
    assert checkpoint_cli(["inspect", str(fp32_ckpt), "--no-verify"]) == 0
    unverified = table(capsys.readouterr().out)
    assert {unverified[name] for name in checksummed} == {"not verified"}


def test_inspect_names_a_dataset_with_one_flipped_byte_and_exits_1(fp32_ckpt, tmp_path, capsys):
    path = tmp_path / "corrupt.h5"
    shutil.copy(fp32_ckpt, path)
    victim = "model/blocks.1.mlp.fc.weight"
    with h5py.File(path, "r") as f:
        storage = storage_of(f[victim])  # contiguous, or a chunk per tp shard: bytes at known offsets
        offset = min(storage.offsets.values())
    with open(path, "r+b") as raw:
        raw.seek(offset + 4 * 1000 + 1)  # a middle byte of element 1000
        byte = raw.read(1)
        raw.seek(-1, 1)
        raw.write(bytes([byte[0] ^ 0x10]))
    # In-process (`run` returns the exit status): the subprocess path is covered by the other tests.
    assert checkpoint_cli(["inspect", str(path)]) == 1
    out = capsys.readouterr()
    assert out.err.startswith("gridlm: ") and "/" + victim in out.err
    rows = table(out.out)
    assert rows["/" + victim] == "MISMATCH"
    assert [name for name, status in rows.items() if status == "MISMATCH"] == ["/" + victim]
    # export reads the same tensor: it refuses, names it, and writes nothing.
    with pytest.raises(CheckpointError, match=f"checksum mismatch in dataset /{victim}"):
        export_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_user_mistakes_exit_2_with_one_gridlm_line_and_no_traceback(fp32_ckpt, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    for args, says in (
        (("inspect", tmp_path / "missing.h5"), "no such file"),
        (("inspect", text), "not a readable HDF5 file"),
        (("export", fp32_ckpt, "--to", "onnx", tmp_path / "x"), "invalid choice"),
    ):
        out = cli(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr
        message = out.stderr.splitlines()[-1]
        assert message.startswith("gridlm: ") and says in message, (args, out.stderr)

    incomplete = tmp_path / "incomplete.h5"
    shutil.copy(fp32_ckpt, incomplete)
    with h5py.File(incomplete, "r+") as f:
        del f.attrs["committed"]  # as a copy taken during a write looks
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine\n")
    for args, says in (
        (["inspect", str(incomplete)], "is incomplete"),
        (["export", str(fp32_ckpt), "--to", "hf", str(full)], "--force"),
        (["inspect", str(tmp_path)], "is a directory"),
    ):
        assert checkpoint_cli(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("gridlm: ") and says in err and err.count("\n") == 1, err
    assert sorted(p.name for p in full.iterdir()) == ["keep.txt"]  # the refused export wrote nothing
    # --force over an earlier model's directory: its generation_config.json (whose token ids transformers'
    # generate takes over config.json's) goes, said so; other files stay.
    (full / "generation_config.json").write_text('{"eos_token_id": 7}\n')
    assert checkpoint_cli(["export", str(fp32_ckpt), "--to", "hf", str(full), "--force"]) == 0
    assert "removed the earlier model's generation_config.json" in capsys.readouterr().out
    assert sorted(p.name for p in full.iterdir()) == ["config.json", "keep.txt", "model.safetensors"]


def test_a_truncated_or_rewritten_file_is_told_the_tools_fix_not_a_resumes(fp32_ckpt, tmp_path, capsys):
    """Found in review: inspect (and export, generate, eval) told a truncated file to "resume from an older
    checkpoint (run.resume: <file>)": a tool has no run.resume. A resume's words are unchanged."""
    from app.checkpoint.io import RESUME

    truncated = tmp_path / "step_0000001.h5"
    whole = fp32_ckpt.read_bytes()
    truncated.write_bytes(whole[: len(whole) // 3])
    for args in (["inspect", str(truncated)], ["export", str(truncated), "--to", "hf", str(tmp_path / "hf")]):
        assert checkpoint_cli(args) == 2, args
        err = capsys.readouterr().err
        assert "truncated or corrupt: use an older checkpoint of its directory" in err, err
        assert "run.resume" not in err and err.count("\n") == 1, err
    with pytest.raises(
        CheckpointError, match=re.escape("truncated or corrupt: resume from an older checkpoint (run.resume: <file>)")
    ):
        read_header(truncated, RESUME)


def test_inspect_checks_the_datasets_against_the_model_of_the_stored_deck(
    fp32_ckpt, bf16_untied_ckpt, llama_ckpt, mixtral_ckpt, tmp_path, capsys
):
    """Found in review: inspect checksummed the datasets present and compared them with nothing, so a
    renamed dataset (blocks.1.ln1.weight -> blocks.1.ln1.wehght) passed with exit 0 while a resume
    refused the file. The datasets a resume reads come from the stored deck's model (as `load` requires
    them): one missing, one the model has no place for, one of another shape is damage, each named, exit 1."""
    from app.checkpoint.slabs import dataset_checksum

    # What this gridlm writes matches its deck: masters (bf16), an untied head, llama's names, experts.
    for path in (fp32_ckpt, bf16_untied_ckpt, llama_ckpt, mixtral_ckpt):
        assert checkpoint_cli(["inspect", str(path), "--no-verify"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    damaged = tmp_path / "step_0000003.h5"
    shutil.copy(fp32_ckpt, damaged)
    short = "optimizer/exp_avg/blocks.0.mlp.fc.bias"
    with h5py.File(damaged, "r+") as f:
        f.move("model/blocks.1.ln1.weight", "model/blocks.1.ln1.wehght")
        values = f[short][:-1]  # one element short, with the right checksum of what is there
        del f[short]
        f.create_dataset(short, data=values).attrs.update(dtype="float32", checksum=np.uint64(dataset_checksum(values)))
    assert checkpoint_cli(["inspect", str(damaged)]) == 1
    out = capsys.readouterr()
    rows = table(out.out)
    assert rows.pop("/model/blocks.1.ln1.weight").startswith("MISSING")
    assert rows.pop("/model/blocks.1.ln1.wehght").startswith("UNEXPECTED")
    assert rows.pop("/" + short) == "WRONG SHAPE (the model of its deck has shape (256,))"
    assert set(rows.values()) == {"ok"}
    assert out.err.count("\n") == 1 and out.err.startswith(f"gridlm: {damaged}: 3 damaged dataset(s): "), out.err
    for name in (
        "/model/blocks.1.ln1.weight (missing)",
        "/model/blocks.1.ln1.wehght (unexpected)",
        f"/{short} (wrong shape)",
    ):
        assert name in out.err, out.err
    # A renamed group: 28 missing and 28 unexpected datasets, the first 8 named on the one line.
    shutil.copy(fp32_ckpt, damaged)
    with h5py.File(damaged, "r+") as f:
        f.move("optimizer/exp_avg_sq", "optimizer/exp_avg_sqq")
    assert checkpoint_cli(["inspect", str(damaged), "--no-verify"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "56 damaged dataset(s)" in err and "and 48 more (listed above)" in err, err


def test_inspect_and_export_take_a_latest_pointer_or_a_directory_as_a_resume_does(fp32_ckpt, tmp_path, capsys):
    """Found in review: inspect of a run's `latest` pointer (or its checkpoint directory) said "not a
    readable HDF5 file ... corrupt" though run.resume takes both: they are resolved as a resume
    resolves them (store.named_checkpoint), and the report names the file they resolved to."""
    directory = fp32_ckpt.parent
    assert (directory / "latest").read_text().strip() == fp32_ckpt.name
    for given in (directory / "latest", directory):
        assert checkpoint_cli(["inspect", str(given), "--no-verify"]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith(f"checkpoint  {fp32_ckpt} (gridlm-checkpoint v2)")
    assert checkpoint_cli(["export", str(directory / "latest"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert f"exported step 3 of {fp32_ckpt} " in capsys.readouterr().out
    stale = tmp_path / "checkpoints"
    stale.mkdir()
    (stale / "latest").write_text("step_0000009.h5\n")
    for given in (stale / "latest", stale):
        assert checkpoint_cli(["inspect", str(given)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "names step_0000009.h5, which does not exist" in err, err


def test_inspect_calls_a_dataset_it_cannot_checksum_unreadable_not_a_traceback(fp32_ckpt, monkeypatch, capsys):
    """Found in review: inspect caught only OSError around a dataset's read and checksum, so values of a
    width no checksum covers (a float128 dataset: KeyError) ended in a traceback. ValueError, KeyError
    and TypeError there make that dataset UNREADABLE, named, exit 1."""
    from app.checkpoint import slabs

    real = slabs.dataset_checksum

    def checksum(values: np.ndarray, version: int = 2) -> int:
        if values.shape == (32, 64):  # wpe, and its two moments
            raise KeyError(16)
        return real(values, version)

    monkeypatch.setattr(slabs, "dataset_checksum", checksum)
    assert checkpoint_cli(["inspect", str(fp32_ckpt)]) == 1
    out = capsys.readouterr()
    rows = table(out.out)
    unreadable = {name for name, status in rows.items() if status != "ok"}
    assert unreadable == {"/model/wpe", "/optimizer/exp_avg/wpe", "/optimizer/exp_avg_sq/wpe"}, rows
    assert {rows[name] for name in unreadable} == {"UNREADABLE (KeyError: 16)"}
    assert out.err.count("\n") == 1 and "/model/wpe (unreadable)" in out.err, out.err


def test_help_answers_without_loading_mpi_torch_or_h5py():
    # --help is read on login nodes: it must not start MPI or load torch (imported lazily).
    code = (
        "import runpy, sys\n"
        "sys.argv = ['x', 'export', '--help']\n"
        "try:\n    runpy.run_module('app.checkpoint', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'mpi4py', 'h5py') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "whole into memory on this one process" in " ".join(out.stdout.split())
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ---- export -----------------------------------------------------------------------------


def test_export_hf_loads_in_transformers_and_gives_our_logits(fp32_ckpt, tmp_path, capsys):
    assert checkpoint_cli(["export", str(fp32_ckpt), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert "exported step 3" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_inner"]) == (64, 2, 4, 256)
    assert (config["vocab_size"], config["n_positions"], config["tie_word_embeddings"]) == (128, 32, True)
    assert config["activation_function"] == "gelu_new"
    hf = hf_model(tmp_path / "hf")
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied
    assert_same_logits(gridlm_model(fp32_ckpt, tmp_path), hf, vocab=128, seq=32)


def test_export_that_cannot_write_its_weights_is_one_line_and_exit_2(fp32_ckpt, tmp_path):
    """Found in review (2026-11-30): safetensors reports a failed write (a full or read-only drive) as
    its own SafetensorError, not an OSError, so the export died with a traceback and exit 1 (which
    means a checksum mismatch). A real failed write: the file-size limit (EFBIG) under the weights'."""
    import resource
    import signal

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    out = subprocess.run([sys.executable, "-m", "app.checkpoint", "export", str(fp32_ckpt), "--to", "hf",
                          str(tmp_path / "hf")], cwd=REPO, env=app_env(), capture_output=True, text=True,
                         timeout=300, preexec_fn=small_files)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot write to {tmp_path / 'hf'}" in out.stderr and "too large" in out.stderr, out.stderr
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert not (tmp_path / "hf" / "model.safetensors.tmp").exists()


def test_an_export_whose_config_cannot_be_written_leaves_the_earlier_export_whole(
    fp32_ckpt, bf16_untied_ckpt, tmp_path
):
    """Found in review: the weights were renamed into place before config.json was written, so a --force
    export over an earlier one whose config write failed left the new weights beside the old config.json
    (another model's shapes). Both files are written first, then renamed: the earlier export stays whole."""
    from app.errors import CheckpointError

    out = tmp_path / "hf"
    export_hf(fp32_ckpt, out)
    before = {name: (out / name).read_bytes() for name in ("model.safetensors", "config.json")}
    (out / "config.json.tmp").mkdir()  # the config's write fails (EISDIR), after the weights' is done
    with pytest.raises(CheckpointError, match="cannot write to"):
        export_hf(bf16_untied_ckpt, out, force=True)
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not (out / "model.safetensors.tmp").exists()


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    # Grouped-query attention (2 key/value heads for 4 query heads), an untied head (llama's default).
    return _checkpoint(tmp_path_factory, "llama", "model.arch=llama", "model.kv_heads=2", "model.rope_theta=500")


def test_export_of_a_llama_checkpoint_is_a_llama_for_causal_lm_with_our_logits(llama_ckpt, tmp_path):
    """model.arch: llama exports as LlamaForCausalLM: the fused QKV rows split into q/k/v_proj by
    key/value group, the interleaved SwiGLU rows into gate_proj and up_proj. Tolerance as for
    GPT-2 (`assert_same_logits`): the same fp32 weights, op order apart. Swapping gate and up, or
    q/k rows within a group, moves the logits by far more (the model was trained away from init)."""
    export_hf(llama_ckpt, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["intermediate_size"], config["rope_theta"], config["tie_word_embeddings"]) == (192, 500.0, False)
    hf = hf_model(tmp_path / "hf", "LlamaForCausalLM")
    assert_same_logits(gridlm_model(llama_ckpt, tmp_path), hf, vocab=128, seq=32)


@pytest.fixture(scope="module")
def mixtral_ckpt(tmp_path_factory):
    # llama blocks with 4 experts of width 48, top-2, in every block (Mixtral's shape).
    return _checkpoint(tmp_path_factory, "mixtral", "model.arch=llama", "model.kv_heads=2", "model.rope_theta=500",
                       "model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=48")  # fmt: skip


def test_export_of_a_llama_checkpoint_with_experts_is_a_mixtral_with_our_logits(mixtral_ckpt, tmp_path):
    """llama with experts exports as MixtralForCausalLM: the router as block_sparse_moe.gate, each
    expert's interleaved SwiGLU rows as its w1 (gate) and w3 (up), its proj as w2. The same logits
    within `assert_same_logits`' tolerance (Mixtral's routing is gridlm's: softmax, top-k,
    renormalised; only the order of the experts' sum differs). Swapping w1 and w3, or two experts,
    changes which expert a token's output comes from and moves the logits far more."""
    export_hf(mixtral_ckpt, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 48)
    hf = hf_model(tmp_path / "hf", "MixtralForCausalLM")
    assert_same_logits(gridlm_model(mixtral_ckpt, tmp_path), hf, vocab=128, seq=32)


def test_export_untied_writes_lm_head(bf16_untied_ckpt, tmp_path):
    from safetensors.numpy import load_file

    export_hf(bf16_untied_ckpt, tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    with h5py.File(bf16_untied_ckpt, "r") as f:
        np.testing.assert_array_equal(saved["lm_head.weight"], f["optimizer/master/head"][()])
        assert not np.array_equal(f["optimizer/master/head"][()], f["optimizer/master/wte.weight"][()])
    hf = hf_model(tmp_path / "hf")
    assert not hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    assert_same_logits(gridlm_model(bf16_untied_ckpt, tmp_path, source="optimizer/master"), hf, vocab=128, seq=32)


def test_export_of_a_bf16_checkpoint_writes_the_fp32_masters(bf16_untied_ckpt, tmp_path):
    from safetensors.numpy import load_file

    header = read_header(bf16_untied_ckpt)
    assert header["precision"] == "bf16"
    assert header["datasets"]["model/wte.weight"]["dtype"] == "bfloat16"
    done = export_hf(bf16_untied_ckpt, tmp_path / "hf")
    assert done.source == "optimizer/master" and done.step == 3
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {np.dtype(np.float32)}
    with h5py.File(bf16_untied_ckpt, "r") as f:
        for name, hf_name in (("wte.weight", "transformer.wte.weight"), ("ln_f.bias", "transformer.ln_f.bias")):
            master = f[f"optimizer/master/{name}"][()]
            rounded = decode(f[f"model/{name}"][()], "bfloat16").numpy()
            np.testing.assert_array_equal(saved[hf_name], master)
            # The bf16 parameters are the masters rounded: exporting them instead would differ.
            np.testing.assert_array_equal(torch.from_numpy(master).bfloat16().float().numpy(), rounded)
            assert not np.array_equal(master, rounded)


def _doc_snippets() -> list[str]:
    text = (REPO / "docs" / "CHECKPOINT.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_the_five_line_reader_of_docs_checkpoint_md_reads_a_parameter(fp32_ckpt, bf16_untied_ckpt, which):
    """The documented h5py snippet, run on a real checkpoint, gives the parameter (decoded from
    bf16 bit patterns too), and the documented checksum check holds."""
    path = fp32_ckpt if which == "fp32" else bf16_untied_ckpt
    reader, checker = _doc_snippets()[:2]
    scope: dict = {}
    exec(reader.replace("runs/gpt_tiny/checkpoints/step_0000300.h5", str(path)), scope)  # noqa: S102
    with h5py.File(path, "r") as f:
        stored = f["model/blocks.0.attn.qkv.weight"]
        expected = decode(stored[...], stored.attrs["dtype"]).numpy()
        assert scope["w"].dtype == np.float32 and np.array_equal(scope["w"], expected)
        exec(checker, {"f": f})  # noqa: S102 - raises AssertionError on a mismatch


def test_inspect_names_the_architecture_the_experts_and_every_axis_of_the_grid(fp32_ckpt, mixtral_ckpt):
    """Found in review (2026-11-30): inspect showed a llama or Mixtral checkpoint as a GPT-2 (no arch,
    no kv heads, no experts) and a cp or 3D-tensor grid without cp or the split (its axes did not
    multiply to the world size)."""
    from app.checkpoint.__main__ import _grid_line

    out = cli("inspect", mixtral_ckpt, "--no-verify")
    assert out.returncode == 0, out.stderr
    model = next(line for line in out.stdout.splitlines() if line.startswith("model"))
    assert model.startswith("model       llama |") and "heads 4 (2 kv)" in model, model
    assert "4 experts of 48, top-2" in model, model
    plain = next(
        line for line in cli("inspect", fp32_ckpt, "--no-verify").stdout.splitlines() if line.startswith("model")
    )
    assert plain.startswith("model       gpt2 |") and "kv" not in plain and "experts" not in plain, plain
    grid = {"tp": 2, "pp": 1, "dp": 2, "order": "tp-cp-dp-pp", "cp": 2, "virtual_stages": 1,
            "sequence_parallel": False, "zero": 1, "world_size": 8}  # fmt: skip
    assert _grid_line(grid).startswith("tp=2 cp=2 pp=1 dp=2 (tp-cp-dp-pp)")
    grid.update(cp=1, tensor=[2, 1, 1], tensor_order="yxz")
    del grid["cp"]
    assert _grid_line(grid).startswith("tp=2 tensor=[2, 1, 1] yxz pp=1 dp=2")
    del grid["tensor"], grid["tensor_order"]
    assert _grid_line({**grid, "ep": 2}).startswith("tp=2 pp=1 dp=2 ep=2 (tp-cp-dp-pp)")
