"""Run under mpirun across nodes (tests/test_multinode.py): each rank builds the real grids of
2 x 2 x 2 in two orders and all-gathers its hostname over each axis's torch group (real gloo
traffic between the nodes), so that the test checks which hosts every group really spans.

    mpirun -n 8 --host gridlm-node1:4,gridlm-node2:4 python tests/multinode_probe.py OUT.json

Rank 0 writes {order: {"within_node": {axis: bool}, "groups": [{axis: [hosts]} per rank]},
"hosts": [host per rank], "nodes": N}.
"""

from __future__ import annotations

import json
import sys

ORDERS = ("tp-dp-pp", "tp-pp-dp")


def main(out: str) -> None:
    import torch.distributed as dist

    from app.names import AXES
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import bind_device, init_mpi, init_torch_distributed

    runtime = init_mpi()
    bind_device(runtime, "cpu")
    init_torch_distributed(runtime, connect_s=30)
    report: dict = {"hosts": runtime.comm.gather(runtime.hostname, root=0), "nodes": runtime.nodes}
    for order in ORDERS:
        grid = ProcessGrid(runtime, 2, 2, 2, order)
        mine = {}
        for axis in AXES:
            hosts: list = [None] * grid.size(axis)
            dist.all_gather_object(hosts, runtime.hostname, group=grid.group[axis])
            mine[axis] = hosts
        groups = runtime.comm.gather(mine, root=0)
        report[order] = {"within_node": grid.within_node, "groups": groups}
    if runtime.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
