"""The Slurm allocation this process runs in: its nodes, CPUs and GPUs per node, and time left.

Read once, from the job's environment (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``,
``SLURM_JOB_CPUS_PER_NODE``) and Slurm's own tools: ``scontrol show hostnames``
expands the node list, ``scontrol show job -d`` gives the GPUs on each node,
``squeue -o %L`` the time left.  A pilot with ``backend: slurm`` takes its shape
from here (:meth:`PilotDescription.resolve`); the parsers are pure functions.
:func:`lost_nodes` says which of the job's nodes Slurm has taken away since
(down, failed, not responding, or gone from the job).
Outside an allocation, :func:`current_allocation` raises :class:`NoAllocation`,
whose message says how to get one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from collections.abc import Sequence

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


LOST_STATES = ("down", "fail", "failing", "unknown")
"""Node states (``sinfo %T``, flags stripped) in which no job step runs on a node."""


def node_problems(sinfo_text: str) -> dict[str, str]:
    """The nodes of ``sinfo -h -N -o '%N|%T|%E'`` that no step can use, with Slurm's state and reason.

    A state is lost when its base (``down*`` -> ``down``, ``fail``, ``failing``) is in
    :data:`LOST_STATES` or it ends in ``*`` (slurmctld gets no answer from the node's slurmd).
    """
    found: dict[str, str] = {}
    for line in sinfo_text.splitlines():
        name, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        base = state.rstrip("*~#!%$@^-+")
        if name and (base in LOST_STATES or state.endswith("*")):
            said = f"Slurm says it is {state}" + (f" ({reason.strip()})" if reason.strip() not in ("", "none") else "")
            found[name] = said
    return found


def lost_nodes(job_id: str, nodes: Sequence[str]) -> dict[str, str]:
    """Which of ``nodes`` job ``job_id`` has lost, each with what Slurm says: nodes gone from the job's
    node list (Slurm removes a failed node from a ``--no-kill`` job) or in a lost state
    (:func:`node_problems`).  Empty when Slurm cannot be asked (the failure is then the step's own)."""
    wanted = list(dict.fromkeys(nodes))
    if not wanted:
        return {}
    try:
        listed = _tool("squeue", "-h", "-j", job_id, "-o", "%N").strip()
        current = set(_tool("scontrol", "show", "hostnames", listed).split()) if listed else set()
        found = node_problems(_tool("sinfo", "-h", "-N", "-n", ",".join(wanted), "-o", "%N|%T|%E"))
    except (ConfigError, OSError, subprocess.SubprocessError):
        return {}
    lost = {n: f"node {n} was lost: {found[n]}" for n in wanted if n in found}
    for name in wanted:
        if current and name not in current and name not in lost:
            lost[name] = f"node {name} was lost: Slurm took it out of job {job_id}"
    return lost
