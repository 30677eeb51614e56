"""Faults found in review of the Hugging Face interchange (app/checkpoint/export.py, hf_import.py).

Serial tests: tiny models saved with `transformers` (safetensors), read by `HFWeights` as
`run.init_from` does on each rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO

TINY = REPO / "inputs/gpt_tiny.yaml"
SIZES = ("model.vocab_size=128", "model.hidden=64", "model.layers=2", "model.heads=4", "model.seq_len=32")


def save_tiny(arch: str, directory: Path) -> None:
    """A tiny tied GPT-2 or Llama (GQA: 2 key/value heads) whose MLP width is 4 x hidden, GPT-2's default."""
    import torch
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)


@pytest.mark.parametrize(("hf_arch", "deck"), [("llama", ()), ("gpt2", ("model.arch=llama", "model.kv_heads=2"))])
def test_the_fix_for_a_deck_of_another_architecture_is_accepted(hf_arch, deck, tmp_path):
    """Found in review: with the deck's model.arch not the HF model's, the refusal's fix named the
    arch but compared the other keys with the deck's architecture's derived values: a gpt2 deck
    (ffn 4h, no key/value heads) for a GQA Llama omitted model.kv_heads, and model.ffn_hidden that
    equals 4h, so the deck with the fix applied was refused again (num_key_value_heads,
    intermediate_size); a llama deck with kv_heads for a GPT-2 gave a fix the deck refuses (gpt2 has
    no kv_heads). The fix must now be complete: applied as given, the deck is accepted."""
    from app.checkpoint.hf_import import HFWeights
    from app.deck import load_deck
    from app.errors import CheckpointError

    save_tiny(hf_arch, tmp_path)
    sets = (*SIZES, *deck)
    with pytest.raises(CheckpointError, match=f"--set model.arch={hf_arch}") as refused:
        HFWeights(tmp_path, load_deck(TINY, sets).model)
    fix = re.search(r"; fix: (.*) \(or these keys", str(refused.value))
    assert fix is not None, str(refused.value)
    fixed = load_deck(TINY, (*sets, *fix.group(1).removeprefix("--set ").split(" --set ")))
    weights = HFWeights(tmp_path, fixed.model)  # accepted: the fix was the whole of it
    assert fixed.model.arch == hf_arch and all(weights.tensor(name).size for name in weights.sources)
