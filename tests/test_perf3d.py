"""The performance model of 3D tensor parallelism (`parallel.tensor`, AxoNN's X x Y x Z split):
message volumes per sub-axis against AxoNN's per-layer formulas, the degenerate shapes against
the 1D model, the sub-axes' links, and the search over 1D and 3D. Serial, pure Python."""

from __future__ import annotations

import dataclasses

import pytest

from app.deck import load_deck, resolve_for_world
from app.plan.machine import load_machine
from app.plan.perf import (
    Overlap3D,
    _layer_passes3d,
    axis_links3d,
    device_of,
    linears3d,
    predict,
    stage_params3d,
    step_messages,
    tp3d_collectives,
)
from app.plan.search import _rank_shapes, format_text, search
from app.runtime.grid import GridLayout
from conftest import REPO

TINY = REPO / "inputs/gpt_tiny.yaml"
AXONN_5B = REPO / "inputs/axonn/gpt_5b.yaml"


def _deck(path, world: int, *sets: str):
    return resolve_for_world(load_deck(path, ("parallel.dp=auto", *sets)), world)


def _tensor(shape: tuple[int, int, int]) -> str:
    return "parallel.tensor=[" + ",".join(map(str, shape)) + "]"


def _axonn_block(h: int, f: int, tokens: int, e: int, shape: tuple[int, int, int]) -> dict[tuple[str, str], float]:
    """One block's bytes per micro-batch by (sub-axis, op), from AxoNN's per-layer formulas (Singh et al.,
    "A 4D hybrid algorithm...", the 3D tensor-parallel layer): a Linear y = x W with W of k x n split
    (k / Gx, n / Gy) on the A layout ((k / Gy, n / Gx) on B), each block sharded over Gz:
    all-gather and reduce-scatter over Z of k n / (Gx Gy) elements, forward all-reduce of m n / Gy
    over X and backward all-reduce of m k / Gx over Y (A; X and Y swapped on B), m this rank's
    tokens. Plus LayerNorm3D's statistics: 2 x 2 fp32 all-reduces over X per LayerNorm."""
    x, y, _ = shape
    # (k, n, layout A?) of qkv, attn.proj, mlp.fc, mlp.proj
    linears = [(h, 3 * h, True), (h, h, False), (h, f, True), (f, h, False)]
    out: dict[tuple[str, str], float] = {}

    def add(axis, op, n):
        out[(axis, op)] = out.get((axis, op), 0.0) + n

    for k, n, a in linears:
        add("tp_z", "all_gather", 2 * k * n / (x * y) * e)  # forward, and again in backward
        add("tp_z", "reduce_scatter", k * n / (x * y) * e)
        if a:
            add("tp_x", "all_reduce", tokens * n / y * e)
            add("tp_y", "all_reduce", tokens * k / x * e)
        else:
            add("tp_y", "all_reduce", tokens * n / x * e)
            add("tp_x", "all_reduce", tokens * k / y * e)
    add("tp_x", "all_reduce", 2 * 2 * 2 * tokens * 4.0)  # two LayerNorms, forward and backward
    return out


def _sum(items) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for axis, op, n in items:
        out[(axis, op)] = out.get((axis, op), 0.0) + n
    return out


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4, 1), (1, 2, 4), (4, 1, 2), (2, 2, 1)])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_block_volumes_per_sub_axis_are_axonn_s_formulas(shape, precision):
    x, y, z = shape
    deck = _deck(TINY, 2 * x * y * z, f"parallel.tp={x * y * z}", _tensor(shape), f"train.precision={precision}",
                 "train.global_batch=64")  # fmt: skip
    m, tr = deck.model, deck.train
    e = 2 if precision == "bf16" else 4
    tokens = tr.micro_batch * m.seq_len
    msgs = tp3d_collectives(deck)
    block = _sum(msgs["layer_forward"] + msgs["layer_backward"])
    sizes = dict(zip(("tp_x", "tp_y", "tp_z"), shape))
    expected = {k: v for k, v in _axonn_block(m.hidden, m.ffn, tokens, e, shape).items() if sizes[k[0]] > 1}
    assert block.keys() == expected.keys()
    for key, value in expected.items():
        assert block[key] == pytest.approx(value), key
    # One gather per Linear in each pass (backward gathers again: the block is not kept), one
    # reduce-scatter backward; the recompute gathers like the forward and stops before mlp.proj's
    # forward all-reduce (no dropout), as in 1D.
    recompute = _sum(msgs["layer_recompute"])
    assert recompute.get(("tp_z", "all_gather"), 0.0) == block.get(("tp_z", "all_gather"), 0.0) / 2
    if y > 1:
        forward_y = _sum(msgs["layer_forward"])[("tp_y", "all_reduce")]
        assert recompute[("tp_y", "all_reduce")] == pytest.approx(forward_y - tokens * m.hidden / x * e)


def test_step_messages_add_the_head_and_embedding_and_scale_with_the_micro_batches():
    shape = (2, 2, 2)
    deck = _deck(TINY, 16, "parallel.tp=8", _tensor(shape), "train.global_batch=32", "train.micro_batch=2")
    m, tr = deck.model, deck.train
    assert deck.dp == 2 and deck.num_micro_batches == 32 // (2 * 2 * 2)  # the batch is split over dp x Z
    e, tokens, (x, y, z) = 4, tr.micro_batch * m.seq_len, shape
    sent = step_messages(deck, 0)
    table = m.vocab_size / y * m.hidden / x * e
    per_micro = {k: v * m.layers for k, v in _axonn_block(m.hidden, m.ffn, tokens, e, shape).items()}
    # tied, pp = 1: the embedding and the head each gather the (V/Y, h/X) block (the head in both
    # passes) and reduce-scatter it
    per_micro[("tp_z", "all_gather")] += 3 * table
    per_micro[("tp_z", "reduce_scatter")] += 2 * table
    per_micro[("tp_y", "all_reduce")] += tokens * m.hidden / x * e * 2 + 3 * tokens * 4.0  # lookup, dx, CE
    per_micro[("tp_x", "all_reduce")] += tokens * m.vocab_size / y * e + 4 * tokens * 4.0  # logits, ln_f
    for key, value in per_micro.items():
        assert sent[key] == pytest.approx(deck.num_micro_batches * value), key
    sharded, replicated = stage_params3d(m, shape, m.layers, True, True)
    h, f, v, s = m.hidden, m.ffn, m.vocab_size, m.seq_len
    assert sharded - replicated == m.layers * (4 * h * h + 2 * f * h) // (x * y * z) + v * h // (x * y * z)
    assert replicated == m.layers * (4 * h // x + 3 * h // y + h // x + f // y + h // x) + s * h // x + 2 * h // x
    assert sent[("dp", "all_reduce")] == pytest.approx(sharded * 4)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_1_t_1_is_megatron_s_1d_tensor_parallelism(tp):
    """(1, t, 1): A is column-parallel, B row-parallel, LayerNorm local: the same collectives as 1D
    (without SP), the same GEMMs and attention; all exposed, as 1D without overlap_tp_comm."""
    machine = load_machine("frontier")
    # run.compile false: its chains across a block's modules (GPU default) are 1D's only
    sets = (f"parallel.tp={tp}", "parallel.overlap_tp_comm=false", "run.compile=false")
    one = _deck(AXONN_5B, 512, *sets, "parallel.tensor=null")
    three = _deck(AXONN_5B, 512, *sets, _tensor((1, tp, 1)))
    a, b = predict(one, machine), predict(three, machine)
    for key in ("gemm", "attention", "tp_exposed"):
        assert b.breakdown[key] == pytest.approx(a.breakdown[key], rel=1e-9), key
    assert b.tensor3d["tp_y"] == pytest.approx(b.breakdown["tp_exposed"]) and b.tensor3d["tp_x"] == 0
    # 3D adds the A layout's (column-parallel) bias after the (absent) all-reduce, a separate add of
    # (3h + f) / t features where 1D's F.linear fuses it: more element-wise work, a slightly longer step.
    assert a.breakdown["elementwise"] < b.breakdown["elementwise"] < 1.5 * a.breakdown["elementwise"]
    assert a.step_time_s <= b.step_time_s < 1.03 * a.step_time_s
    one_sent, three_sent = step_messages(one, 0), step_messages(three, 0)
    tp_1d = {op: n for (axis, op), n in one_sent.items() if axis == "tp"}
    tp_3d = {op: n for (axis, op), n in three_sent.items() if axis.startswith("tp_")}
    assert tp_3d == pytest.approx(tp_1d)
    assert {k: v for k, v in one_sent.items() if k[0] != "tp"} == pytest.approx(
        {k: v for k, v in three_sent.items() if not k[0].startswith("tp")}
    )


def test_1_1_1_sends_nothing_over_tp_and_is_the_1d_step():
    machine = load_machine("frontier")
    # (3D's Linears do not fuse their gradient accumulation: the 1D run without it, like for like; and
    # no recomputation, which re-runs 3D's MLP output GEMM, a custom function, but not 1D's F.linear)
    unfused = ("train.fuse_grad_accumulation=false", "train.recompute=none")
    one = _deck(AXONN_5B, 64, "parallel.tp=1", "parallel.tensor=null", "train.global_batch=64", *unfused)
    three = _deck(AXONN_5B, 64, "parallel.tp=1", _tensor((1, 1, 1)), "train.global_batch=64", *unfused)
    assert not any(tp3d_collectives(three).values())
    a, b = predict(one, machine), predict(three, machine)
    assert b.breakdown["tp_exposed"] == a.breakdown["tp_exposed"] == 0.0
    assert b.breakdown["gemm"] == pytest.approx(a.breakdown["gemm"])
    assert a.step_time_s <= b.step_time_s < 1.02 * a.step_time_s


def test_the_sub_axes_cross_the_links_of_their_strides():
    machine = load_machine("frontier")  # packages of 2 GCDs, nodes of 8, Slingshot
    layout = GridLayout.from_order_string(64, 1, 8, "tp-dp-pp", 8)
    links = axis_links3d(machine, layout, (2, 4, 8))
    assert [links[a].level for a in ("tp_x", "tp_y", "tp_z")] == ["package", "node", "slingshot"]
    assert links["tp_x"].bandwidth == pytest.approx(200e9)
    assert links["tp_y"].bandwidth == pytest.approx(50e9)  # one GCD of each package in a group
    assert links["tp_z"].bandwidth == pytest.approx(12.5e9)  # one GCD per node
    # tp outside dp: every sub-axis stride is scaled by tp's own
    outer = axis_links3d(machine, GridLayout.from_order_string(4, 1, 8, "dp-tp-pp", 8), (2, 2, 1))
    assert outer["tp_x"].level == "slingshot"
    # parallel.tensor_order zxy: Z innermost (stride 1), then X (8), then Y (16).
    links = axis_links3d(machine, layout, (2, 4, 8), "zxy")
    assert [links[a].level for a in ("tp_x", "tp_y", "tp_z")] == ["slingshot", "slingshot", "node"]


def test_the_predicted_step_follows_the_tensor_order():
    """Putting z (weight gathers) innermost pushes x and y (activation all-reduces in every Linear)
    across nodes: the model predicts more exposed tp time than the default order."""
    machine = load_machine("frontier")
    sets = ("parallel.tp=16", "parallel.pp=1", _tensor((2, 2, 4)))
    default = _deck(REPO / "inputs/axonn/gpt_20b.yaml", 256, *sets)
    flipped = _deck(REPO / "inputs/axonn/gpt_20b.yaml", 256, *sets, "parallel.tensor_order=zyx")
    a, b = predict(default, machine), predict(flipped, machine)
    assert b.breakdown["tp_exposed"] > a.breakdown["tp_exposed"]
    assert b.step_time_s > a.step_time_s


def test_large_tp_across_nodes_communicates_less_in_3d_than_in_1d():
    """AxoNN's point: at tp 64 (8 Frontier nodes) 1D all-reduces the whole activation across the
    network in every Linear, micro-batch after micro-batch; the 3D shapes the search ranks first put
    most of the group on Z, which moves each weight block once per micro-batch and pass (gathered in
    forward and again in backward), while the
    batch split over Z leaves each rank 1/Z of the micro-batches."""
    machine = load_machine("frontier")
    sets = ("parallel.tp=64", "parallel.pp=1", "train.global_batch=4096", "train.recompute=full",
            "model.layers=32", "model.hidden=8192", "model.heads=64")  # fmt: skip
    one_deck = _deck(AXONN_5B, 4096, *sets, "parallel.tensor=null")
    one = predict(one_deck, machine)
    ranked = [s for _, s in _rank_shapes(one_deck, machine, 64, 1)]
    assert ranked[:3] == [(1, 1, 64), (1, 2, 32), (2, 1, 32)]
    for shape in ranked[:3]:
        deck = _deck(AXONN_5B, 4096, *sets, _tensor(shape))
        three = predict(deck, machine)
        comm_3d = three.breakdown["tp_exposed"] + three.tensor3d["tp_z_grad_sum"]
        assert comm_3d < 0.75 * one.breakdown["tp_exposed"], shape  # (1, 2, 32): 0.62 with the backward re-gather
        assert three.step_time_s < one.step_time_s
        assert three.levels["tp_z"] == "slingshot" and one.levels["tp"] == "slingshot"
        tp_sum = sum(three.tensor3d[a] for a in ("tp_x", "tp_y", "tp_z"))
        assert tp_sum == pytest.approx(three.breakdown["tp_exposed"])
        # bytes per rank and step: 1D's all-reduces against 3D's (mostly Z's weight blocks)
        sent_1d = sum(n for (axis, _), n in step_messages(one_deck, 0).items() if axis == "tp")
        sent_3d = sum(n for (axis, _), n in step_messages(deck, 0).items() if axis.startswith("tp_"))
        assert sent_3d < sent_1d
    # Not every shape: Z spread one GCD per node (stride 8) gets one NIC share, and Y over the network
    # all-reduces activations as 1D does.
    worse = predict(_deck(AXONN_5B, 4096, *sets, _tensor((2, 8, 4))), machine)
    assert worse.breakdown["tp_exposed"] > one.breakdown["tp_exposed"]


def test_the_overlap_hooks_only_hide_time():
    machine = load_machine("frontier")
    deck = _deck(AXONN_5B, 512, "parallel.tp=8", _tensor((2, 2, 2)))
    dev = device_of(machine, deck.train.precision)
    links = axis_links3d(machine, GridLayout.from_order_string(8, 1, 64, "tp-dp-pp", 8), (2, 2, 2))
    f0, b0, _ = _layer_passes3d(deck, dev, links, Overlap3D())
    f1, b1, _ = _layer_passes3d(deck, dev, links, Overlap3D(True, True, True))
    assert f1.tp < f0.tp and b1.tp < b0.tp
    assert (f1.gemm, b1.gemm, f1.elementwise) == (f0.gemm, b0.gemm, f0.elementwise)
    assert sum(f0.axes) == pytest.approx(f0.tp)


def test_linears3d_shapes():
    m = load_deck(TINY).model
    assert [(lin.n, lin.k, lin.forward_axis) for lin in linears3d(m, (2, 4, 1))] == [
        (3 * 256 // 4, 256 // 2, "tp_x"), (256 // 2, 256 // 4, "tp_y"), (1024 // 4, 256 // 2, "tp_x"),
        (256 // 2, 1024 // 4, "tp_y"),
    ]  # fmt: skip


def test_the_search_ranks_3d_shapes_the_deck_rules_allow_and_shows_them():
    machine = load_machine("selene")
    deck = load_deck(TINY, ("model.heads=4",))  # heads 4: no Y of 8
    shapes = [s for _, s in _rank_shapes(deck, machine, 8, 4)]
    assert shapes and all(s[1] <= 4 for s in shapes)
    assert len(shapes) == len(set(shapes)) == 10 - 1  # the 10 ordered factorisations of 8, less y = 8
    result = search(deck, 16, machine, top=3, tensor="3d")
    assert result.best and all(c.sets.get("parallel.tensor") for c in result.best)
    text = format_text(result, "gpt_tiny.yaml")
    assert " 3d [" in text and "--set parallel.tensor=[" in text
    both = search(deck, 16, machine, top=200)
    kinds = {c.sets.get("parallel.tensor") is None for c in both.best}
    assert kinds == {True, False}
    flat = search(deck, 16, machine, top=200, tensor="1d")
    assert all(c.sets.get("parallel.tensor") is None for c in flat.best)
    with pytest.raises(ValueError):
        search(deck, 16, machine, tensor="2d")


def test_a_3d_deck_searches_1d_grids_too():
    machine = load_machine("selene")
    deck = load_deck(TINY, ("parallel.tp=4", "parallel.tensor=[2,2,1]"))
    result = search(deck, 8, machine, top=50)
    assert result.own.sets["parallel.tensor"] == (2, 2, 1) and not result.own.rejected
    assert any(c.sets.get("parallel.tensor", "x") is None for c in result.best)
    assert dataclasses.asdict(result.own.plan.deck.parallel)["tensor"] == [2, 2, 1]
