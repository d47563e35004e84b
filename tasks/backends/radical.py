"""The RADICAL-Pilot backend: one RP pilot holds the allocation; stages are RP tasks.

Each stage becomes an RP task with ``ranks``, ``cores_per_rank``,
``gpus_per_rank`` and ``gpu_type`` (from the pilot's ``gpu_vendor``).  hetflow's own scheduler has already
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

Options (``pilot.options.radical``): ``placement`` (``hetflow``/``rp``), ``start_timeout`` (seconds to wait for the
pilot; default 600), ``resource_config`` (a mapping merged into the RP
resource config, written to the run directory), ``project`` (RP project
override, default ``account``), ``worker_init`` (shell lines run before the
agent on a ``hetflow.slurm``/``hetflow.pbs``/``hetflow.lsf`` resource, e.g.
``module load``).  Those three resources are generic clusters that RP ships no
config for: hetflow writes their RP resource config from the pilot.  RP submits
their pilot job with a clean environment (``--export=NONE`` on Slurm), so the
config puts this Python's ``bin`` first on the agent's ``PATH`` (the same
installation must be visible on the compute nodes, as for ``hetflow submit``)
before the ``worker_init`` lines; the pilot sandbox is the pilot's ``data_dir``,
else the run directory (which the ranks write datasets to, so the compute nodes
see it).  Tasks on ``hetflow.slurm`` get the job-step environment defaults of
the ``slurm`` backend (:data:`~hetflow.tasks.launchers.srun.STEP_ENV_DEFAULTS`).
``raptor`` (``true``/``false``, default false): run eligible stages as function
tasks in RP Raptor MPI workers that stay up for the whole pilot (one master and
one MPI worker per node, one worker rank per usable core; each stage gets a
private communicator of exactly its ranks through ``Create_group``) instead of a
fresh ``mpiexec`` per stage.  Eligible are stages of the hetflow worker entry
point without GPUs whose ranks are on one node; anything else runs as a normal
RP task (logged once per stage).  See :mod:`hetflow.tasks.backends.raptor` for
failure handling: a failing multi-rank stage, a timeout or a cancel replaces that
node's pool, and stages that only shared it run again in the new one.
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
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ProtocolError
from ..launchers.srun import STEP_ENV_DEFAULTS
from ..paths import private_dir
from ..pilot import PilotDescription
from ..protocol import AttemptFiles, RankResult
from .base import Backend, LaunchSpec, TaskOutcome
from .ranks import options_for, safe_name

if TYPE_CHECKING:
    from .raptor import Pool

log = logging.getLogger(__name__)

OPTIONS = ("placement", "gpu_type", "start_timeout", "resource_config", "project", "worker_init", "raptor")
LOCAL_RESOURCES = (None, "local", "local.localhost", "hetflow.localhost")
LOCAL_RESOURCE = "hetflow.localhost"
# Resources hetflow describes to RP itself (machines RP ships no config for):
# label -> (RP resource manager, psij job manager endpoint, RP launch method).
GENERIC_RESOURCES = {
    "hetflow.slurm": ("SLURM", "slurm://localhost/", "SRUN"),
    "hetflow.pbs": ("PBSPRO", "pbspro://localhost/", "MPIEXEC"),
    "hetflow.lsf": ("LSF", "lsf://localhost/", "JSRUN"),
}


THIS_PYTHON: Mapping[str, Any] = {
    "rp_version": "installed", "virtenv_mode": "none", "python_dist": "default",
    "python_interpreter": sys.executable,
}
"""How the agent finds Python and RP: this installation, as it is (PATH puts its ``bin`` first).

Not ``virtenv_mode: local``: RP reads that as "activate ``$VIRTUAL_ENV`` (else ``$CONDA_PREFIX``)
of the submitting shell", which need not be the environment hetflow runs from (a venv's
Python run by path, with another venv active), and whose ``bin`` then shadows this one's.
Nothing is created or installed on the compute nodes.
"""


def rp_gpu_type(pilot: PilotDescription) -> str:
    """RP's ``gpu_type`` for the pilot's GPU vendor (RP then sets the matching visible-devices variables)."""
    return "ROCm" if pilot.vendor == "amd" else "CUDA"


def rp_options(pilot: PilotDescription) -> Mapping[str, Any]:
    """``pilot.options.radical``, checked."""
    options = options_for(pilot, "radical", OPTIONS)
    placement = options.get("placement", "hetflow")
    if placement not in ("hetflow", "rp"):
        raise ConfigError(f"pilot {pilot.name!r}: bad value for 'options.radical.placement': {placement!r} "
                          f"(expected 'hetflow' or 'rp')")
    if "gpu_type" in options:
        raise ConfigError(f"pilot {pilot.name!r}: 'options.radical.gpu_type' is set by the pilot's gpu_vendor "
                          f"(nvidia: CUDA, amd: ROCm); remove it and set gpu_vendor instead")
    if options.get("raptor", False) not in (True, False):
        raise ConfigError(f"pilot {pilot.name!r}: bad value for 'options.radical.raptor': {options['raptor']!r} "
                          f"(expected true or false)")
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
            **THIS_PYTHON,
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
        worker_init = [f"export PATH={venv_bin}:$PATH"]
        worker_init += [line for line in str(rp_options(pilot).get("worker_init", "")).splitlines() if line.strip()]
        generic: dict[str, Any] = {
            "description": f"hetflow: a generic {manager} cluster described by pilot {pilot.name!r}",
            "default_schema": "batch",
            "schemas": {"batch": {"job_manager_endpoint": endpoint, "filesystem_endpoint": "file://localhost/"}},
            "default_queue": pilot.queue or "",
            "default_remote_workdir": pilot.data_dir if pilot.data_dir and "://" not in pilot.data_dir \
            else str(run_dir / "radical"),  # an s3:// data directory holds datasets only
            "resource_manager": manager,
            "agent_config": "default",
            "agent_scheduler": "CONTINUOUS",
            "agent_spawner": "POPEN",
            "launch_methods": {"order": [method], method: {}},
            "pre_bootstrap_0": worker_init,
            **THIS_PYTHON,
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


def raptor_function(spec: LaunchSpec, uid: str, pool: Pool, sandbox: Path) -> dict[str, Any]:
    """The RP ``TaskDescription`` fields of a stage run as a function task in ``pool``."""
    from .raptor import function_description, spec_path_of

    spec_path = spec_path_of(spec.argv)
    assert spec_path is not None  # checked by eligibility
    cores = max(len(s.cores) for s in spec.slots)
    return function_description(uid, pool.master, spec_path, spec.ranks, cores, dict(spec.env),
                                spec.stdout, spec.stderr, sandbox)


def _recorded_error(spec: LaunchSpec) -> bool:
    """Whether a rank of ``spec``'s attempt recorded an error (the stage that brought its pool down)."""
    files = AttemptFiles(spec.cwd)
    for rank in range(spec.ranks):
        path = files.rank_result(rank)
        if not path.exists():
            continue
        try:
            if RankResult.read(path).status == "error":
                return True
        except ProtocolError:
            return True  # unreadable: do not run it again blindly
    return False


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
        description["gpu_type"] = rp_gpu_type(pilot)
    if pilot.resource in GENERIC_RESOURCES and GENERIC_RESOURCES[str(pilot.resource)][2] == "SRUN":
        for key, value in STEP_ENV_DEFAULTS.items():
            if key not in os.environ:
                description["environment"].setdefault(key, value)
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
        self._raptor = bool(self.options.get("raptor", False))
        self._pools: dict[int, Pool] = {}  # node -> its current Raptor pool
        self._in_pool: dict[str, Pool] = {}  # function task uid -> the pool it was sent to
        self._specs: dict[str, tuple[LaunchSpec, bool]] = {}  # function task uid -> (launch, relaunched once)
        self._not_raptor: set[str] = set()  # stages already logged as running outside Raptor
        self._closing = False

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
            if self._raptor:
                self._start_pools(timeout)
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
            self._closing = True
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
    def _launch(self, spec: LaunchSpec) -> Future[TaskOutcome]:

        if self._tmgr is None:
            raise RuntimeError("radical backend not started; call start() first")
        outcome: Future[TaskOutcome] = Future()
        outcome.set_running_or_notify_cancel()
        self._submit(spec, outcome, time.time(), spec.timeout)
        return outcome

    def _submit(self, spec: LaunchSpec, outcome: Future[TaskOutcome], started: float, timeout: float | None,
                relaunched: bool = False) -> None:
        """Submit ``spec`` as a new RP task (a Raptor function task if eligible) resolving ``outcome``."""
        import radical.pilot as rp

        tmgr = self._tmgr
        if tmgr is None:
            return
        with self._lock:
            self._count += 1
            uid = f"{safe_name(spec.task_id)}.{self._count:06d}"
        sandbox = private_dir(self._base / "tasks" / uid)
        pool = self._pool_for(spec)
        with self._lock:
            pool = self._pools.get(pool.node) if pool is not None else None  # the current generation
            if pool is not None:
                description = raptor_function(spec, uid, pool, sandbox)
                pool.tasks.add(uid)
                self._in_pool[uid] = pool
                self._specs[uid] = (spec, relaunched)
            else:
                description = task_description(spec, self.pilot, self.node_names(), uid, sandbox)
            self._running[uid] = (spec.task_id, outcome, started)
            self._uids[spec.task_id] = uid
        try:
            tmgr.submit_tasks(rp.TaskDescription(description))
        except BaseException:  # not submitted: forget it (launch() reports the error)
            with self._lock:
                self._running.pop(uid, None)
                self._uids.pop(spec.task_id, None)
                self._specs.pop(uid, None)
                if self._in_pool.pop(uid, None) is not None and pool is not None:
                    pool.tasks.discard(uid)
            raise
        if timeout is not None:
            timer = threading.Timer(timeout, self._time_out, args=(uid,))
            timer.daemon = True
            with self._lock:
                self._timers[uid] = timer
            timer.start()

    def _time_out(self, uid: str) -> None:
        with self._lock:
            if uid not in self._running:
                return
            self._timed_out.add(uid)
            pool = self._in_pool.get(uid)
        if pool is not None:  # a function cannot be killed inside its worker: replace the pool
            self._lose_pool(pool, f"stage task {uid} timed out", timed_out=uid)
        elif self._tmgr is not None:
            self._tmgr.cancel_tasks([uid])

    def _state_cb(self, task: Any, state: str) -> None:
        import radical.pilot as rp

        if state not in rp.FINAL:
            return
        with self._lock:
            lost = next((p for p in self._pools.values() if task.uid in (p.master, p.worker)), None)
        if lost is not None:
            if not self._closing:
                self._lose_pool(lost, f"Raptor {'master' if task.uid == lost.master else 'worker'} "
                                      f"{task.uid} ended {state}")
            return
        with self._lock:
            pool = self._in_pool.pop(task.uid, None)
            self._specs.pop(task.uid, None)
            if pool is not None:
                pool.tasks.discard(task.uid)
                pool.worked = True
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
            pool = self._in_pool.get(uid) if uid is not None else None
        if running and pool is not None and uid is not None:
            self._lose_pool(pool, f"stage task {uid} was cancelled", cancelled=uid)
        elif running and self._tmgr is not None:
            self._tmgr.cancel_tasks([uid])

    # ------------------------------------------------------------ Raptor pools
    def _pool_for(self, spec: LaunchSpec) -> Pool | None:
        """The Raptor pool that runs ``spec``, or ``None`` for a normal RP task."""
        from .raptor import ineligible

        if not self._raptor:
            return None
        node = spec.slots[0].node
        with self._lock:
            pool = self._pools.get(node)
        reason = "no Raptor pool on its node" if pool is None else ineligible(spec.argv, spec.slots, pool.cores)
        if reason is None:
            return pool
        stage = spec.task_id.rsplit("/", 1)[0]
        if stage not in self._not_raptor:
            self._not_raptor.add(stage)
            log.info("%s runs as a normal RP task, not in Raptor: %s", stage, reason)
        return None

    def _start_pools(self, timeout: float) -> None:
        """Start every node's Raptor master and MPI worker; wait until each worker ran a ping."""
        import radical.pilot as rp

        from .raptor import Pool, ping_description

        base = private_dir(self._base / "raptor")
        cores = self.pilot.resolve().usable_cores()
        for node, host in enumerate(self._hosts):
            self._submit_pool(Pool(node, host, cores, base))
        pings = [rp.TaskDescription(ping_description(f"{p.master}.ping", p.master, len(p.cores), p.sandbox))
                 for p in self._pools.values()]
        tasks = self._tmgr.submit_tasks(pings)
        deadline = time.monotonic() + timeout
        while not all(t.state in rp.FINAL for t in tasks):
            with self._lock:
                gone = len(self._pools) < len(self._hosts)
            if gone or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for task in tasks:
            if task.state != rp.DONE:
                raise RuntimeError(f"Raptor pool ping {task.uid} is {task.state} "
                                   f"({str(task.stderr or '').strip()[-300:] or 'no worker came up'}); see the "
                                   f"worker's .err file under {base}")
        with self._lock:
            for pool in self._pools.values():
                pool.worked = True
        self._remember_agents()
        log.info("Raptor pools up: %s", ", ".join(f"{p.worker} ({len(p.cores)} ranks on {p.host})"
                                                  for p in self._pools.values()))

    def _submit_pool(self, pool: Pool) -> None:
        import radical.pilot as rp

        private_dir(pool.sandbox)
        master, worker = pool.descriptions()
        with self._lock:
            self._pools[pool.node] = pool
        self._rp_pilot.submit_raptors([rp.TaskDescription(master)])
        self._tmgr.submit_workers([rp.TaskDescription(worker)])

    def _lose_pool(self, pool: Pool, reason: str, *, timed_out: str | None = None,
                   cancelled: str | None = None) -> None:
        """Fail every stage in ``pool``, stop its master and worker, start the next generation."""
        with self._lock:
            if self._closing or pool.lost or self._pools.get(pool.node) is not pool:
                return
            pool.lost = True
            replacement = pool.next_generation()
            if replacement is None:
                del self._pools[pool.node]
            else:
                self._pools[pool.node] = replacement
            victims = [(uid, self._running.pop(uid), self._specs.pop(uid, None))
                       for uid in sorted(pool.tasks) if uid in self._running]
            for uid in pool.tasks:
                self._in_pool.pop(uid, None)
                self._timed_out.discard(uid)
                timer = self._timers.pop(uid, None)
                if timer is not None:
                    timer.cancel()
        again = []
        for uid, (task_id, outcome, started), launch in victims:
            if uid not in (timed_out, cancelled) and launch is not None and not launch[1] \
                    and not _recorded_error(launch[0]):
                again.append((launch[0], outcome, started))  # a bystander: it runs again in the new pool
                continue
            detail = reason if uid in (timed_out, cancelled) else f"lost with Raptor pool {pool.master}: {reason}"
            outcome.set_result(TaskOutcome(task_id, 1, timed_out=uid == timed_out, cancelled=uid == cancelled,
                                           started=started, ended=time.time(),
                                           detail=f"timed out; {detail}" if uid == timed_out else detail))
        log.warning("Raptor pool %s lost (%s): %d stage task(s) fail with it, %d bystander(s) run again; %s",
                    pool.master, reason, len(victims) - len(again), len(again),
                    f"starting {replacement.master}" if replacement is not None else
                    f"{pool.bad_starts + 1} pools in a row failed: stages on node {pool.node} run as normal RP tasks")
        threading.Thread(target=self._replace_pool, args=(pool, replacement, again), daemon=True,
                         name=f"hetflow-raptor-replace-{pool.master}").start()

    def _replace_pool(self, old: Pool, new: Pool | None,
                      again: list[tuple[LaunchSpec, Future[TaskOutcome], float]]) -> None:
        tmgr = self._tmgr
        if tmgr is None or self._closing:
            for spec, outcome, started in again:
                outcome.set_result(TaskOutcome(spec.task_id, None, cancelled=True, started=started,
                                               ended=time.time(), detail="backend shut down"))
            return
        try:
            tmgr.cancel_tasks([old.master, old.worker] + sorted(old.tasks))
            if new is not None:
                self._submit_pool(new)
            for spec, outcome, started in again:
                for stale in AttemptFiles(spec.cwd).rank_files():
                    stale.unlink(missing_ok=True)
                left = None if spec.timeout is None else max(1.0, spec.timeout - (time.time() - started))
                self._submit(spec, outcome, started, left, relaunched=True)
        except Exception:
            log.exception("could not replace Raptor pool %s", old.master)
        with self._lock:
            tracked = {id(entry[1]) for entry in self._running.values()}
        for spec, outcome, started in again:  # not resubmitted (shut down meanwhile, or an error above)
            if id(outcome) not in tracked and not outcome.done():
                outcome.set_result(TaskOutcome(spec.task_id, None, started=started, ended=time.time(),
                                               detail=f"lost with Raptor pool {old.master}; not run again"))
