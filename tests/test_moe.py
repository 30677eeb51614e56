"""Mixture of experts (`app/model/moe.py`): a model whose blocks route tokens to experts equals one
written here from the formulas, loss and gradients; capacity drops the same tokens; the deck
refuses what does not run yet; a run logs the routers' losses.

The reference (`reference_moe`) computes each token's output as the weighted sum of its top-k
experts' MLPs expert by expert (index_add over the tokens each expert got), in fp32 like the model:
the two differ only in summation order, about 1e-7 relative, so losses and gradients are compared
within 1e-6 (relative on the loss, absolute on gradients of magnitude ~1e-2). A wrong weight, a
token sent to the wrong expert or a missing aux-loss gradient moves them by 1e-3 or more.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from app.deck import load_deck, resolve_for_world
from app.errors import DeckError
from app.model.gpt import GPT, swiglu
from app.model.moe import MoE
from conftest import REPO, read_metrics, run_app

TOL = 1e-6
SMALL = ("model.vocab_size=64", "model.seq_len=16", "model.layers=3", "model.hidden=32", "model.heads=4",
         "model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=24", "model.moe_aux_loss_coef=0.1",
         "model.moe_z_loss_coef=0.01", "model.moe_every=2", "model.moe_shared_experts=1")  # fmt: skip


def reference_moe(m: MoE, x: torch.Tensor, gated: bool, capacity: int | None = None):
    """(y, coef_aux x aux + coef_z x z) of MoE layer `m` on x (B, S, h), from the formulas."""
    t = x.reshape(-1, x.shape[-1])
    n, k, n_experts = t.shape[0], m.top_k, m.experts
    logits = t @ m.router.weight.t()
    p = torch.softmax(logits, dim=-1)
    w, e = torch.topk(p, k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(t)
    for expert in range(n_experts):
        rows, which = (e == expert).nonzero(as_tuple=True)  # row-major: token order
        if capacity is not None:
            rows, which = rows[:capacity], which[:capacity]  # later tokens over capacity are dropped
        if rows.numel() == 0:
            continue
        h = t[rows] @ m.fc.weight[expert].t() + (m.fc.bias[expert] if m.bias else 0)
        a = swiglu(h) if gated else F.gelu(h, approximate="tanh")
        o = a @ m.proj.weight[expert].t() + (m.proj.bias[expert] if m.bias else 0)
        out = out.index_add(0, rows, o * w[rows, which].unsqueeze(1))
    if m.shared is not None:  # the shared experts: a dense MLP on every token
        fc, proj = m.shared.fc, m.shared.proj
        h = t @ fc.weight.t() + (fc.bias if m.bias else 0)
        a = swiglu(h) if gated else F.gelu(h, approximate="tanh")
        out = out + a @ proj.weight.t() + (proj.bias if m.bias else 0)
    f = torch.bincount(e.reshape(-1), minlength=n_experts).float() / (n * k)
    aux = n_experts * (f * p.mean(dim=0)).sum()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return out.view_as(x), m.aux_coef * aux + m.z_coef * z


def _loss_and_grads(model: GPT, tokens, targets, reference: bool, capacity_factor=None):
    """The model's loss with its routers' losses added, and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    stats = model.router_stats
    stats.reset()
    stats.scale = 1.0
    extras = []
    moes = [mod for mod in model.modules() if isinstance(mod, MoE)]
    if reference:
        for mod in moes:
            cap = mod.capacity(tokens.numel())

            def forward(x, mod=mod, cap=cap):
                y, extra = reference_moe(mod, x, model.cfg.spec.gated, cap)
                extras.append(extra)
                return y

            mod.forward = forward
    loss = model.loss(tokens, targets)
    total = loss + sum(extras) if reference else loss
    total.backward()
    if reference:
        for mod in moes:
            del mod.forward
        value = float(total.detach())
    else:
        # The model's loss, and the routers' losses it added in backward (the same coefficients in every layer).
        value = float(loss.detach()) + moes[0].aux_coef * float(stats.aux) + moes[0].z_coef * float(stats.z)
    return value, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "capacity0.75"])
def test_the_moe_model_equals_one_written_from_the_formulas(arch, capacity_factor):
    """1 rank: a 3-block model with experts in blocks 0 and 2 (moe_every 2) and a shared expert,
    gpt2's GELU experts with biases and llama's SwiGLU ones without; dropless and with a capacity
    factor of 0.75 (so that some assignments are dropped): the loss with the routers' losses, and
    every gradient, within TOL."""
    sets = (*SMALL, f"model.arch={arch}", *(() if capacity_factor is None else
            (f"model.moe_capacity_factor={capacity_factor}",)))  # fmt: skip
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", sets)
    torch.manual_seed(0)
    model = GPT(deck.model, seed=7)
    assert [i for i, b in model.blocks.items() if isinstance(b.mlp, MoE)] == ["0", "2"]
    tokens = torch.randint(0, 64, (4, 16))
    targets = torch.randint(0, 64, (4, 16))
    ours, ours_grads = _loss_and_grads(model, tokens, targets, reference=False)
    dropped = float(model.router_stats.dropped)
    ref, ref_grads = _loss_and_grads(model, tokens, targets, reference=True)
    assert ours == pytest.approx(ref, rel=TOL)
    assert (dropped > 0) == (capacity_factor is not None)
    for name, g in ref_grads.items():
        torch.testing.assert_close(ours_grads[name], g, rtol=0, atol=TOL, msg=name)
    # The router's gradient includes the load-balancing and z-losses': without them it differs.
    router = "blocks.0.mlp.router.weight"
    for mod in model.modules():
        if isinstance(mod, MoE):
            mod.aux_coef = mod.z_coef = 0.0
    _, bare = _loss_and_grads(model, tokens, targets, reference=False)
    assert (bare[router] - ours_grads[router]).abs().max() > 100 * TOL


def test_capacity_keeps_the_first_tokens_of_each_expert():
    """ceil(F x tokens x top_k / experts) slots per expert; the assignments beyond, by token order,
    are dropped and counted."""
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", (*SMALL, "model.moe_capacity_factor=0.5"))
    model = GPT(deck.model, seed=3)
    mod = model.blocks["0"].mlp
    assert isinstance(mod, MoE) and mod.capacity(64) == math.ceil(0.5 * 64 * 2 / 4) == 16
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.router_stats.reset()
        y = mod(x)
        ref, _ = reference_moe(mod, x, False, 16)
    torch.testing.assert_close(y, ref, rtol=0, atol=TOL)


def test_evaluation_and_decoding_route_every_token_whatever_the_capacity():
    """Found in review (2026-11-30): the capacity dropped tokens in evaluation and generation too, so a
    sample's logits depended on the other samples of its batch and differed from the exported Mixtral
    (dropless) by 3.9 on a 3.8 scale. In eval mode the layer is the dropless reference, and a batch
    gives each sample's own logits (within fp32 summation order)."""
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", (*SMALL, "model.moe_capacity_factor=0.5"))
    model = GPT(deck.model, seed=3).eval()
    mod = model.blocks["0"].mlp
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, deck.model.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.router_stats.reset()
        y = mod(x)
        ref, _ = reference_moe(mod, x, False, None)
        torch.testing.assert_close(y, ref, rtol=0, atol=TOL)
        batched = model(tokens)
        alone = torch.cat([model(tokens[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_flops_count_the_active_parameters():
    """The step's model FLOPs of a mixture of experts: a Linear weight's 6 FLOPs per token (forward 2,
    backward 4) over the parameters a token runs through (the router and its top-k experts:
    `Arch.active_params`), so the MoE model's count exceeds its dense twin's (the same deck with
    dense MLPs) by 6 x tokens x the difference of their active parameters (llama: no biases, the
    norms the same); full recomputation runs the experts' forward again (a third more)."""
    from app.metrics.flops import step_flops

    sets = (*SMALL, "model.arch=llama", "model.moe_every=1")
    moe = load_deck(REPO / "inputs/gpt_tiny.yaml", sets)
    dense = load_deck(REPO / "inputs/gpt_tiny.yaml", (*sets, "model.moe_experts=0"))
    tokens = moe.train.global_batch * moe.model.seq_len
    active = moe.model.spec.active_params(moe.model)
    assert active < moe.model.spec.num_params(moe.model)
    delta = 6 * tokens * (active - dense.model.spec.num_params(dense.model))
    assert step_flops(moe)["model"] - step_flops(dense)["model"] == pytest.approx(delta, rel=1e-12)
    full = load_deck(REPO / "inputs/gpt_tiny.yaml", (*sets, "train.recompute=full"))
    dense_full = load_deck(REPO / "inputs/gpt_tiny.yaml", (*sets, "model.moe_experts=0", "train.recompute=full"))
    extra = step_flops(full)["hardware"] - step_flops(dense_full)["hardware"]
    assert extra == pytest.approx(delta * 4 / 3, rel=1e-12)


@pytest.mark.parametrize(
    "sets,key",
    [
        (("model.moe_experts=1",), "model.moe_experts"),
        (("model.moe_experts=4", "model.moe_top_k=5"), "model.moe_top_k"),
        (
            ("model.moe_experts=4", "parallel.tp=2", "parallel.sequence_parallel=true", "model.moe_capacity_factor=1"),
            "model.moe_capacity_factor",
        ),
    ],
)
def test_the_deck_refuses_what_moe_does_not_run_yet(sets, key):
    with pytest.raises(DeckError, match=key.replace(".", r"\.")):
        load_deck(REPO / "inputs/gpt_tiny.yaml", sets)


@pytest.mark.parametrize(
    "sets,world,message",
    [
        (("parallel.ep=2",), 4, "expert parallelism splits a mixture of experts: set model.moe_experts"),
        (("model.moe_experts=6", "parallel.ep=4"), 4, "must divide model.moe_experts = 6"),
        (("model.moe_experts=4", "parallel.ep=4", "parallel.tp=2"), 4, r"ep must divide dp = 2"),
    ],
)
def test_the_deck_refuses_an_ep_that_does_not_split_the_experts_or_dp(sets, world, message):
    """parallel.ep: only with experts, dividing their number (load) and dp (resolved for the world)."""
    with pytest.raises(DeckError, match=message) as err:
        resolve_for_world(load_deck(REPO / "inputs/gpt_tiny.yaml", sets), world)
    assert err.value.key == "parallel.ep"


def test_moe_tiny_trains_and_logs_the_routers_losses(tmp_path):
    """inputs/moe_tiny.yaml, 6 steps on one rank: the loss falls, each record carries the routers'
    losses (aux near 1 for a balanced router: E sum f P with f, P ~ 1/E) and no drops (dropless).
    Its checkpoint (gpt2 blocks with experts) has no Hugging Face form: export says so."""
    from app.checkpoint.export import export_hf
    from app.errors import CheckpointError

    out = run_app(1, "inputs/moe_tiny.yaml", "--set", "train.steps=6", "--set", "run.log_every=1", "--set",
                  f"run.dir={tmp_path}", "--set", "checkpoint.every=0", timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert len(records) == 6 and records[-1]["loss"] < records[0]["loss"]
    assert all(0.9 < r["moe_aux_loss"] < 2.0 and r["moe_z_loss"] > 0 and r["moe_dropped"] == 0 for r in records)
    assert " | aux " in out.stdout + out.stderr
    with pytest.raises(CheckpointError, match="model.arch gpt2 has no Hugging Face form with experts"):
        export_hf(tmp_path / "checkpoints" / "step_0000006.h5", tmp_path / "hf")


def test_a_mixtral_directory_names_the_expert_keys_a_dense_deck_lacks(tmp_path):
    """run.init_from with a Mixtral config.json and a dense llama deck: refused with the keys that fix
    it (the experts, their width); a Mixtral into a deck with experts every second block: refused."""
    from app.checkpoint.hf_import import check_config
    from app.errors import CheckpointError

    config = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "num_local_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    dense = load_deck(REPO / "inputs/gpt_tiny.yaml", (*SMALL[:5], "model.arch=llama", "model.kv_heads=2"))
    with pytest.raises(CheckpointError) as err:
        check_config(tmp_path, config, dense.model)
    assert "--set model.moe_experts=4" in str(err.value) and "--set model.moe_ffn_hidden=24" in str(err.value)
    sets = (*SMALL, "model.arch=llama", "model.kv_heads=2", "model.moe_ffn_hidden=24", "model.moe_shared_experts=0")
    every2 = load_deck(REPO / "inputs/gpt_tiny.yaml", sets)
    with pytest.raises(CheckpointError, match="model.moe_every is 2: set it to 1"):
        check_config(tmp_path, config, every2.model)
    ok = load_deck(REPO / "inputs/gpt_tiny.yaml", (*sets, "model.moe_every=1"))
    check_config(tmp_path, config, ok.model)
    shared = load_deck(REPO / "inputs/gpt_tiny.yaml", (*sets, "model.moe_every=1", "model.moe_shared_experts=1"))
    with pytest.raises(CheckpointError, match="no shared experts"):
        check_config(tmp_path, config, shared.model)
    # sliding_window: null or a window as long as a sample is full causal attention, as gridlm's;
    # a shorter one, or not a positive integer, is refused in one line (a string was a TypeError).
    check_config(tmp_path, {**config, "sliding_window": 4096}, ok.model)
    for window, said in ((4, "sliding_window 4 < model.seq_len"), ("4096", "is not null or a positive integer")):
        with pytest.raises(CheckpointError, match=said):
            check_config(tmp_path, {**config, "sliding_window": window}, ok.model)


def test_the_exported_router_aux_loss_coef_weighs_mixtrals_balancing_loss_as_gridlm_does(tmp_path):
    """A Mixtral of 4 layers, top-2, in gridlm and in Hugging Face with the same weights: HF's balancing
    term (router_aux_loss_coef x its aux_loss, pooled over the layers, f_e a share of the tokens) equals
    gridlm's (model.moe_aux_loss_coef x the per-layer sum, f_e a share of the assignments) with the
    exported coefficient, within 5% (only the pooling over layers differs: random routers are alike).
    The deck's coefficient copied as it was (before the fix) weighs HF's term layers / top_k = 2x less."""
    import transformers

    from app.archs.llama import hf_config
    from app.checkpoint.hf_import import HFWeights, model_section

    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rope_theta=10000.0, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(config)
    hf.save_pretrained(tmp_path)
    sets = (*SMALL[:5], "model.layers=4", "model.arch=llama", "model.kv_heads=2", "model.rope_theta=10000",
            "model.moe_every=1", "model.moe_shared_experts=0", "model.moe_aux_loss_coef=0.01")  # fmt: skip
    m = load_deck(REPO / "inputs/gpt_tiny.yaml", (*SMALL[5:], *sets)).model
    model = GPT(m, seed=0)
    weights = HFWeights(tmp_path, m)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(weights.tensor(name)).view(p.shape))
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    model(tokens)
    ours = m.moe_aux_loss_coef * model.router_stats.aux.item()
    section = {**dataclasses.asdict(m), **model_section(m)}  # as a checkpoint's (io.model_section)
    exported = hf_config(section)["router_aux_loss_coef"]
    with torch.no_grad():
        theirs = hf(input_ids=tokens, output_router_logits=True).aux_loss.item()
    assert exported * theirs == pytest.approx(ours, rel=0.05)
    assert m.moe_aux_loss_coef * theirs == pytest.approx(ours / 2, rel=0.05)  # the copied coefficient's


def test_the_plans_stage_flops_divide_the_experts_by_tp_under_sequence_parallelism():
    """Under SP each tp rank routes its shard's tokens, so the experts' GEMMs per rank are 1/tp of tp 1's
    (app/model/moe.py; perf.py's step time counts so); without SP every tp rank runs them whole. The
    dense part divides by tp either way. Found in review: the stage estimate (its balance check and
    stage_layers advice) counted the experts whole under SP too."""
    from app.plan.estimate import estimate_stages

    def stage_flops(*sets: str) -> float:
        deck = resolve_for_world(load_deck(REPO / "inputs/moe_tiny.yaml", sets), 2 if "parallel.tp=2" in sets else 1)
        return estimate_stages(deck)[0].flops_per_micro_batch

    one, whole, split = (stage_flops(*s) for s in ((), ("parallel.tp=2",),
                                                    ("parallel.tp=2", "parallel.sequence_parallel=true")))  # fmt: skip
    assert split == pytest.approx(one / 2, rel=1e-9)  # everything split over tp
    assert whole > split * 1.2  # the experts whole on each tp rank without SP


def test_the_experts_backward_writes_bytes_linear_in_the_number_of_experts():
    """Found in review (2026-12-02): each expert indexed its matrices out of the stacked (E, out, in)
    tensors (weight[e]), and every index's backward wrote a zero gradient of the whole stack: E^2
    bytes (64 experts: 16.6 GiB allocated in one backward, 2 s). With one unbind per matrix the
    bytes the backward's ops write grow as the experts' weights do, 8x from 4 to 32 experts at the
    same tokens (the indexing wrote 22.8x; measured 3.2x now)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from app.deck import ModelConfig

    class Written(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
            return out

    def backward_bytes(experts: int) -> int:
        cfg = ModelConfig(vocab_size=64, seq_len=64, layers=1, hidden=64, heads=4, moe_experts=experts,
                          moe_top_k=2, moe_ffn_hidden=64)  # fmt: skip
        moe = next(m for m in GPT(cfg, seed=1).modules() if isinstance(m, MoE))
        y = moe(torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(0)))
        with Written() as written:
            y.sum().backward()
        return written.bytes

    few, many = backward_bytes(4), backward_bytes(32)
    print(f"backward bytes written: {few:,} at 4 experts, {many:,} at 32 ({many / few:.1f}x)")
    assert many <= 8 * few, (few, many)
