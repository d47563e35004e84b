"""Stages for tests/backends/test_launch_failure.py (found by the workers by module and name)."""

from __future__ import annotations

import pyarrow as pa


def first(ctx):
    return {"rows": pa.table({"x": [1, 2, 3]})}


def second(ctx, rows):
    return {"out": rows}
