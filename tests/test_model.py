"""The GPT, its deterministic shard-local initialisation, the FLOP formula, the LR schedule."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from app.deck import ModelConfig, OptimConfig, load_deck
from app.metrics.flops import (
    gpt_hardware_step_flops,
    gpt_step_flops,
    megatron_recompute_step_flops,
    megatron_step_flops,
)
from app.metrics.peaks import peak_tflops
from app.model.gpt import GPT
from app.optim.optimizer import learning_rate
from app.sharding.init import ParamMeta, counter_normal

CFG = ModelConfig(vocab_size=97, seq_len=16, layers=2, hidden=32, heads=4)
CPU = torch.device("cpu")


def test_init_is_a_function_of_seed_and_name_only():
    a, b = GPT(CFG, seed=7), GPT(CFG, seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    c = GPT(CFG, seed=8)
    assert not torch.equal(a.wte.weight, c.wte.weight)
    # Two same-shaped parameters with different names get different values.
    assert not torch.equal(a.blocks["0"].attn.qkv.weight, a.blocks["1"].attn.qkv.weight)


@pytest.mark.parametrize("dim", [0, 1])
def test_a_shard_initialises_to_the_same_slice_of_the_full_tensor(dim):
    # What tensor parallelism will rely on: rank k materialises only its slice.
    meta = ParamMeta((12, 10), std=0.02)
    full = counter_normal(3, "blocks.0.mlp.fc.weight", meta, (12, 10), CPU)
    parts = 2 if dim == 0 else 5
    size = full.shape[dim] // parts
    for k in range(parts):
        offset = (k * size, 0) if dim == 0 else (0, k * size)
        local = (size, 10) if dim == 0 else (12, size)
        shard = counter_normal(3, "blocks.0.mlp.fc.weight", dataclasses.replace(meta, offset=offset), local, CPU)
        assert torch.equal(shard, full.narrow(dim, k * size, size))


def test_initial_values_of_a_range_equal_that_slice_of_the_shard():
    """What a ZeRO shard built from a meta model relies on: any flat range of a tp shard's
    values, computed alone, is bitwise the same slice of the whole shard's values (also across
    the generator's chunk boundaries: 2^16 elements on a CPU, 2^22 on an accelerator), and zeros/ones
    inits fill their range."""
    from app.sharding.init import initial_values

    shard = ParamMeta((64, 50), std=0.5, offset=(32, 10), shape=(32, 20))
    whole = counter_normal(5, "blocks.1.attn.qkv.weight", shard, (32, 20), CPU).reshape(-1)
    for lo, hi in ((0, 640), (5, 600), (19, 21), (639, 640)):
        assert torch.equal(initial_values(5, "blocks.1.attn.qkv.weight", shard, lo, hi, CPU), whole[lo:hi])
    long = ParamMeta(((1 << 22) + 300,), std=0.1)
    full = counter_normal(5, "wte.weight", long, long.local_shape, CPU)
    lo, hi = (1 << 22) - 100, (1 << 22) + 200
    assert torch.equal(initial_values(5, "wte.weight", long, lo, hi, CPU), full[lo:hi])
    assert torch.equal(initial_values(5, "ln.bias", ParamMeta((9,), init="zeros"), 2, 7, CPU), torch.zeros(5))
    assert torch.equal(initial_values(5, "ln.weight", ParamMeta((9,), init="ones"), 0, 9, CPU), torch.ones(9))


def _splitmix_normal(seed: int, name: str, index: int, std: float) -> float:
    """Element `index` (global, flat) of parameter `name`: app/sharding/init.py's docstring rule
    written again on Python ints (SplitMix64, two 53-bit uniforms, Box-Muller)."""
    import zlib

    mask, gamma = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    key = mix(((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)) * gamma & mask)

    def uniform(counter: int) -> float:
        return (mix((key + (counter + 1) * gamma) & mask) >> 11) * 2.0**-53

    u1, u2 = 1.0 - uniform(2 * index), uniform(2 * index + 1)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2 * math.pi * u2) * std


def test_initial_values_follow_the_documented_generator_element_by_element():
    """The generator itself, pinned: elements of a whole parameter, of a shard split along dim 0 (one
    run of global indices) and along dim 1 (rows of a run each), past the CPU chunk of 2^16 elements,
    equal the rule computed on Python ints. Tolerance: torch's vectorised float64 log/cos may differ
    from libm's in the last bit; rounded to float32 that is at most one float32 ulp (rel 1.2e-7)."""
    from app.sharding.init import initial_values

    cases = [
        (ParamMeta((97, 32), std=0.02), 0, 97 * 32),
        (ParamMeta((600, 300), std=0.5, offset=(300, 0), shape=(300, 300)), 65_000, 66_000),
        (ParamMeta((600, 300), std=0.5, offset=(0, 150), shape=(600, 150)), 65_000, 66_000),
    ]
    for meta, lo, hi in cases:
        got = initial_values(11, "blocks.0.mlp.fc.weight", meta, lo, hi, CPU)
        rows, cols = meta.local_shape
        for i in [*range(lo, lo + 40), *range(hi - 40, hi)]:
            index = (i // cols + meta.local_offset[0]) * meta.global_shape[1] + i % cols + meta.local_offset[1]
            want = _splitmix_normal(11, "blocks.0.mlp.fc.weight", index, meta.std)
            assert got[i - lo].item() == pytest.approx(want, rel=2.4e-7, abs=1e-12), (meta, i)


def test_counter_normal_has_the_requested_moments():
    values = counter_normal(1, "w", ParamMeta((400, 500), std=0.02), (400, 500), CPU)
    # 200k samples: the standard error of the std estimate is ~0.02 / sqrt(4e5) ~ 3e-5.
    assert abs(values.mean().item()) < 2e-4
    assert values.std().item() == pytest.approx(0.02, rel=5e-3)


def test_layout_and_special_inits():
    model = GPT(CFG, seed=1)
    block = model.blocks["0"]
    assert torch.equal(block.ln1.weight, torch.ones(32)) and torch.equal(block.attn.qkv.bias, torch.zeros(96))
    residual_std = block.attn.proj.weight.std().item()
    assert residual_std == pytest.approx(0.02 / math.sqrt(2 * CFG.layers), rel=0.15)
    assert not block.ln1.weight.meta.decay and block.mlp.fc.weight.meta.decay


def test_forward_shapes_causality_and_initial_loss():
    model = GPT(CFG, seed=1)
    tokens = torch.randint(0, CFG.vocab_size, (3, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (3, CFG.seq_len, CFG.vocab_size)
    # Changing a later token must not change earlier logits (causal attention).
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % CFG.vocab_size
    assert torch.allclose(model(changed)[:, :-1], logits[:, :-1], atol=1e-6)
    # Small init: predictions near uniform, loss near log(V).
    # (Random targets: with tied embeddings the input token itself is slightly favoured.)
    targets = torch.randint(0, CFG.vocab_size, tokens.shape, generator=torch.Generator().manual_seed(1))
    assert model.loss(tokens, targets).item() == pytest.approx(math.log(CFG.vocab_size), abs=0.1)


def test_parameter_count_is_the_sum_over_the_1_rank_model():
    for cfg in (CFG, dataclasses.replace(CFG, tie_embeddings=False, ffn_hidden=48)):
        assert GPT(cfg, seed=1).num_parameters() == sum(p.numel() for p in GPT(cfg, seed=1).parameters())


def test_parameter_count_matches_the_gpt2_formula():
    h, v, s, n = CFG.hidden, CFG.vocab_size, CFG.seq_len, CFG.layers
    per_layer = 12 * h * h + 13 * h  # qkv, proj, fc, proj weights + their biases + 2 LayerNorms
    assert GPT(CFG, seed=1).num_parameters() == v * h + s * h + n * per_layer + 2 * h
    untied = dataclasses.replace(CFG, tie_embeddings=False)
    assert GPT(untied, seed=1).num_parameters() == GPT(CFG, seed=1).num_parameters() + v * h


def test_megatron_flops_formula_against_a_hand_computed_value():
    # B=8, s=1024, l=24, h=2048, V=50304:
    # 72*8*1024*24*2048^2 = 59,373,627,899,904 ; 1 + 1024/12288 + 50304/589824 = 1.16861979...
    expected = 59_373_627_899_904 * (1 + 1024 / 12288 + 50304 / 589824)
    assert megatron_step_flops(8, 1024, 24, 2048, 50304) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(6.9385e13, rel=1e-4)


@pytest.mark.parametrize(
    "config,model,hardware",
    [
        # GPT-3 175B (l 96, h 12288, s 2048, V 51200 as in Megatron SC21), B = 1536:
        # 72*1536*2048*96*12288^2 = 3,283,124,128,353,091,584; 1 + 2048/73728 + 51200/14155776 = 1.0313947
        # -> 3.38620e18; recompute: x 96/72 and 1 + 2048/73728 + 51200/18874368 = 1.0304904 -> 4.51097e18.
        ((1536, 2048, 96, 12288, 51200), 3.38620e18, 4.51097e18),
        # Megatron's 1T (l 128, h 25600, s 2048, V 51200), B = 3072:
        # 72*3072*2048*128*25600^2 = 3.79991e19; 1 + 2048/153600 + 51200/39321600 = 1.0146354 -> 3.85553e19;
        # recompute: x 96/72 and 1 + 2048/153600 + 51200/52428800 = 1.0143099 -> 5.13905e19.
        ((3072, 2048, 128, 25600, 51200), 3.85553e19, 5.13905e19),
    ],
    ids=["gpt3-175b", "megatron-1t"],
)
def test_flops_of_published_configs_against_hand_values(config, model, hardware):
    b, s, n, h, v = config
    # The hand values above carry 6 significant digits.
    assert megatron_step_flops(*config) == pytest.approx(model, rel=2e-6)
    assert gpt_step_flops(*config, 4 * h) == pytest.approx(model, rel=2e-6)
    assert megatron_recompute_step_flops(*config) == pytest.approx(hardware, rel=2e-6)
    assert gpt_hardware_step_flops(*config, 4 * h, "full") == pytest.approx(hardware, rel=2e-6)
    # The causal convention halves the score and context GEMMs: 3 x 2 B s^2 h l fewer FLOPs.
    halved = gpt_step_flops(*config, 4 * h) - gpt_step_flops(*config, 4 * h, causal=True)
    assert halved == pytest.approx(6.0 * b * s * s * h * n, rel=1e-12)


def test_term_by_term_flops_equal_megatron_when_ffn_is_4h():
    assert gpt_step_flops(8, 1024, 24, 2048, 50304, 4 * 2048) == pytest.approx(
        megatron_step_flops(8, 1024, 24, 2048, 50304), rel=1e-12
    )
    assert gpt_step_flops(8, 1024, 24, 2048, 50304, 2048) < megatron_step_flops(8, 1024, 24, 2048, 50304)


def test_hardware_flops_add_what_recomputation_runs_again():
    args = (8, 1024, 24, 2048, 50304, 4 * 2048)
    assert gpt_hardware_step_flops(*args, "none") == gpt_step_flops(*args)
    # Full: one more forward of every layer = the SC21 96 * B s l h^2 (...) formula.
    assert gpt_hardware_step_flops(*args, "full") == pytest.approx(
        megatron_recompute_step_flops(8, 1024, 24, 2048, 50304), rel=1e-12
    )
    # Selective, by hand for B=2, s=8, l=3, h=16: the attention core's forward once more,
    # 4 s h per token and layer = 4 * B * s^2 * h * l = 4 * 2 * 64 * 16 * 3.
    small = (2, 8, 3, 16, 50, 40)
    assert gpt_hardware_step_flops(*small, "selective") - gpt_step_flops(*small) == 24_576
    with pytest.raises(ValueError, match="recompute='some'"):
        gpt_hardware_step_flops(*small, "some")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_hardware_flops_are_what_a_step_executes(arch, recompute, fused, dropout):
    """Found in review (2026-11-30): under full recomputation torch's checkpoint stops once the saved
    tensors are rebuilt, so a dense block's MLP output GEMM is not run again where it is a plain
    F.linear (its input was saved before it ran), and is where its weight gradient is fused (a
    custom function saves after its GEMM). step_flops counted it always: HFU read 1/12 high on CPU
    ranks. torch's FlopCounterMode over one micro-batch's forward and backward (the math attention,
    whose GEMMs it counts: full, backward 2 x forward, the convention) must equal step_flops'
    hardware FLOPs exactly; the model FLOPs are the recompute-free count. With dropout the output
    GEMM runs again fused or not: the dropout after it saves its mask (found in review, 2026-11-30)."""
    from torch.utils.flop_counter import FlopCounterMode

    from app.deck import resolve_for_world
    from app.metrics.flops import step_flops

    sets = ("parallel.dp=1", "model.attention_kernel=math", f"train.recompute={recompute}", "model.layers=2",
            "train.global_batch=2", "train.micro_batch=2", f"train.fuse_grad_accumulation={str(fused).lower()}",
            f"model.arch={arch}", f"model.dropout={dropout}")  # fmt: skip
    deck = resolve_for_world(load_deck("inputs/gpt_tiny.yaml", sets), 1)
    model = GPT(deck.model, seed=3, recompute=recompute)
    model.train()
    if fused:  # DataParallel's `wgrad_into`: the weight-gradient GEMM into an accumulator
        for p in model.parameters():
            if getattr(p, "wgrad_fusable", False):
                p.wgrad_into = lambda w, g, x: torch.mm(g, x)  # noqa: ARG005 (counted, then dropped)
    tokens = torch.randint(
        0, deck.model.vocab_size, (2, deck.model.seq_len), generator=torch.Generator().manual_seed(0)
    )
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens, tokens).backward()
    flops = step_flops(deck, gpu=False)
    assert counter.get_total_flops() == flops["hardware"], (counter.get_total_flops(), flops)
    assert recompute != "none" or flops["hardware"] == flops["model"]


def _loss_and_grads(recompute: str, cfg: ModelConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = GPT(cfg, seed=3, recompute=recompute)
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(11)  # dropout masks
    loss = model.loss(tokens, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_leaves_loss_and_gradients_bitwise_unchanged(recompute, dropout):
    # The recomputed forward runs the same ops on the same values, with the RNG state
    # restored for dropout, so nothing may differ, not even in the last bit.
    cfg = dataclasses.replace(CFG, dropout=dropout)
    want_loss, want_grads = _loss_and_grads("none", cfg)
    loss, grads = _loss_and_grads(recompute, cfg)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.parametrize(("recompute", "calls"), [("none", 2), ("full", 4), ("selective", 4)])
def test_recomputation_runs_the_attention_core_again_in_backward(monkeypatch, recompute, calls):
    import app.model.gpt as gpt

    count, core = [0], gpt._attention_core

    def counted(*args):
        count[0] += 1
        return core(*args)

    monkeypatch.setattr(gpt, "_attention_core", counted)
    _loss_and_grads(recompute, CFG)
    assert count[0] == calls  # 2 layers: once per layer in forward, once more in backward


def test_recomputation_is_off_outside_training_and_unknown_modes_are_refused():
    model = GPT(CFG, seed=3, recompute="full").eval()
    tokens = torch.zeros((1, CFG.seq_len), dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(model(tokens), GPT(CFG, seed=3).eval()(tokens))
    with pytest.raises(ValueError, match="recompute='attention'"):
        GPT(CFG, seed=3, recompute="attention")


def test_peak_table_knows_gpus_and_never_guesses_a_cpu():
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("AMD Instinct MI250X", "bf16") == 191.5  # per GCD: half of the 383 of a package
    assert peak_tflops("NVIDIA H200", "bf16") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA GH200 120GB", "bf16") == 989.0  # not the H100 or H200 entry
    # NVL cards: a lower peak than the SXM part whose name they contain, not sourced here: unknown
    assert peak_tflops("NVIDIA H100 NVL", "bf16") is None and peak_tflops("NVIDIA H200 NVL", "bf16") is None
    assert peak_tflops("NVIDIA H100 NVL", "bf16", override=835.0) == 835.0
    assert peak_tflops("AMD Instinct MI300X", "fp16") == pytest.approx(1307.4)
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "fp8") is None  # a precision not in the table: no guess
    assert peak_tflops("cpu") is None
    assert peak_tflops("cpu", override=1.5) == 1.5


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="cosine")
    lrs = [learning_rate(cfg, s, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] == pytest.approx(0.1)
    linear = dataclasses.replace(cfg, schedule="linear")
    assert learning_rate(linear, 12, 20) == pytest.approx(0.1 + 0.9 * (1 - 8 / 15))
    assert learning_rate(dataclasses.replace(cfg, schedule="constant"), 15, 20) == 1.0
    # One decay step (steps = warm-up + 1): it is the last, at min_lr (it ran at the peak, found in review).
    for schedule in ("cosine", "linear"):
        assert learning_rate(dataclasses.replace(cfg, schedule=schedule), 4, 5) == pytest.approx(0.1)


def test_mean_step_time_leaves_out_warmup_only_when_steps_remain():
    from app.metrics.report import mean_step_time

    assert mean_step_time([9.0, 9.0, 1.0, 3.0], 2) == (2.0, pytest.approx(2**0.5), 2)
    assert mean_step_time([4.0, 2.0], 2) == (3.0, pytest.approx(2**0.5), 0)


@pytest.mark.parametrize("kernel", ["math", "flash"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_chosen_attention_kernel_computes_the_same_attention(recompute, kernel):
    """model.attention_kernel=math (scores materialised, to reproduce 2021 runs) or flash (one
    backend chosen, as cudnn and efficient are on GPUs) is the same function as torch's default
    kernel: fp32, equal up to summation order. Measured (math): 1e-7 relative on the loss and 6e-8
    absolute on gradients (the largest 0.4); we allow 1e-5 on both, 100x above that, while a wrong
    mask or scale moves the loss at the 1e-2 level."""
    want_loss, want_grads = _loss_and_grads(recompute, CFG)
    loss, grads = _loss_and_grads(recompute, dataclasses.replace(CFG, attention_kernel=kernel))
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    for name, grad in grads.items():
        assert (grad - want_grads[name]).abs().max().item() < 1e-5, name


@pytest.mark.parametrize(
    "arch", [("model.arch=gpt2",), ("model.arch=llama", "model.kv_heads=2")], ids=["gpt2", "llama"]
)
def test_the_flop_count_is_what_the_model_multiplies(arch):
    """`gpt_step_flops` (with `arch_flops_args`: llama's grouped-query QKV and three SwiGLU matrices)
    against torch's FLOP counter on a real forward: the Linears and the head exactly. The counter
    leaves out the CPU attention kernel, so the formula's attention term (4 s h per token and layer)
    is taken off first. A wrong QKV width (3h under GQA) or a two-matrix MLP under llama misses by
    thousands of FLOPs per token."""
    from torch.utils.flop_counter import FlopCounterMode

    from app.metrics.flops import arch_flops_args

    b, s, layers, h, v, f = 3, 16, 2, 64, 128, 96
    sizes = (f"model.hidden={h}", "model.heads=4", f"model.seq_len={s}", f"model.vocab_size={v}",
             f"model.layers={layers}", f"model.ffn_hidden={f}")  # fmt: skip
    m = load_deck(None, (*arch, *sizes)).model
    model = GPT(m, seed=1)
    tokens = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens, tokens)
    attention = b * s * layers * 4 * s * h
    assert counter.get_total_flops() == gpt_step_flops(b, s, layers, h, v, f, **arch_flops_args(m)) / 3 - attention


@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
def test_a_kernel_the_device_lacks_is_a_deck_error_before_the_first_step(kernel):
    """cudnn and efficient have no CPU kernel: check_attention_kernel (the trainer calls it before
    building the model) names the key, the device, dtype and head size and the fix, where torch
    would fail inside the first forward; flash, math and auto pass."""
    from app.errors import DeckError
    from app.model.gpt import check_attention_kernel

    with pytest.raises(DeckError) as err:
        check_attention_kernel(dataclasses.replace(CFG, attention_kernel=kernel), torch.device("cpu"), torch.float32)
    message = str(err.value)
    assert (
        f"model.attention_kernel = '{kernel}'" in message
        and f"(cpu, float32, head size {CFG.hidden // CFG.heads})" in message
    )
    assert "use auto" in message
    for fine in ("auto", "flash", "math"):
        check_attention_kernel(dataclasses.replace(CFG, attention_kernel=fine), torch.device("cpu"), torch.float32)
