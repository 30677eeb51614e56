"""Machine descriptions: `inputs/machines/<name>.yaml`.

A machine file says what a node holds (devices, memory per device, cores), how fast its
links are (with sources), which scheduler it runs and how ranks are launched on it. The
dry run uses it to place ranks on nodes and check memory; `launch/submit.py` uses it to
write job scripts. The keys, their types, bounds and meaning are declared once, in `FIELDS`,
and checked by the schema engine (app/schema.py) that also checks decks and study files; so
are the nested performance-model keys (GEMM_FIELDS, LINK_FIELDS, FIT_FIELDS, ...). A wrong
key or value is named with the file and its full name (gemm.tile, links[1].gbs).
`_validate` adds the rules between keys.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from app.deck_yaml import read_yaml_file
from app.errors import InputError
from app.metrics.peaks import peak_tflops
from app.schema import Key, Problem, check, check_value, type_name

MACHINES_DIR = Path(__file__).resolve().parents[2] / "inputs" / "machines"
SCHEDULERS = ("slurm", "pbs")
# per-task: the launcher gives each rank one device (it sees device 0);
# all-visible: every rank sees the node's devices and picks one by its local rank.
BINDINGS = ("per-task", "all-visible")
LAUNCH_FIELDS = ("nodes", "ranks", "ranks_per_node")
# Collectives a calibration may time per group size (`collectives`); `perf.ring_terms` gives each
# one's cost. p2p is timed between pairs (ranks 2) and serves every group.
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
# Element-wise kinds a machine may rate apart (`elementwise_gbs`), in the bytes the performance
# model counts for them, forward and backward (perf._layer_passes, perf._head_passes).
ELEMENTWISE_KINDS = ("layernorm", "gelu", "softmax")

# The keys, declared for the schema engine (app/schema.py). docs/CLUSTERS.md's machine file reference is
# this table (`machine_reference`; tests/test_plan.py checks that it lists every key).
FIELDS: dict[str, Key] = {
    "name": Key(str, help="short name, = the file stem (used by --machine)"),
    "description": Key(str, help="one line: site, system, node type"),
    "scheduler": Key(str, help="slurm or pbs", choices=SCHEDULERS),
    "devices_per_node": Key(int, help="GPUs (GCDs on MI250X) per node = ranks per node", min=0, exclusive_min=True),
    "device": Key(str, help="the device, in words"),
    "device_name": Key(str, help="name as torch reports it (matched against the peak table), or cpu"),
    "peak_tflops": Key(
        dict,
        None,
        "dense peak TFLOP/s per device by precision (bf16, fp16, fp32), only where the peak table "
        "(app/metrics/peaks.py, by device_name) has none: app.plan.calibrate writes the measured one",
    ),
    "memory_per_device_gib": Key(
        float, help="device memory in GiB (for a CPU machine: host memory per rank)", min=0, exclusive_min=True
    ),
    "cpu_cores_per_node": Key(int, help="CPU cores per node usable by ranks", min=0, exclusive_min=True),
    "intra_node_gbs": Key(
        float, help="device-to-device bandwidth inside a node, GB/s per direction", min=0, exclusive_min=True
    ),
    "inter_node_gbs": Key(
        float, help="network injection bandwidth per node, GB/s per direction", min=0, exclusive_min=True
    ),
    "hbm_gbs": Key(
        float,
        None,
        "device memory bandwidth, GB/s (datasheet); the performance model's memory roofline",
        min=0,
        exclusive_min=True,
    ),
    "memory_gbs": Key(
        float,
        None,
        "bandwidth of memory past the last-level cache, GB/s per device with every device streaming "
        "(CPUs: STREAM-sized operands, measured by app.plan.calibrate, where hbm_gbs is a cache rate); each "
        "step's first pass over the optimizer's state is charged at it. Leave it out where hbm_gbs is the "
        "memory (GPUs)",
        min=0,
        exclusive_min=True,
    ),
    "fault_gbs": Key(
        float,
        None,
        "CPUs: GB/s per rank at which a fresh result of at least run.malloc_mmap_threshold_kb (mmapped, "
        "not cut from the heap) is page-faulted in, on top of computing it (measured by app.plan.calibrate "
        "with a Linear whose output is that size); leave it out on GPUs (a caching allocator)",
        min=0,
        exclusive_min=True,
    ),
    "host_link_gbs": Key(
        float,
        None,
        "device<->host bandwidth per device, GB/s per direction (PCIe, Infinity Fabric, NVLink-C2C; where devices "
        "share an uplink, the share of each with all of them copying): the offloaded optimizer's gradient and "
        "parameter copies (optim.offload); not used on CPU machines, where the host is the device",
        min=0,
        exclusive_min=True,
    ),
    "host_memory_gbs": Key(
        float,
        None,
        "host DRAM bandwidth per node, GB/s, shared by the node's ranks: the offloaded optimizer's CPU update "
        "(optim.offload) on GPU machines; CPU machines use their calibrated rates (hbm_gbs, memory_gbs)",
        min=0,
        exclusive_min=True,
    ),
    "host_memory_gib": Key(
        float,
        None,
        "host memory per node, GiB: the dry run checks the offloaded optimizer state (optim.offload: host) of "
        "the node's ranks against it; left out, it is not checked (the dry run says so)",
        min=0,
        exclusive_min=True,
    ),
    "nvme_gb": Key(
        float,
        None,
        "node-local NVMe capacity per node, GB: the dry run checks the optim.offload: nvme files of the node's "
        "ranks against it; left out where nodes have none",
        min=0,
        exclusive_min=True,
    ),
    "nvme_read_gbs": Key(
        float,
        None,
        "node-local NVMe read bandwidth per node, GB/s, shared by the node's ranks (optim.offload: nvme); "
        "left out where nodes have none",
        min=0,
        exclusive_min=True,
    ),
    "nvme_write_gbs": Key(
        float,
        None,
        "node-local NVMe write bandwidth per node, GB/s, shared by the node's ranks (optim.offload: nvme); "
        "left out where nodes have none",
        min=0,
        exclusive_min=True,
    ),
    "filesystem": Key(
        str,
        None,
        "the parallel file system checkpoints go to, in words (name, mount point); with filesystem_write_gbs",
    ),
    "filesystem_write_gbs": Key(
        float,
        None,
        "that file system's aggregate peak write bandwidth, GB/s (the site's figure): the dry run's checkpoint "
        "time is the checkpoint's bytes over the lesser of it and the job's nodes x inter_node_gbs",
        min=0,
        exclusive_min=True,
    ),
    "filesystem_read_gbs": Key(
        float,
        None,
        "its aggregate peak read bandwidth, GB/s (the dry run's load time; the write figure where left out)",
        min=0,
        exclusive_min=True,
    ),
    "checkpoint_setstripe": Key(
        dict,
        None,
        "the site's Lustre striping for one large shared file: {least checkpoint GB: lfs setstripe options}; "
        "launch/submit.py gives the job script the options of the largest size at or below the deck's "
        "checkpoint, and the script applies them to the checkpoint directory (launch/jobs/common.sh "
        "gridlm_stripe); left out where the site gives none",
    ),
    "gemm": Key(
        dict,
        None,
        "performance model: efficiency (achieved fraction of peak on large GEMMs), compute_units (SMs/CUs), "
        "tile ([rows, columns] of a large GEMM's output tile), optional attention_efficiency (flash "
        "attention, forward and backward), attention_backward_efficiency (the backward's, where measured "
        "apart) and memory_efficiency; each with its source under sources",
    ),
    "links": Key(
        list,
        None,
        "performance model: link levels innermost first, each {name, devices (domain size; null = the "
        "network, the last level, which every list ends with), gbs (per device, per direction), latency_us}; "
        "default: a node level from intra_node_gbs and a network level from inter_node_gbs",
    ),
    "op_overhead_us": Key(
        float,
        None,
        "performance model: host time of one framework operation, in microseconds, added per op (CPUs, "
        "where it is not hidden behind the device's work); measured by app.plan.calibrate",
        min=0,
        exclusive_min=True,
    ),
    "collectives": Key(
        dict,
        None,
        "performance model: collectives measured by app.plan.calibrate inside a node on groups of consecutive "
        "ranks running side by side, {op: {ranks: {gbs, latency_us}}} for op in all_reduce, all_gather, "
        "reduce_scatter, p2p (ranks 2: pairs); they replace the link level's figures for groups of that size "
        "inside a node",
    ),
    "network_collectives": Key(
        dict,
        None,
        "performance model: collectives measured by app.plan.calibrate across nodes (groups with ranks on "
        "several nodes, every rank of a node at once; p2p between pairs of nodes), {op: {ranks: {gbs, "
        "latency_us}}}; they replace the network level's figures for groups of that size that cross nodes",
    ),
    "elementwise_gbs": Key(
        dict,
        None,
        "performance model: achieved GB/s of element-wise kinds slower than hbm_gbs (layernorm, gelu, "
        "softmax; on CPUs the tanh and exp are compute-bound), in the model's bytes; measured by app.plan.calibrate",
    ),
    "binding": Key(str, help="per-task (one device per rank) or all-visible (local rank picks)", choices=BINDINGS),
    "launch": Key(str, help="launch line; {nodes}, {ranks} and {ranks_per_node} are filled in"),
    "template": Key(str, help="job-script template in launch/jobs/"),
    "defaults": Key(
        dict,
        {},
        "scheduler defaults for submit.py: time, partition/queue, qos, constraint, ...; a value may be a "
        "mapping {value: most nodes}, the first that takes the job's nodes (Polaris's queues)",
    ),
    "sources": Key(list, help="where the figures come from (URLs, papers)"),
    "notes": Key(str, "", "anything a user of the machine should know"),
}


class MachineError(InputError):
    """A machine file is missing, or a key in it is unknown or has a bad value."""


# Per-step latencies of NCCL's ring (Simple protocol) cost model, in microseconds: NVIDIA/nccl,
# src/graph/tuning.cc, hwLat (NVLink 5.7, network 6.6). Used when a machine file gives none.
NCCL_RING_LATENCY_US = {"node": 5.7, "network": 6.6}


# The nested performance-model keys, declared for the same engine (each name prefixed with its
# parent in messages: gemm.efficiency, links[1].gbs, collectives.all_reduce.8.gbs).
FRACTION = {"min": 0.0, "exclusive_min": True, "max": 1.0}
GEMM_FIELDS: dict[str, Key] = {
    "efficiency": Key(float, None, "achieved fraction of peak on large GEMMs", **FRACTION),
    "compute_units": Key(
        int,
        None,
        "SMs / CUs per device: tiles are spread over whole units (wave quantisation)",
        min=0,
        exclusive_min=True,
        max=10**6,
    ),
    "tile": Key(list[int], None, "[rows, columns] of a large GEMM's output tile", min=0, exclusive_min=True, length=2),
    "attention_efficiency": Key(float, None, "flash attention's fraction of peak, forward and backward", **FRACTION),
    "attention_backward_efficiency": Key(float, None, "flash attention backward's, where measured apart", **FRACTION),
    "memory_efficiency": Key(float, None, "achieved fraction of hbm_gbs in element-wise kernels", **FRACTION),
}
POSITIVE = {"min": 0.0, "exclusive_min": True}
LINK_FIELDS: dict[str, Key] = {
    "name": Key(str, help="the level's name (nvlink, node, network, ...)"),
    "devices": Key(
        Optional[int], help="devices per domain, growing outwards; null: the network (last level only)", **POSITIVE
    ),
    "gbs": Key(float, help="bandwidth per device per direction, GB/s", **POSITIVE),
    "latency_us": Key(float, help="per-step latency, microseconds", **POSITIVE),
}
FIT_FIELDS: dict[str, Key] = {
    "gbs": Key(float, help="fitted bandwidth, GB/s", **POSITIVE),
    "latency_us": Key(float, help="fitted latency, microseconds", min=0.0),
    "busy_us": Key(
        Optional[float],
        None,
        "extra time of one blocking collective while the node's other ranks compute (CPU ranks sharing "
        "cores: the wait for the group's ranks to be scheduled together), microseconds",
        min=0.0,
    ),
}
COLLECTIVE_RANKS = Key(int, help="group size the fit was measured on (an integer >= 2; p2p: 2)", min=2)
ELEMENTWISE_FIELDS: dict[str, Key] = {
    kind: Key(float, None, f"achieved GB/s of {kind}, in the model's bytes", **POSITIVE) for kind in ELEMENTWISE_KINDS
}
PEAK_FIELDS: dict[str, Key] = {
    precision: Key(float, None, f"dense peak TFLOP/s at {precision}", **POSITIVE)
    for precision in ("bf16", "fp16", "fp32")
}


@dataclass(frozen=True)
class LinkLevel:
    """One level of a node's (or the machine's) link hierarchy, innermost first."""

    name: str
    devices: Optional[int]  # devices per domain of this level; None = the whole machine (network)
    gbs: float  # bandwidth per device per direction when every device of a domain communicates
    latency_us: float


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    scheduler: str
    devices_per_node: int
    device: str
    device_name: str
    memory_per_device_gib: float
    cpu_cores_per_node: int
    intra_node_gbs: float
    inter_node_gbs: float
    binding: str
    launch: str
    template: str
    sources: list[str]
    peak_tflops: Optional[dict[str, float]] = None
    hbm_gbs: Optional[float] = None
    memory_gbs: Optional[float] = None
    fault_gbs: Optional[float] = None
    host_link_gbs: Optional[float] = None
    host_memory_gbs: Optional[float] = None
    host_memory_gib: Optional[float] = None
    nvme_gb: Optional[float] = None
    nvme_read_gbs: Optional[float] = None
    nvme_write_gbs: Optional[float] = None
    filesystem: Optional[str] = None
    filesystem_write_gbs: Optional[float] = None
    filesystem_read_gbs: Optional[float] = None
    checkpoint_setstripe: Optional[dict[Any, str]] = None
    gemm: Optional[dict[str, Any]] = None
    links: Optional[list[dict[str, Any]]] = None
    op_overhead_us: Optional[float] = None
    collectives: Optional[dict[str, dict[int, dict[str, float]]]] = None
    network_collectives: Optional[dict[str, dict[int, dict[str, float]]]] = None
    elementwise_gbs: Optional[dict[str, float]] = None
    defaults: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    path: Optional[Path] = None

    @property
    def memory_per_device_bytes(self) -> float:
        return self.memory_per_device_gib * 2**30

    def setstripe(self, checkpoint_gb: float) -> str:
        """The lfs setstripe options for a checkpoint of `checkpoint_gb` (`checkpoint_setstripe`: the
        largest size at or below it); empty where none applies."""
        fits = [least for least in (self.checkpoint_setstripe or {}) if least <= checkpoint_gb]
        return (self.checkpoint_setstripe or {})[max(fits)] if fits else ""

    def peak(self, precision: str) -> Optional[float]:
        """Peak TFLOP/s per device at `precision`: the peak table's for `device_name`
        (app/metrics/peaks.py, the one MFU uses), unless the file gives its own (`peak_tflops`:
        a calibrated CPU); None where neither knows it."""
        if self.peak_tflops is not None and precision in self.peak_tflops:
            return self.peak_tflops[precision]
        return peak_tflops(self.device_name, precision)

    def link_levels(self) -> list[LinkLevel]:
        """The link hierarchy, innermost first, ending with the network."""
        if self.links:
            return [
                LinkLevel(str(x["name"]), x.get("devices"), float(x["gbs"]), float(x["latency_us"])) for x in self.links
            ]
        return [
            LinkLevel("node", self.devices_per_node, self.intra_node_gbs, NCCL_RING_LATENCY_US["node"]),
            LinkLevel("network", None, self.inter_node_gbs / self.devices_per_node, NCCL_RING_LATENCY_US["network"]),
        ]

    def measured_collectives(self, size: int, network: bool = False) -> dict[str, tuple[float, float]]:
        """(bandwidth bytes/s, latency s) of each collective measured on groups of `size` ranks,
        and the pairs' p2p: inside a node, or across nodes (`network`: a group that crosses them)."""
        out = {}
        for op, by_size in ((self.network_collectives if network else self.collectives) or {}).items():
            fit = by_size.get(2 if op == "p2p" else size)
            if fit is not None:
                out[op] = (fit["gbs"] * 1e9, fit["latency_us"] * 1e-6)
        return out

    def busy_seconds(self, op: str, size: int, network: bool = False) -> float:
        """The extra time of one blocking `op` on a group of `size` ranks while the other ranks
        compute (`busy_us`, measured by app.plan.calibrate for each collective and p2p; 0 where
        not measured, as on GPUs, whose ranks do not share cores). A collective without its own
        figure (machine files calibrated before it was timed per op) takes the all-reduce's: the
        wait is for the group's ranks to run together, whatever the op. `network`: the figures
        measured across nodes, where there are any (else those inside a node: the same cores wait)."""
        collectives = (self.network_collectives if network else None) or self.collectives or {}
        if op == "p2p":
            return float((collectives.get("p2p", {}).get(2) or {}).get("busy_us") or 0.0) * 1e-6
        for source in (op, "all_reduce"):
            fit = collectives.get(source, {}).get(size) or {}
            if fit.get("busy_us") is not None:
                return float(fit["busy_us"]) * 1e-6
        return 0.0

    @property
    def host_is_device(self) -> bool:
        """A CPU machine: the ranks compute in host memory, so there is no device<->host link."""
        return self.device_name == "cpu"

    def missing_for_prediction(self, precision: str, offload: str = "none") -> list[str]:
        """The keys the performance model needs that this file lacks (empty: it can predict), for
        a deck at `precision` with `optim.offload` = `offload`: an offloaded update needs the
        host link and host memory (GPU machines; a CPU machine's calibrated rates serve) and, for
        nvme, the node's drive."""
        missing = [] if self.peak(precision) is not None else [f"peak_tflops.{precision}"]
        missing += [] if self.hbm_gbs is not None else ["hbm_gbs"]
        missing += [f"gemm.{k}" for k in ("efficiency", "compute_units", "tile") if k not in (self.gemm or {})]
        needed = [] if offload == "none" or self.host_is_device else ["host_link_gbs", "host_memory_gbs"]
        needed += ["nvme_read_gbs", "nvme_write_gbs"] if offload == "nvme" else []
        return missing + [key for key in needed if getattr(self, key) is None]

    def require_prediction(self, precision: str, offload: str = "none") -> None:
        """MachineError naming the keys `missing_for_prediction` finds, if any: where a step time
        must be predicted (the device constants, the offload rates)."""
        missing = self.missing_for_prediction(precision, offload)
        if missing:
            raise MachineError(
                f"machine {self.name}: cannot predict step times: missing {', '.join(missing)} "
                "(see docs/PERFORMANCE_MODEL.md for each key and its source)"
            )

    def launch_line(self, nodes: int) -> str:
        """The launch line for `nodes` nodes, one rank per device."""
        return self.launch.format(
            nodes=nodes, ranks=nodes * self.devices_per_node, ranks_per_node=self.devices_per_node
        )


def machine_reference() -> list[tuple[str, str, bool, str]]:
    """(key, type, required, help) of every top-level machine key, in FIELDS order: docs/CLUSTERS.md's
    machine file reference."""
    return [(name, type_name(key.type), key.required, key.help) for name, key in FIELDS.items()]


def machine_names(directory: Path = MACHINES_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def machine_path(name_or_path: Union[str, Path]) -> Path:
    """A machine name (`frontier`) is looked up in inputs/machines/; a path is taken as is."""
    text = str(name_or_path)
    if text.endswith((".yaml", ".yml")) or "/" in text:
        return Path(text)
    return MACHINES_DIR / f"{text}.yaml"


def load_machine(name_or_path: Union[str, Path]) -> Machine:
    """Read and validate a machine file; `MachineError` names the file, the key and the fix."""
    path = machine_path(name_or_path)
    if not os.path.lexists(path):
        raise MachineError(
            f"machine {str(name_or_path)!r}: no file {path}; known machines: {', '.join(machine_names())} "
            "(or give the path of a machine YAML)"
        )
    # Bounded like a deck (size, depth, no aliases or tags, UTF-8, a regular file): /dev/zero, a
    # FIFO or an alias bomb given as --machine is one line, not gigabytes or a hang.
    raw = read_yaml_file(path, "machine file", lambda message: MachineError(f"machine file {path}: {message}"),
                         "inputs/machines/frontier.yaml")  # fmt: skip
    try:
        # A null value is the key left out: the Machine's default.
        values = _nested(check(raw, FIELDS, f"machine file {path}", null_is_absent=True), f"machine file {path}")
    except Problem as bad:
        raise MachineError(str(bad)) from None
    machine = Machine(**values, path=path)
    _validate(machine)
    return machine


def _nested(values: dict[str, Any], file: str) -> dict[str, Any]:
    """`values` with the nested performance-model keys checked against their declarations and
    converted (an int given for a float is a float); a Problem names the nested key."""
    out = dict(values)
    for key, fields in (("gemm", GEMM_FIELDS), ("elementwise_gbs", ELEMENTWISE_FIELDS), ("peak_tflops", PEAK_FIELDS)):
        if values.get(key) is not None:
            out[key] = check(values[key], fields, file, prefix=f"{key}.", null_is_absent=True)
    if values.get("links") is not None:
        out["links"] = [_entry(level, LINK_FIELDS, file, f"links[{i}]") for i, level in enumerate(values["links"])]
    ops = {op: Key(dict, None, "{ranks: {gbs, latency_us}}") for op in COLLECTIVE_OPS}
    for key in ("collectives", "network_collectives"):
        if values.get(key) is not None:
            out[key] = {
                op: {
                    check_value(COLLECTIVE_RANKS, ranks, f"{key}.{op}.{ranks}", file): _entry(
                        fit, FIT_FIELDS, file, f"{key}.{op}.{ranks}"
                    )
                    for ranks, fit in by_size.items()
                }
                for op, by_size in check(values[key], ops, file, prefix=f"{key}.", null_is_absent=True).items()
            }
    return out


def _entry(raw: Any, fields: dict[str, Key], file: str, name: str) -> dict[str, Any]:
    """One nested mapping (a link level, a collective's fit) checked against `fields`; a value that is
    not a mapping is named by its key (`check` alone names only the file)."""
    if not isinstance(raw, dict):
        raise Problem(file, name, raw, f"expected a mapping of the keys {', '.join(fields)}")
    return check(raw, fields, file, prefix=f"{name}.")


# lfs setstripe options as they go into a job script: flags, numbers, sizes and pool names only.
SETSTRIPE_OPTIONS = re.compile(r"^[-A-Za-z0-9_ =.]+$")


def _validate(m: Machine) -> None:
    where = f"machine file {m.path}"
    if m.filesystem_read_gbs is not None and m.filesystem_write_gbs is None:
        raise MachineError(f"{where}: filesystem_read_gbs needs filesystem_write_gbs (the save's bandwidth)")
    for least, options in (m.checkpoint_setstripe or {}).items():
        if isinstance(least, bool) or not isinstance(least, (int, float)) or least < 0:
            raise MachineError(
                f"{where}: checkpoint_setstripe key {least!r}: must be a checkpoint size in GB (a number >= 0)"
            )
        if not isinstance(options, str) or not SETSTRIPE_OPTIONS.match(options):
            raise MachineError(
                f"{where}: checkpoint_setstripe.{least} = {options!r}: must be lfs setstripe options (letters, digits, "
                "spaces, - _ = .), e.g. '-c 8 -S 16M'"
            )
    if m.path is not None and m.name != m.path.stem:
        raise MachineError(f"{where}: name = {m.name!r} must equal the file stem {m.path.stem!r}")
    try:
        m.launch.format(**{k: 1 for k in LAUNCH_FIELDS})
    except (KeyError, IndexError, ValueError) as err:
        raise MachineError(
            f"{where}: launch = {m.launch!r}: bad placeholder {err}; accepted: "
            + ", ".join("{" + k + "}" for k in LAUNCH_FIELDS)
        ) from None
    # Between the levels (each level's own keys were checked by _nested).
    last = 0
    for i, level in enumerate(m.links or []):
        devices = level["devices"]
        if (devices is None and i != len(m.links or []) - 1) or (devices is not None and devices <= last):
            raise MachineError(
                f"{where}: links[{i}].devices = {devices!r}: devices must grow outwards (an integer per "
                "domain), with null only on the last level (the network)"
            )
        last = devices or last
    if m.links and m.links[-1]["devices"] is not None:
        n = len(m.links) - 1
        raise MachineError(
            f"{where}: links[{n}].devices = {m.links[n]['devices']}: the last level must be the network "
            "(devices: null), the level groups that cross nodes use; add one, e.g. {name: network, devices: null, "
            "gbs: <per device per direction>, latency_us: <per step>}"
        )
