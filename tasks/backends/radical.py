"""The RADICAL-Pilot backend: one RP pilot holds the allocation; stages are RP tasks.

Each stage becomes an RP task with ``ranks``, ``cores_per_rank``,
``gpus_per_rank`` and ``gpu_type``.  hetflow's own scheduler has already
chosen the slots, so by default the task carries them as RP ``slots`` (RP's
agent honours pre-placed tasks and skips its own scheduler); with
``options.placement: rp`` RP's scheduler places the task instead (hetflow still
rejects requests that can never fit before anything is submitted).

What this module handles for users (seen with radical.pilot 1.103):

* RP starts its client components by command name: the venv's ``bin`` is put
  first on ``PATH`` of this process, otherwise the client hangs;
* the agent runs with a cleaned environment and cannot find the venv's
  ``mpiexec``; RP's ``local.localhost`` also rounds a pilot up to 8 fake cores.
  For a local pilot the backend therefore writes its own resource config,
  ``hetflow.localhost`` (the pilot's exact cores/GPUs, the venv on the MPI
  launch method's ``PATH``, sandboxes in the run directory), into
  ``RUN_DIR/radical/.radical/pilot/configs/`` and points
  ``RADICAL_CONFIG_USER_DIR`` there — never into the user's home;
* an interrupted client leaves agent processes behind: the backend records
  every process whose command line names its session and kills what is still
  alive after ``Session.close()`` (also at interpreter exit, e.g. after Ctrl-C).

RP's pilot launcher (psij) keeps small launch scripts under ``~/.psij/work``;
that directory is psij's and is not configurable from here.

Options (``pilot.options.radical``): ``placement`` (``hetflow``/``rp``), ``gpu_type``
(``CUDA``/``ROCm``; default CUDA), ``start_timeout`` (seconds to wait for the
pilot; default 600), ``resource_config`` (a mapping merged into the RP
resource config, written to the run directory), ``project`` (RP project
override, default ``account``), ``worker_init`` (shell lines run before the
agent on a ``hetflow.slurm``/``hetflow.pbs``/``hetflow.lsf`` resource, e.g.
``module load``).  Those three resources are generic clusters that RP ships no
config for: hetflow writes their RP resource config from the pilot.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shlex
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError
from ..pilot import PilotDescription
from .base import Backend, LaunchSpec, TaskOutcome
from .ranks import options_for, private_dir, safe_name

log = logging.getLogger(__name__)

OPTIONS = ("placement", "gpu_type", "start_timeout", "resource_config", "project", "worker_init")
LOCAL_RESOURCES = (None, "local", "local.localhost", "hetflow.localhost")
LOCAL_RESOURCE = "hetflow.localhost"
# Resources hetflow describes to RP itself (machines RP ships no config for):
# label -> (RP resource manager, psij job manager endpoint, RP launch method).
GENERIC_RESOURCES = {
    "hetflow.slurm": ("SLURM", "slurm://localhost/", "SRUN"),
    "hetflow.pbs": ("PBSPRO", "pbspro://localhost/", "MPIEXEC"),
    "hetflow.lsf": ("LSF", "lsf://localhost/", "JSRUN"),
}


def rp_options(pilot: PilotDescription) -> Mapping[str, Any]:
    """``pilot.options.radical``, checked."""
    options = options_for(pilot, "radical", OPTIONS)
    placement = options.get("placement", "hetflow")
    if placement not in ("hetflow", "rp"):
        raise ConfigError(f"pilot {pilot.name!r}: bad value for 'options.radical.placement': {placement!r} "
                          f"(expected 'hetflow' or 'rp')")
    gpu_type = options.get("gpu_type", "CUDA")
    if gpu_type not in ("CUDA", "ROCm"):
        raise ConfigError(f"pilot {pilot.name!r}: bad value for 'options.radical.gpu_type': {gpu_type!r} "
                          f"(expected 'CUDA' or 'ROCm')")
    if not isinstance(options.get("resource_config", {}), Mapping):
        raise ConfigError(f"pilot {pilot.name!r}: 'options.radical.resource_config' must be a mapping")
    return options


def is_local(pilot: PilotDescription) -> bool:
    return pilot.resource in LOCAL_RESOURCES


def rp_resource(pilot: PilotDescription) -> str:
    """The RP resource label the pilot is submitted to."""
    if is_local(pilot):
        return LOCAL_RESOURCE
    return str(pilot.resource)


def resource_config(pilot: PilotDescription, run_dir: Path) -> dict[str, Any] | None:
    """The resource config hetflow writes for this pilot (``None``: RP's shipped one as is).

    Returned as ``{site: {host: config}}``, the layout of RP's ``resource_<site>.json``.
    """
    extra = dict(rp_options(pilot).get("resource_config", {}))
    venv_bin = str(Path(sys.executable).parent)
    if is_local(pilot):
        sandbox = str(run_dir / "radical")
        config: dict[str, Any] = {
            "description": "hetflow: this machine, with the pilot's exact shape",
            "default_schema": "local",
            "schemas": {"local": {"job_manager_endpoint": "fork://localhost",
                                  "filesystem_endpoint": "file://localhost"}},
            "default_remote_workdir": sandbox,
            "resource_manager": "FORK",
            "agent_config": "default",
            "agent_scheduler": "CONTINUOUS",
            "agent_spawner": "POPEN",
            "launch_methods": {"order": ["MPIEXEC", "FORK"],
                               "MPIEXEC": {"pre_exec_cached": [f"export PATH={venv_bin}:$PATH"]},
                               "FORK": {}},
            "pre_bootstrap_0": [f"export PATH={venv_bin}:$PATH"],
            "rp_version": "installed",
            "virtenv_mode": "local",
            "python_dist": "default",
            "cores_per_node": pilot.cores_per_node,
            "gpus_per_node": pilot.gpus_per_node or 0,
            "mem_per_node": (pilot.memory_per_node or 0) // 2**20,
            "lfs_path_per_node": pilot.node_local_dir or "/tmp",
            "lfs_size_per_node": 1024,
            "fake_resources": True,
            "system_architecture": {"oversubscribe": False},
        }
        config.update(extra)
        site, host = LOCAL_RESOURCE.split(".")
        return {site: {host: config}}
    site, _, host = str(pilot.resource).partition(".")
    if pilot.resource in GENERIC_RESOURCES:
        manager, endpoint, method = GENERIC_RESOURCES[str(pilot.resource)]
        worker_init = [line for line in str(rp_options(pilot).get("worker_init", "")).splitlines() if line.strip()]
        generic: dict[str, Any] = {
            "description": f"hetflow: a generic {manager} cluster described by pilot {pilot.name!r}",
            "default_schema": "batch",
            "schemas": {"batch": {"job_manager_endpoint": endpoint, "filesystem_endpoint": "file://localhost/"}},
            "default_queue": pilot.queue or "",
            "default_remote_workdir": pilot.data_dir or "$HOME",
            "resource_manager": manager,
            "agent_config": "default",
            "agent_scheduler": "CONTINUOUS",
            "agent_spawner": "POPEN",
            "launch_methods": {"order": [method], method: {}},
            "pre_bootstrap_0": worker_init,
            "rp_version": "installed",
            "virtenv_mode": "local",
            "python_dist": "default",
            "cores_per_node": pilot.cores_per_node,
            "gpus_per_node": pilot.gpus_per_node or 0,
            "mem_per_node": (pilot.memory_per_node or 0) // 2**20,
            "lfs_path_per_node": pilot.node_local_dir or "/tmp",
            "system_architecture": {"blocked_cores": list(pilot.reserved_cores)},
        }
        generic.update(extra)
        return {site: {host: generic}}
    if not extra:
        return None
    return {site: {host: extra}}


def pilot_description(pilot: PilotDescription, run_dir: Path) -> dict[str, Any]:
    """The RP ``PilotDescription`` fields for ``pilot``."""
    description: dict[str, Any] = {
        "resource": rp_resource(pilot),
        "nodes": pilot.nodes,
        "runtime": max(1, int((pilot.walltime or 3600) // 60)),
    }
    if pilot.queue:
        description["queue"] = pilot.queue
    project = rp_options(pilot).get("project", pilot.account)
    if project:
        description["project"] = project
    if is_local(pilot):
        description["sandbox"] = str(run_dir / "radical")
    return description


def task_description(spec: LaunchSpec, pilot: PilotDescription, hosts: list[str], uid: str,
                     sandbox: Path) -> dict[str, Any]:
    """The RP ``TaskDescription`` fields for one launch (``slots`` unless RP places it).

    RP keeps its per-task scripts in ``sandbox`` (under hetflow's run directory);
    the ranks start in ``spec.cwd`` through RP's ``pre_exec``.
    """
    cores = max(len(s.cores) for s in spec.slots)
    gpus = max(len(s.gpus) for s in spec.slots)
    description: dict[str, Any] = {
        "uid": uid,
        "executable": spec.argv[0],
        "arguments": list(spec.argv[1:]),
        "ranks": spec.ranks,
        "cores_per_rank": cores,
        "gpus_per_rank": gpus,
        "use_mpi": True,
        "environment": dict(spec.env),
        "sandbox": str(sandbox),
        "pre_exec": [f"cd {shlex.quote(str(spec.cwd))}"],
    }
    if gpus:
        description["gpu_type"] = rp_options(pilot).get("gpu_type", "CUDA")
    if spec.stdout is not None:
        description["stdout"] = str(spec.stdout)
    if spec.stderr is not None:
        description["stderr"] = str(spec.stderr)
    if rp_options(pilot).get("placement", "hetflow") == "hetflow":
        description["slots"] = [{"node_index": s.node, "node_name": hosts[s.node], "cores": list(s.cores),
                                 "gpus": list(s.gpus), "lfs": 0, "mem": 0} for s in spec.slots]
    return description


class RadicalBackend(Backend):
    """Launch tasks as RP tasks in one RP pilot that spans the hetflow pilot."""

    name = "radical"

    def __init__(self, pilot: PilotDescription, run_dir: Path) -> None:
        super().__init__(pilot, run_dir)
        self.options = rp_options(pilot)
        self._session: Any = None
        self._tmgr: Any = None
        self._rp_pilot: Any = None
        self._hosts: list[str] = []
        self._lock = threading.Lock()
        self._running: dict[str, tuple[str, Future[TaskOutcome], float]] = {}  # uid -> (task id, future, start)
        self._uids: dict[str, str] = {}  # task id -> uid of its latest launch
        self._timed_out: set[str] = set()
        self._timers: dict[str, threading.Timer] = {}
        self._pids: set[int] = set()
        self._count = 0
        self._base = run_dir / "radical"
        self._saved_env: str | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        import radical.pilot as rp

        private_dir(self._base)
        venv_bin = str(Path(sys.executable).parent)
        if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
            log.info("putting %s first on PATH: RP starts its components by command name", venv_bin)
            os.environ["PATH"] = os.pathsep.join([venv_bin, os.environ.get("PATH", "")])
        override = resource_config(self.pilot, self.run_dir)
        if override is not None:
            configs = private_dir(self._base / ".radical" / "pilot" / "configs")
            for site, hosts in override.items():
                (configs / f"resource_{site}.json").write_text(json.dumps(hosts, indent=2))
            self._saved_env = os.environ.get("RADICAL_CONFIG_USER_DIR")
            os.environ["RADICAL_CONFIG_USER_DIR"] = str(self._base)
            log.info("RP resource config written to %s (RADICAL_CONFIG_USER_DIR)", configs)
        os.environ.setdefault("RADICAL_REPORT", "FALSE")
        import psutil

        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        self._session = rp.Session(cfg={"base": str(self._base)})
        # RP forks helpers of this process (its proxy) whose command line is the user's
        # script: record them now, or an interrupted script waits for them at exit.
        self._pids.update(p.pid for p in me.children(recursive=True) if p.pid not in before)
        self._remember_agents()
        try:
            pmgr = rp.PilotManager(session=self._session)
            pmgr.register_callback(self._pilot_cb)
            self._tmgr = rp.TaskManager(session=self._session)
            self._tmgr.register_callback(self._state_cb)
            self._rp_pilot = pmgr.submit_pilots(rp.PilotDescription(pilot_description(self.pilot, self.run_dir)))
            self._tmgr.add_pilots(self._rp_pilot)
            timeout = float(self.options.get("start_timeout", 600))
            self._rp_pilot.wait(state=[rp.PMGR_ACTIVE] + list(rp.FINAL), timeout=timeout)
            if self._rp_pilot.state != rp.PMGR_ACTIVE:
                raise RuntimeError(f"RP pilot {self._rp_pilot.uid} is {self._rp_pilot.state} after {timeout} s, "
                                   f"not active; see {self._base}")
            self._remember_agents()
            self._hosts = self._node_names_from_rp()
            # Registered after RP started its helpers: atexit runs hooks last-in first-out, and
            # multiprocessing's own hook (registered while RP started) would otherwise wait
            # forever for RP's forked proxy before this one could stop it.
            atexit.register(self._reap)
        except BaseException:
            self.shutdown()
            raise

    def _node_names_from_rp(self) -> list[str]:
        details = self._rp_pilot.resource_details or {}
        nodes = [str(node.get("name") or "localhost") for node in details.get("node_list") or []]
        if len(nodes) < self.pilot.nodes:
            log.info("RP reports %d node(s) for a %d-node pilot; naming them by index", len(nodes), self.pilot.nodes)
            return super().node_names()
        return nodes[: self.pilot.nodes]

    def node_names(self) -> list[str]:
        return list(self._hosts) if self._hosts else super().node_names()

    def shutdown(self) -> None:
        with self._lock:
            uids = list(self._running)
            timers = list(self._timers.values())
        for timer in timers:
            timer.cancel()
        if uids and self._tmgr is not None:
            self._tmgr.cancel_tasks(uids)
            self._tmgr.wait_tasks(uids, timeout=30)
        if self._session is not None:
            self._remember_agents()
            try:
                self._session.close(download=False, terminate=True)
            finally:
                self._session = None
                self._tmgr = None
        self._reap()
        if os.environ.get("RADICAL_CONFIG_USER_DIR") == str(self._base):
            if self._saved_env is None:
                del os.environ["RADICAL_CONFIG_USER_DIR"]
            else:
                os.environ["RADICAL_CONFIG_USER_DIR"] = self._saved_env
        with self._lock:
            left = list(self._running.values())
            self._running.clear()
        for task_id, outcome, started in left:
            if not outcome.done():
                outcome.set_result(TaskOutcome(task_id, None, cancelled=True, started=started, ended=time.time(),
                                               detail="backend shut down"))

    def pids(self) -> list[int]:
        """PIDs of RP processes (client components, bootstrapper, agent) seen for this session."""
        self._remember_agents()
        return sorted(self._pids)

    def _remember_agents(self) -> None:
        """Record this session's processes and their children: what :meth:`_reap` may kill.

        Those are processes of this user whose command line names the session or this
        backend's directory, or whose working directory is inside it (RP renames its
        components, e.g. ``rp.agent.0``, and the bootstrapper and task launch scripts
        run in the sandbox).
        """
        import psutil

        if self._session is None:
            return
        marks = (str(self._session.uid), str(self._base))
        for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
            try:
                if not proc.info["uids"] or proc.info["uids"].real != os.getuid() or proc.pid == os.getpid():
                    continue
                cmdline = proc.info["cmdline"] or []
                ours = any(mark in part for mark in marks for part in cmdline)
                if not ours:
                    try:
                        ours = proc.cwd().startswith(marks[1])
                    except (psutil.AccessDenied, psutil.ZombieProcess):
                        ours = False
                if ours:
                    self._pids.add(proc.pid)
                    self._pids.update(p.pid for p in proc.children(recursive=True))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue

    def _reap(self) -> None:
        """Kill what is left of this session's processes (agents survive an interrupted client)."""
        import psutil

        if self._session is not None:
            self._remember_agents()
        procs = []
        for pid in sorted(self._pids):
            try:
                proc = psutil.Process(pid)
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    procs.append(proc)
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)

    # ------------------------------------------------------------------- tasks
    def launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        import radical.pilot as rp

        if self._tmgr is None:
            raise RuntimeError("radical backend not started; call start() first")
        with self._lock:
            self._count += 1
            uid = f"{safe_name(spec.task_id)}.{self._count:06d}"
        outcome: Future[TaskOutcome] = Future()
        outcome.set_running_or_notify_cancel()
        sandbox = private_dir(self._base / "tasks" / uid)
        description = task_description(spec, self.pilot, self.node_names(), uid, sandbox)
        with self._lock:
            self._running[uid] = (spec.task_id, outcome, time.time())
            self._uids[spec.task_id] = uid
        self._tmgr.submit_tasks(rp.TaskDescription(description))
        if spec.timeout is not None:
            timer = threading.Timer(spec.timeout, self._time_out, args=(uid,))
            timer.daemon = True
            with self._lock:
                self._timers[uid] = timer
            timer.start()
        return outcome

    def _time_out(self, uid: str) -> None:
        with self._lock:
            if uid not in self._running:
                return
            self._timed_out.add(uid)
        if self._tmgr is not None:
            self._tmgr.cancel_tasks([uid])

    def _state_cb(self, task: Any, state: str) -> None:
        import radical.pilot as rp

        if state not in rp.FINAL:
            return
        with self._lock:
            entry = self._running.pop(task.uid, None)
            timer = self._timers.pop(task.uid, None)
            timed_out = task.uid in self._timed_out
            self._timed_out.discard(task.uid)
        if timer is not None:
            timer.cancel()
        if entry is None:
            return
        task_id, outcome, started = entry
        code = task.exit_code
        detail = "" if state == rp.DONE else f"RP task {task.uid} {state}"
        if state == rp.FAILED and code is None:
            detail += f": {str(task.stderr or '').strip()[-500:] or 'no exit code (see the RP sandbox)'}"
        outcome.set_result(TaskOutcome(
            task_id, None if code is None else int(code), timed_out=timed_out,
            cancelled=state == rp.CANCELED and not timed_out, signal=-int(code) if code and code < 0 else None,
            started=started, ended=time.time(),
            detail=f"timed out; {detail}" if timed_out else detail))

    def _pilot_cb(self, pilot: Any, state: str) -> None:
        """A pilot that ends (walltime, cancelled, agent lost) fails the tasks still running in it."""
        import radical.pilot as rp

        if state not in rp.FINAL:
            return
        with self._lock:
            left = list(self._running.items())
            self._running.clear()
            timers = list(self._timers.values())
            self._timers.clear()
        for timer in timers:
            timer.cancel()
        if left:
            log.error("RP pilot %s ended %s with %d task(s) still running", pilot.uid, state, len(left))
        for uid, (task_id, outcome, started) in left:
            outcome.set_result(TaskOutcome(task_id, None, started=started, ended=time.time(),
                                           detail=f"RP pilot {pilot.uid} ended {state} while task {uid} ran"))

    def cancel(self, task_id: str) -> None:
        with self._lock:
            uid = self._uids.get(task_id)
            running = uid in self._running
        if running and self._tmgr is not None:
            self._tmgr.cancel_tasks([uid])
