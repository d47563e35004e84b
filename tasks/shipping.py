"""Stage functions shipped by value, for code that has no file a worker could execute again.

A worker finds a stage declared in a script by executing the script
(:mod:`hetflow.tasks.script`).  A stage declared in a Jupyter cell, at the
interactive prompt, in ``python -c`` or in code piped to ``python -`` has no
such file: its function lives in ``__main__``, and its code's file is a name
like ``<stdin>`` or an IPython cell.  Such a function is *shipped*: pickled
with cloudpickle (its code, and by value the functions, classes and values of
``__main__`` that it reaches; installed and importable modules by reference)
once, when the run starts -- the version its cache key is made from -- and
written into each attempt's private directory, from which the worker loads it.

Unpickling runs code, so a worker loads only a file no other user could have
written: a regular file (not a symbolic link) owned by this user and not
writable by group or others, in a directory with the same properties.
Anything else is refused with :class:`UnsafeShippedFunction`, naming the file
and what was expected; a file hetflow wrote (0600 in a 0700 directory) always
passes.
"""

from __future__ import annotations

import inspect
import os
import stat
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hetflow.operators import safeio

from .errors import ShippingFailed, UnsafeShippedFunction

_O_NOFOLLOW = safeio.O_NOFOLLOW
_O_DIRECTORY = safeio.O_DIRECTORY


def ships_by_value(func: Callable[..., Any]) -> bool:
    """Whether the stage function ``func`` is in ``__main__`` without a script file to execute.

    ``hetflow run script.py`` and ``python script.py`` run a file: the function's globals
    name it (``__file__``) and its code comes from it, so its stages keep the script path
    (a worker executes the file).  Code from stdin, ``-c``, the interactive prompt or a
    notebook cell has none: no ``__file__``, one that is no file (``python -`` sets
    ``"<stdin>"``), or code from elsewhere (an IPython cell's name).  Decided from the
    function itself, never from ``sys.modules["__main__"]``: ``hetflow run`` calls
    ``pipe.run()`` for a script that does not, after ``runpy`` has put its own
    ``__main__`` back.
    """
    if getattr(func, "__module__", "__main__") != "__main__":
        return False
    target = inspect.unwrap(func)
    script = getattr(target, "__globals__", {}).get("__file__")
    if not isinstance(script, str) or not os.path.isfile(script):
        return True
    try:
        path = inspect.getsourcefile(target)
    except (TypeError, ValueError):
        return True
    if path is None or not os.path.isfile(path):
        return True
    try:
        return not os.path.samefile(path, script)
    except OSError:
        return True


def dumps(stage: str, func: Callable[..., Any]) -> bytes:
    """``func`` pickled by value (cloudpickle); :class:`ShippingFailed` names ``stage`` when it cannot be."""
    import cloudpickle

    try:
        data: bytes = cloudpickle.dumps(func)
    except Exception as exc:  # noqa: BLE001 - whatever a reached value's __reduce__ raises
        raise ShippingFailed(f"stage {stage!r} is declared without a script file, so it is shipped to its "
                             f"workers pickled, and it cannot be pickled ({type(exc).__name__}: {exc}); keep what "
                             "it reaches picklable (open files, locks and connections are not), or define it in "
                             "a script or module") from None
    return data


LARGE = 64 * 2**20
"""A pickled stage larger than this (bytes) is warned about: it is written into every attempt's directory."""


def pickled(stages: Iterable[Any]) -> dict[str, bytes]:
    """``{stage name: pickled function}`` for the stages (``StageSpec``-like: ``name``, ``func``,
    ``module``) that have no script file: each pickled once, as the run starts."""
    shipped = {spec.name: dumps(spec.name, spec.func) for spec in stages
               if spec.module == "__main__" and ships_by_value(spec.func)}
    for name, data in shipped.items():
        if len(data) > LARGE:
            warnings.warn(f"stage {name!r} pickles to {len(data) // 2**20} MiB (the values of the notebook it "
                          "reads are shipped with it, into every attempt's directory): give large data to it as an "
                          "input dataset or a declared file", stacklevel=2)
    return shipped


def write(path: Path, data: bytes) -> Path:
    """Write the pickled function ``data`` to ``path`` in an attempt directory hetflow made (0600)."""
    from .paths import write_private_file

    return write_private_file(path, data, base=Path(path).parent)


def load(path: Path, stage: str) -> Callable[..., Any]:
    """The stage function pickled in ``path``, after checking that only this user could have written it.

    :class:`UnsafeShippedFunction` (one line naming the file and what was expected) for a
    symbolic link, a file or directory owned by another user or writable by group or others.
    """
    import pickle

    data = read_checked(path, f"stage {stage!r}", "its shipped function", "the attempt directory hetflow made",
                        "for this attempt")
    func = pickle.loads(data)  # checked: only this user could have written it
    if not callable(func):
        raise UnsafeShippedFunction(f"stage {stage!r}: {path} holds a {type(func).__name__}, not a function")
    return func  # type: ignore[no-any-return]


def read_checked(path: Path, who: str, what: str, directory_made: str, written: str) -> bytes:
    """The bytes of ``path``, a pickle of ``who`` (``"stage 'x'"``, ``"run R"``) holding ``what``, once it is
    known that only this user could have written it: a regular file, no symbolic link, owned by this user
    and not writable by group or others, in a directory with the same properties (``directory_made`` and
    ``written`` say, in the message, which one hetflow made).  :class:`UnsafeShippedFunction` otherwise."""
    path = Path(path)
    user = os.geteuid()
    directory = path.parent
    try:  # the file is then opened in the directory checked, whatever its name points at by then
        dfd = os.open(directory, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW)
    except OSError as exc:
        problem = "it is a symbolic link" if os.path.islink(directory) else (exc.strerror or str(exc))
        raise UnsafeShippedFunction(f"{who}: refusing the directory {directory} of {what}: "
                                    f"{problem} (expected {directory_made})") from None
    try:
        _check(who, what, directory, os.fstat(dfd), user, "directory", stat.S_ISDIR)
        try:
            fd = os.open(path.name, os.O_RDONLY | _O_NOFOLLOW, dir_fd=dfd)
        except OSError as exc:
            problem = "it is a symbolic link" if os.path.islink(path) else (exc.strerror or str(exc))
            raise UnsafeShippedFunction(f"{who}: refusing {what} {path}: {problem} "
                                        f"(expected a regular file hetflow wrote {written})") from None
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as fh:
        _check(who, what, path, os.fstat(fh.fileno()), user, "file", stat.S_ISREG)
        return fh.read()


def _check(who: str, what: str, path: Path, info: os.stat_result, user: int, kind: str,
           is_kind: Callable[[int], bool]) -> None:
    problems = []
    if not is_kind(info.st_mode):
        problems.append(f"it is not a {'regular file' if kind == 'file' else kind}")
    if info.st_uid != user:
        problems.append(f"it is owned by uid {info.st_uid}, not by this user (uid {user})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"its mode {stat.S_IMODE(info.st_mode):04o} lets group or others write it")
    if problems:
        raise UnsafeShippedFunction(
            f"{who}: refusing to unpickle {what}: {kind} {path}: {'; '.join(problems)} "
            f"(expected a {kind} owned by this user that group and others cannot write)")
