"""The worker <-> orchestrator protocol on files written into a temporary attempt directory.

No processes: the spec, the rank results, pid files, witness records and
launcher logs are written here exactly as the orchestrator, the ranks, the
witness and Hydra write them, and read back through :mod:`hetflow.tasks.protocol`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
from pathlib import Path

import pytest

from hetflow.tasks.backends.base import TaskOutcome
from hetflow.tasks.errors import ProtocolError
from hetflow.tasks.protocol import (AttemptFiles, RankError, RankOutput, RankResult, StageFunction, WorkerSpec,
                                    diagnose)
from hetflow.tasks.scheduler_types import RankSlot

GRACE = 7.0


def _spec(tmp_path: Path, **changes: object) -> WorkerSpec:
    fields: dict[str, object] = {
        "run_id": "run-1", "stage": "sort", "attempt": 2,
        "function": StageFunction(module="__main__", name="sort", path=str(tmp_path / "pipe.py")),
        "attempt_dir": tmp_path, "checkpoint_dir": tmp_path / "checkpoints",
        "slots": (RankSlot(0, (0, 1), ()), RankSlot(1, (2,), (0,))), "nodes": ("node0", "node1"),
        "inputs": (("events", str(tmp_path / "datasets" / "events")),),
        "outputs": {"sorted": str(tmp_path / "datasets" / "sorted")}, "sys_path": (str(tmp_path),),
        "params": {"n": 3, "label": "x", "nested": {"a": [1, 2]}}, "verify": "size",
        "schemas": {"sorted": "c2NoZW1h"}, "files": (str(tmp_path / "calibration.csv"),),
        "memory_per_rank": 4 << 30, "node_local_dir": "/mnt/bb/$USER", "env": {"HF_K": "sha256:" + "d4735e3a265e16eee03f59718b9b5d03019c07d8b6c51f90da3a666eec13ab35",
                                                           "HF_UNSET": None}}
    fields.update(changes)
    return WorkerSpec(**fields)  # type: ignore[arg-type]


def _ok(rank: int, size: int = 2, pid: int = 1000) -> RankResult:
    return RankResult(rank=rank, size=size, pid=pid + rank, host="node0", started=10.0, status="ok", ended=11.0,
                      outputs={"sorted": RankOutput({"file": f"part-{rank}.arrow", "rows": 5}, "c2NoZW1h")},
                      cpus=(rank,), cores=(rank,), gpus=(), visible_devices={"CUDA_VISIBLE_DEVICES": ""})


def _outcome(returncode: int | None = 0, **kwargs: object) -> TaskOutcome:
    return TaskOutcome("run-1/sort/2", returncode, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------- spec
def test_spec_round_trip_through_its_file(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    files = AttemptFiles(tmp_path)
    spec.write(files.spec)
    assert files.spec == tmp_path / "spec.json"
    assert stat.S_IMODE(files.spec.stat().st_mode) == 0o600
    back = WorkerSpec.read(files.spec)
    assert back == spec
    assert back.slots[1] == RankSlot(1, (2,), (0,)) and back.inputs[0][0] == "events"
    assert json.loads(files.spec.read_text())["files"] == [str(tmp_path / "calibration.csv")]


def test_spec_written_before_files_existed_reads_with_defaults(tmp_path: Path) -> None:
    data = _spec(tmp_path).to_json()
    for key in ("files", "sys_path", "schemas", "verify", "params", "memory_per_rank", "node_local_dir", "env"):
        del data[key]
    (tmp_path / "spec.json").write_text(json.dumps(data))
    spec = WorkerSpec.read(tmp_path / "spec.json")
    assert spec.files == () and spec.sys_path == () and spec.verify == "checksum" and spec.params == {}
    assert spec.memory_per_rank is None and spec.node_local_dir is None and spec.env == {}


@pytest.mark.parametrize("change, field", [
    (lambda d: d.pop("stage"), "'stage'"),
    (lambda d: d.update(attempt="2"), "'attempt'"),
    (lambda d: d["slots"][1].update(cores=[2, "three"]), "'slots[1].cores'"),
    (lambda d: d["function"].pop("module"), "'function.module'"),
    (lambda d: d.update(inputs=[["events"]]), "'inputs'"),
    (lambda d: d.update(outputs={"sorted": 3}), "'outputs'"),
    (lambda d: d.update(colour="blue"), "'colour'"),
    (lambda d: d.update(verify="maybe"), "verify='maybe'"),
    (lambda d: d.update(files=["relative.csv"]), "'relative.csv'"),
    (lambda d: d["slots"][0].update(node=5), "slot node 5"),
    (lambda d: d.update(memory_per_rank="4GB"), "'memory_per_rank'"),
    (lambda d: d.update(memory_per_rank=-1), "memory_per_rank=-1"),
    (lambda d: d.update(node_local_dir=7), "'node_local_dir'"),
    (lambda d: d.update(env=["HF_K"]), "'env'"),
    (lambda d: d.update(env={"1X": "a"}), "env '1X'"),
    (lambda d: d.update(env={"HF_K": 3}), "env 'HF_K'='3'"),
    (lambda d: d.update(env={"HF_K": "2"}), "env 'HF_K'='2' (expected a variable name and the digest"),
])
def test_bad_spec_file_names_the_file_and_the_field(tmp_path: Path, change: object, field: str) -> None:
    data = _spec(tmp_path).to_json()
    change(data)  # type: ignore[operator]
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProtocolError) as info:
        WorkerSpec.read(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_unreadable_spec_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text('{"run_id": ')
    with pytest.raises(ProtocolError, match="not valid JSON") as info:
        WorkerSpec.read(path)
    assert str(path) in str(info.value)
    with pytest.raises(ProtocolError, match="cannot read"):
        WorkerSpec.read(tmp_path / "missing.json")
    path.write_text("[1, 2]")
    with pytest.raises(ProtocolError, match="must be a JSON object, got list"):
        WorkerSpec.read(path)


# ------------------------------------------------------------------- result
def test_result_round_trip(tmp_path: Path) -> None:
    failed = RankResult(rank=1, size=2, pid=4242, host="node1", started=1.5, status="error", ended=2.5,
                        outputs={"sorted": None}, error=RankError("ValueError", "boom", "Traceback ...\n"),
                        params_read=["n"], raptor={"worker": "w.0", "pool_rank": 3, "pool_size": 4})
    files = AttemptFiles(tmp_path)
    for result in (_ok(0), failed):
        result.write(files.rank_result(result.rank))
        assert RankResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    assert files.read_results(3) == [_ok(0), failed, None]
    raw = json.loads(files.rank_result(0).read_text())
    assert "error" not in raw and "params_read" not in raw and raw["outputs"]["sorted"]["schema"] == "c2NoZW1h"
    assert RankResult.read(files.rank_result(0)).params_read is None  # None: every parameter was read
    assert RankResult.read(files.rank_result(1)).params_read == ["n"]


def test_bad_result_is_an_error_naming_the_field_and_reads_as_missing(tmp_path: Path) -> None:
    files = AttemptFiles(tmp_path)
    data = _ok(0).to_json()
    data["status"] = "error"  # an error status without its error
    files.rank_result(0).write_text(json.dumps(data))
    with pytest.raises(ProtocolError, match="status 'error'"):
        RankResult.read(files.rank_result(0))
    data = _ok(1).to_json()
    data["outputs"]["sorted"] = {"partition": {}, "schema": 7}
    files.rank_result(1).write_text(json.dumps(data))
    with pytest.raises(ProtocolError, match="'outputs.sorted.schema'"):
        RankResult.read(files.rank_result(1))
    assert files.read_results(2) == [None, None]


def test_attempt_files_names_and_pids(tmp_path: Path) -> None:
    files = AttemptFiles(tmp_path)
    files.write_pid(0, 1000)
    files.write_pid(1, 1001)
    (tmp_path / "rank-x.pid").write_text("junk\n")
    assert files.rank_pid(1) == tmp_path / "rank-1.pid" and files.rank_pid(1).read_text() == "1001\n"
    assert files.rank_pids() == {0: 1000, 1: 1001}
    assert (files.stdout.name, files.stderr.name, files.ended(77).name) == ("stdout.log", "stderr.log",
                                                                              "ended-77.json")
    assert not files.any_ended_alone()
    files.ended(1001).write_text(json.dumps({"pid": 1001, "status": 9, "ended": 5.0}))
    files.ended(5555).write_text(json.dumps({"pid": 5555, "status": 9, "ended": 4.0}))  # not a rank of ours
    assert files.any_ended_alone() and files.ended_alone(files.rank_pids()) == {1: (9, 5.0)}


# ---------------------------------------------------------------- diagnosis
def test_every_rank_ok_is_no_failure(tmp_path: Path) -> None:
    files = AttemptFiles(tmp_path)
    assert diagnose("sort", None, _outcome(0), [_ok(0), _ok(1)], files, grace=GRACE) is None
    # a clean exit code is not enough: a rank without a result is a failure
    failure = diagnose("sort", None, _outcome(0), [_ok(0), None], files, grace=GRACE)
    assert failure is not None and failure.state == "FAILED" and failure.rank == 1


def test_a_rank_error_fails_naming_the_rank_and_the_exception(tmp_path: Path) -> None:
    error = RankError("KeyError", "'colour'", "Traceback (most recent call last):\n  ...\nKeyError: 'colour'\n")
    failed = RankResult(rank=1, size=2, pid=1001, host="node0", started=1.0, status="error", ended=2.0, error=error)
    failure = diagnose("sort", None, _outcome(1), [_ok(0), failed], AttemptFiles(tmp_path), grace=GRACE)
    assert failure is not None
    assert (failure.state, failure.rank, failure.traceback) == ("FAILED", 1, error.traceback)
    assert failure.message == "rank 1 raised KeyError: 'colour'"


def test_timed_out_and_cancelled(tmp_path: Path) -> None:
    files = AttemptFiles(tmp_path)
    timed_out = diagnose("sort", 30.0, _outcome(-9, timed_out=True), [None, None], files, grace=GRACE)
    assert timed_out is not None and timed_out.state == "TIMED_OUT" and "timeout of 30.0s" in timed_out.message
    cancelled = diagnose("sort", None, _outcome(-15, cancelled=True), [None, None], files, grace=GRACE)
    assert cancelled is not None and cancelled.state == "CANCELLED" and "'sort' was cancelled" in cancelled.message


@pytest.mark.parametrize("status, how, sig", [(3 << 8, "exit code 3", None),
                                              (int(signal.SIGKILL), "killed by signal 9", 9)])
def test_witness_record_names_the_rank_and_its_own_status(tmp_path: Path, status: int, how: str,
                                                          sig: int | None) -> None:
    files = AttemptFiles(tmp_path)
    for rank in range(3):
        files.write_pid(rank, 2000 + rank)
    # rank 2 died by itself; Hydra then killed rank 1 and reports rank 1 in its banner, with SIGKILL
    files.ended(2002).write_text(json.dumps({"pid": 2002, "status": status, "ended": 50.0}))
    files.stdout.write_text(_banner(2001, 9))
    assert os.WIFSIGNALED(status) == (sig is not None)
    failure = diagnose("sort", None, _outcome(9, signal=9), [_ok(0, 3), None, None], files, grace=GRACE)
    assert failure is not None and failure.state == "FAILED"
    assert failure.rank == 2 and failure.signal == sig
    assert failure.message == f"rank 2 of stage 'sort' ended without a result ({how})"
    assert failure.traceback is not None and "BAD TERMINATION" in failure.traceback


def test_first_of_two_witnessed_ranks_is_named(tmp_path: Path) -> None:
    files = AttemptFiles(tmp_path)
    for rank in range(2):
        files.write_pid(rank, 3000 + rank)
    files.ended(3000).write_text(json.dumps({"pid": 3000, "status": 1 << 8, "ended": 61.0}))
    files.ended(3001).write_text(json.dumps({"pid": 3001, "status": int(signal.SIGSEGV), "ended": 60.0}))
    failure = diagnose("sort", None, _outcome(1), [None, None], files, grace=GRACE)
    assert failure is not None and failure.rank == 1 and failure.signal == int(signal.SIGSEGV)


def test_hydra_banner_names_the_rank_without_a_witness(tmp_path: Path) -> None:
    files = AttemptFiles(tmp_path)
    for rank in range(2):
        files.write_pid(rank, 4000 + rank)
    files.stdout.write_text("rank 0 says hello\n" + _banner(4001, 11))
    failure = diagnose("sort", None, _outcome(139), [_ok(0), None], files, grace=GRACE)
    assert failure is not None
    assert (failure.state, failure.rank, failure.signal) == ("FAILED", 1, 11)
    assert failure.message == "rank 1 of stage 'sort' ended without a result (killed by signal 11)"
    # without a banner either: the ranks without a result and the launcher's exit code
    files.stdout.write_text("")
    failure = diagnose("sort", None, _outcome(5), [None, None], files, grace=GRACE)
    assert failure is not None and failure.rank == 0 and failure.signal is None and failure.traceback is None
    assert failure.message == "rank(s) [0, 1] of stage 'sort' ended without a result (exit code 5)"


def test_ended_by_us_is_a_failure_that_says_so(tmp_path: Path) -> None:
    files = AttemptFiles(tmp_path)
    files.write_pid(0, 5000)
    files.ended(5000).write_text(json.dumps({"pid": 5000, "status": int(signal.SIGKILL), "ended": 1.0}))
    failure = diagnose("sort", None, _outcome(-15, cancelled=True), [None], files, ended_by_us=True, grace=GRACE)
    assert failure is not None and failure.state == "FAILED" and failure.rank == 0
    assert failure.message.endswith("(killed by signal 9; the launcher did not end the other ranks within 7 s, "
                                    "so hetflow did)")


def _banner(pid: int, sig: int) -> str:
    """MPICH Hydra's report of a badly terminated rank, as it prints it."""
    rule = "=" * 83
    return (f"\n{rule}\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
            f"=   PID {pid} RUNNING AT node0\n=   EXIT CODE: {sig}\n=   CLEANING UP REMAINING PROCESSES\n"
            f"=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES\n{rule}\n"
            f"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal {sig})\n")


def test_the_launchers_account_follows_a_rank_without_a_result(tmp_path: Path) -> None:
    """srun's report (exit code, its error line naming the node) is part of the stage's error text."""
    files = AttemptFiles(tmp_path)
    outcome = dataclasses.replace(_outcome(15), detail="srun exited with 15: srun: error: n1: tasks 0-1: "
                                                       "Exited with exit code 15")
    failure = diagnose("generate", None, outcome, [None, None], files, grace=GRACE)
    assert failure is not None
    assert failure.message == ("rank(s) [0, 1] of stage 'generate' ended without a result (exit code 15; srun exited "
                               "with 15: srun: error: n1: tasks 0-1: Exited with exit code 15)")


def test_the_stage_memory_and_node_local_dir_become_the_operator_settings(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Only while the stage function runs; ``$VAR`` is expanded on the node."""
    from hetflow.operators import settings
    from hetflow.tasks.worker import operator_settings

    monkeypatch.setenv("USER", "ada")
    before = settings.current()
    with operator_settings(_spec(tmp_path)):
        assert settings.current().memory_budget == 4 << 30 and settings.current().spill_dir == "/mnt/bb/ada"
    assert settings.current() == before
    with operator_settings(_spec(tmp_path, memory_per_rank=0, node_local_dir=None)):
        assert settings.current().memory_budget is None and settings.current().spill_dir is None


def test_a_rank_that_dies_after_returning_its_result_is_named_as_such(tmp_path: Path) -> None:
    """A native library aborting in the interpreter's teardown (SIGABRT after the stage's last line)."""
    files = AttemptFiles(tmp_path)
    for rank in range(2):
        files.write_pid(rank, 6000 + rank)
    files.ended(6001).write_text(json.dumps({"pid": 6001, "status": int(signal.SIGABRT), "ended": 9.0}))
    failure = diagnose("sort", None, _outcome(6), [_ok(0), _ok(1)], files, grace=GRACE)
    assert failure is not None and failure.state == "FAILED"
    assert (failure.rank, failure.signal) == (1, int(signal.SIGABRT))
    assert failure.message == ("rank 1 of stage 'sort' returned its result, then ended badly on its way out, "
                               f"after the stage's code (killed by signal {int(signal.SIGABRT)})")
    # the launcher ended rank 0 before it had returned its own: still rank 1's doing
    failure = diagnose("sort", None, _outcome(6), [None, _ok(1)], files, grace=GRACE)
    assert failure is not None and (failure.rank, failure.signal) == (1, int(signal.SIGABRT))
    assert failure.message.startswith("rank 1 of stage 'sort' returned its result, then ended badly"), failure.message
    assert failure.message.endswith("; rank(s) [0] ended before returning theirs"), failure.message


def test_a_rank_takes_declared_values_from_its_environment_checked_against_the_specs_digests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec file holds digests, never values: the rank's environment brings the values (``LaunchSpec.env``),
    a value other than the key's is refused naming the variable, and a variable unset for the key is unset here."""
    spec = _spec(tmp_path)
    monkeypatch.setenv("HF_K", "2")
    monkeypatch.setenv("HF_UNSET", "set-on-this-node")
    assert spec.env_values() == {"HF_K": "2", "HF_UNSET": None} and "HF_UNSET" not in os.environ
    assert "2" not in json.dumps(spec.to_json()["env"]).replace(spec.env["HF_K"] or "", "")
    monkeypatch.setenv("HF_K", "3")
    with pytest.raises(ProtocolError, match=r"^stage 'sort': environment variable HF_K is not the value in this"):
        spec.env_values()
    monkeypatch.delenv("HF_K")
    with pytest.raises(ProtocolError, match=r"^stage 'sort': environment variable HF_K is unset in this"):
        spec.env_values()
