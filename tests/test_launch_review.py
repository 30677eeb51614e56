"""Job scripts checked against the sites' own documentation (review of launch/, 2026-12): each test
renders a machine's script with launch/submit.py and runs it under bash with stand-ins for the site's
`srun` and `module`, which record what the ranks would get. Serial: no MPI, no scheduler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.plan.machine import load_machine
from app.runtime.mpi import device_index
from conftest import REPO
from launch import study as study_cli
from launch import submit

TINY = REPO / "inputs" / "gpt_tiny.yaml"
# The launcher stand-in: writes the environment the ranks would start with, one NAME=value a line.
RECORD_ENV = '#!/bin/sh\nenv > "{out}"\n'


def write_script(tmp_path: Path, monkeypatch, machine: str, nodes: int = 2) -> Path:
    """The job script of gpt_tiny on `nodes` nodes of `machine`, written by submit.py into tmp_path."""
    monkeypatch.chdir(tmp_path)
    batch = 4 * nodes * load_machine(machine).devices_per_node  # micro_batch 4 on every rank
    out = tmp_path / f"{machine}.sh"
    argv = [str(TINY), "--machine", machine, "--nodes", str(nodes), "--out", str(out), "--account", "abc123",
            "--set", f"train.global_batch={batch}"]  # fmt: skip
    assert submit.main(argv) == 0
    return out


def run_job(script: Path, tmp_path: Path, tools: dict[str, str], env: dict[str, str] | None = None) -> dict[str, str]:
    """Run the job script under bash with `tools` ({name: script text}) first on PATH and the test's python;
    the environment the launcher saw (RECORD_ENV's file), and the job's output under the key '_output'."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    seen = tmp_path / "launcher.env"
    for name, text in tools.items():
        (bin_dir / name).write_text(text.format(out=seen, log=tmp_path / f"{name}.log"))
        (bin_dir / name).chmod(0o755)
    base = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
            "GRIDLM_VENV": "/nonexistent", "SLURM_JOB_NUM_NODES": "2"}  # fmt: skip
    done = subprocess.run(["bash", str(script)], env={**base, **(env or {})}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    got = dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)
    got["_output"] = done.stdout + done.stderr
    return got


def test_perlmutter_ranks_use_the_gpu_next_to_their_cores(tmp_path, monkeypatch):
    """Found in review: Perlmutter's GPUs are numbered against its NUMA domains (GPU 3 sits next to cores
    0-15, GPU 0 next to 48-63: `nvidia-smi topo -m`; NERSC's and WarpX's Perlmutter job scripts set
    CUDA_VISIBLE_DEVICES=$((3-SLURM_LOCALID))). `srun -c 32 --cpu-bind=cores` gives local rank r the cores
    16r..16r+15 (NUMA domain r), but the script set no GRIDLM_GPU_ORDER, so rank r took GPU r: every rank's
    host copies (offload, checkpoint gathers, data) crossed to another NUMA domain. Polaris, the same
    HPE node design, already reversed the order."""
    script = write_script(tmp_path, monkeypatch, "perlmutter")
    got = run_job(script, tmp_path, {"srun": RECORD_ENV})
    order = got.get("GRIDLM_GPU_ORDER")
    # The GPU the app picks for each local rank (the same function the ranks call, 4 GPUs visible).
    picked = [device_index(rank, 4, 4, "nid001", order) for rank in range(4)]
    assert picked == [3, 2, 1, 0], f"GRIDLM_GPU_ORDER={order!r}"


def test_alps_turns_off_nccl_ll128_and_sets_cscs_libfabric_variables(tmp_path, monkeypatch):
    """Found in review: on GH200 over Slingshot, NCCL's LL128 protocol corrupts data silently (the NIC writes
    through NVLink-C2C and a 128-byte line's flag can be seen before its data: NVIDIA/nccl#2001, #2053), and
    NCCL >= 2.27 enables it there. CSCS's NCCL page sets NCCL_PROTO=^LL128 with FI_CXI_DEFAULT_TX_SIZE=32768
    and FI_CXI_RX_MATCH_MODE=software, "for correctness and optimal performance"; the script set none."""
    script = write_script(tmp_path, monkeypatch, "alps")
    got = run_job(script, tmp_path, {"srun": RECORD_ENV})
    assert "LL128" in got.get("NCCL_PROTO", "") and got["NCCL_PROTO"].startswith("^")  # every protocol but LL128
    assert got.get("FI_CXI_DEFAULT_TX_SIZE") == "32768"
    assert got.get("FI_CXI_RX_MATCH_MODE") == "software"
    assert got.get("NCCL_NET") == "AWS Libfabric"  # unchanged: a missing plugin stays an error
    # A protocol list the user exported before sbatch is theirs to keep.
    (tmp_path / "launcher.env").unlink()
    got = run_job(script, tmp_path, {"srun": RECORD_ENV}, {"NCCL_PROTO": "Simple"})
    assert got["NCCL_PROTO"] == "Simple"


# `module` as on Frontier (Lmod): logs each call; `load rccl-net-plugin` puts the plugin's lib on the path.
FAKE_MODULE = """#!/bin/sh
echo "$*" >> "{log}"
[ "$1 $2" = "load rccl-net-plugin" ] || exit 0
[ -z "$NO_PLUGIN_MODULE" ]
"""


@pytest.mark.parametrize("module_there", [True, False])
def test_frontier_loads_olcfs_rccl_plugin_module_and_asks_for_its_network_setting(tmp_path, monkeypatch, module_there):
    """Found in review: OLCF's PyTorch guide has RCCL reach Slingshot through the rccl-net-plugin module,
    loaded after rocm ("some settings are critical for RCCL correctness"), in jobs that request
    --network=disable_rdzv_get (the module sets FI_CXI_RDZV_PROTO=alt_read). The script loaded no such
    module and asked for no such network: unless the user built the plugin and exported GRIDLM_RCCL_PLUGIN,
    RCCL ran over TCP sockets, which OLCF says does not scale to Frontier's job sizes."""
    script = write_script(tmp_path, monkeypatch, "frontier")
    text = script.read_text()
    assert "#SBATCH --network=disable_rdzv_get\n" in text
    assert text.index("#SBATCH --network=") < text.index("\nset -eo pipefail")  # a directive, read by sbatch
    env = {} if module_there else {"NO_PLUGIN_MODULE": "1"}
    got = run_job(script, tmp_path, {"srun": RECORD_ENV, "module": FAKE_MODULE}, env)
    calls = (tmp_path / "module.log").read_text().splitlines()
    loads = [c for c in calls if c.startswith("load ")]
    assert "rocm" in loads[0].split() and loads[1] == "load rccl-net-plugin", calls  # the plugin after rocm
    if module_there:
        assert "RCCL uses TCP sockets" not in got["_output"]
    else:  # the job still runs, and says what it lacks
        assert "no module rccl-net-plugin and GRIDLM_RCCL_PLUGIN is unset" in got["_output"]
    # A plugin of one's own replaces the module.
    (tmp_path / "module.log").unlink()
    got = run_job(script, tmp_path, {"srun": RECORD_ENV, "module": FAKE_MODULE}, {"GRIDLM_RCCL_PLUGIN": "/opt/p/lib"})
    assert "load rccl-net-plugin" not in (tmp_path / "module.log").read_text()
    assert got["LD_LIBRARY_PATH"].split(os.pathsep)[0] == "/opt/p/lib"


def test_submit_all_s_one_at_a_time_example_gives_every_point_the_same_job_name(tmp_path, monkeypatch, capsys):
    """Found in review: submit_all.sh told the user to pass `--dependency=singleton to run one at a time`,
    but singleton only waits for earlier jobs of the same name and user, and every point's script has
    its own name (<study>-n1, -n2, ...): with the advice as given, all points ran at once. The example
    now names the job as well; sbatch's command line overrides the scripts' #SBATCH --job-name."""
    monkeypatch.chdir(tmp_path)
    assert study_cli.main([str(REPO / "inputs" / "studies" / "local_weak.yaml")]) == 0
    capsys.readouterr()
    jobs = tmp_path / "jobs" / "local_weak"
    comment = next(line for line in (jobs / "submit_all.sh").read_text().splitlines() if "singleton" in line)
    # The arguments it suggests: from "or " to " to run one at a time".
    suggested = comment.split(" or ", 1)[1].split(" to run one at a time")[0].split()
    assert "--dependency=singleton" in suggested
    given = [a.split("=", 1)[1] for a in suggested if a.startswith("--job-name=")]
    names = set()
    for script in sorted(jobs.glob("local_weak-n*.sh")):
        (own,) = [
            line.split("=", 1)[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH --job-name=")
        ]
        names.add(given[-1] if given else own)  # sbatch's --job-name wins over the script's
    assert len(list(jobs.glob("local_weak-n*.sh"))) == 3
    assert len(names) == 1, f"singleton would not serialise jobs named {sorted(names)}"
