"""hetflow: pilot-based heterogeneous workflows on Arrow data.

    import hetflow as hf
    pipe = hf.Pipeline("demo", pilot="local")

    @pipe.stage(ranks=2, outputs=["events"])
    def generate(ctx):
        return {"events": table_for_this_rank}

    run = pipe.run()
"""

from __future__ import annotations

import logging
from typing import Any

__version__ = "0.1.0"

from hetflow.tasks.context import StageContext  # noqa: E402
from hetflow.tasks.description import ResourceRequest  # noqa: E402
from hetflow.tasks.pilot import PilotDescription, load_pilot  # noqa: E402

from .errors import (ConfigError, HetflowError, MissingExtraError, PipelineError, RunLocked, TaskFailed,  # noqa: E402
                     UnknownRun, UnsatisfiableRequest)
from .pipeline import Pipeline, RunOptions, open_dataset, run_options  # noqa: E402
from .status import RunStatus, StageStatus, run_status  # noqa: E402

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "__version__", "Pipeline", "RunOptions", "run_options", "open_dataset", "RunStatus", "StageStatus",
    "run_status", "StageContext", "ResourceRequest", "PilotDescription", "load_pilot", "HetflowError",
    "ConfigError", "UnsatisfiableRequest", "MissingExtraError", "PipelineError", "RunLocked", "TaskFailed",
    "UnknownRun", "ml",
]


def __getattr__(name: str) -> Any:
    if name == "ml":  # torch is heavy: import hetflow.ml only when asked for
        import importlib

        return importlib.import_module("hetflow.ml")
    raise AttributeError(f"module 'hetflow' has no attribute {name!r}")
