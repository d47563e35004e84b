"""Atomic checkpoints: committed only with a marker, newest kept, loaded with weights_only."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hetflow.ml as ml  # noqa: E402


def _state() -> dict[str, object]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "history": [{"loss": 1.0}]}


def test_save_then_load_gives_the_same_tensors_and_files_are_private(tmp_path: Path) -> None:
    state = _state()
    path = ml.save_checkpoint(tmp_path / "ck", state, epoch=3, step=30)
    assert (path / ml.COMMIT_MARKER).is_file()
    assert ml.latest_checkpoint(tmp_path / "ck") == path
    loaded = ml.load_checkpoint(path)
    for k, v in state["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(v, loaded["model"][k])
    assert loaded["optimizer"]["state"][0]["exp_avg"].shape == (2, 3)
    assert (tmp_path / "ck").stat().st_mode & 0o077 == 0
    assert (path / "state.pt").stat().st_mode & 0o077 == 0


def test_a_directory_without_the_marker_is_not_a_checkpoint(tmp_path: Path) -> None:
    first = ml.save_checkpoint(tmp_path, _state(), epoch=1, step=10)
    torn = ml.save_checkpoint(tmp_path, _state(), epoch=2, step=20)
    os.remove(torn / ml.COMMIT_MARKER)  # as if killed before the marker was written
    assert ml.latest_checkpoint(tmp_path) == first
    with pytest.raises(ml.CheckpointError, match="not a committed"):
        ml.load_checkpoint(torn)
    again = ml.save_checkpoint(tmp_path, _state(), epoch=2, step=20)  # the torn one is replaced
    assert ml.latest_checkpoint(tmp_path) == again


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    for step in range(5):
        ml.save_checkpoint(tmp_path, {"step": step}, epoch=step, step=step, keep=2)
    assert [p.name for p in ml.committed_checkpoints(tmp_path)] == ["ckpt-000000000003", "ckpt-000000000004"]


class _Evil:
    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, ("echo pwned",))


def test_loading_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    path = ml.save_checkpoint(tmp_path, {"payload": _Evil()}, epoch=0, step=0)
    with pytest.raises(ml.CheckpointError, match="cannot load"):
        ml.load_checkpoint(path)


def test_random_states_are_restored(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    path = ml.save_checkpoint(tmp_path, {"rng": ml.rng_state()}, epoch=0, step=0)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    ml.set_rng_state(ml.load_checkpoint(path)["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]
