"""hetflow: pilot-based heterogeneous workflows on Arrow data.

A script declares a :class:`Pipeline` and its stages; each stage is a function
called once per rank with a :class:`StageContext` and its input partitions, and
returns ``{output name: pyarrow.Table}`` (this rank's partition)::

    import hetflow as hf

    pipe = hf.Pipeline("demo", pilot="local")

    @pipe.stage(ranks=2, outputs=["events"])
    def generate(ctx):
        return {"events": pa.table({"rank": [ctx.rank]})}

    run = pipe.run()

``hetflow.operators`` (distributed dataframe operators) and ``hetflow.ml``
(training and inference) are reachable as ``hf.operators`` and ``hf.ml``.
The documentation (``docs/``) starts with the quickstart.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from hetflow.tasks.context import StageContext  # noqa: E402
from hetflow.tasks.description import ResourceRequest  # noqa: E402
from hetflow.tasks.pilot import PilotDescription, load_pilot  # noqa: E402

from .errors import (ConfigError, HetflowError, MissingExtraError, PipelineError, RunFailed,  # noqa: E402
                     RunLocked, TaskFailed, UnknownRun, UnsatisfiableRequest)

if TYPE_CHECKING:  # the orchestrator, the store and SQLAlchemy load on first use (see __getattr__)
    from .handle import RunHandle
    from .pipeline import Pipeline, RunOptions, open_dataset, run_options
    from .status import RunStatus, StageStatus, run_status

logging.getLogger(__name__).addHandler(logging.NullHandler())

from . import observed as _observed  # noqa: E402

if not _observed.in_hetflow_process():  # a rank installs it around its script's top level only
    _observed.install()  # the files a script's top level reads, until its pipe.run() (hetflow.observed)
    _observed.recording(True)

__all__ = [
    "__version__", "Pipeline", "RunOptions", "run_options", "open_dataset", "RunHandle", "RunStatus", "StageStatus",
    "run_status", "StageContext", "ResourceRequest", "PilotDescription", "load_pilot", "HetflowError",
    "ConfigError", "UnsatisfiableRequest", "MissingExtraError", "PipelineError", "RunFailed", "RunLocked",
    "TaskFailed", "UnknownRun", "ml", "operators",
]


# Heavy parts are imported on first use, so that a stage's worker process (which imports
# hetflow.tasks.worker, and with it this package) does not pay for SQLAlchemy and the
# orchestrator on every rank start.
_LAZY = {"Pipeline": "pipeline", "RunOptions": "pipeline", "run_options": "pipeline", "open_dataset": "pipeline",
         "RunHandle": "handle", "RunStatus": "status", "StageStatus": "status", "run_status": "status"}


def __dir__() -> list[str]:
    """The public names too, before their lazy import (``dir()``, tab completion)."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    import importlib

    if name in ("ml", "operators"):  # torch is heavy: import hetflow.ml only when asked for (operators alike)
        return importlib.import_module(f"hetflow.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(f"hetflow.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hetflow' has no attribute {name!r}")
