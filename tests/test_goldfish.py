"""The Goldfish loss mask (app/model/goldfish.py): the authors' hash-table rule (the default) on
fixed cases computed from their published rule and against a transcription of it in torch,
gridlm's earlier splitmix rule against a direct implementation, the loss against a naive masked
mean, the deck's checks, and a training run on a known text that counts exactly the targets the
rule keeps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from app.deck import ModelConfig, load_deck
from app.errors import DeckError
from app.model.goldfish import GOLDFISH_SEED, CountedTargets, goldfish_keep
from app.model.gpt import GPT
from conftest import REPO, read_metrics, run_app

MASK64 = (1 << 64) - 1


def naive_mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int, wrapping by hand (the module docstring's rule)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def naive_keep(targets: list[int], k: int, h: int) -> list[bool]:
    """The rule, one target at a time: the first h count; then drop when the hash of the h
    targets before it is 0 mod k."""
    keep = []
    for i in range(len(targets)):
        if i < h:
            keep.append(True)
            continue
        acc = GOLDFISH_SEED
        for token in targets[i - h : i]:
            acc = naive_mix64(acc ^ token)
        keep.append(acc % k != 0)
    return keep


@pytest.mark.parametrize("k, h, vocab", [(2, 1, 7), (3, 4, 64), (4, 13, 50257), (7, 5, 2**24)])
def test_mask_equals_a_direct_implementation_of_the_rule(k, h, vocab):
    rng = np.random.default_rng(k * 100 + h)
    targets = torch.from_numpy(rng.integers(0, vocab, size=(3, 40)))
    keep = goldfish_keep(targets, k, h, "splitmix")
    assert keep.dtype == torch.bool and keep.shape == targets.shape
    want = [naive_keep(row.tolist(), k, h) for row in targets]
    assert keep.tolist() == want
    assert keep[:, :h].all()  # the first h targets of a sample always count
    assert not keep.all()  # some are dropped: the comparison is not vacuous


def published_keep(targets: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """The authors' `apply_goldfish(strategy="hash-table")` (github.com/ahans30/goldfish-loss,
    lit_gpt/utils.py) transcribed from its description in torch: a table of 1,000,003 torch.rand
    values after manual_seed(2971215073) on the CPU; the key of the window of h targets ending at
    each target is their product (torch.prod, int64) % 1,000,003; dropped where table[key] < 1/k;
    the first h - 1 targets are never dropped."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(2971215073)
    table = torch.rand(1_000_003, generator=generator)
    dropped = table[targets.unfold(1, h, 1).prod(dim=-1) % 1_000_003] < 1 / k
    keep = torch.ones_like(targets, dtype=torch.bool)
    keep[:, h - 1 :][dropped] = False
    return keep


# Fixed cases, computed once from the published rule (above): (targets, k, h, kept).
PUBLISHED = [
    (list(range(1, 33)), 4, 4, "11111110111100111110111110110111"),
    ([50256, 464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 198, 464, 2068, 7586, 21831], 4, 3,
     "1111011010101010"),
]  # fmt: skip


@pytest.mark.parametrize("targets, k, h, kept", PUBLISHED)
def test_the_default_mask_is_the_authors_hash_table_rule_on_fixed_cases(targets, k, h, kept):
    from app.model.goldfish import hash_table

    keep = goldfish_keep(torch.tensor([targets]), k, h)
    assert "".join("1" if x else "0" for x in keep[0].tolist()) == kept
    assert hash_table()[:3].tolist() == pytest.approx(
        [0.23368388414382935, 0.4412640333175659, 0.7411476969718933], abs=0
    )


@pytest.mark.parametrize("k, h, vocab", [(4, 13, 50257), (3, 4, 64), (2, 1, 7), (8, 6, 2**31 - 1)])
def test_the_default_mask_equals_the_published_rule_bit_for_bit(k, h, vocab):
    """On random targets, products that wrap past 2^63 included (h = 13 of ids up to 50256): the
    mask is the published rule's, position for position; the first h - 1 always count."""
    rng = np.random.default_rng(k * 1000 + h)
    targets = torch.from_numpy(rng.integers(0, vocab, size=(4, 300)))
    keep = goldfish_keep(targets, k, h)
    assert torch.equal(keep, published_keep(targets, k, h))
    assert keep[:, : h - 1].all() and not keep.all()


def test_changing_a_target_flips_its_own_decision_in_about_a_third_of_cases():
    """The window ends at the target (the authors'); the splitmix rule hashes the targets before it
    only, so changing a target never changes its own decision there (the issue's 37.5% vs 0%)."""
    rng = np.random.default_rng(5)
    k, h = 4, 13
    targets = torch.from_numpy(rng.integers(0, 50257, size=(2000, 40)))
    changed = targets.clone()
    changed[:, 30] = (changed[:, 30] + 1 + torch.from_numpy(rng.integers(0, 1000, size=2000))) % 50257
    for rule, low, high in (("hash-table", 0.3, 0.45), ("splitmix", 0.0, 0.0)):
        a, b = goldfish_keep(targets, k, h, rule)[:, 30], goldfish_keep(changed, k, h, rule)[:, 30]
        rate = (a != b).float().mean().item()
        assert low <= rate <= high, (rule, rate)


def test_mask_drops_about_one_in_k_and_follows_the_passage_not_its_position():
    rng = np.random.default_rng(0)
    k, h = 4, 13
    targets = torch.from_numpy(rng.integers(0, 50257, size=(8, 4096)))
    dropped = (~goldfish_keep(targets, k, h))[:, h:].float().mean().item()
    assert dropped == pytest.approx(1 / k, abs=0.01)  # 32,664 hashed targets: 1/k within ~4 sigma
    # The same passage at another offset in another sample is masked the same way after its first h
    # tokens: the hash sees only the passage (what makes verbatim recall impossible, Hans et al.).
    passage = targets[0, :200]
    shifted = torch.cat([targets[1, :37], passage]).unsqueeze(0)
    a, b = goldfish_keep(passage.unsqueeze(0), k, h)[0, h:], goldfish_keep(shifted, k, h)[0, 37 + h :]
    assert torch.equal(a, b)


def test_mask_rejects_k_below_2():
    with pytest.raises(ValueError, match="k >= 2"):
        goldfish_keep(torch.zeros(1, 8, dtype=torch.int64), 1, 3)


def test_counted_targets_loss_is_the_masked_mean_over_the_counted_targets():
    cfg = ModelConfig(vocab_size=64, seq_len=32, layers=2, hidden=32, heads=4)
    model = GPT(cfg, seed=5)
    rng = np.random.default_rng(1)
    tokens = torch.from_numpy(rng.integers(0, 64, size=(2, 33)))
    x, y = tokens[:, :-1], tokens[:, 1:]
    keep = goldfish_keep(y, 3, 6)
    counted = int(keep.sum())
    assert 0 < counted < y.numel()
    with torch.no_grad():
        logits = model(x)
        per_token = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1), reduction="none").view(y.shape)
        naive = per_token[keep].sum() / counted
        # One micro-batch holding the whole batch: weight M / N = 1 / counted.
        loss = model.loss(x, CountedTargets(y, keep.float() / counted))
        plain = model.loss(x, y)
    # fp32 sums of 64 terms in another order: a few ulps.
    assert loss.item() == pytest.approx(naive.item(), rel=1e-6)
    assert plain.item() == pytest.approx(per_token.mean().item(), rel=1e-6)
    assert abs(loss.item() - plain.item()) > 1e-4  # dropping targets changes the loss: not vacuous


@pytest.mark.parametrize(
    "sets, key, match",
    [
        (("train.goldfish_k=1",), "train.goldfish_k", "k = 1 would drop every target"),
        (("train.goldfish_k=4", "train.goldfish_context=64"), "train.goldfish_context", "below model.seq_len = 64"),
    ],
)
def test_deck_refuses_goldfish_settings_that_drop_all_or_nothing(sets, key, match):
    with pytest.raises(DeckError, match=match) as err:
        load_deck(REPO / "inputs/gpt_tiny.yaml", sets)
    assert err.value.key == key


def write_tokens(prefix, documents: list[list[int]], vocab_size: int = 257) -> None:
    """A gridlm token file (app/data/memmap.py's format) holding `documents`, each ended by EOS 256."""
    ids = [t for doc in documents for t in (*doc, 256)]
    offsets = np.cumsum([0] + [len(doc) + 1 for doc in documents]).astype(np.int64)
    np.asarray(ids, dtype="<u2").tofile(f"{prefix}.bin")
    np.save(f"{prefix}.idx.npy", offsets)
    meta = {"format": "gridlm-tokens", "version": 1, "dtype": "uint16", "vocab_size": vocab_size,
            "num_tokens": len(ids), "num_documents": len(documents), "tokenizer": "byte", "eos": 256,
            "max_token_id": max(ids)}  # fmt: skip
    with open(f"{prefix}.json", "w") as f:
        json.dump(meta, f)


def test_training_on_a_known_text_counts_exactly_the_targets_the_rule_keeps(tmp_path):
    from app.data.memmap import MemmapTokens

    text = ("Be like a goldfish, don't memorize! " * 40).encode()
    prefix = str(tmp_path / "known")
    write_tokens(prefix, [list(text)])
    seq, batch, k, h = 32, 8, 3, 5
    run_dir = tmp_path / "run"
    out = run_app(
        2, "inputs/gpt_tiny.yaml",
        "--set", "data.kind=memmap", "--set", f"data.path={prefix}", "--set", "model.vocab_size=320",
        "--set", f"model.seq_len={seq}", "--set", "model.layers=2", "--set", "model.hidden=32",
        "--set", "model.heads=4", "--set", f"train.global_batch={batch}", "--set", "train.micro_batch=2",
        "--set", "train.steps=2", "--set", "run.log_every=1", "--set", f"train.goldfish_k={k}",
        "--set", f"train.goldfish_context={h}", "--set", f"run.dir={run_dir}", "--set", "checkpoint.at_exit=false",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    data = MemmapTokens(prefix, seq, 320, seed=1234)  # gpt_tiny's train.seed: the run's sample order
    records = read_metrics(run_dir)
    for step, record in enumerate(records):
        samples = np.stack([data.sample(i) for i in range(step * batch, (step + 1) * batch)])
        want = int(published_keep(torch.from_numpy(samples[:, 1:].astype(np.int64)), k, h).sum())
        assert record["loss_tokens"] == want
        assert f"loss {record['loss']:.4f} on {want:,}/{batch * seq:,} targets" in out.stdout
    assert records[0]["loss_tokens"] < batch * seq  # it dropped some
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["goldfish"]["counted_targets"] == sum(r["loss_tokens"] for r in records)
    assert summary["goldfish"]["targets"] == 2 * batch * seq
