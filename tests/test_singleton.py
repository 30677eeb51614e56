"""A rank started without a launcher (`python -m app deck`, no mpirun or srun) on a machine without
ssh: Open MPI's singleton start-up needs an rsh agent on PATH, or MPI_Init aborts (a bare GPU image)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.runtime.mpi import singleton_rsh_agent

REPO = Path(__file__).resolve().parent.parent
SSH = ("ssh", "rsh", "slogin", "scp", "sftp")


def _bin_without_ssh(where: Path) -> Path:
    """A directory of links to every program of /usr/bin but ssh's family (a PATH like a container's)."""
    where.mkdir()
    for program in Path("/usr/bin").iterdir():
        if program.name not in SSH and not program.name.startswith("ssh-"):
            (where / program.name).symlink_to(program)
    return where


def test_the_agent_is_set_only_for_a_launcherless_process_without_ssh(tmp_path):
    bare = str(_bin_without_ssh(tmp_path / "bin"))
    env = {"PATH": bare}
    assert singleton_rsh_agent(env) == "false" and env["OMPI_MCA_plm_rsh_agent"] == "false"
    for launched in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK"):  # Open MPI's launchers wire it: no daemon to start
        assert singleton_rsh_agent({"PATH": bare, launched: "0"}) is None
    # Found in review: Slurm's batch step exports SLURM_PROCID=0 (and MPICH's hydra PMI_RANK), yet Open MPI
    # still starts the singleton's daemon there, so the agent was not set and MPI_Init aborted.
    for batch in ("SLURM_PROCID", "PMI_RANK"):
        env = {"PATH": bare, batch: "0"}
        assert singleton_rsh_agent(env) == "false" and env["OMPI_MCA_plm_rsh_agent"] == "false"
    site = {"PATH": bare, "OMPI_MCA_plm_rsh_agent": "/opt/site/ssh"}
    assert singleton_rsh_agent(site) is None and site["OMPI_MCA_plm_rsh_agent"] == "/opt/site/ssh"
    assert singleton_rsh_agent({"PATH": "/usr/bin"}) is None  # ssh is there (setup installs it)


@pytest.mark.parametrize("batch", [{}, {"SLURM_PROCID": "0", "SLURM_JOB_ID": "1"}], ids=["bare", "sbatch-script"])
def test_python_m_app_trains_without_a_launcher_on_a_machine_without_ssh(tmp_path, batch):
    """One step of a tiny deck as `python -m app` with ssh off PATH: MPI starts and training ends
    with 0, also as a line of an sbatch script (Slurm's batch step sets SLURM_PROCID=0; found in
    review: MPI_Init aborted there with Open MPI's message). (This machine's Open MPI aborts MPI_Init
    so without the agent: the first check below.)"""
    bare = _bin_without_ssh(tmp_path / "bin")
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": str(bare), "OMP_NUM_THREADS": "1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **batch}  # fmt: skip
    plain = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], env=env, capture_output=True,
                           text=True, timeout=120, check=False)  # fmt: skip
    print("mpi4py alone without ssh:", plain.returncode, plain.stderr.strip().splitlines()[-1:])
    sets = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32", "train.steps=1",
            "train.global_batch=4", "train.micro_batch=2", "checkpoint.at_exit=false", "run.resume=none",
            f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "app", "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s))],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "gridlm: done" in done.stdout


def test_prepare_in_a_batch_script_on_a_machine_without_ssh(tmp_path):
    """`python -m app.data.prepare` as a line of an sbatch script (SLURM_PROCID=0: it takes MPI's world)
    without ssh: found in review (2026-12-02), it imported mpi4py without the agent and MPI_Init aborted."""
    bare = _bin_without_ssh(tmp_path / "bin")
    (tmp_path / "in.txt").write_text("one document\n\ntwo documents\n")
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": str(bare), "OMP_NUM_THREADS": "1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "SLURM_PROCID": "0",
           "SLURM_JOB_ID": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "app.data.prepare", str(tmp_path / "in.txt"), "--out",
                           str(tmp_path / "corpus")], cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (tmp_path / "corpus.bin").is_file()
