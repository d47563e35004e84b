"""The peers' native tasks on the Slurm lab cluster, for ``benchmarks/throughput.py --lab``.

Each peer runs a plain Python function per task (``throughput.table_bytes``: a
1 KB Arrow table, returned as bytes) the way its users write one-node tasks,
on two whole nodes of the lab cluster that it asks Slurm for itself:

- ``parsl-slurm``: a ``@python_app`` on a HighThroughputExecutor whose one
  block is a ``SlurmProvider`` job of two nodes, its worker pools started by
  ``srun`` (``SrunLauncher``), two workers a node;
- ``dask-slurm``: ``client.submit`` on dask-jobqueue's ``SLURMCluster``, one
  job per node, two single-threaded worker processes each;
- ``rp-raptor``: RADICAL-Pilot function tasks (``rp.PythonTask``) on one
  Raptor master (a core of its own) and a one-rank worker on each other core, in an RP pilot job
  of two nodes on the ``hetflow.slurm`` resource that hetflow's radical
  backend describes (RP ships no config for this cluster).

``start`` returns when the peer has run one task (its workers are up);
``run(n)`` submits ``n`` tasks at once and waits for every result;
``close`` ends the peer and its Slurm job.  RP's results are the same bytes as base64 text (its master
decodes a function's result as UTF-8).  The function is passed in: it must
be ``__main__``'s, which the engines ship by value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NODES = 2
WORKERS_PER_NODE = os.cpu_count() or 2
PEERS = ("parsl-slurm", "dask-slurm", "rp-raptor")
BIN = os.path.dirname(sys.executable)


class ParslSlurm:
    def __init__(self, run_dir: str, func: Callable[..., Any]) -> None:
        import parsl
        from parsl.config import Config
        from parsl.executors import HighThroughputExecutor
        from parsl.launchers import SrunLauncher
        from parsl.providers import SlurmProvider

        os.environ["PATH"] = BIN + os.pathsep + os.environ.get("PATH", "")
        provider = SlurmProvider(nodes_per_block=NODES, init_blocks=1, min_blocks=1, max_blocks=1,
                                 walltime="00:30:00", exclusive=True, launcher=SrunLauncher(),
                                 worker_init=f"export PATH={BIN}:$PATH", cmd_timeout=60)
        self.parsl = parsl
        self.dfk = parsl.load(Config(executors=[HighThroughputExecutor(
            label="htex", max_workers_per_node=WORKERS_PER_NODE, provider=provider, address="127.0.0.1",
            worker_logdir_root=os.path.join(run_dir, "workers"))],
            run_dir=run_dir, strategy="none", usage_tracking=0))
        self.app = parsl.python_app(func)
        self.app(-1).result()

    def run(self, n: int) -> None:
        futures = [self.app(i) for i in range(n)]
        for future in futures:
            assert len(future.result()) > 1000

    def close(self) -> None:
        self.dfk.cleanup()
        self.parsl.clear()


class DaskSlurm:
    def __init__(self, run_dir: str, func: Callable[..., Any]) -> None:
        from dask.distributed import Client
        from dask_jobqueue.slurm import SLURMCluster

        self.func = func
        self.cluster = SLURMCluster(
            cores=WORKERS_PER_NODE, processes=WORKERS_PER_NODE, memory="4GiB",
            job_name="dask-native", walltime="00:30:00", job_directives_skip=["--mem"],
            job_extra_directives=["--exclusive"], python=sys.executable,
            local_directory=os.path.join(run_dir, "workers"), log_directory=os.path.join(run_dir, "logs"),
            scheduler_options={"dashboard": False, "dashboard_address": "127.0.0.1:0"})
        self.cluster.scale(jobs=NODES)
        self.client = Client(self.cluster)
        self.client.wait_for_workers(NODES * WORKERS_PER_NODE, timeout=180)
        self.client.submit(func, -1, pure=False).result()

    def run(self, n: int) -> None:
        futures = [self.client.submit(self.func, i, pure=False) for i in range(n)]
        for result in self.client.gather(futures):
            assert len(result) > 1000

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


class RaptorSlurm:
    def __init__(self, run_dir: str, func: Callable[..., Any]) -> None:
        import radical.pilot as rp
        from hetflow.tasks.backends.radical import resource_config
        from hetflow.tasks.pilot import PilotDescription

        os.environ["PATH"] = BIN + os.pathsep + os.environ.get("PATH", "")
        os.environ.setdefault("RADICAL_REPORT", "FALSE")
        base = Path(run_dir)
        pilot = PilotDescription(name="rp-native", backend="radical", resource="hetflow.slurm", nodes=NODES,
                                 cores_per_node=WORKERS_PER_NODE, gpus_per_node=0, memory_per_node=2**33)
        configs = base / ".radical" / "pilot" / "configs"
        configs.mkdir(parents=True, exist_ok=True)
        for site, hosts in (resource_config(pilot, base) or {}).items():
            (configs / f"resource_{site}.json").write_text(json.dumps(hosts, indent=2))
        os.environ["RADICAL_CONFIG_USER_DIR"] = str(base)
        self.rp, self.func = rp, func
        self.session = rp.Session(cfg={"base": str(base)})
        pmgr = rp.PilotManager(session=self.session)
        self.tmgr = rp.TaskManager(session=self.session)
        self.pilot = pmgr.submit_pilots(rp.PilotDescription({"resource": "hetflow.slurm", "nodes": NODES,
                                                             "runtime": 30}))
        try:
            self._start(rp)
        except BaseException:
            self.close()
            raise

    def _start(self, rp: Any) -> None:
        self.tmgr.add_pilots(self.pilot)
        self.pilot.wait(state=[rp.PMGR_ACTIVE, *rp.FINAL], timeout=600)
        if self.pilot.state != rp.PMGR_ACTIVE:
            raise RuntimeError(f"RP pilot is {self.pilot.state}")
        # one master (a core of its own), a one-rank worker on every other core: RP places them
        self.masters = self.pilot.submit_raptors([rp.TaskDescription({"mode": rp.RAPTOR_MASTER})])
        self.masters[0].submit_workers([rp.TaskDescription({"mode": rp.RAPTOR_WORKER, "ranks": 1,
                                                            "raptor_class": "DefaultWorker"})
                                        for _ in range(NODES * WORKERS_PER_NODE - 1)])
        self.run(1)

    def run(self, n: int) -> None:
        rp = self.rp
        tasks = []
        for i in range(n):
            master = self.masters[i % len(self.masters)]
            tasks += master.submit_tasks([rp.TaskDescription({"mode": rp.TASK_FUNCTION,
                                                              "function": rp.PythonTask(self.func, (i, True), {})})])
        self.tmgr.wait_tasks([t.uid for t in tasks])
        bad = [t for t in tasks if t.state != rp.DONE or len(t.return_value or b"") < 1000]
        if bad:
            raise RuntimeError(f"{len(bad)} RP tasks not done: {bad[0].state} {str(bad[0].stderr)[-500:]}")

    def close(self) -> None:
        self.session.close(download=False)


def peer(name: str, run_dir: str, func: Callable[..., Any]) -> Any:
    os.makedirs(run_dir, exist_ok=True)
    return {"parsl-slurm": ParslSlurm, "dask-slurm": DaskSlurm, "rp-raptor": RaptorSlurm}[name](run_dir, func)


def my_jobs() -> list[str]:
    """Jobs still listed (a peer's close should have ended its own)."""
    listed = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, check=False)
    return listed.stdout.split("\n") if listed.stdout.strip() else []


if __name__ == "__main__":  # a smoke test: python benchmarks/lab_peers.py NAME N
    from throughput import table_bytes

    started = time.time()
    p = peer(sys.argv[1], os.path.abspath(f"lab-peer-{sys.argv[1]}"), table_bytes)
    print("up", time.time() - started, flush=True)
    t = time.time()
    p.run(int(sys.argv[2]))
    print("ran", time.time() - t, flush=True)
    p.close()
