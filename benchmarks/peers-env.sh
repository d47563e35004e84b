#!/usr/bin/env bash
# The environment of the benchmark's MPI dataframe peers (benchmarks/peers_mpi.py): Bodo runs
# SPMD under mpiexec and needs pandas<3; Modin runs on unidist's MPI engine. Kept apart from
# hetflow's .venv so neither pins the other. Idempotent. PYTHON picks the interpreter.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.peers-venv"
test -x "$venv/bin/python" || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q 'bodo' 'pandas<3' 'modin[mpi]' 'unidist[mpi]' mpich mpi4py numpy pyarrow
"$venv/bin/python" -c "import bodo, modin, unidist; print('peers:', 'bodo', bodo.__version__, 'modin', modin.__version__)"
