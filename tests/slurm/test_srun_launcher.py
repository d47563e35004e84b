"""The slurm backend's pure parts: the srun argv of one job step, and reading an allocation.

No cluster needed (the ``slurm``-marked tests run the real thing).
"""

from __future__ import annotations

import pytest

from hetflow.tasks.errors import ConfigError
from hetflow.tasks.launchers.srun import SrunStep
from hetflow.tasks.scheduler import RankSlot
from hetflow.tasks.slurm_allocation import expand_counts, gpus_by_node, parse_time_left

HOSTS = ["n1", "n2", "n3"]


def test_one_rank_per_listed_node_in_rank_order() -> None:
    slots = [RankSlot(node=1, cores=(0,), gpus=()), RankSlot(node=0, cores=(1,), gpus=()),
             RankSlot(node=1, cores=(1,), gpus=()), RankSlot(node=0, cores=(0,), gpus=())]
    argv = SrunStep("/usr/bin/srun").argv(["python", "-m", "w", "spec.json"], slots, HOSTS)
    assert argv == ["/usr/bin/srun", "--nodes=2", "--ntasks=4", "--nodelist=n2,n1,n2,n1",
                    "--distribution=arbitrary", "--cpus-per-task=1", "--exact", "--cpu-bind=cores",
                    "--kill-on-bad-exit=1", "--mpi=pmi2", "python", "-m", "w", "spec.json"]


def test_cores_and_gpus_per_rank() -> None:
    slots = [RankSlot(node=2, cores=(0, 1, 2), gpus=(0,)), RankSlot(node=2, cores=(3, 4, 5), gpus=(1,))]
    argv = SrunStep(mpi="pmix", job_name="train").argv(["a b", "c;d"], slots, HOSTS)
    assert argv[:4] == ["srun", "--nodes=1", "--ntasks=2", "--nodelist=n3,n3"]
    assert "--cpus-per-task=3" in argv and "--gpus-per-task=1" in argv and "--mpi=pmix" in argv
    assert "--job-name=train" in argv
    assert argv[-2:] == ["a b", "c;d"]  # arguments stay literal: no shell anywhere


def test_a_rank_without_cores_still_asks_for_one_cpu() -> None:
    argv = SrunStep().argv(["x"], [RankSlot(node=0, cores=(), gpus=())], HOSTS)
    assert "--cpus-per-task=1" in argv and not any(a.startswith("--gpus") for a in argv)


def test_mixed_shapes_and_no_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="one shape"):
        SrunStep().argv(["x"], [RankSlot(node=0, cores=(0,), gpus=()), RankSlot(node=0, cores=(1, 2), gpus=())],
                        HOSTS)
    with pytest.raises(ValueError, match="at least one"):
        SrunStep().argv(["x"], [], HOSTS)


@pytest.mark.parametrize("text, counts", [("2(x3)", [2, 2, 2]), ("4", [4]), ("2(x2),1", [2, 2, 1]),
                                          ("56(x2),8,56(x1)", [56, 56, 8, 56])])
def test_cpus_per_node(text: str, counts: list[int]) -> None:
    assert expand_counts(text) == counts


def test_cpus_per_node_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ConfigError, match="'2x3'"):
        expand_counts("2x3")


@pytest.mark.parametrize("text, seconds", [("10:00", 600.0), ("1:02:03", 3723.0), ("2-00:00:01", 172801.0),
                                           ("0:05", 5.0), ("UNLIMITED", None), ("NOT_SET", None)])
def test_time_left(text: str, seconds: float | None) -> None:
    assert parse_time_left(text) == seconds


def test_time_left_refuses_garbage() -> None:
    with pytest.raises(ConfigError, match="soon"):
        parse_time_left("soon")


def test_gpus_per_node_from_job_detail() -> None:
    detail = """JobId=7 JobName=x
     Nodes=n[1-2] CPU_IDs=0-7 Mem=0 GRES=gpu:a100:4(IDX:0-3)
     Nodes=n3 CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1)
     Nodes=n4 CPU_IDs=0-3 Mem=0 GRES=
   MinCPUsNode=1"""
    assert gpus_by_node(detail) == {"n[1-2]": 4, "n3": 2, "n4": 0}


def test_outside_an_allocation_backend_slurm_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hetflow.tasks.backends import get_backend
    from hetflow.tasks.pilot import PilotDescription

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match=r"not in one.*salloc -N2.*sbatch"):
        PilotDescription(name="lab", backend="slurm").resolve()
    local_shape = PilotDescription(name="l", backend="slurm", cores_per_node=2, gpus_per_node=0)
    with pytest.raises(ConfigError, match="salloc"):
        get_backend("slurm")(local_shape, tmp_path).start()  # e.g. `hetflow run --backend slurm`


def test_a_shaped_slurm_pilot_resolves_to_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler resolves its pilot again: a shaped one (or one given by --backend) keeps its shape."""
    from hetflow.tasks.pilot import PilotDescription

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    shaped = PilotDescription(name="l", backend="slurm", nodes=1, cores_per_node=2, gpus_per_node=0)
    assert shaped.resolve() is shaped


def test_a_failed_step_reports_srun_and_mpi_error_lines() -> None:
    """What a step whose MPI_Init failed leaves in its stderr: the report keeps the lines naming why and where."""
    from hetflow.tasks.launchers.srun import failure_report

    log = (  # srun repeats its line: kept once
        "2026-11-24 07:26:55 [generate rank 0/2] INFO starting\n"
        "Abort(1090575) on node 0: Fatal error in internal_Init: Other MPI error, error stack:\n"
        "internal_Init(70)....: MPI_Init(argc=(nil), argv=(nil)) failed\n"
        "srun: error: n1: tasks 0-1: Exited with exit code 15\n"
        "srun: error: n1: tasks 0-1: Exited with exit code 15\n")
    assert failure_report(15, log) == (
        "srun exited with 15: Abort(1090575) on node 0: Fatal error in internal_Init: Other MPI error, "
        "error stack: | srun: error: n1: tasks 0-1: Exited with exit code 15")
    assert failure_report(1, None) == "srun exited with 1 (no srun error in its log)"
    many = "\n".join(f"srun: error: n{i}: task {i}: Killed" for i in range(9))
    assert failure_report(137, many).count("srun: error:") == 4 and "n8" in failure_report(137, many)


def test_lost_nodes_are_read_from_sinfo_states() -> None:
    """``sinfo -h -N -o '%N|%T|%E'``: down, failed and not-responding nodes are lost; busy or drained ones are not."""
    from hetflow.tasks.slurm_allocation import node_problems

    text = ("n1|allocated|none\n"
            "n2|down|hetflow-test-node-loss\n"
            "n3|idle*|Not responding\n"
            "n4|mixed|none\n"
            "n5|drained|maintenance\n"
            "n6|fail|bad dimm\n")
    assert node_problems(text) == {"n2": "Slurm says it is down (hetflow-test-node-loss)",
                                   "n3": "Slurm says it is idle* (Not responding)",
                                   "n6": "Slurm says it is fail (bad dimm)"}
    assert node_problems("") == {}


def test_partition_node_names_map_to_pilot_indices_through_one_list() -> None:
    from hetflow.tasks.backends.base import node_indices

    assert node_indices(["n1", "n2", "n3"], {"n2"}) == {1}
    assert node_indices(["n1", "n2", "n3"], {"elsewhere", "n3", "n1"}) == {0, 2}  # another allocation's host
    assert node_indices(["127.0.0.1", "127.0.0.1"], {"127.0.0.1"}) == {0, 1}  # pilot nodes on one host
