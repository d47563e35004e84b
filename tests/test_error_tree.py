"""One exception tree (issue 29): ``except hetflow.HetflowError`` catches every error hetflow raises.

Every public exception class defined in any module of ``hetflow``, ``hetflow.operators``,
``hetflow.tasks`` and ``hetflow.ml`` is walked, not a list kept by hand: a new error outside the tree
fails here.  The only classes outside it are interrupts and control flow, which must pass an
``except Exception`` (they are ``BaseException``s, never ``Exception``s).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import hetflow as hf
import pytest

PACKAGES = ("hetflow", "hetflow.operators", "hetflow.tasks", "hetflow.ml")
NOT_ERRORS = {
    "hetflow.errors.RunInterrupted",      # Ctrl-C or SIGTERM stopped a run: a KeyboardInterrupt
    "hetflow.errors.Terminated",          # SIGTERM reached the orchestrator: a KeyboardInterrupt
    "hetflow.pipeline.Declared",          # `hetflow submit` stops a script once its pipeline is declared
    "hetflow.tasks.protocol.ScriptImportStop",   # a worker stops a script's import at its run call
}


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        names = [package] + [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")]
        for name in names:
            loaded = importlib.import_module(name)
            for attr, value in vars(loaded).items():
                if (not attr.startswith("_") and inspect.isclass(value) and issubclass(value, BaseException)
                        and value.__module__ == name):
                    found[f"{name}.{attr}"] = value
    return found


def test_every_hetflow_exception_is_under_hetflow_error() -> None:
    classes = _exception_classes()
    assert len(classes) > 40   # the walk reached the errors of all four packages
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, hf.HetflowError))
    assert outside == sorted(NOT_ERRORS), outside
    for name in NOT_ERRORS:   # interrupts and control flow pass an `except Exception`
        assert not issubclass(classes[name], Exception), name


def test_the_root_is_one_class_reexported_by_every_layer() -> None:
    from hetflow.operators import dataset, errors, location, safeio
    from hetflow.tasks import errors as task_errors
    from hetflow.tasks import paths

    assert hf.HetflowError is errors.HetflowError is task_errors.HetflowError
    assert issubclass(dataset.DatasetError, errors.OperatorError)
    assert issubclass(location.StorageError, errors.OperatorError) and issubclass(location.StorageError, OSError)
    # the two refusals of safe file I/O are one: the orchestrator's `except UnsafePath` catches a dataset's
    assert paths.UnsafePath is safeio.UnsafePath and issubclass(dataset.UnsafeDatasetPath, safeio.UnsafePath)
    assert not issubclass(hf.RunFailed, hf.TaskFailed)


@pytest.mark.parametrize("make", [
    lambda: __import__("hetflow.operators.errors", fromlist=["x"]).ColumnNotFoundError("c", ["a"]),
    lambda: __import__("hetflow.operators.dataset", fromlist=["x"]).CorruptDataset("bad"),
    lambda: __import__("hetflow.operators.safeio", fromlist=["x"]).UnsafePath("/p", "a link"),
])
def test_a_user_catches_each_with_one_except(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(hf.HetflowError):
        raise make()
