#!/usr/bin/env bash
# gridlm setup: MPI + parallel HDF5 (apt, when none is on PATH), the HDF5 command-line
# tools (h5ls, h5dump), a .venv with torch, mpi4py, h5py built against parallel HDF5,
# tokenizers (app.data.prepare), safetensors + transformers (checkpoint export), matplotlib (scaling plots), tensorboard, the test tools,
# and the app (editable; it builds the C checksum kernel, app/checkpoint/_checksum.c, in place).
# Idempotent and prompt-free; a second run with everything present takes seconds.
#
# Environment knobs:
#   GRIDLM_VENV        where the venv lives            (default: <repo>/.venv)
#   GRIDLM_PYTHON      interpreter that creates it      (default: the distribution's python3, see below)
#   GRIDLM_TORCH_SPEC  pip requirement for torch        (default: torch==2.13.0)
#   GRIDLM_WHEEL_CACHE where the h5py wheel built here is kept for the next setup
#                      (default: ~/.cache/gridlm/wheels; empty: none kept)
#   GRIDLM_FORCE_SETUP=1  redo every step even if the stamp says it is done
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GRIDLM_VENV:-$repo/.venv}"
# The interpreter: GRIDLM_PYTHON; else the distribution's /usr/bin/python3 where it is 3.9 or newer
# and can make a venv and build extensions (venv, ensurepip and Python.h present); else python3 on
# PATH. Distributions build CPython with profile-guided and link-time optimisation; pyenv's default
# build, first on PATH on this kind of machine, does not, and the test suite's Python ran slower on
# it: 12-20% more user time for the same tests, 4-13% more wall time (2026-11-30, alternating
# runs). On a cluster /usr/bin/python3 is often older than 3.9 and the loaded module's python3 is
# used; a venv keeps the interpreter it was made with (delete it to switch).
pick_python() {
  if [ -n "${GRIDLM_PYTHON:-}" ]; then
    echo "$GRIDLM_PYTHON"
  elif [ -x /usr/bin/python3 ] && /usr/bin/python3 - <<'PY' >/dev/null 2>&1; then
import ensurepip, os, sys, sysconfig, venv  # noqa: F401
sys.exit(0 if sys.version_info >= (3, 9) and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PY
    echo /usr/bin/python3
  else
    echo python3
  fi
}
python="$(pick_python)"
torch_spec="${GRIDLM_TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.gridlm-setup-stamp"

say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

# The stamp records the inputs of this script; any change to them redoes the setup.
want_stamp="$(cat "$repo/launch/setup.sh" "$repo/setup.py" "$repo/app/checkpoint/_checksum.c" | sha256sum | cut -c1-16) $torch_spec"

venv_ok() {
  # From / : `app` must come from the venv's editable install of this checkout, not from the current
  # directory (a venv shared with another checkout's setup points at that one; scripts run from
  # benchmarks/ would import it).
  [ -x "$venv/bin/python" ] && command -v mpirun >/dev/null 2>&1 &&
    (cd / && "$venv/bin/python" - "$repo" <<'PY' >/dev/null 2>&1)
import importlib.util, os, sys
import h5py, hypothesis, matplotlib, mpi4py, numpy, pytest, safetensors, tokenizers, torch, xdist, yaml, app  # noqa: F401
import app.checkpoint._checksum  # noqa: F401  # the C kernel pip install -e . builds in place
assert h5py.get_config().mpi and importlib.util.find_spec("transformers") and importlib.util.find_spec("tensorboard")
assert os.path.realpath(app.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
PY
}

if [ "${GRIDLM_FORCE_SETUP:-0}" != 1 ] && [ -f "$stamp" ] &&
  [ "$(cat "$stamp")" = "$want_stamp" ] && venv_ok; then
  say "everything present ($venv)"
  exit 0
fi

# --- 1. MPI and parallel HDF5 ------------------------------------------------------
if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
  say "using MPI on PATH: $(command -v mpirun)"
else
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    die "no mpicc/mpirun on PATH and cannot apt-get (need root on Debian/Ubuntu).
  Fix: load your machine's MPI and parallel-HDF5 modules (e.g. 'module load openmpi hdf5-parallel')
  or, as root, run: apt-get install openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config"
  fi
  say "installing OpenMPI and parallel HDF5 with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config >/dev/null
fi
command -v mpicc >/dev/null 2>&1 || die "mpicc still missing after install"
# h5ls / h5dump: users read checkpoints with them (the tests list a checkpoint with h5ls -r).
if ! command -v h5ls >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing the HDF5 command-line tools (hdf5-tools)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends hdf5-tools >/dev/null ||
      { apt-get update -qq && apt-get install -y -qq --no-install-recommends hdf5-tools >/dev/null; }
  else
    say "warning: no h5ls on PATH and cannot apt-get: install the HDF5 tools (e.g. 'module load hdf5') to inspect checkpoints with h5ls/h5dump"
  fi
fi

# --- 2. the virtual environment ------------------------------------------------------
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv with $python ($("$python" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo '?'))"
  "$python" -m venv "$venv" || die "'$python -m venv' failed (on Debian: apt-get install python3-venv)"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# pip byte-compiles every file it installs, on one core: 50 of the 80 s these installs took on a
# 2-core machine, for 11,700 files of which 2,600 are transformers' model zoo that gridlm never
# imports. So pip installs without it and compileall does it on every core: torch's files beside
# the second install (pip keeps one core busy), then the rest but the unused models. The bytecode
# must be there: where PYTHONDONTWRITEBYTECODE is set (batch environments often set it), every
# process would compile torch's modules anew at its start.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
compile=("$venv/bin/python" -m compileall -q -q)

compiling=""
if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  say "installing $torch_spec"
  "${pip[@]}" install --no-compile "$torch_spec"
  "${compile[@]}" "$site/torch" &
  compiling=$!
fi
say "installing numpy, pyyaml, mpi4py, safetensors, tokenizers, transformers, matplotlib, tensorboard, pytest tools and h5py build tools"
"${pip[@]}" install --no-compile numpy pyyaml mpi4py safetensors tokenizers transformers matplotlib tensorboard pytest pytest-mpi pytest-timeout pytest-xdist hypothesis ruff \
  "Cython>=3,<4" pkgconfig "setuptools>=77" wheel
# The rest compiles beside h5py's and gridlm's installs (waited for before the final check).
# compileall exits 1 for a file that does not compile (torch ships one in Python 3.12 syntax):
# skipped, as pip skips it.
[ -z "$compiling" ] || wait "$compiling" || true
say "byte-compiling the installed packages (beside the next steps)"
"${compile[@]}" -j 0 -x '/transformers/models/(?!(__init__|auto/|gpt2/|llama/|mixtral/))' "$site" &
compiling=$!

# --- 3. h5py against parallel HDF5 -----------------------------------------------------
h5py_mpi() { "$venv/bin/python" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)'; }
if ! h5py_mpi >/dev/null 2>&1; then
  "${pip[@]}" uninstall -y h5py >/dev/null 2>&1 || true
  h5env=(CC=mpicc HDF5_MPI=ON H5PY_SETUP_REQUIRES=0)
  if [ -n "${HDF5_DIR:-}" ]; then
    say "h5py against HDF5_DIR=$HDF5_DIR"
    hdf5="$HDF5_DIR"
  elif pkg-config --exists hdf5-openmpi 2>/dev/null; then
    h5env+=(HDF5_PKGCONFIG_NAME=hdf5-openmpi)
    hdf5="hdf5-openmpi $(pkg-config --modversion hdf5-openmpi)"
  elif pkg-config --exists hdf5-mpich 2>/dev/null; then
    h5env+=(HDF5_PKGCONFIG_NAME=hdf5-mpich)
    hdf5="hdf5-mpich $(pkg-config --modversion hdf5-mpich)"
  else
    hdf5="default"
  fi
  # The wheel built here is kept outside the checkout, for the next setup of any checkout (a fresh
  # clone in CI): the build is half of a fresh setup's 4 minutes, the install 1 s. Keyed by the
  # interpreter, the HDF5 and the MPI compiler it was built with; a kept wheel that does not import
  # with MPI is thrown away and built again. GRIDLM_WHEEL_CACHE="" keeps none.
  cache="${GRIDLM_WHEEL_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/gridlm/wheels}"
  key="$( { "$venv/bin/python" -c 'import sys; print(sys.version, sys.implementation.cache_tag)'; echo "$hdf5"
            mpicc -show 2>/dev/null || true; } | sha256sum | cut -c1-16)"
  kept="${cache:+$cache/h5py-$key}"
  if [ -n "$kept" ] && ls "$kept"/h5py-*.whl >/dev/null 2>&1; then
    say "installing h5py from the wheel built before against parallel HDF5 ($kept)"
    "${pip[@]}" install --no-deps "$kept"/h5py-*.whl >/dev/null 2>&1 || true
    h5py_mpi >/dev/null 2>&1 || { say "that wheel does not import with MPI: building again"; rm -rf "$kept"; "${pip[@]}" uninstall -y h5py >/dev/null 2>&1 || true; }
  fi
  if ! h5py_mpi >/dev/null 2>&1; then
    # Parallel C build of the extension modules; the cfg path must be absolute.
    cfg="$(mktemp --suffix=.cfg)" built="$(mktemp -d)"
    printf '[build_ext]\nparallel = %s\n' "$(nproc)" >"$cfg"
    say "building h5py against parallel HDF5 (about 2 minutes the first time)"
    # Without --no-build-isolation pip compiles an old mpi4py from source: >20 min, >20 GB.
    env "${h5env[@]}" DIST_EXTRA_CONFIG="$cfg" \
      "${pip[@]}" wheel --no-build-isolation --no-binary=h5py --no-deps -w "$built" h5py
    "${pip[@]}" install --no-deps "$built"/h5py-*.whl
    if [ -n "$kept" ] && h5py_mpi >/dev/null 2>&1 && mkdir -p "$kept" 2>/dev/null; then
      cp "$built"/h5py-*.whl "$kept"/ 2>/dev/null || say "warning: could not keep the h5py wheel in $kept"
    fi
    rm -rf "$cfg" "$built"
  fi
fi
h5py_mpi ||
  die "h5py is not built against parallel HDF5 (h5py.get_config().mpi is False).
  Fix: make sure mpicc and a parallel HDF5 (libhdf5-openmpi-dev, or HDF5_DIR) are visible, then
  GRIDLM_FORCE_SETUP=1 launch/setup.sh"

# --- 4. the app itself ---------------------------------------------------------------
say "installing gridlm (editable)"
"${pip[@]}" install --no-build-isolation --no-deps -e "$repo"

wait "$compiling" || true
venv_ok || die "the environment does not import (torch, h5py, matplotlib, mpi4py, yaml, pytest, app); see messages above"
echo "$want_stamp" >"$stamp"
say "done: $("$venv/bin/python" -c 'import torch, h5py, mpi4py; print("torch", torch.__version__, "| h5py", h5py.__version__, "(mpi) | mpi4py", mpi4py.__version__)')"
