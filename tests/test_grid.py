"""The process grid: the pure rank mapping (up to 32,768 ranks) and, under MPI, the real
communicators and torch groups of every grid that fits the launched ranks."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from app.runtime.grid import AXES, GridLayout, placement_warnings
from conftest import REPO, fake_cpu_topology

ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]
SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 3), (8, 4, 2), (3, 5, 7)]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_mapping_is_a_bijection_and_groups_partition_the_world(shape, order):
    layout = GridLayout.from_order_string(*shape, order)
    n = layout.world_size
    coords = [layout.coords(r) for r in range(n)]
    assert len({tuple(c.values()) for c in coords}) == n
    assert all(layout.rank(**c) == r for r, c in enumerate(coords))
    for axis in AXES:
        groups = layout.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(n))
        for g in groups:
            assert [coords[r][axis] for r in g] == list(range(layout.size(axis)))
            others = [a for a in AXES if a != axis]
            assert len({tuple(coords[r][a] for a in others) for r in g}) == 1
            assert all(layout.group_of(r, axis) == g for r in g)


def test_innermost_axis_is_contiguous_and_outermost_is_strided():
    layout = GridLayout.from_order_string(tp=4, pp=2, dp=3, order="tp-dp-pp")
    assert layout.groups("tp")[0] == [0, 1, 2, 3]
    assert layout.group_of(0, "dp") == [0, 4, 8]
    assert layout.group_of(0, "pp") == [0, 12]
    other = GridLayout.from_order_string(tp=4, pp=2, dp=3, order="dp-pp-tp")
    assert other.group_of(0, "dp") == [0, 1, 2] and other.group_of(0, "tp") == [0, 6, 12, 18]


def test_32768_rank_layout_keeps_every_tp_group_inside_a_node():
    # Frontier-sized: 4,096 nodes x 8 GCDs; tp = 8 innermost, pp = 16, dp = 256.
    layout = GridLayout.from_order_string(tp=8, pp=16, dp=256, order="tp-dp-pp", ranks_per_node=8)
    assert layout.world_size == 32768
    tp_groups = layout.groups("tp")
    assert len(tp_groups) == 4096
    assert all(len({layout.node_of(r) for r in g}) == 1 for g in tp_groups)
    assert layout.axis_within_node("tp")
    assert not layout.axis_within_node("dp") and not layout.axis_within_node("pp")
    seen = sorted(r for g in layout.groups("pp") for r in g)
    assert seen == list(range(32768))


def test_tp_wider_than_a_node_is_reported_as_spanning_nodes():
    layout = GridLayout.from_order_string(tp=16, pp=1, dp=4, order="tp-dp-pp", ranks_per_node=8)
    assert not layout.axis_within_node("tp")
    assert layout.describe()["within_node"] == {"tp": False, "pp": True, "dp": False}
    # tp outermost scatters every tp group over nodes even when it would fit in one.
    assert not GridLayout.from_order_string(tp=2, pp=1, dp=8, order="dp-pp-tp", ranks_per_node=8).axis_within_node("tp")


def test_rank_0_warns_when_tp_spans_nodes_or_the_node_shape_differs_from_the_deck():
    # Frontier-like: 8 GCDs per node. tp = 8 fits a node; tp = 16 does not; order dp-tp-pp strides tp.
    fits = GridLayout.from_order_string(8, 4, 2, "tp-dp-pp", ranks_per_node=8).describe()["within_node"]
    assert placement_warnings(fits, 8, gpus_per_node=8) == []
    wide = GridLayout.from_order_string(16, 2, 2, "tp-dp-pp", ranks_per_node=8).describe()["within_node"]
    strided = GridLayout.from_order_string(8, 1, 2, "dp-tp-pp", ranks_per_node=8).describe()["within_node"]
    for within_node in (wide, strided):
        (warning,) = placement_warnings(within_node, 8)
        assert "tensor-parallel groups span nodes" in warning
    (warning,) = placement_warnings(fits, 4, gpus_per_node=8)
    assert "parallel.gpus_per_node = 8 but MPI placed 4 ranks per node" in warning


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError):
        GridLayout(2, 2, 2, ("tp", "dp"))
    with pytest.raises(ValueError):
        GridLayout(0, 1, 1)
    with pytest.raises(ValueError):
        GridLayout(2, 1, 1).coords(2)


def _shapes_for(world: int):
    return [(tp, pp, world // (tp * pp)) for tp in (1, 2, 4) for pp in (1, 2, 4) if world % (tp * pp) == 0]


@pytest.mark.mpi
def test_process_grid_groups_and_communicators_match_the_layout(runtime, grids):
    import torch
    import torch.distributed as dist

    for tp, pp, dp in _shapes_for(runtime.world_size):
        for order in ("tp-dp-pp", "pp-dp-tp"):
            grid = grids.grid(tp, pp, dp, order)  # a ProcessGrid, kept for the session's later tests
            assert grid.coords == grid.layout.coords(grid.rank)
            if runtime.nodes == 1:
                assert grid.describe()["within_node"] == {"tp": True, "pp": True, "dp": True}
            for axis in AXES:
                # The group's torch ranks hold this rank at its coordinate.
                assert len(grid.ranks[axis]) == grid.size(axis)
                assert grid.ranks[axis][grid.coords[axis]] == runtime.global_ranks[runtime.rank]
                # torch: summing one-hot coordinates over the group gives all ones.
                onehot = torch.zeros(grid.size(axis))
                onehot[grid.coords[axis]] = 1.0
                dist.all_reduce(onehot, group=grid.group[axis])
                assert onehot.tolist() == [1.0] * grid.size(axis)


@pytest.mark.mpi(min_size=2)
def test_size_one_axes_share_a_group_and_a_gloo_group_costs_one_thread(runtime, grids):
    """app/runtime/groups.py: the axes of size 1 of every grid share this rank's own group, and a new
    gloo group adds one worker thread (torch's default gloo group adds three: two workers and an
    event loop), so that a process making many grids does not pile up threads."""
    import torch
    import torch.distributed as dist

    sub = grids.runtime(2)
    grid = grids.grid(2, 1, 1)  # tp 2: pp and dp are this rank alone
    assert grid.group["pp"] is grid.group["dp"] is grids.grid(1, 2, 1).group["tp"]
    assert dist.get_backend(grid.group["tp"]) == "gridlm_gloo"
    before = len(os.listdir(f"/proc/{os.getpid()}/task"))
    pair = [sub.global_ranks[r] for r in range(2)]
    made = [runtime.groups.new(pair, runtime.backend, runtime.watchdog, "tp") for _ in range(3)]
    added = len(os.listdir(f"/proc/{os.getpid()}/task")) - before
    for group in made:  # each works: a sum over the pair
        x = torch.ones(1)
        dist.all_reduce(x, group=group)
        assert x.item() == 2.0
    assert added <= len(made), f"{len(made)} gloo groups added {added} threads"


@pytest.mark.parametrize(
    "local_rank,local_size,visible,want",
    [
        (0, 8, 1, 0),  # srun --gpus-per-task=1 --gpu-bind=closest (Frontier): each rank sees one GCD
        (5, 8, 1, 0),
        (3, 4, 4, 3),  # all visible (Perlmutter --gpus-per-node=4, Polaris mpiexec): local rank picks
        (1, 2, 4, 1),  # fewer ranks than GPUs: the first ones
    ],
)
def test_device_index_under_both_launch_styles(local_rank, local_size, visible, want):
    from app.runtime.mpi import device_index

    assert device_index(local_rank, local_size, visible) == want


def test_gpu_order_maps_local_ranks_to_the_gpus_next_to_their_cores():
    """Polaris: mpiexec --cpu-bind depth gives local rank 0 the cores next to GPU 3 (ALCF's affinity
    script assigns num_gpus - 1 - local rank); GRIDLM_GPU_ORDER=3,2,1,0 says so."""
    from app.errors import LaunchError
    from app.runtime.mpi import device_index

    assert [device_index(rank, 4, 4, "x3001", "3,2,1,0") for rank in range(4)] == [3, 2, 1, 0]
    assert device_index(2, 4, 1, "x3001", "3,2,1,0") == 0  # one visible device: the launcher chose it
    assert device_index(1, 2, 4, "x3001", "") == 1  # unset or empty: the local rank
    for order, said in (("3,2,x,0", "not a comma-separated list"), ("3,3,1,0", "distinct GPUs 0 .. 3"),
                        ("4,2,1,0", "distinct GPUs 0 .. 3"), ("3,2", "names 2 GPUs for 4 ranks")):  # fmt: skip
        with pytest.raises(LaunchError, match=said) as err:
            device_index(0, 4, 4, "x3001", order)
        assert "GRIDLM_GPU_ORDER" in str(err.value) and "e.g. 3,2,1,0" in str(err.value)


def test_torch_threads_count_a_core_s_hardware_threads_once(tmp_path):
    """Perlmutter's srun -c 32 gives a rank 16 cores x 2 hardware threads: 16 torch threads, not 32."""
    from app.runtime.mpi import physical_cores

    fake_cpu_topology(tmp_path, 2, 16)  # cpu c and c + 32 are one core's threads
    rank = set(range(16)) | set(range(32, 48))  # the first socket, both threads of each core
    assert physical_cores(rank, tmp_path) == 16
    assert physical_cores(set(range(32)), tmp_path) == 32  # one thread of every core
    assert physical_cores({0, 32}, tmp_path) == 1
    assert physical_cores({0, 1}, tmp_path / "absent") == 2  # no topology: every CPU counts
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_more_ranks_than_visible_gpus_is_a_launch_error():
    from app.errors import LaunchError
    from app.runtime.mpi import device_index

    with pytest.raises(LaunchError, match="8 ranks on node n0 share 4 visible GPUs"):
        device_index(5, 8, 4, "n0")


def test_groups_within_node_follow_the_measured_placement_not_the_layout():
    """ProcessGrid.within_node comes from where the ranks really are (node of each grid rank)."""
    from app.runtime.grid import _groups_within_node

    layout = GridLayout.from_order_string(tp=2, pp=1, dp=4, order="tp-dp-pp", ranks_per_node=4)
    packed = [0, 0, 0, 0, 1, 1, 1, 1]
    assert _groups_within_node(layout, "tp", packed) and _groups_within_node(layout, "pp", packed)
    assert not _groups_within_node(layout, "dp", packed)
    # A launcher that deals ranks round-robin over the nodes splits every tp pair.
    round_robin = [0, 1, 0, 1, 0, 1, 0, 1]
    assert not _groups_within_node(layout, "tp", round_robin)
    assert _groups_within_node(layout, "dp", [0] * 8)


_FREED_PROBE = r"""
import re, sys
import torch
from app.runtime.mpi import set_malloc_mmap_threshold

def rss_mb():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024

fixed = set_malloc_mmap_threshold(int(sys.argv[1]))
# glibc's dynamic threshold: freeing an mmapped 8 MiB block raises it to 8 MiB, so the next
# 4 MiB tensors come from the heap, each followed by a 256 KiB tensor that stays (as a shard
# built between temporaries does) and keeps the heap from trimming the hole below it.
big = torch.ones(2 << 20); del big
before = rss_mb()
freed, kept = [], []
for _ in range(16):
    freed.append(torch.ones(1 << 20))  # 4 MiB, pages touched
    kept.append(torch.ones(1 << 16))
del freed
print(fixed, round(rss_mb() - before, 1))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc (Linux)")
def test_a_fixed_mmap_threshold_gives_freed_tensors_back_to_the_system(tmp_path):
    """run.malloc_mmap_threshold_kb: with it, 64 MiB of freed 4 MiB tensors leave the resident
    set; with glibc's dynamic threshold (0) they stay, which is what this guards against."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    out = {}
    for kib in (1024, 0):
        run = subprocess.run([sys.executable, "-c", _FREED_PROBE, str(kib)], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        fixed, kept = run.stdout.split()
        out[kib] = (fixed, float(kept))
    assert out[1024][0] == "True" and out[0][0] == "False"
    assert out[1024][1] < 20, out  # 4 MiB kept and 64 MiB freed: at most a quarter of that may stay
    assert out[0][1] > 48, out  # the control: without the fixed threshold most of it stays


_FAULT_PROBE = r"""
import resource, sys
import torch
from app.runtime.mpi import cool_heap, set_malloc_mmap_threshold, warm_heap

torch.set_num_threads(1)
assert set_malloc_mmap_threshold(1024)
a, b = torch.ones(1 << 20), torch.ones(1 << 20)  # 4 MiB operands: the result is above the threshold

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(16):
        torch.add(a, b)  # allocated, written, freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

cold = faults()
warmed = warm_heap(64 << 20)
warm = faults()
cool_heap()
print(warmed, cold, warm)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc (Linux)")
def test_a_warm_heap_serves_large_temporaries_without_page_faults():
    """app.plan.calibrate times its compute primitives on a heap warmed as a run's is: under the run's
    1 MiB mmap threshold each fresh 4 MiB result is mmapped and faults in its 1024 pages (about
    16k minor faults for 16 of them); from a warm heap it reuses touched pages (a few faults)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    run = subprocess.run([sys.executable, "-c", _FAULT_PROBE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    warmed, cold, warm = run.stdout.split()
    assert warmed == "True"
    assert int(cold) > 8 * 1024, run.stdout  # at least half of the 16 x 1024 pages faulted afresh
    assert int(warm) < 1024, run.stdout  # not one result's worth


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-cp-dp-pp", "cp-tp-pp-dp", "dp-pp-tp-cp"])
def test_the_cp_axis_is_a_fourth_axis_and_its_replicas_are_every_dp_and_cp_rank(order):
    """cp is placed where the order says (right after tp when it does not name it); the grid stays a
    bijection; the replica group of a rank (dp x cp, in ascending rank order: torch's order of the
    group's members, which ZeRO's shards follow) holds every rank with its tp and pp coordinates; at
    cp = 1 nothing names cp."""
    layout = GridLayout.from_order_string(2, 2, 3, order, cp=2)
    assert layout.world_size == 24 and layout.axes == ("tp", "cp", "pp", "dp")
    coords = [layout.coords(r) for r in range(24)]
    assert all(layout.rank(**c) == r for r, c in enumerate(coords))
    assert len({tuple(c.values()) for c in coords}) == 24
    if "cp" not in order:
        assert layout.order == ("tp", "cp", "dp", "pp") and layout.group_of(0, "cp") == [0, 2]
    for r in range(24):
        replicas = layout.replica_group_of(r)
        assert replicas == sorted(replicas)
        assert sorted((coords[q]["dp"], coords[q]["cp"]) for q in replicas) == [
            (d, c) for d in range(3) for c in range(2)
        ]
        assert {(coords[q]["tp"], coords[q]["pp"]) for q in replicas} == {(coords[r]["tp"], coords[r]["pp"])}
    plain = GridLayout.from_order_string(2, 2, 3, "tp-dp-pp")
    assert set(plain.coords(5)) == set(AXES) and plain.describe()["order"] == "tp-dp-pp"
    assert "cp" in layout.describe() and "cp" not in plain.describe()


def test_a_round_robin_rank_order_that_breaks_a_group_s_order_is_refused():
    """torch numbers a group's members by ascending rank, and its collectives order their pieces so;
    the grid gives each rank its coordinate along the axis. With ranks dealt round-robin over 2 nodes
    (mpirun --map-by node: node 0 holds ranks 0, 2, 4, 6) the grid's node-major numbering puts
    launcher ranks 0, 4, 1, 5 in one dp group (tp 2 x dp 4, 4 per node): a refusal naming the fix,
    where the results would have been silently wrong. Block placement, and round-robin where every
    group stays within a node or takes one rank per node, are fine."""
    from app.runtime.grid import order_sensitive_axes, unordered_group

    layout = GridLayout.from_order_string(tp=2, pp=1, dp=4, order="tp-dp-pp", ranks_per_node=4)
    block = list(range(8))
    round_robin = [0, 2, 4, 6, 1, 3, 5, 7]  # grid rank -> launcher rank: node-major over the dealt ranks
    assert unordered_group(layout, block) is None
    why = unordered_group(layout, round_robin)
    assert why is not None and "the dp group of grid ranks 0, 2, 4, 6 holds launcher ranks 0, 4, 1, 5" in why
    assert "--distribution=block" in why and "--map-by node" in why
    # Only the groups whose collectives rely on the order (found in review: a dp group that only
    # all-reduces, or pp's named point-to-point messages, run right in any order).
    assert order_sensitive_axes(2, 1, 0, 1) == {"tp"}
    assert unordered_group(layout, round_robin, order_sensitive_axes(2, 1, 0, 1)) is None  # no ZeRO: all-reduce
    assert unordered_group(layout, round_robin, order_sensitive_axes(2, 1, 1, 1)) is not None  # ZeRO-1: shards
    assert order_sensitive_axes(1, 2, 0, 1) == {"cp", "dp x cp"} and order_sensitive_axes(1, 1, 0, 2) == {
        "dp",
        "dp x cp",
    }
    pp = GridLayout.from_order_string(tp=1, pp=4, dp=1, order="pp-dp-tp", ranks_per_node=2)
    assert unordered_group(pp, [0, 2, 1, 3]) is not None and unordered_group(pp, [0, 2, 1, 3], {"tp", "dp"}) is None
    assert unordered_group(GridLayout.from_order_string(tp=4, pp=1, dp=2, order="tp-dp-pp"), round_robin) is None
    # cp: the dp x cp replicas are a group of their own (dp inner to cp: grid ranks 0, 1, 2, 3 at tp 2)
    cp = GridLayout.from_order_string(tp=2, pp=1, dp=2, order="dp-cp-tp-pp", ranks_per_node=4, cp=2)
    assert cp.replica_group_of(0) == [0, 1, 2, 3] and cp.replica_group_of(5) == [4, 5, 6, 7]
    assert unordered_group(cp, block) is None
