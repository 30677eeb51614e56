"""`run.init_from`: a saved Hugging Face GPT-2 or Llama model as a run's initial weights, on any grid.

A small random model of each is saved with `transformers` (safetensors), every parameter moved
away from HF's init by N(0, 0.1) noise so that LayerNorm gains and biases differ from 1 and 0 and
a misplaced tensor shows. The token file holds exactly one global batch of windows, so step 1
reads all of them, in whatever order, and its loss is HF's mean cross-entropy over all windows.
At lr 0 the run's step-1 loss must equal HF's within 1e-5: the same fp32 weights and math, the
summation order apart (measured differences are ~1e-7 on losses ~5); a wrong layout moves it
by 1e-2 or more. Checked on 1 rank, on tp 2 x pp 2, and on dp 2 with ZeRO-1 (the fp32 masters sharded
over dp are set too). The command line (`python -m app`, run.init_from in the deck) runs once per
architecture (gpt2 and llama on 1 rank, Mixtral on tp 2 x ep 2); the other grids start in-process
on the 4-rank group's ranks (`Trainer.initialise_from_hf`, what the job calls), without the 4 s of
CPU each rank's start costs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, grid_trainer, read_metrics, run_app, settle, train_steps

VOCAB, SEQ, BATCH, HIDDEN, LAYERS, HEADS = 128, 32, 8, 64, 2, 4
DECK_MODEL = {
    "gpt2": ("model.arch=gpt2", "model.tie_embeddings=true", "model.ffn_hidden=256", "model.layernorm_eps=1e-5"),
    "llama": (
        "model.arch=llama", "model.kv_heads=2", "model.ffn_hidden=96", "model.rope_theta=500",
        "model.layernorm_eps=1e-6", "model.tie_embeddings=false",
    ),
    "mixtral": (
        "model.arch=llama", "model.kv_heads=2", "model.rope_theta=500", "model.layernorm_eps=1e-6",
        "model.tie_embeddings=false", "model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=48",
    ),
}  # fmt: skip


def save_hf(arch: str, directory: Path, **extra: object) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, **extra,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500.0,
            max_position_embeddings=64, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500.0,
            max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def write_batch(prefix: Path) -> np.ndarray:
    """A token file of exactly BATCH windows of SEQ + 1 tokens (num_samples = (N - 1) // SEQ)."""
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=BATCH * SEQ + 1).astype("<u2")
    tokens.tofile(f"{prefix}.bin")
    np.save(f"{prefix}.idx.npy", np.array([0, len(tokens)], dtype=np.int64))
    meta = {"format": "gridlm-tokens", "version": 1, "dtype": "uint16", "vocab_size": VOCAB,
            "num_tokens": len(tokens), "num_documents": 1, "tokenizer": "byte", "eos": 0,
            "max_token_id": int(tokens.max())}  # fmt: skip
    Path(f"{prefix}.json").write_text(json.dumps(meta))
    return tokens.astype(np.int64)


def hf_loss(model: torch.nn.Module, tokens: np.ndarray) -> float:
    windows = torch.tensor(np.stack([tokens[w * SEQ : w * SEQ + SEQ + 1] for w in range(BATCH)]))
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1)))


def base_sets(directory: Path, prefix: Path, run_dir: Path, arch: str) -> list[str]:
    sets = (
        *DECK_MODEL[arch], f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}", f"model.hidden={HIDDEN}",
        f"model.layers={LAYERS}", f"model.heads={HEADS}", "model.dropout=0", "data.kind=memmap",
        f"data.path={prefix}", f"train.global_batch={BATCH}", "train.micro_batch=2", "train.steps=1",
        "optim.lr=0", "optim.min_lr=0", "optim.warmup_steps=0", "run.resume=none", f"run.init_from={directory}",
        f"run.dir={run_dir}", "checkpoint.at_exit=false",
    )  # fmt: skip
    return [arg for s in sets for arg in ("--set", s)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "batch"
    return prefix, write_batch(prefix)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_init_from_gives_the_hf_loss_through_the_command_line(arch, data, tmp_path):
    """`python -m app` with run.init_from: a saved Hugging Face GPT-2 or Llama on 1 rank, a Mixtral
    (llama blocks with experts) on tp2 dp2 ep2, each rank holding 2 of the 4 experts, whole on both tp
    ranks; the first loss is Hugging Face's within 1e-5, and the summary names ep only where it splits."""
    prefix, tokens = data
    model = save_hf(arch, tmp_path / "hf")
    want = hf_loss(model, tokens)
    ranks, grid_sets = (4, ("--set", "parallel.tp=2", "--set", "parallel.ep=2")) if arch == "mixtral" else (1, ())
    run_dir = tmp_path / "run"
    out = run_app(ranks, "inputs/gpt_tiny.yaml", *base_sets(tmp_path / "hf", prefix, run_dir, arch), *grid_sets)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"gridlm: initial weights from {tmp_path / 'hf'}: " in out.stdout
    loss = read_metrics(run_dir)[0]["loss"]
    assert abs(loss - want) < 1e-5, (ranks, loss, want)
    grid = json.loads((run_dir / "summary.json").read_text())["grid"]
    assert grid.get("ep") == (2 if arch == "mixtral" else None) and "cp" not in grid, grid


# The grids the command line does not run, per architecture: (tp, pp, dp, overrides).
IN_PROCESS_GRIDS = {
    "gpt2": ((2, 2, 1, ()), (1, 1, 2, ("optim.zero=1",))),
    "llama": ((2, 2, 1, ()), (1, 1, 2, ("optim.zero=1",))),
    "mixtral": ((1, 1, 1, ()),),
}


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_init_from_gives_the_hf_loss_on_tp2_pp2_dp2_zero1_and_one_rank(arch, runtime, grids, shared_tmp):
    """The same start on the grids above, each in the group's last copy of it (`GridPool.trains`):
    tp2 pp2 and dp2 ZeRO-1 for GPT-2 and Llama, 1 rank for Mixtral; the first loss is Hugging
    Face's within 1e-5 on each."""
    hf_dir, prefix = shared_tmp / "hf", shared_tmp / "batch"
    want = None
    if runtime.rank == 0:
        want = hf_loss(save_hf(arch, hf_dir), write_batch(prefix))
    want = runtime.comm.bcast(want, root=0)  # the model and the tokens are written
    losses, problems = {}, []
    for tp, pp, dp, extra in IN_PROCESS_GRIDS[arch]:
        size = tp * pp * dp
        grids.runtime(size)
        if grids.trains(size):
            sets = base_sets(hf_dir, prefix, shared_tmp / f"run-tp{tp}-pp{pp}-dp{dp}", arch)[1::2]  # the --set values
            trainer = grid_trainer(grids, tp, pp, dp, (*sets, *extra))
            trainer.initialise_from_hf(hf_dir)
            loss = train_steps(trainer, 1)[0]
            if abs(loss - want) >= 1e-5:
                problems.append(f"tp{tp} pp{pp} dp{dp} {extra}: loss {loss} != Hugging Face's {want}")
            losses[tp, pp, dp] = loss
        else:
            grids.stand_by(grids.grid(tp, pp, dp), 1)
        settle(runtime.comm)
    problems = sum(runtime.comm.allgather(problems), [])
    trained = {k for d in runtime.comm.allgather(losses) for k in d}
    assert trained == {(tp, pp, dp) for tp, pp, dp, _ in IN_PROCESS_GRIDS[arch]}, trained
    assert not problems, "\n".join(problems)


def test_a_tied_hf_model_starts_an_untied_head_as_the_embedding(data, tmp_path):
    prefix, tokens = data
    model = save_hf("gpt2", tmp_path / "hf")
    sets = base_sets(tmp_path / "hf", prefix, tmp_path / "run", "gpt2") + ["--set", "model.tie_embeddings=false"]
    out = run_app(1, "inputs/gpt_tiny.yaml", *sets)
    assert out.returncode == 0, out.stdout + out.stderr
    assert abs(read_metrics(tmp_path / "run")[0]["loss"] - hf_loss(model, tokens)) < 1e-5


@pytest.mark.parametrize("act", ["gelu_fast", "gelu_pytorch_tanh"])
def test_the_other_names_of_the_tanh_gelu_are_imported(act, data, tmp_path):
    """Found in review (2026-12-02): a GPT-2 saved with activation_function gelu_fast (transformers' name
    for the same tanh approximation, its constant rounded to 1e-10) was refused; now imported, its loss
    is HF's within 1e-5, as above (at this width that bound would not tell the erf GELU apart, 9e-6 off:
    which names are accepted is what this test holds)."""
    prefix, tokens = data
    model = save_hf("gpt2", tmp_path / "hf", activation_function=act)
    out = run_app(1, "inputs/gpt_tiny.yaml", *base_sets(tmp_path / "hf", prefix, tmp_path / "run", "gpt2"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert abs(read_metrics(tmp_path / "run")[0]["loss"] - hf_loss(model, tokens)) < 1e-5
    # Another activation is refused, named.
    save_hf("gpt2", tmp_path / "relu", activation_function="relu")
    out = run_app(1, "inputs/gpt_tiny.yaml", *base_sets(tmp_path / "relu", prefix, tmp_path / "r2", "gpt2"))
    assert out.returncode == 2 and "activation_function 'relu'" in out.stderr, out.stdout + out.stderr


def test_a_model_that_is_not_the_decks_is_refused_with_the_keys_that_fix_it(data, tmp_path):
    prefix, _ = data
    save_hf("llama", tmp_path / "hf")
    sets = base_sets(tmp_path / "hf", prefix, tmp_path / "run", "llama")
    out = run_app(2, "inputs/gpt_tiny.yaml", *sets, "--set", "model.hidden=32", "--set", "model.kv_heads=4")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "hidden_size = 64 (model.hidden is 32), num_key_value_heads = 2 (model.kv_heads is 4)" in out.stderr
    assert "fix: --set model.hidden=64 --set model.kv_heads=2" in out.stderr and "Traceback" not in out.stderr
    # An untied HF model cannot become a tied one.
    out = run_app(1, "inputs/gpt_tiny.yaml", *sets, "--set", "model.tie_embeddings=true")
    assert out.returncode == 2 and "--set model.tie_embeddings=false" in out.stderr, out.stderr
    # No safetensors: said, with how to save them.
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "pytorch_model.bin")
    out = run_app(1, "inputs/gpt_tiny.yaml", *sets)
    assert out.returncode == 2 and "safe_serialization=True" in out.stderr, out.stderr
    out = run_app(1, "inputs/gpt_tiny.yaml", *base_sets(tmp_path / "nothing", prefix, tmp_path / "r2", "llama"))
    assert out.returncode == 2 and "run.init_from" in out.stderr and "no config.json there" in out.stderr, out.stderr


def test_a_stale_shard_index_beside_model_safetensors_is_not_read(tmp_path):
    """Found in review (2026-11-30): an export --force into a directory of an earlier sharded model left its
    model.safetensors.index.json, which the import read before model.safetensors (the stale shards);
    transformers' from_pretrained takes model.safetensors first, and so does the import now."""
    import json

    from app.checkpoint.hf_import import HFWeights
    from app.deck import load_deck

    save_hf("gpt2", tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"transformer.wte.weight": "stale-00001-of-00001.safetensors"}})
    )
    sets = [s for s in base_sets(tmp_path, tmp_path / "data", tmp_path / "run", "gpt2") if s != "--set"]
    weights = HFWeights(tmp_path, load_deck(REPO / "inputs/gpt_tiny.yaml", tuple(sets)).model)
    assert set(weights.files.values()) == {tmp_path / "model.safetensors"}


def test_import_places_each_tensor_where_export_takes_it_from():
    """The import's `place` is the export's `convert` read backwards, tensor by tensor: a round trip
    of random tensors through both gives them back exactly (gpt2 and llama with GQA)."""
    from app.checkpoint.export import dataset_name, mapping

    models = [
        dict(arch="gpt2", hidden=8, ffn=32, vocab_size=10, seq_len=6, heads=2, layers=2, tie_embeddings=False),
        dict(arch="llama", hidden=8, ffn=24, vocab_size=10, seq_len=6, heads=4, kv=2, layers=2, tie_embeddings=False),
    ]
    for model in models:
        rules = mapping(model)
        rng = np.random.default_rng(0)
        ours = {dataset_name(k): rng.standard_normal(r.shape) for k, r in rules.items()}
        back = {name: np.full(x.shape, np.nan) for name, x in ours.items()}
        for key, rule in rules.items():
            hf = rule.convert(ours[dataset_name(key)])
            assert hf.shape == rule.hf_shape, key
            rule.place(back[dataset_name(key)], hf)
        for name in ours:
            np.testing.assert_array_equal(back[name], ours[name], err_msg=name)


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_keys_a_config_leaves_out_are_the_defaults_transformers_takes(model_type):
    """Found in review (2026-11-30): a Mixtral config.json without rms_norm_eps, rope_theta or
    num_key_value_heads was read with LlamaConfig's defaults (1e-6, 1e4, the query heads) where
    transformers takes MixtralConfig's (1e-5, 1e6, 8): a deck that differed was accepted and its
    logits were not HF's. Each expected value of a bare config is the transformers config's default."""
    from transformers import AutoConfig

    from app.archs.llama import hf_expected

    default = AutoConfig.for_model(model_type)
    compared = 0
    for key, hf_key, value in hf_expected({"model_type": model_type}):
        if key == "arch" or not hasattr(default, hf_key) and hf_key != "rope_theta":
            continue
        rope = getattr(default, "rope_parameters", None) or {"rope_theta": getattr(default, "rope_theta", None)}
        want = rope["rope_theta"] if hf_key == "rope_theta" else getattr(default, hf_key)
        assert value == want, (key, hf_key, value, want)
        compared += 1
    assert compared >= 9


def _shard(directory: Path) -> dict[str, list[str]]:
    """Split DIR's model.safetensors into two shards listed by model.safetensors.index.json, as
    save_pretrained writes a large model: shard file -> its tensors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, directory / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


def test_a_sharded_directory_with_a_missing_or_damaged_shard_or_a_null_rope_theta_is_named(tmp_path):
    """Found in review: a shard file the index lists that is missing, one that is not safetensors, or
    one without a tensor the index places there ended in "internal error" and a traceback at its
    first read; "rope_theta": null in config.json in a TypeError. Each is the import's one-line
    error, naming the file (checked when the directory is opened)."""
    from safetensors.torch import load_file, save_file

    from app.checkpoint.hf_import import HFWeights
    from app.deck import load_deck
    from app.errors import CheckpointError

    directory = tmp_path / "hf"
    save_hf("llama", directory)
    shards = _shard(directory)
    sets = [s for s in base_sets(directory, tmp_path / "data", tmp_path / "run", "llama") if s != "--set"]
    model = load_deck(REPO / "inputs/gpt_tiny.yaml", tuple(sets)).model
    whole = HFWeights(directory, model)
    assert len(set(whole.files.values())) == 2 and all(whole.tensor(n) is not None for n in whole.sources)

    def refused(says: str) -> None:
        with pytest.raises(CheckpointError, match=f"run.init_from {directory}: .*{says}"):
            weights = HFWeights(directory, model)
            for name in weights.sources:
                weights.tensor(name)

    second = directory / "model-00002-of-00002.safetensors"
    kept = second.read_bytes()
    second.unlink()
    refused(r"lists the shard model-00002-of-00002.safetensors, which is not there")
    second.write_bytes(b"not safetensors at all")
    refused(r"shard model-00002-of-00002.safetensors is not a readable safetensors file")
    second.write_bytes(kept)
    tensors = load_file(second)
    dropped = shards[second.name][0]
    save_file({n: t for n, t in tensors.items() if n != dropped}, second)
    refused(f"shard model-00002-of-00002.safetensors has no tensor {re.escape(dropped)}")
    second.write_bytes(kept)
    config = json.loads((directory / "config.json").read_text())
    config["rope_theta"] = None
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["rope_theta"] = None
    (directory / "config.json").write_text(json.dumps(config))
    refused(r"config.json: rope_theta = None is not a positive number")
