"""Launchers for the MPI starters a pilot may use: mpiexec (Hydra), srun, jsrun."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from ..scheduler import RankSlot
from .base import Launcher


class Mpiexec(Launcher):
    """MPICH/Hydra ``mpiexec``; one host list entry per node with its rank count."""

    def __init__(self, executable: str = "mpiexec") -> None:
        self.executable = executable

    def argv(self, command: Sequence[str], slots: Sequence[RankSlot], hosts: Sequence[str]) -> list[str]:
        argv = [self.executable, "-n", str(len(slots))]
        per_node = Counter(slot.node for slot in slots)
        if len(per_node) > 1 or (per_node and hosts[next(iter(per_node))] != "localhost"):
            order = sorted(per_node)
            argv += ["-hosts", ",".join(f"{hosts[n]}:{per_node[n]}" for n in order)]
        return argv + list(command)


class Srun(Launcher):
    """Slurm ``srun`` inside an allocation (Frontier); binding is done by the worker."""

    def __init__(self, executable: str = "srun") -> None:
        self.executable = executable

    def argv(self, command: Sequence[str], slots: Sequence[RankSlot], hosts: Sequence[str]) -> list[str]:
        nodes = sorted({slot.node for slot in slots})
        cores = max((len(s.cores) for s in slots), default=1)
        gpus = max((len(s.gpus) for s in slots), default=0)
        argv = [self.executable, f"--nodes={len(nodes)}", f"--ntasks={len(slots)}", f"--cpus-per-task={cores}",
                f"--nodelist={','.join(hosts[n] for n in nodes)}", "--cpu-bind=none", "--exact"]
        if gpus:
            argv.append(f"--gpus-per-task={gpus}")
        return argv + list(command)


class Jsrun(Launcher):
    """IBM LSF ``jsrun`` (Summit): one resource set per rank."""

    def __init__(self, executable: str = "jsrun") -> None:
        self.executable = executable

    def argv(self, command: Sequence[str], slots: Sequence[RankSlot], hosts: Sequence[str]) -> list[str]:
        cores = max((len(s.cores) for s in slots), default=1)
        gpus = max((len(s.gpus) for s in slots), default=0)
        return [self.executable, f"--nrs={len(slots)}", "--tasks_per_rs=1", f"--cpu_per_rs={cores}",
                f"--gpu_per_rs={gpus}", "--bind=none"] + list(command)


def launcher_for(name: str, executable: str | None = None) -> Launcher:
    kinds: dict[str, type[Launcher]] = {"mpiexec": Mpiexec, "srun": Srun, "jsrun": Jsrun}
    if name not in kinds:
        raise ValueError(f"unknown launcher {name!r} (known launchers: {sorted(kinds)})")
    cls = kinds[name]
    return cls(executable) if executable else cls()  # type: ignore[call-arg]
