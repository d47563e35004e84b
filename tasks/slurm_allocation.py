"""The Slurm allocation this process runs in: its nodes, CPUs and GPUs per node, and time left.

Read once, from the job's environment (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``,
``SLURM_JOB_CPUS_PER_NODE``) and Slurm's own tools: ``scontrol show hostnames``
expands the node list, ``scontrol show job -d`` gives the GPUs on each node,
``squeue -o %L`` the time left.  A pilot with ``backend: slurm`` takes its shape
from here (:meth:`PilotDescription.resolve`); the parsers are pure functions.
Outside an allocation, :func:`current_allocation` raises :class:`NoAllocation`,
whose message says how to get one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from .errors import ConfigError


class NoAllocation(ConfigError):
    """``backend: slurm`` outside a Slurm job."""


HOW_TO_GET_ONE = ("backend 'slurm' runs hetflow's pilot inside a Slurm allocation, and this process is "
                  "not in one (SLURM_JOB_ID is not set); get one first, e.g. "
                  "`salloc -N2 --exclusive hetflow run SCRIPT --pilot CONFIG` or `sbatch` a script that runs "
                  "`hetflow run`, or choose another backend (local, radical, parsl, dask)")


@dataclass(frozen=True)
class Allocation:
    """One Slurm job's resources, as hetflow's pilot sees them."""

    job_id: str
    nodes: tuple[str, ...]
    cpus_per_node: tuple[int, ...]
    gpus_per_node: tuple[int, ...]
    seconds_left: float | None
    """``None``: the job has no time limit."""


def expand_counts(text: str) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``"2(x3),1"``) as one count per node: ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ConfigError(f"cannot read the CPUs per node {text!r} (expected e.g. '2(x3),1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def parse_time_left(text: str) -> float | None:
    """``squeue -o %L`` (``"MM:SS"``, ``"HH:MM:SS"``, ``"D-HH:MM:SS"``, ``"UNLIMITED"``) in seconds."""
    text = text.strip()
    if text in ("UNLIMITED", "NOT_SET", "INVALID", ""):
        return None
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not re.fullmatch(r"\d*", days) or not all(p.isdigit() for p in parts) or len(parts) > 3:
        raise ConfigError(f"cannot read the job's time left {text!r} (expected [D-][HH:]MM:SS)")
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return float(seconds + int(days or 0) * 86400)


def gpus_by_node(job_detail: str) -> dict[str, int]:
    """GPUs of the job on each node from ``scontrol show job -d`` (``GRES=gpu:a100:4(IDX:0-3)``)."""
    found: dict[str, int] = {}
    for line in job_detail.splitlines():
        match = re.search(r"\bNodes=(\S+)\s.*\bGRES=(\S*)", line)
        if match is None:
            continue
        count = sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", match.group(2)))
        found[match.group(1)] = count
    return found


def _tool(name: str, *args: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"SLURM_JOB_ID is set but {name!r} is not on PATH; load your site's Slurm module")
    done = subprocess.run([path, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ConfigError(f"`{name} {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def current_allocation() -> Allocation:
    """The allocation of the Slurm job this process runs in; :class:`NoAllocation` outside one."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise NoAllocation(HOW_TO_GET_ONE)
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    cpus = os.environ.get("SLURM_JOB_CPUS_PER_NODE")
    if not nodelist or not cpus:
        raise ConfigError(f"Slurm job {job_id}: SLURM_JOB_NODELIST or SLURM_JOB_CPUS_PER_NODE is not set")
    nodes = tuple(_tool("scontrol", "show", "hostnames", nodelist).split())
    counts = expand_counts(cpus)
    if len(counts) != len(nodes):
        raise ConfigError(f"Slurm job {job_id}: {len(nodes)} nodes ({nodelist}) but CPUs for {len(counts)} ({cpus})")
    detail = _tool("scontrol", "show", "job", "-d", job_id)
    gres: dict[str, int] = {}
    for group, count in gpus_by_node(detail).items():
        for node in _tool("scontrol", "show", "hostnames", group).split():
            gres[node] = count
    left = parse_time_left(_tool("squeue", "-h", "-j", job_id, "-o", "%L"))
    return Allocation(job_id=job_id, nodes=nodes, cpus_per_node=tuple(counts),
                      gpus_per_node=tuple(gres.get(n, 0) for n in nodes), seconds_left=left)
