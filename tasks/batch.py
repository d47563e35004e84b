"""The Slurm batch script ``hetflow submit`` writes, and the ``sbatch`` call that submits it.

Pure functions: a pilot and a command in, text or an argv list out.  Every
value that reaches the script is quoted with :func:`shlex.quote` (``#SBATCH``
lines carry only values hetflow formats or checks itself), and ``sbatch``
is called with an argv list, so nothing a user typed is read by a shell as
code.  The job asks for the pilot's nodes whole (``--exclusive``): the
``slurm`` backend then takes cores and GPUs per node from the allocation.  It
also asks to outlive a failed node (``--no-kill``): Slurm then ends only the
steps on that node, and the pilot goes on without it.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from .errors import ConfigError
from .pilot import PilotDescription

PLACEHOLDERS = ("PROJECT_ID", "YOUR_ACCOUNT", "YOUR_QUEUE", "CHANGE_ME")
_DIRECTIVE_VALUE = re.compile(r"[A-Za-z0-9_.,:@%+=/-]+")
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")


def slurm_time(seconds: float) -> str:
    """``seconds`` as Slurm's ``D-HH:MM:SS``, rounded up to whole minutes (Slurm's own unit)."""
    minutes = max(1, math.ceil(seconds / 60))
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def _directive_value(pilot: PilotDescription, key: str, value: str) -> str:
    if any(p in value for p in PLACEHOLDERS):
        raise ConfigError(f"pilot {pilot.name!r}: {key} is {value!r}: set your allocation's {key} "
                          f"(e.g. in a config that says 'extends: {pilot.name}')")
    if not _DIRECTIVE_VALUE.fullmatch(value):
        raise ConfigError(f"pilot {pilot.name!r}: bad value for {key!r}: {value!r} "
                          "(expected a Slurm name: letters, digits and _.,:@%+=/-)")
    return value


def directives(pilot: PilotDescription, *, job_name: str, output: Path) -> list[str]:
    """The ``#SBATCH`` lines for ``pilot``: nodes, time, partition, account, GPUs, name and log file."""
    lines = [f"--job-name={_directive_value(pilot, 'job name', job_name)}", f"--nodes={pilot.nodes}",
             "--exclusive", "--no-kill"]
    if pilot.walltime is not None:
        lines.append(f"--time={slurm_time(pilot.walltime)}")
    if pilot.queue is not None:
        lines.append(f"--partition={_directive_value(pilot, 'queue', str(pilot.queue))}")
    if pilot.account is not None:
        lines.append(f"--account={_directive_value(pilot, 'account', str(pilot.account))}")
    if pilot.gpus_per_node:
        lines.append(f"--gpus-per-node={pilot.gpus_per_node}")
    if "\n" in str(output) or "#" in str(output) or " " in str(output):
        raise ConfigError(f"job log path {str(output)!r} has a space, '#' or a newline: #SBATCH cannot carry it "
                          "(choose another --workdir)")
    lines.append(f"--output={output}")
    return [f"#SBATCH {line}" for line in lines]


def _line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(part) for part in argv)


def batch_script(pilot: PilotDescription, command: Sequence[str], *, job_name: str, output: Path,
                 chdir: Path, successor: Sequence[str] = (), chain: int = 0, resume: Path | None = None) -> str:
    """A bash batch script that runs ``command`` (one argv, quoted) in ``chdir`` inside the job.

    With ``chain`` > 0, ``successor`` runs after ``command`` with the number of further jobs still
    allowed as its last argument: the script's first argument, ``chain`` when it has none (the job
    ``hetflow submit`` made).  The job's exit status is ``command``'s.  ``resume``: the batch script that
    resumes the run (this one), named by the run's summary as the way to resume it
    (``HETFLOW_RESUME_BATCH``): ``hetflow resume`` on a login node would use the script's own pilot.
    """
    body = [
        "#!/bin/bash",
        f"# hetflow pilot {pilot.name!r}: written by hetflow submit",
        *directives(pilot, job_name=job_name, output=output),
        "set -u",
        f"cd {shlex.quote(str(chdir))}",
    ]
    if resume is not None:
        body.append(f"export HETFLOW_RESUME_BATCH={shlex.quote(str(resume))}")
    if chain > 0 and successor:
        body += [f"chain_left=${{1:-{int(chain)}}}", _line(command), "status=$?",
                 _line(successor) + ' "$chain_left"', "exit $status"]
    else:
        body.append("exec " + _line(command))
    return "\n".join(body) + "\n"


def sbatch_argv(script: Path, *, dependency: str | None = None, args: Sequence[str] = ()) -> list[str]:
    """``sbatch --parsable`` of ``script`` with ``args`` (``dependency`` as Slurm writes it: ``afterany:42``)."""
    argv = ["sbatch", "--parsable"]
    if dependency is not None:
        argv.append(f"--dependency={dependency}")
    return [*argv, str(script), *args]


def parse_job_id(reply: str) -> str:
    """The job id from ``sbatch --parsable``'s reply (``ID`` or ``ID;CLUSTER``)."""
    first = reply.strip().splitlines()[0] if reply.strip() else ""
    job_id = first.split(";")[0].strip()
    if not _JOB_ID.fullmatch(job_id):
        raise ConfigError(f"sbatch answered {reply.strip()!r}, not a job id")
    return job_id
