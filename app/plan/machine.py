"""Machine descriptions: `inputs/machines/<name>.yaml`.

A machine file says what a node holds (devices, memory per device, cores), how fast its
links are (with sources), which scheduler it runs and how ranks are launched on it. The
dry run uses it to place ranks on nodes and check memory; `launch/submit.py` uses it to
write job scripts. The keys, their types and their meaning are declared once, in
`FIELDS`; a wrong key or value is named with the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from app.errors import GridlmError

MACHINES_DIR = Path(__file__).resolve().parents[2] / "inputs" / "machines"
SCHEDULERS = ("slurm", "pbs")
# per-task: the launcher gives each rank one device (it sees device 0);
# all-visible: every rank sees the node's devices and picks one by its local rank.
BINDINGS = ("per-task", "all-visible")
LAUNCH_FIELDS = ("nodes", "ranks", "ranks_per_node")

# key -> (type, required, help). The README's machine reference is built from it.
FIELDS: dict[str, tuple[type, bool, str]] = {
    "name": (str, True, "short name, = the file stem (used by --machine)"),
    "description": (str, True, "one line: site, system, node type"),
    "scheduler": (str, True, "slurm or pbs"),
    "devices_per_node": (int, True, "GPUs (GCDs on MI250X) per node = ranks per node"),
    "device": (str, True, "the device, in words"),
    "device_name": (str, True, "name as torch reports it (matched against the peak table), or cpu"),
    "peak_tflops": (dict, False, "dense peak TFLOP/s per device by precision (bf16, fp16, fp32); null for CPUs"),
    "memory_per_device_gib": (float, True, "device memory in GiB (for a CPU machine: host memory per rank)"),
    "cpu_cores_per_node": (int, True, "CPU cores per node usable by ranks"),
    "intra_node_gbs": (float, True, "device-to-device bandwidth inside a node, GB/s per direction"),
    "inter_node_gbs": (float, True, "network injection bandwidth per node, GB/s per direction"),
    "binding": (str, True, "per-task (one device per rank) or all-visible (local rank picks)"),
    "launch": (str, True, "launch line; {nodes}, {ranks} and {ranks_per_node} are filled in"),
    "template": (str, True, "job-script template in launch/jobs/"),
    "defaults": (dict, False, "scheduler defaults for submit.py: time, partition/queue, qos, constraint, ..."),
    "sources": (list, True, "where the figures come from (URLs, papers)"),
    "notes": (str, False, "anything a user of the machine should know"),
}


class MachineError(GridlmError):
    """A machine file is missing, or a key in it is unknown or has a bad value."""


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
    defaults: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    path: Optional[Path] = None

    @property
    def memory_per_device_bytes(self) -> float:
        return self.memory_per_device_gib * 2**30

    def peak(self, precision: str) -> Optional[float]:
        """Peak TFLOP/s per device at `precision`, or None (CPUs, or a precision not listed)."""
        return None if self.peak_tflops is None else self.peak_tflops.get(precision)

    def launch_line(self, nodes: int) -> str:
        """The launch line for `nodes` nodes, one rank per device."""
        return self.launch.format(
            nodes=nodes, ranks=nodes * self.devices_per_node, ranks_per_node=self.devices_per_node
        )


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
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise MachineError(
            f"machine {str(name_or_path)!r}: no file {path}; known machines: {', '.join(machine_names())} "
            "(or give the path of a machine YAML)"
        ) from None
    except (OSError, yaml.YAMLError) as err:
        raise MachineError(f"machine file {path}: not readable YAML ({err})") from None
    if not isinstance(raw, dict):
        raise MachineError(f"machine file {path}: expected a mapping of the keys {', '.join(FIELDS)}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in FIELDS:
            raise MachineError(f"machine file {path}: unknown key {key!r}; accepted: {', '.join(FIELDS)}")
        values[key] = _check(path, key, value)
    missing = [k for k, (_, required, _) in FIELDS.items() if required and k not in values]
    if missing:
        raise MachineError(f"machine file {path}: missing key(s) {', '.join(missing)}")
    machine = Machine(**values, path=path)
    _validate(machine)
    return machine


def _check(path: Path, key: str, value: Any) -> Any:
    want, _, help_ = FIELDS[key]
    if value is None and key in ("peak_tflops", "defaults", "notes"):
        return None if key == "peak_tflops" else ({} if key == "defaults" else "")
    ok = isinstance(value, want) and not isinstance(value, bool)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise MachineError(f"machine file {path}: {key} = {value!r}: expected {want.__name__} ({help_})")
    if want in (int, float) and value <= 0:
        raise MachineError(f"machine file {path}: {key} = {value!r}: must be > 0")
    return value


def _validate(m: Machine) -> None:
    where = f"machine file {m.path}"
    if m.path is not None and m.name != m.path.stem:
        raise MachineError(f"{where}: name = {m.name!r} must equal the file stem {m.path.stem!r}")
    if m.scheduler not in SCHEDULERS:
        raise MachineError(f"{where}: scheduler = {m.scheduler!r}: accepted: {', '.join(SCHEDULERS)}")
    if m.binding not in BINDINGS:
        raise MachineError(f"{where}: binding = {m.binding!r}: accepted: {', '.join(BINDINGS)}")
    try:
        m.launch.format(**{k: 1 for k in LAUNCH_FIELDS})
    except (KeyError, IndexError, ValueError) as err:
        raise MachineError(
            f"{where}: launch = {m.launch!r}: bad placeholder {err}; accepted: "
            + ", ".join("{" + k + "}" for k in LAUNCH_FIELDS)
        ) from None
    for precision, tflops in (m.peak_tflops or {}).items():
        if precision not in ("bf16", "fp16", "fp32") or not isinstance(tflops, (int, float)) or tflops <= 0:
            raise MachineError(
                f"{where}: peak_tflops.{precision} = {tflops!r}: expected bf16/fp16/fp32 keys with positive numbers"
            )
