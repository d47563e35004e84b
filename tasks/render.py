"""``hetflow pilot render`` and ``hetflow pilot check``: what a pilot would submit, and what is wrong with it.

:func:`render` prints, without submitting anything, exactly what the radical
or parsl backend would hand to its engine for a pilot config: for RADICAL-Pilot
the resource config hetflow writes, the ``PilotDescription`` and the
``TaskDescription`` of an example stage; for Parsl the ``Config`` (as Parsl's
own ``repr``, which reads like the code that builds it) and the batch script
its provider writes (the provider's ``submit`` runs with its command
execution captured, so nothing reaches ``sbatch``/``bsub``/``qsub``).

:func:`check` validates a config beyond what :class:`PilotDescription` already
rejects and returns the problems as sentences (empty: the config is usable).
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
from pathlib import Path
from typing import Any, Literal, Mapping

from .description import ResourceRequest
from .errors import ConfigError, HetflowError
from .pilot import PilotDescription
from .protocol import AttemptFiles
from .scheduler import RankSlot, check_request

RenderBackend = Literal["radical", "parsl"]
RUN_DIR = Path("RUN_DIR")
"""Placeholder for the run directory in rendered output (the real one is made by ``hetflow run``)."""

PLACEHOLDERS = ("PROJECT_ID", "YOUR_ACCOUNT", "YOUR_QUEUE", "CHANGE_ME")
_CAPTURE_LOCK = threading.Lock()
_BATCH_REPLY = {"slurm": "Submitted batch job 0", "lsf": "Job <0> is submitted to queue <q>.", "pbs": "0.server"}


def _example_spec(pilot: PilotDescription) -> Any:
    """A two-rank (GPU, if the pilot has GPUs) stage on node 0, as the scheduler would place it."""
    from .backends.base import LaunchSpec

    usable = pilot.usable_cores()
    gpus = pilot.gpus_per_node or 0
    slots = []
    for rank in range(min(2, len(usable))):
        gpu = (rank,) if rank < gpus else ()
        cores = tuple(pilot.gpu_cores[rank][:1]) if gpu and pilot.gpu_cores else (usable[rank],)
        slots.append(RankSlot(node=0, cores=cores, gpus=gpu))
    files = AttemptFiles(RUN_DIR / "attempts" / "example")
    argv = ("python", "-m", "hetflow.tasks.worker", str(files.spec))
    return LaunchSpec(task_id="example", argv=argv, slots=tuple(slots), cwd=files.directory,
                      stdout=files.stdout, stderr=files.stderr)


def render(pilot: PilotDescription, backend: RenderBackend) -> str:
    """What the ``backend`` would submit for ``pilot``, as text (the same text for the same config)."""
    pilot = pilot.resolve()  # only a local pilot has anything to detect
    if backend in ("radical", "parsl"):
        from .backends import require

        require(backend)  # a missing engine is a one-line MissingExtraError naming the extra
    if backend == "radical":
        text = _render_radical(pilot)
    elif backend == "parsl":
        text = _render_parsl(pilot)
    else:
        raise ConfigError(f"cannot render for backend {backend!r} (renderable backends: ['radical', 'parsl'])")
    # Parsl names blocks by submit time and reprs functions by address: make the text stable.
    text = re.sub(r"parsl\.hetflow\.block-0\.[0-9.]*[0-9]", "parsl.hetflow.block-0", text)
    return re.sub(r" at 0x[0-9a-f]+>", ">", text)


def _gpu_line(pilot: PilotDescription) -> str:
    """What a GPU rank of ``pilot`` is told, e.g. ``# GPUs: 8 per node, amd: ROCR_VISIBLE_DEVICES=...``."""
    from .gpu import visible_devices_env

    if not pilot.gpus_per_node:
        return "# GPUs: none"
    example = ", ".join(f"{k}={v}" for k, v in visible_devices_env(pilot.vendor, [pilot.gpus_per_node - 1]).items())
    return (f"# GPUs: {pilot.gpus_per_node} per node, vendor {pilot.vendor} "
            f"(a rank on GPU {pilot.gpus_per_node - 1} gets {example})")


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def _render_radical(pilot: PilotDescription) -> str:
    from .backends import radical
    from .backends.base import placeholder_names

    radical.rp_options(pilot)
    out = [f"# hetflow pilot {pilot.name!r} on RADICAL-Pilot (nothing was submitted)", _gpu_line(pilot), ""]
    override = radical.resource_config(pilot, RUN_DIR)
    if override is None:
        out.append(f"# resource config: RP's shipped {radical.rp_resource(pilot)!r}, unchanged")
    else:
        for site, hosts in override.items():
            out.append(f"# resource config written to {RUN_DIR}/radical/.radical/pilot/configs/resource_{site}.json")
            out.append(f"# (RADICAL_CONFIG_USER_DIR={RUN_DIR}/radical while the session runs)")
            out.append(_json(hosts))
    out += ["", "# radical.pilot.PilotDescription", _json(radical.pilot_description(pilot, RUN_DIR)), ""]
    spec = _example_spec(pilot)
    hosts = placeholder_names(pilot.nodes, local=radical.is_local(pilot))
    uid = "example.000001"
    description = radical.task_description(spec, pilot, hosts, uid, RUN_DIR / "radical" / "tasks" / uid)
    out += [f"# radical.pilot.TaskDescription of an example stage ({spec.ranks} ranks on node 0; "
            f"node names come from the active pilot)", _json(description), ""]
    if radical.rp_options(pilot).get("raptor", False):
        out += _render_raptor(spec, hosts, uid, pilot.usable_cores())
    return "\n".join(out)


def _render_raptor(spec: Any, hosts: list[str], uid: str, cores: tuple[int, ...]) -> list[str]:
    """Node 0's Raptor master and MPI worker, and the example stage as a function task if eligible."""
    from .backends import radical, raptor

    pool = raptor.Pool(0, hosts[0], cores, RUN_DIR / "radical" / "raptor")
    master, worker = pool.descriptions()
    out = [f"# Raptor (options.radical.raptor): on every node one master and one MPI worker of {len(cores)} "
           "ranks, started with the pilot; node 0's below",
           "# (RP's submit_raptors/submit_workers add executable, arguments and named_env 'rp')",
           "# Raptor master: radical.pilot.TaskDescription", _json(master), "",
           "# Raptor MPI worker: radical.pilot.TaskDescription", _json(worker), ""]
    reason = raptor.ineligible(spec.argv, spec.slots, pool.cores)
    if reason is None:
        function = radical.raptor_function(spec, uid, pool, RUN_DIR / "radical" / "tasks" / uid)
        out += ["# Raptor function task: the example stage as it is submitted with Raptor on "
                "(instead of the TaskDescription above)", _json(function), ""]
    else:
        out += [f"# Raptor: the example stage stays the RP task above: {reason}", ""]
    return out


def _render_parsl(pilot: PilotDescription) -> str:
    from .backends import parsl as parsl_backend

    scheduler = parsl_backend.scheduler_of(pilot)
    config = parsl_backend.parsl_config(pilot, RUN_DIR)
    executor = config.executors[0]
    out = [f"# hetflow pilot {pilot.name!r} on Parsl, {scheduler} scheduler (nothing was submitted)", _gpu_line(pilot), "",
           "# parsl.config.Config", repr(config), ""]
    if scheduler == "local":
        hosts = parsl_backend.nodefile_hosts(pilot)
        out += [f"# {RUN_DIR}/parsl/nodefile (PBS_NODEFILE for the MPI worker pool): {len(hosts)} entries",
                "\n".join(hosts), ""]
    script, submit = _provider_script(executor.provider, executor.launch_cmd, scheduler)
    out += [f"# block script ({submit}); fields in {{braces}} are filled by Parsl when the executor starts",
            script, ""]
    example = _example_spec(pilot)
    nodes = sorted({s.node for s in example.slots})
    out += ["# parsl_resource_specification of an example stage",
            _json({"num_nodes": len(nodes), "num_ranks": example.ranks, "ranks_per_node": example.ranks}), ""]
    return "\n".join(out)


def _provider_script(provider: Any, command: str, scheduler: str) -> tuple[str, str]:
    """The script ``provider.submit`` would write, with command execution captured, not run."""
    from parsl.providers import cluster_provider

    with tempfile.TemporaryDirectory(prefix="hetflow-render-") as tmp:
        provider.script_dir = tmp
        if scheduler == "local":
            launched = provider.launcher(command, 1, provider.nodes_per_block)
            script = provider.worker_init + "\nexport JOBNAME=parsl.hetflow.block-0\n" + launched
            submit = "run in the background by parsl's LocalProvider"
        else:
            captured: list[str] = []

            def execute_wait(cmd: str, walltime: int | None = None) -> tuple[int, str, str]:
                captured.append(cmd)
                return 0, _BATCH_REPLY[scheduler], ""

            # Every batch provider reaches the shell through this one module function
            # (LSF calls it via super(), past any instance attribute): replace it while
            # submitting, so the command is recorded and never run.
            with _CAPTURE_LOCK:
                real = getattr(cluster_provider, "execute_wait")
                setattr(cluster_provider, "execute_wait", execute_wait)
                try:
                    provider.submit(command, 1, job_name="parsl.hetflow.block-0")
                except Exception as exc:  # noqa: BLE001 - parsing our fake reply may fail; the script is written
                    captured.append(f"(reply not parsed: {exc})")
                finally:
                    setattr(cluster_provider, "execute_wait", real)
            scripts = sorted(Path(tmp).glob("parsl.hetflow.block-0*.submit")) or \
                sorted(p for p in Path(tmp).iterdir() if p.suffix not in (".stdout", ".stderr"))
            if not scripts:
                raise HetflowError(f"parsl's {type(provider).__name__} wrote no script")
            script = scripts[0].read_text()
            submit = "submitted with: " + (captured[0].replace(tmp, f"{RUN_DIR}/parsl/runinfo/submit_scripts")
                                           if captured else "?")
        return script.replace(tmp, f"{RUN_DIR}/parsl/runinfo/submit_scripts"), submit


# -------------------------------------------------------------------- check
def check(pilot: PilotDescription, requests: Mapping[str, ResourceRequest] | None = None) -> list[str]:
    """Problems with ``pilot`` (resolved if local) and with ``requests`` on it; empty when it is usable."""
    problems: list[str] = []
    batch = pilot.backend in ("radical", "parsl") and not _is_local_resource(pilot)
    if batch:
        for key in ("account", "queue"):
            value = getattr(pilot, key)
            if value is None or any(p in str(value) for p in PLACEHOLDERS):
                problems.append(f"{key} is {value!r}: set your allocation's {key} (e.g. in a config that says "
                                f"'extends: {pilot.name}')")
        if pilot.walltime is None:
            problems.append("walltime is not set: a batch pilot needs one (e.g. walltime: '02:00:00')")
    elif pilot.backend == "slurm" and pilot.walltime is None:
        problems.append("walltime is not set: hetflow submit refuses a slurm pilot without one (the job would get "
                        "the partition's default time limit); set walltime: 'HH:MM:SS' or pass submit --walltime")
    if pilot.walltime is not None and pilot.drain >= pilot.walltime:
        problems.append(f"drain ({pilot.drain:g} s) is not shorter than walltime ({pilot.walltime:g} s): "
                        "no task could ever start")
    if pilot.backend == "local" and pilot.nodes > 1:
        problems.append(f"backend 'local' runs on this machine only, but nodes is {pilot.nodes}")
    if pilot.gpu_cores and pilot.reserved_cores:
        clash = sorted({c for cores in pilot.gpu_cores for c in cores} & set(pilot.reserved_cores))
        if clash:
            problems.append(f"gpu_cores lists reserved cores {clash}")
    if pilot.gpus_per_node and pilot.cores_per_node is not None and \
            pilot.gpus_per_node > len(pilot.usable_cores()):
        problems.append(f"{pilot.gpus_per_node} GPUs per node but only {len(pilot.usable_cores())} usable cores: "
                        "some GPU ranks would get no core")
    problems += _backend_problems(pilot)
    for name, request in (requests or {}).items():
        try:
            check_request(request, pilot, what=f"stage {name!r}")
        except HetflowError as exc:
            problems.append(str(exc))
    return problems


def _is_local_resource(pilot: PilotDescription) -> bool:
    if pilot.backend == "radical":
        from .backends.radical import LOCAL_RESOURCES

        return pilot.resource in LOCAL_RESOURCES
    if pilot.backend == "parsl":
        from .backends.parsl import scheduler_of

        try:
            return scheduler_of(pilot) == "local"
        except ConfigError:
            return False
    return True


def _backend_problems(pilot: PilotDescription) -> list[str]:
    problems: list[str] = []
    try:
        if pilot.backend == "radical":
            from .backends.radical import GENERIC_RESOURCES, is_local, rp_options

            rp_options(pilot)
            if not is_local(pilot) and pilot.resource not in GENERIC_RESOURCES:
                known = _rp_resources()
                if known is not None and pilot.resource not in known:
                    import difflib

                    site = str(pilot.resource).split(".")[0]
                    close = difflib.get_close_matches(str(pilot.resource), sorted(known), n=4, cutoff=0.6) or \
                        sorted(r for r in known if r.startswith(site + "."))[:8]
                    problems.append(f"resource {pilot.resource!r} is not a RADICAL-Pilot resource "
                                    f"(closest: {close or 'none'})")
        elif pilot.backend == "parsl":
            from .backends.parsl import scheduler_of

            scheduler = scheduler_of(pilot)
            expected = {"slurm": "srun", "lsf": "jsrun"}.get(scheduler)
            if expected and pilot.launcher != expected:
                problems.append(f"launcher {pilot.launcher!r} with the {scheduler} scheduler (expected {expected!r})")
        elif pilot.backend == "dask":
            from .backends.dask import check_options

            check_options(pilot)
    except ConfigError as exc:
        problems.append(re.sub(r"^pilot '[^']*': ", "", str(exc)))
    except ImportError as exc:
        problems.append(f"backend {pilot.backend!r} is not installed: {exc}")
    return problems


def _rp_resources() -> set[str] | None:
    """``site.host`` labels of RP's shipped resource configs (``None`` if RP is not installed)."""
    import warnings

    try:
        with warnings.catch_warnings():
            # RP warns about fork() after logging was set up; reading configs forks nothing.
            warnings.filterwarnings("ignore", message="Import `radical` modules before `logging`")
            import radical.pilot
            import radical.utils as ru
    except ImportError:
        return None
    root = Path(radical.pilot.__file__).parent / "configs"
    labels: set[str] = set()
    for path in root.glob("resource_*.json"):
        site = path.stem[len("resource_"):]
        labels.update(f"{site}.{host}" for host in ru.read_json(str(path)))
    return labels
