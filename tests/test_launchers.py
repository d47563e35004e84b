"""Launchers are pure: a request and slots in, an argv list out."""

from __future__ import annotations

from hetflow.tasks.launchers.mpiexec import Jsrun, Mpiexec, Srun, launcher_for
from hetflow.tasks.scheduler import RankSlot

CMD = ["python", "-m", "hetflow.tasks.worker", "spec; rm -rf /"]


def test_mpiexec_local() -> None:
    slots = [RankSlot(0, (0,)), RankSlot(0, (1,))]
    assert Mpiexec("/venv/bin/mpiexec").argv(CMD, slots, ["localhost"]) == ["/venv/bin/mpiexec", "-n", "2", *CMD]


def test_mpiexec_multi_node_hosts() -> None:
    slots = [RankSlot(0, (0,)), RankSlot(0, (1,)), RankSlot(2, (0,))]
    argv = Mpiexec().argv(CMD, slots, ["n0", "n1", "n2"])
    assert argv[:5] == ["mpiexec", "-n", "3", "-hosts", "n0:2,n2:1"] and argv[5:] == CMD


def test_srun_and_jsrun() -> None:
    slots = [RankSlot(0, (1, 2), (0,)), RankSlot(1, (1, 2), (0,))]
    argv = Srun().argv(CMD, slots, ["f1", "f2"])
    assert "--ntasks=2" in argv and "--cpus-per-task=2" in argv and "--gpus-per-task=1" in argv
    assert "--nodelist=f1,f2" in argv and argv[-len(CMD):] == CMD
    argv = Jsrun().argv(CMD, slots, ["s1", "s2"])
    assert argv[0] == "jsrun" and "--nrs=2" in argv and "--gpu_per_rs=1" in argv and argv[-1] == CMD[-1]
    assert launcher_for("srun").argv(CMD, slots, ["a", "b"])[0] == "srun"
