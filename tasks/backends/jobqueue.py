"""Dask workers as batch jobs: dask-jobqueue's ``SLURMCluster`` for the dask backend.

With ``options.dask.jobqueue: slurm`` the dask backend starts no worker itself:
a ``SLURMCluster`` (its scheduler runs in this process) submits one batch job
per pilot node, each running one Dask worker that holds the node's usable cores
(``--resources cores=N gpus=M``).  The backend tells nodes apart by the workers'
hostnames, so a stage whose ranks span nodes gets the TCP communicator; closing
the cluster cancels the jobs.

A job asks for a whole node (``--exclusive``) and leaves ``--mem`` out, as
Parsl's ``SlurmProvider`` does: hetflow places by cores, and a site's memory
limit per job is not the pilot's ``memory_per_node`` (the worker's Dask memory
limit is).  Options (``pilot.options.dask``): ``worker_init`` (shell lines run
before the worker, e.g. ``module load``), ``scheduler_options`` (extra
``#SBATCH`` lines), ``start_timeout`` (seconds the jobs may take to start and
their workers to connect; default 600).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..paths import private_dir
from ..pilot import PilotDescription

JOBQUEUES = ("slurm",)
"""Values of ``options.dask.jobqueue``: the batch systems whose dask-jobqueue cluster the backend can start."""

JOB_NAME = "hetflow-dask"


def walltime(pilot: PilotDescription) -> str:
    """The pilot's walltime as Slurm's ``HH:MM:SS`` (one hour when it has none)."""
    seconds = int(pilot.walltime or 3600)
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def batch_lines(pilot: PilotDescription, options: Mapping[str, Any]) -> list[str]:
    """``options.scheduler_options`` as sbatch arguments (each line must start with ``#SBATCH``)."""
    lines = []
    for line in str(options.get("scheduler_options", "")).splitlines():
        line = line.strip()
        if not line:
            continue
        if not line.startswith("#SBATCH"):
            raise ConfigError(f"pilot {pilot.name!r}: options.dask.scheduler_options: line {line!r} does not "
                              "start with '#SBATCH' (expected one '#SBATCH --option' per line)")
        lines.append(line[len("#SBATCH"):].strip())
    return lines


def slurm_cluster_kwargs(pilot: PilotDescription, run_dir: Path, options: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the ``SLURMCluster`` for ``pilot`` (pure: nothing is started)."""
    cores = len(pilot.usable_cores())
    base = run_dir / "dask"
    return {
        "cores": cores,
        "processes": 1,
        "memory": f"{pilot.memory_per_node or 2**30}B",
        "nanny": False,
        "job_name": JOB_NAME,
        "queue": pilot.queue,
        "account": pilot.account,
        "walltime": walltime(pilot),
        "job_directives_skip": ["--mem"],
        "job_extra_directives": ["--exclusive", *batch_lines(pilot, options)],
        "job_script_prologue": [line for line in str(options.get("worker_init", "")).splitlines() if line.strip()],
        "local_directory": str(base / "workers"),
        "log_directory": str(base / "logs"),
        "python": sys.executable,
        # one shell word: dask-jobqueue joins these into the job script unquoted
        "worker_extra_args": ["--resources", f"cores={cores},gpus={pilot.gpus_per_node or 0}"],
        # no dashboard; the HTTP server the scheduler always starts on a free loopback port, not :8787
        "scheduler_options": {"dashboard": False, "dashboard_address": "127.0.0.1:0"},
    }


def ended_jobs(cluster: Any) -> list[str]:
    """Ids of the cluster's submitted jobs that Slurm no longer lists as pending or running."""
    ids = [str(job.job_id) for job in list(cluster.workers.values()) if getattr(job, "job_id", None)]
    if not ids:
        return []
    try:
        listed = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(ids)], capture_output=True, text=True,
                                timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return []  # cannot tell: the caller's timeout decides
    return sorted(set(ids) - set(listed.stdout.split()))


def job_error(log_directory: Path, job_id: str) -> str:
    """The last line of a job's stderr (what a worker that could not start said), or where to look."""
    path = log_directory / f"{JOB_NAME}-{job_id}.err"
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return f"{lines[-1][:300]} ({path})" if lines else f"see {path}"


def start_cluster(kind: str, pilot: PilotDescription, run_dir: Path, options: Mapping[str, Any]) -> Any:
    """Start the ``kind`` cluster and ask for one job per pilot node; returns the cluster (``.close()`` it)."""
    if kind != "slurm":
        raise ConfigError(f"pilot {pilot.name!r}: options.dask.jobqueue is {kind!r} (allowed: {list(JOBQUEUES)})")
    try:
        from dask_jobqueue.slurm import SLURMCluster
    except ImportError:
        raise ConfigError(f"pilot {pilot.name!r}: options.dask.jobqueue needs dask-jobqueue: "
                          "pip install 'hetflow[dask]'") from None
    kwargs = slurm_cluster_kwargs(pilot, run_dir, options)
    private_dir(Path(kwargs["local_directory"]))
    private_dir(Path(kwargs["log_directory"]))
    cluster = SLURMCluster(**kwargs)
    try:
        cluster.scale(jobs=pilot.nodes)  # type: ignore[no-untyped-call]
    except BaseException:
        cluster.close()
        raise
    return cluster
