"""One task as one Slurm job step: the ``srun`` argv of the ``slurm`` backend.

Rank ``r`` runs on ``hosts[slots[r].node]``: ``--nodelist`` repeats each
rank's node in rank order and ``--distribution=arbitrary`` keeps that order,
so the step has exactly the ranks per node the pilot's scheduler chose.
``--exact`` gives the step only the CPUs it asks for (so steps run side by
side), ``--cpus-per-task`` and ``--gpus-per-task`` the slot's counts;
``--cpu-bind=cores`` binds every rank to its own cores of the step.  Slurm,
not hetflow, picks the core ids inside a ``--exact`` step (an explicit
``map_cpu`` outside the step's CPUs is refused by Slurm), so hetflow's core ids
set the counts and the rank's record shows the CPUs it ran on.
``--kill-on-bad-exit=1`` ends the step when one rank fails; ``--mpi`` (PMI-2
for MPICH) makes the step's ranks one MPI world.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from ..scheduler import RankSlot
from .base import Launcher


class SrunStep(Launcher):
    """``srun`` inside an allocation, one job step per task (the ``slurm`` backend)."""

    def __init__(self, executable: str = "srun", mpi: str = "pmi2", job_name: str | None = None) -> None:
        self.executable = executable
        self.mpi = mpi
        self.job_name = job_name

    def argv(self, command: Sequence[str], slots: Sequence[RankSlot], hosts: Sequence[str]) -> list[str]:
        if not slots:
            raise ValueError("a job step needs at least one rank slot")
        cores = {len(s.cores) for s in slots}
        gpus = {len(s.gpus) for s in slots}
        if len(cores) > 1 or len(gpus) > 1:
            raise ValueError(f"srun starts ranks of one shape; slots have {sorted(cores)} cores and "
                             f"{sorted(gpus)} GPUs")
        per_rank_cores, per_rank_gpus = max(cores.pop(), 1), gpus.pop()
        rank_hosts = [hosts[s.node] for s in slots]
        argv = [self.executable, f"--nodes={len(set(rank_hosts))}", f"--ntasks={len(slots)}",
                f"--nodelist={','.join(rank_hosts)}", "--distribution=arbitrary",
                f"--cpus-per-task={per_rank_cores}", "--exact", "--cpu-bind=cores",
                "--kill-on-bad-exit=1", f"--mpi={self.mpi}"]
        if per_rank_gpus:
            argv += [f"--gpus-per-task={per_rank_gpus}", "--gpu-bind=none"]
        if self.job_name:
            argv.append(f"--job-name={self.job_name}")
        return argv + list(command)


STEP_ENV_DEFAULTS = {"MPIR_CVAR_CH4_NETMOD": "ofi"}
"""Set in every step unless the user set them.  The PyPI MPICH's default netmod (UCX) publishes a
business card of several KB through Slurm's PMI-1 service in ~1 KB segments; a segment whose hex
does not compress makes a ``put`` line longer than the 1024 bytes slurmstepd reads, the line is cut,
and MPI_Init fails on every rank (exit code 15, ``mpi/pmi2: invalid client request`` in slurmd's
log) -- now and then, depending on the bytes.  OFI's address is a few bytes: one short ``put``.
OFI's automatic progress (``MPIR_CVAR_CH4_OFI_ENABLE_{DATA,CONTROL}_AUTO_PROGRESS``) is left off:
with it, a 4-rank step across two lab nodes hung in MPI_Init now and then (docs/slurm.md); hetflow's
training keeps MPI progressing from a thread instead (:func:`hetflow.ml.distributed.mpi_progress`)."""

SRUN_INPUTS_DROPPED = ("SLURM_HOSTFILE", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS_PER_SOCKET",
                       "SLURM_NTASKS_PER_CORE", "SLURM_NTASKS_PER_GPU", "SLURM_DISTRIBUTION")
"""srun options the allocation's environment may carry that would change the step's layout (a batch
script's ``#SBATCH --ntasks-per-node=1``, as Parsl and RP write them, would otherwise cap every step)."""


def step_env(environ: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a step's ``srun``: ``environ`` without :data:`SRUN_INPUTS_DROPPED`, plus
    ``extra``, plus :data:`STEP_ENV_DEFAULTS` where neither set them."""
    env = {k: v for k, v in environ.items() if k not in SRUN_INPUTS_DROPPED}
    env.update(extra)
    for key, value in STEP_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return env


STEP_ERROR = re.compile(r"^(srun: (error|fatal):|slurmstepd(-[\w.-]+)?: error:|Abort\(|Fatal error in )")
"""The lines of a step's stderr that say why it failed: srun's and slurmstepd's own errors (which name
the node and the tasks) and an MPI library's fatal error (MPI_Init failing inside a rank)."""

REPORTED_LINES = 4


def failure_report(code: int, stderr_text: str | None) -> str:
    """``srun exited with CODE`` and the last few error lines srun and the step wrote.

    srun's exit code alone does not say whether a rank ended by itself, MPI failed to start, or Slurm
    refused the step; its own error lines (``srun: error: n1: tasks 0-1: Exited with exit code 15``)
    name the node and the tasks, so they go into the stage's error text.
    """
    found: list[str] = []
    for line in (stderr_text or "").splitlines():
        line = line.strip()
        if STEP_ERROR.match(line) and line not in found:
            found.append(line[:240])
    lines = found[-REPORTED_LINES:]
    return f"srun exited with {code}" + (": " + " | ".join(lines) if lines else " (no srun error in its log)")
