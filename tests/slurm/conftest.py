"""The Slurm lab cluster for the tests marked ``slurm`` (scripts/slurm-cluster.sh).

A session fixture starts it (root and the packages of scripts/system-deps.sh
needed; without them the tests skip, which under CI is a failure: see
tests/conftest.py) and stops it at the end if this session started it; a
cluster that was already running is left running.

The script's instance variables (``HETFLOW_SLURM_LAB``, ``HETFLOW_SLURM_PORT``,
``HETFLOW_SLURM_NODES``, ``HETFLOW_SLURM_NODE_PORT``, ``HETFLOW_SLURM_FIRST_JOB``)
select the instance: the script reads them from this process's environment,
and :func:`slurm_nodes` gives the tests its node names.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm-cluster.sh"
PROGRAMS = ("slurmctld", "slurmd", "munged", "srun", "salloc", "sinfo")
DEFAULT_NODES = "n1 n2 n3"


def _missing() -> list[str]:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [p for p in PROGRAMS if shutil.which(p, path=path) is None]


@pytest.fixture(scope="session")
def slurm_nodes(slurm_env: dict[str, str]) -> list[str]:
    """The lab cluster's node names as the cluster itself lists them (``scontrol show nodes``), in its
    order, which is the order Slurm allocates an idle cluster's nodes in: the tests hold for any
    instance of scripts/slurm-cluster.sh (``HETFLOW_SLURM_NODES``), not only n1 n2 n3."""
    shown = subprocess.run(["scontrol", "--oneliner", "show", "nodes"], env=slurm_env, capture_output=True,
                           text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    names = [m.group(1) for m in re.finditer(r"^NodeName=(\S+)", shown.stdout, re.MULTILINE)]
    expected = os.environ.get("HETFLOW_SLURM_NODES", DEFAULT_NODES).split()
    assert sorted(names) == sorted(expected), f"the lab cluster has nodes {names}, its script was given {expected}"
    return names


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """The environment (``SLURM_CONF`` set) in which Slurm's commands reach the lab cluster."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm lab cluster needs root (scripts/slurm-cluster.sh runs the daemons as root)")
    missing = _missing()
    if missing:
        pytest.skip(f"the Slurm lab cluster needs {missing}: run scripts/system-deps.sh as root")
    running = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True).returncode == 0
    started = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, f"scripts/slurm-cluster.sh start failed:\n{started.stderr}"
    conf = subprocess.run([str(SCRIPT), "env"], capture_output=True, text=True).stdout.strip().partition("=")[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = conf
    try:
        yield env
    finally:
        if not running:
            stopped = subprocess.run([str(SCRIPT), "stop"], capture_output=True, text=True, timeout=120)
            assert stopped.returncode == 0, f"scripts/slurm-cluster.sh stop failed:\n{stopped.stderr}"
