"""The stages of a run started from Python code, recorded in the run for ``hetflow resume``.

``hetflow resume`` resumes a script's run by executing the script again.  A run
started from a notebook, the prompt, ``python -c`` or stdin has no script; its
stages are recorded instead: each session of the run writes the pipeline's
stages, pickled with cloudpickle as their functions are shipped to workers
(:mod:`hetflow.tasks.shipping`), the pilot and the working directory into
``pipeline.pickle`` in the run's directory (0600, in the 0700 run directory).
``hetflow resume RUN`` loads them from there, from that working directory, and
resumes the run as ``pipe.run(run_id=RUN)`` would in the session that started
it.  A later ``pipe.run(run_id=...)`` from the session writes the file again, so
the shell resumes the newest definitions.

Unpickling runs code: the file is read only when only the user resuming could
have written it (:func:`hetflow.tasks.shipping.read_checked`): another user's
run, or a file or directory others can write, is refused naming it.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RECORDED = "pipeline.pickle"
"""The file, in a run's directory, that holds the stages of a run without a script."""


@dataclass(frozen=True)
class Recorded:
    """A run's recorded pipeline: its name, stages (with their functions), pilot, and working directory."""

    name: str
    stages: dict[str, Any]
    pilot: Any
    cwd: str


def record(run_dir: Path, name: str, stages: Mapping[str, Any], pilot: Any, cwd: Path) -> bool:
    """Write the stages of a run without a script into ``run_dir``; whether they could be recorded.

    Something that cannot be pickled (a stage imported from a module that a worker would import anyway
    pickles by reference, so this is rare) leaves the run resumable from Python code only: it is logged,
    and an older record of the run is removed so that the shell never resumes older stages.
    """
    import cloudpickle

    from hetflow.tasks.paths import write_private_file

    target = Path(run_dir) / RECORDED
    try:
        body = cloudpickle.dumps({"stages": dict(stages), "pilot": pilot})
        data = pickle.dumps({"version": 1, "name": name, "cwd": str(cwd), "body": body})
        write_private_file(target, data, base=run_dir)
    except Exception as exc:  # noqa: BLE001 - whatever a reached value's __reduce__ raises
        log.warning("run in %s: its stages could not be recorded for `hetflow resume` (%s: %s); resume it "
                    "with pipe.run(run_id=...) from the same code", run_dir, type(exc).__name__, exc)
        try:
            target.unlink()
        except OSError:
            pass
        return False
    return True


def load(run_id: str, run_dir: str) -> Recorded:
    """The pipeline recorded in run ``run_id``'s directory, its stages unpickled with the run's working
    directory as the working directory and first on ``sys.path`` (where the session imported its modules
    from): the caller restores both.  :class:`~hetflow.tasks.errors.UnsafeShippedFunction` for a file
    another user could have written; ``FileNotFoundError``/``ValueError`` with a one-line message
    otherwise."""
    import sys

    from hetflow import observed
    from hetflow.tasks.shipping import read_checked

    path = Path(run_dir) / RECORDED
    if not path.is_file() and not path.is_symlink():
        raise FileNotFoundError(f"run {run_id} was started from Python code and has no record of its stages "
                                f"({path} is missing: a run of an older hetflow, or stages that could not be "
                                f"pickled); resume it with pipe.run(run_id={run_id!r}) from the same code")
    with observed.not_recording():
        data = read_checked(path, f"run {run_id}", "its recorded stages", "the run directory hetflow made",
                            "for this run")
    outer = pickle.loads(data)  # checked above: only this user could have written it
    cwd = outer["cwd"]
    if not os.path.isdir(cwd):
        raise ValueError(f"run {run_id} was started in {cwd}, which is no longer a directory; its stages "
                         "import their modules and read their files from there")
    _check_session_dir(run_id, cwd)
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    try:
        body = pickle.loads(outer["body"])
    except Exception as exc:  # noqa: BLE001 - a module the session imported that is gone, say
        raise ValueError(f"run {run_id}: its recorded stages cannot be loaded here ({type(exc).__name__}: "
                         f"{exc}); resume it with pipe.run(run_id={run_id!r}) from the same code") from None
    return Recorded(name=outer["name"], stages=body["stages"], pilot=body["pilot"], cwd=cwd)


def _check_session_dir(run_id: str, cwd: str) -> None:
    """Refuse to import from the run's working directory when another user could have put a module there
    since (owned by someone else, or writable by group or others: a shared ``/tmp``): the stages are
    unpickled with it first on ``sys.path``.  :class:`~hetflow.tasks.errors.UnsafeShippedFunction`."""
    import stat

    from hetflow.tasks.errors import UnsafeShippedFunction

    info = os.stat(cwd)
    problems = []
    if info.st_uid != os.geteuid():
        problems.append(f"it is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"its mode {stat.S_IMODE(info.st_mode):04o} lets group or others write it")
    if problems:
        raise UnsafeShippedFunction(
            f"run {run_id} was started in {cwd}, and {' and '.join(problems)}: a module put there by someone else "
            f"would be imported when its stages are loaded; resume it with pipe.run(run_id={run_id!r}) from the "
            "same session, or start runs from a directory only you can write")
