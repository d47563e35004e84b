"""Paths and bounds: what hetflow creates, what it refuses to follow, what a pilot file may ask for.

Every test here is a failure users found: on the code before the fix each
one chmod'ed, deleted, wrote or read outside the work directory, hung, or let
a bad value through.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

import _pipelines as P
import hetflow as hf
from hetflow.operators import dataset as ds
from hetflow.tasks.paths import UnsafePath, private_dir, write_private_file

LOCAL_1 = hf.PilotDescription(name="one-core", cores_per_node=1, gpus_per_node=0, memory_per_node=2**34)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_277():
    """A umask that takes bits out of 0700/0600 (so 'created with mode 0700' alone is not enough)."""
    old = os.umask(0o277)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the work directory with a file a planted symlink would expose."""
    victim = tmp_path / "outside"
    victim.mkdir()
    os.chmod(victim, 0o755)
    (victim / "part-00000.arrow").write_bytes(b"precious")
    (victim / ds.MANIFEST).write_text('{"precious": true}')
    return victim


# ------------------------------------------------------------------ private_dir
def test_existing_workdir_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared-project"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    private_dir(shared)
    private_dir(shared / "runs" / "r1")
    assert mode(shared) == 0o2775
    assert mode(shared / "runs") == mode(shared / "runs" / "r1") == 0o700


def test_pipeline_run_leaves_an_existing_workdir_mode_alone(tmp_path: Path) -> None:
    workdir = tmp_path / "project"
    workdir.mkdir()
    os.chmod(workdir, 0o755)
    pipe = P.pipeline("keep-mode", workdir=workdir)
    pipe.stage(name="t", ranks=1, outputs=["t"])(P.tiny)
    assert pipe.run(pilot=LOCAL_1).ok
    assert mode(workdir) == 0o755
    assert mode(workdir / "runs") == 0o700


def test_created_dirs_and_files_are_private_under_any_umask(tmp_path: Path, umask_277: None) -> None:
    private_dir(tmp_path / "a" / "b")
    written = write_private_file(tmp_path / "a" / "b" / "report.html", b"<html/>")
    assert mode(tmp_path / "a") == mode(tmp_path / "a" / "b") == 0o700
    assert mode(written) == 0o600 and written.read_bytes() == b"<html/>"


@pytest.mark.parametrize("where", ["leaf", "middle", "dangling"])
def test_private_dir_refuses_a_symlink_and_names_it(tmp_path: Path, outside: Path, where: str) -> None:
    run_dir = private_dir(tmp_path / "work" / "runs" / "r1")
    link = run_dir / "datasets"
    os.symlink(outside if where != "dangling" else tmp_path / "nowhere", link)
    target = link if where == "leaf" else link / "numbers"
    with pytest.raises(UnsafePath, match=f"refusing {link}: it is a symbolic link"):
        private_dir(target)
    assert mode(outside) == 0o755 and sorted(os.listdir(outside)) == sorted([ds.MANIFEST, "part-00000.arrow"])
    assert not (tmp_path / "nowhere").exists()


def test_private_dir_below_a_base_follows_the_base_only(tmp_path: Path, outside: Path) -> None:
    base = tmp_path / "base-link"
    os.symlink(outside, base)
    assert private_dir(base / "x", base=base) == base / "x"
    assert (outside / "x").is_dir() and mode(outside) == 0o755
    os.symlink(outside, outside / "inner")
    with pytest.raises(UnsafePath, match="inner: it is a symbolic link"):
        private_dir(base / "inner" / "y", base=base)


def test_write_private_file_refuses_a_planted_symlink(tmp_path: Path, outside: Path) -> None:
    os.symlink(outside / "part-00000.arrow", tmp_path / "report.html")
    with pytest.raises(UnsafePath, match="report.html: it is a symbolic link"):
        write_private_file(tmp_path / "report.html", b"overwritten")
    assert (outside / "part-00000.arrow").read_bytes() == b"precious"


def test_resume_through_a_planted_dataset_symlink_is_refused(tmp_path: Path, outside: Path) -> None:
    """The user-found failure: a symlink at runs/R/datasets/NAME made a resume chmod, delete and overwrite."""
    workdir = tmp_path / "work"

    def build(rows: int) -> hf.Pipeline:
        pipe = P.pipeline("planted", workdir=workdir)
        pipe.stage(ranks=1, outputs=["numbers"], params={"rows_per_rank": rows})(P.make_rows)
        return pipe

    first = build(10).run(pilot=LOCAL_1, check=False)
    assert first.ok, first
    target = workdir / "runs" / first.id / "datasets" / "numbers"
    for entry in target.iterdir():
        entry.unlink()
    target.rmdir()
    os.symlink(outside, target)
    try:
        status = build(20).run(pilot=LOCAL_1, run_id=first.id, check=False)  # changed params: the stage must run again
    except UnsafePath as exc:
        message = str(exc)
    else:
        assert not status.ok, status
        message = str(status)
    assert str(target) in message and "symbolic link" in message
    assert mode(outside) == 0o755
    assert sorted(os.listdir(outside)) == sorted([ds.MANIFEST, "part-00000.arrow"])
    assert (outside / "part-00000.arrow").read_bytes() == b"precious"


# ------------------------------------------------------------------ names
@pytest.mark.parametrize("bad", ["clean\n", "clean\r\n", "a\nb", "clean\x00", "../up", ".hidden", "x" * 129])
def test_stage_dataset_and_pipeline_names_are_matched_in_full(tmp_path: Path, bad: str) -> None:
    with pytest.raises(hf.PipelineError, match="bad pipeline name " + re.escape(repr(bad))):
        hf.Pipeline(bad, workdir=tmp_path)
    pipe = hf.Pipeline("names", workdir=tmp_path)
    with pytest.raises(hf.PipelineError, match=r"pipeline 'names': bad stage name"):
        pipe.stage(name=bad, ranks=1, outputs=["ok"])(P.tiny)
    with pytest.raises(hf.PipelineError, match=r"bad output dataset name"):
        pipe.stage(name="fine", ranks=1, outputs=[bad])(P.tiny)
    pipe.stage(name="fine", ranks=1, outputs=["ok.v2-final_1"])(P.tiny)  # the allowed alphabet still works


# ------------------------------------------------------------------ reports
def _finished_run(workdir: Path) -> hf.RunStatus:
    pipe = P.pipeline("reported", workdir=workdir)
    pipe.stage(name="t", ranks=1, outputs=["t"])(P.tiny)
    run = pipe.run(pilot=LOCAL_1, check=False)
    assert run.ok, run
    return run


@pytest.mark.parametrize("umask", [0o022, 0o277], ids=["umask022", "umask277"])
def test_report_files_are_private_under_any_umask(tmp_path: Path, umask: int) -> None:
    from hetflow.report import write_report
    from hetflow.store import Store

    workdir = tmp_path / "work"
    run = _finished_run(workdir)
    old = os.umask(umask)
    try:
        html, png = write_report(Store.for_workdir(workdir), run.id)
        custom, custom_png = write_report(Store.for_workdir(workdir), run.id, tmp_path / "new" / "mine.html")
    finally:
        os.umask(old)
    assert html == workdir / "runs" / run.id / "report.html" and png is not None and custom_png is not None
    for path in (html, png, custom, custom_png):
        assert mode(path) == 0o600, path
    assert mode(tmp_path / "new") == 0o700
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "hetflow run" in html.read_text()


@pytest.mark.parametrize("planted", ["report.html", "report.png"])
def test_report_refuses_a_planted_symlink(tmp_path: Path, outside: Path, planted: str) -> None:
    from hetflow.report import write_report
    from hetflow.store import Store

    workdir = tmp_path / "work"
    run = _finished_run(workdir)
    link = workdir / "runs" / run.id / planted
    os.symlink(outside / "part-00000.arrow", link)
    with pytest.raises(UnsafePath, match=f"refusing {link}: it is a symbolic link"):
        write_report(Store.for_workdir(workdir), run.id)
    assert (outside / "part-00000.arrow").read_bytes() == b"precious"


def test_report_refuses_a_symlinked_run_dir(tmp_path: Path, outside: Path) -> None:
    from hetflow.report import write_report
    from hetflow.store import Store

    workdir = tmp_path / "work"
    run = _finished_run(workdir)
    run_dir = workdir / "runs" / run.id
    run_dir.rename(tmp_path / "moved")
    os.symlink(outside, run_dir)
    with pytest.raises(UnsafePath, match=f"refusing {run_dir}: it is a symbolic link"):
        write_report(Store.for_workdir(workdir), run.id)
    assert sorted(os.listdir(outside)) == sorted([ds.MANIFEST, "part-00000.arrow"])
