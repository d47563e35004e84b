"""What a run started with, kept where only its user can write: ``runs/RUN/started.json``.

``hetflow resume RUN`` restarts a run from its record in the state store: the script it executes, the
parameters and command-line arguments the script gets, the data directory it writes to.  A store that
users share (a PostgreSQL server, an SQLite file others can write) is written by all of them, so any of
them could change those values in your run's record, and your resume would run your script with values
you never gave (a parameter naming a path to read or to overwrite).  The run's own directory is private
to you (mode 0700, checked when a run starts): the values are written there when the run is created, and
a resume refuses a record that differs from them (:func:`check`).

Decision: a run without the file (made by an older hetflow) is refused too, not resumed with a warning:
the directory read is the one the store names, so a missing file is also what a changed record looks
like.  Starting it again costs little: the stages it finished are reused from the cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ChangedInStore

STARTED = "started.json"
"""The file, in the run's directory."""


def values(*, script: str | None, params: Any, argv: Any, pilot: Any) -> dict[str, Any]:
    """What a resume takes from the run's record: ``pilot`` is the recorded pilot mapping (its ``data_dir``
    is where a resume writes)."""
    return {"script": script, "params": params, "argv": argv, "data_dir": (pilot or {}).get("data_dir")}


def write(run_dir: Path, run_id: str, started: dict[str, Any]) -> None:
    """Write ``started`` (:func:`values` of the record being created) into the new run's directory, 0600."""
    from hetflow import observed
    from hetflow.tasks.paths import write_private_file

    try:
        text = json.dumps({"run": run_id, **started}, sort_keys=True)
    except (TypeError, ValueError):
        return  # not JSON: the store refuses to record the run the same way, naming it
    with observed.not_recording():  # hetflow's own file, not one the script's top level opened
        write_private_file(Path(run_dir) / STARTED, text.encode(), base=run_dir)


def check(record: Any) -> None:
    """Refuse (:class:`~hetflow.errors.ChangedInStore`, one line) to resume ``record`` (a run's row) when
    its script, params, argv or data directory differ from what the run started with, or when that was
    not kept or could have been written by another user."""
    _compare(record, _kept(record, Path(record.run_dir)), values(script=record.script, params=record.params,
                                                                   argv=record.argv, pilot=record.pilot))


def check_kept_data_dir(record: Any, run_dir: Path) -> None:
    """Refuse (:class:`~hetflow.errors.ChangedInStore`) to resume ``record`` from Python code
    (``pipe.run(run_id=...)``) into the data directory its record names when that is not the one the run
    started with (kept in ``run_dir``, the run's directory as the record names it: its ``started.json`` must
    be this user's and name this run, so a record pointing elsewhere is refused too).

    Decision: the params, argv and script of such a resume are the caller's own (its code gives them), so
    only the data directory, which it takes from the store, is compared: a user of a shared store who named
    a directory (or bucket) of theirs would otherwise receive the run's new outputs, and could swap them
    before the next stage reads them."""
    _compare(record, _kept(record, run_dir), {"data_dir": (record.pilot or {}).get("data_dir")})


def _kept(record: Any, run_dir: Path) -> dict[str, Any]:
    from hetflow import observed
    from hetflow.tasks.errors import UnsafeShippedFunction
    from hetflow.tasks.shipping import read_checked

    path = run_dir / STARTED
    if not path.is_file() and not path.is_symlink():
        raise ChangedInStore(f"run {record.id} has no record of what it started with ({path} is missing: a run of "
                             "an older hetflow, or its directory is not where the store says): refusing to resume "
                             "it from the store's params and argv alone, which any user of a shared store can "
                             "change; start it again (the stages it finished are reused from the cache)")
    try:
        with observed.not_recording():  # hetflow's own file, not one the script's top level reads
            kept = json.loads(read_checked(path, f"run {record.id}", "what it started with",
                                           "the run directory hetflow made", "when the run started"))
    except UnsafeShippedFunction as exc:
        raise ChangedInStore(str(exc)) from None
    except ValueError as exc:
        raise ChangedInStore(f"run {record.id}: {path} is not what hetflow wrote ({exc})") from None
    if not isinstance(kept, dict) or kept.get("run") != record.id:
        raise ChangedInStore(f"run {record.id}: {path} is the record of another run ({kept.get('run')!r}) "
                             "(the store's record of its directory was changed)" if isinstance(kept, dict) else
                             f"run {record.id}: {path} is not what hetflow wrote")
    return kept


def _compare(record: Any, kept: dict[str, Any], now: dict[str, Any]) -> None:
    changed = [name for name in now if _canonical(now[name]) != _canonical(kept.get(name))]
    if changed:
        details = "; ".join(_difference(name, now[name], kept.get(name)) for name in changed)
        raise ChangedInStore(f"run {record.id}'s recorded {' and '.join(changed)} were changed in the store since it "
                             f"started: {details}; refusing to resume it (another user of a shared store may have "
                             "written them); start it again with the values you mean")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _difference(name: str, now: Any, kept: Any) -> str:
    if name == "params" and isinstance(now, dict) and isinstance(kept, dict):
        keys = sorted(set(now) | set(kept), key=str)
        return ", ".join(f"param {key!r} is {_shown(now, key)} in the store, {_shown(kept, key)} when it started"
                         for key in keys if _canonical(now.get(key)) != _canonical(kept.get(key))
                         or (key in now) != (key in kept))
    return f"{name} is {_short(now)} in the store, {_short(kept)} when it started"


def _shown(params: dict[str, Any], key: str) -> str:
    return _short(params[key]) if key in params else "absent"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
