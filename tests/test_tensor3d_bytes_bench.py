"""benchmarks/tensor3d_bytes_bench.py and count_collectives.py: the byte counting, serially (no run)."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import count_collectives  # noqa: E402
import tensor3d_bytes_bench as bench  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_one_message_sends_its_ring_volume():
    assert bench.sent("all_reduce", 4, 1000) == 1500  # 2 (n-1)/n
    assert bench.sent("all_gather", 4, 1000) == 750  # (n-1)/n of the gathered size
    assert bench.sent("reduce_scatter", 4, 1000) == 750
    assert bench.sent("reduce_scatter", 4, 1000, gloo=True) == 1500  # gloo's sends an all-reduce's
    assert bench.sent("all_reduce", 2, 1000) == 1000
    assert bench.sent("send", 2, 1000) == 1000 and bench.sent("recv", 2, 1000) == 0
    assert bench.sent("all_reduce", 1, 1000) == 0  # a one-rank group sends nothing


def test_counted_calls_go_to_their_axis_column_per_step():
    records = [  # two steps of calls, as count_collectives.py writes them
        {"axis": "tp_x", "phase": "passes", "op": "all_reduce", "n": 2, "bytes": 1024, "calls": 72},
        {"axis": "tp_z", "phase": "passes", "op": "all_gather", "n": 2, "bytes": 4096, "calls": 10},
        {"axis": "tp_z", "phase": "passes", "op": "reduce_scatter", "n": 2, "bytes": 4096, "calls": 4},
        {"axis": "tp_z", "phase": "update", "op": "all_reduce", "n": 2, "bytes": 800, "calls": 2},
        {"axis": "tp", "phase": "update", "op": "all_reduce", "n": 4, "bytes": 8, "calls": 4},
        {"axis": "dp", "phase": "update", "op": "all_reduce", "n": 2, "bytes": 2000, "calls": 2},
    ]
    assert bench.counted_bytes(records, steps=2) == {
        "tp_x": 36 * 1024,
        "tp_z": (5 + 2) * 2048,
        "tp_z_sum": 800,
        "scalars": 2 * 12,
        "dp": 2000,
    }
    assert bench.counted_bytes(records, steps=2, gloo=True)["tp_z"] == (5 + 4) * 2048


def test_the_model_s_1d_bytes_are_the_hand_count():
    """gpt_tiny at tp 4: per micro-batch (T = 4 x 64 tokens, h = 256, fp32) 4 all-reduces of T h e per
    block, 1 in the head, 1 in the embedding, 3 of 4T in the cross-entropy; 4 micro-batches; ring 1.5."""
    deck = bench.resolve("inputs/gpt_tiny.yaml", "1d:4", [])
    x = 256 * 256 * 4
    assert bench.predicted_bytes(deck) == {"tp": 4 * 1.5 * ((4 * 4 + 2) * x + 3 * 256 * 4)}


def test_the_z_sum_is_the_replicated_gradients_once_per_step():
    """[1, 2, 2]: LayerNorms 4 x h/X, the biases 3h/Y + h/X + f/Y + h/X per block, wpe 64 x h/X, ln_f."""
    deck = bench.resolve("inputs/gpt_tiny.yaml", "3d:1x2x2", [])
    replicated = 4 * (4 * 256 + 384 + 256 + 512 + 256) + 64 * 256 + 2 * 256
    assert bench.predicted_bytes(deck)["tp_z_sum"] == replicated * 4  # fp32, ring 2 (2-1)/2 = 1
    assert "tp_z_sum" not in bench.predicted_bytes(bench.resolve("inputs/gpt_tiny.yaml", "3d:2x2x1", []))


def test_variants_parse_and_bad_ones_are_refused():
    assert bench.parse_variant("1d:8") == (8, None, 1)
    assert bench.parse_variant("3d:2x2x1/dp2") == (4, (2, 2, 1), 2)
    assert bench.variant_sets("3d:1x2x2") == ["parallel.tp=4", "parallel.tensor=[1,2,2]", "parallel.dp=1"]
    with pytest.raises(SystemExit, match="bad variant"):
        bench.parse_variant("3d:2x2")


def test_the_spied_calls_read_the_sizes_the_model_means():
    """Every spied torch.distributed name exists and binds its message by the names SPIED reads."""
    import inspect

    import torch
    import torch.distributed as dist

    out, inp = torch.empty(8, 4), torch.empty(2, 4)
    args = {"all_gather_single": (out, inp), "reduce_scatter_single": (inp, out), "all_reduce": (inp,),
            "isend": (inp, 1), "irecv": (inp, 0), "broadcast": (inp, 0)}  # fmt: skip
    for name, (op, size) in count_collectives.SPIED.items():
        real = getattr(dist, name)
        if name in args:
            bound = inspect.signature(real).bind(*args[name], group=None).arguments
            assert size(bound) == {"all_gather": 128, "reduce_scatter": 128}.get(op, 32), name


def test_the_bytes_share_is_the_step_less_the_step_at_infinite_bandwidth():
    from app.plan.machine import load_machine
    from app.plan.perf import predict

    deck = bench.resolve("inputs/gpt_tiny.yaml", "3d:2x2x2", [])
    frontier = load_machine("frontier")
    model = bench.predicted_time(deck, frontier)
    p = predict(deck, frontier)
    assert model["step"] == pytest.approx(1e3 * p.step_time_s)
    assert model["tp_x"] == pytest.approx(1e3 * p.tensor3d["tp_x"]) and model["tp"] == pytest.approx(
        1e3 * p.tensor3d["tp_z_grad_sum"]
    )
    free = predict(deck, bench.free_bytes(frontier))
    assert model["bytes"] == pytest.approx(1e3 * (p.step_time_s - free.step_time_s))
    assert 0 < model["bytes"] < model["step"]
    assert free.breakdown["tp_exposed"] < p.breakdown["tp_exposed"]  # the latencies are left
