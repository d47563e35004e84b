"""Which params a stage read: TrackedParams and StageContext.params_read."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hetflow.tasks.context import StageContext, TrackedParams

PARAMS = {"rows": 10, "seed": 42, "lr": 0.1}


def context(params: dict[str, Any] | TrackedParams = PARAMS, **extra: Any) -> StageContext:
    return StageContext(comm=None, stage="s", run_id="r", attempt=0, params=params, workdir=Path("w"),
                        checkpoint_dir=Path("c"), **extra)


def test_single_reads_record_their_keys() -> None:
    ctx = context()
    assert ctx.params_read == []
    assert ctx.params["seed"] == 42 and ctx.params.get("rows") == 10
    assert "absent" not in ctx.params and ctx.params.get("other", 7) == 7
    with pytest.raises(KeyError):
        ctx.params["missing"]
    assert "lr" in ctx.params.keys()  # noqa: SIM118 - a membership test on the view reads one key, not all
    assert ctx.params_read == ["absent", "lr", "missing", "other", "rows", "seed"]


@pytest.mark.parametrize("see_all", [
    lambda p: list(p), len, lambda p: list(p.keys()), lambda p: list(p.items()), lambda p: list(p.values()),
    dict, lambda p: {**p}, repr, lambda p: p == PARAMS, copy.copy, copy.deepcopy, pickle.dumps,
    lambda p: json.dumps(dict(p)),
], ids=["iter", "len", "keys", "items", "values", "dict", "unpack", "repr", "eq", "copy", "deepcopy", "pickle",
        "json"])
def test_whatever_sees_every_key_records_all(see_all: Callable[[TrackedParams], Any]) -> None:
    ctx = context()
    ctx.params["rows"]
    see_all(ctx.params)
    assert ctx.params_read is None


def test_copies_are_plain_dicts_and_json_of_the_tracker_itself_fails_loudly() -> None:
    params = TrackedParams(PARAMS)
    assert type(copy.copy(params)) is dict and pickle.loads(pickle.dumps(params)) == PARAMS
    with pytest.raises(TypeError, match="not JSON serializable"):  # a dict subclass would be read unrecorded
        json.dumps(TrackedParams(PARAMS))


def test_context_wraps_params_and_stays_frozen() -> None:
    ctx = context(files=(Path("/data/a.csv"),))
    assert isinstance(ctx.params, TrackedParams) and dict(ctx.params) == PARAMS
    assert ctx.files == (Path("/data/a.csv"),) and context().files == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.params = {}
    tracked = TrackedParams(PARAMS)
    assert context(tracked).params is tracked  # an already tracked mapping is kept, not wrapped again


def test_replace_keeps_one_record() -> None:
    ctx = context()
    ctx.params["lr"]
    later = dataclasses.replace(ctx, attempt=1)
    later.params["seed"]
    assert ctx.params_read == later.params_read == ["lr", "seed"]
