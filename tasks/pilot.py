"""Pilot descriptions: the shape of one allocation, loaded from ``pilot-configs/``.

A pilot config is a YAML mapping whose keys are exactly the fields of
:class:`PilotDescription`.  Unknown keys and bad values are :class:`ConfigError`
naming the file, the key and what is allowed.  ``None`` for ``cores_per_node``,
``gpus_per_node`` or ``memory_per_node`` means "detect on this machine" and is
only allowed for the ``local`` backend; for the ``slurm`` backend the allocation
the pilot runs in gives ``nodes``, ``cores_per_node``, ``gpus_per_node`` and the
time left (:meth:`PilotDescription.resolve`).

Every number has an upper bound (:data:`LIMITS`), generous for the largest
machines (Frontier: 9,408 nodes x 56 cores x 8 GPUs), so a typo such as
``cores_per_node: 100000000000000000000`` is an error rather than a hang or an
exhausted memory; NaN and infinities are errors too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping, get_args

from .errors import ConfigError
from .gpu import GPU_VENDORS, GpuVendor, detect_gpus
from .sizes import parse_bytes
from .slurm_allocation import current_allocation

Backend = Literal["local", "slurm", "radical", "parsl", "dask"]
Launcher = Literal["mpiexec", "srun", "jsrun"]

BACKENDS: tuple[str, ...] = get_args(Backend)
LAUNCHERS: tuple[str, ...] = get_args(Launcher)

YEAR = 365 * 24 * 3600
LIMITS: Mapping[str, tuple[float, float]] = {
    "nodes": (1, 1_000_000),
    "cores_per_node": (1, 4096),
    "gpus_per_node": (0, 64),
    "memory_per_node": (0, 2**50),  # 1 PiB per node
    "walltime": (0, YEAR),          # seconds; walltime must also be > 0
    "drain": (0, YEAR),
}
"""Allowed range of each numeric pilot field, inclusive."""

@dataclass(frozen=True)
class PilotDescription:
    """One allocation: ``nodes`` × (``cores_per_node`` cores, ``gpus_per_node`` GPUs).

    ``reserved_cores`` are core ids never given to tasks (e.g. Frontier's
    low-noise cores).  ``gpu_cores`` lists, per GPU id, the core ids closest
    to it; the scheduler binds GPU ranks to those cores when it can.
    ``gpu_vendor`` (``nvidia``/``amd``) says which variables give a rank its
    GPUs (:mod:`hetflow.tasks.gpu`); left out, :meth:`resolve` detects it,
    and a pilot with GPUs of no detectable vendor is taken as ``nvidia``.
    ``walltime`` and ``drain`` are seconds; no task starts inside the last
    ``drain`` seconds.  ``options`` holds backend-specific settings.
    """

    name: str = "local"
    backend: Backend = "local"
    nodes: int = 1
    cores_per_node: int | None = None
    gpus_per_node: int | None = None
    gpu_vendor: GpuVendor | None = None
    memory_per_node: int | None = None
    reserved_cores: tuple[int, ...] = ()
    gpu_cores: tuple[tuple[int, ...], ...] = ()
    walltime: float | None = None
    drain: float = 0.0
    launcher: Launcher = "mpiexec"
    resource: str | None = None
    queue: str | None = None
    account: str | None = None
    data_dir: str | None = None
    node_local_dir: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(key: str, value: Any, allowed: str) -> ConfigError:
            return ConfigError(f"pilot {self.name!r}: bad value for {key!r}: {value!r} (expected {allowed})")

        if self.backend not in BACKENDS:
            raise bad("backend", self.backend, f"one of {list(BACKENDS)}")
        if self.launcher not in LAUNCHERS:
            raise bad("launcher", self.launcher, f"one of {list(LAUNCHERS)}")
        if self.gpu_vendor is not None and self.gpu_vendor not in GPU_VENDORS:
            raise bad("gpu_vendor", self.gpu_vendor, f"one of {list(GPU_VENDORS)}, or left out to detect it")
        if not _in_range(self.nodes, "nodes"):
            raise bad("nodes", self.nodes, _allowed("nodes"))
        for key in ("cores_per_node", "gpus_per_node", "memory_per_node"):
            value = getattr(self, key)
            if value is None:
                if self.backend == "slurm":
                    continue  # taken from the allocation by resolve()
                if self.backend != "local" or self.nodes != 1:
                    raise bad(key, value, "a number (only a one-node local pilot may detect it)")
                continue
            if not _in_range(value, key):
                raise bad(key, value, _allowed(key))
        if self.walltime is not None and not (_in_range(self.walltime, "walltime", real=True) and self.walltime > 0):
            raise bad("walltime", self.walltime, f"a positive, finite duration of at most {YEAR} s (a year)")
        if not _in_range(self.drain, "drain", real=True):
            raise bad("drain", self.drain, f"a finite duration in 0..{YEAR} s (a year)")
        max_core = (self.cores_per_node or LIMITS["cores_per_node"][1]) - 1
        for core in self.reserved_cores:
            if not _is_int(core) or not 0 <= core <= max_core:
                raise bad("reserved_cores", core, f"core ids (integers) in 0..{max_core}")
        if len(self.gpu_cores) > LIMITS["gpus_per_node"][1]:
            raise bad("gpu_cores", f"{len(self.gpu_cores)} entries", f"at most {LIMITS['gpus_per_node'][1]}, "
                      "one per GPU")
        for cores in self.gpu_cores:
            for core in cores:
                if not _is_int(core) or not 0 <= core <= max_core:
                    raise bad("gpu_cores", core, f"core ids (integers) in 0..{max_core}")
        if self.cores_per_node is not None and len(set(self.reserved_cores)) >= self.cores_per_node:
            raise bad("reserved_cores", list(self.reserved_cores), "fewer reserved cores than cores_per_node")
        if self.gpu_cores and self.gpus_per_node is not None and len(self.gpu_cores) != self.gpus_per_node:
            raise bad("gpu_cores", f"{len(self.gpu_cores)} entries", f"one entry per GPU ({self.gpus_per_node})")

    # ------------------------------------------------------------------ shape
    def resolve(self) -> "PilotDescription":
        """Fill detected values (cores, GPUs and their vendor, memory of this machine) for a local pilot,
        or the allocation's shape for a ``slurm`` pilot (:func:`_from_allocation`)."""
        if self.backend == "slurm":
            # once shaped (or given a shape, e.g. by --backend slurm), a slurm pilot stays as it is
            shaped = self
            if self.cores_per_node is None or self.gpus_per_node is None:
                shaped = _from_allocation(self)
            return shaped._with_vendor()
        if self.cores_per_node is not None and self.gpus_per_node is not None and self.memory_per_node is not None:
            return self._with_vendor()
        changes: dict[str, Any] = {}
        if self.cores_per_node is None:
            changes["cores_per_node"] = len(os.sched_getaffinity(0))
        if self.gpus_per_node is None:
            found = detect_gpus()
            changes["gpus_per_node"] = found.count
            if self.gpu_vendor is None and found.vendor is not None:
                changes["gpu_vendor"] = found.vendor
        if self.memory_per_node is None:
            changes["memory_per_node"] = _detect_memory()
        return dataclasses.replace(self, **changes)._with_vendor()

    def _with_vendor(self) -> PilotDescription:
        """This pilot with ``gpu_vendor`` set when it has GPUs: as declared, else detected, else ``nvidia``."""
        if self.gpu_vendor is not None or not self.gpus_per_node:
            return self
        return dataclasses.replace(self, gpu_vendor=detect_gpus().vendor or "nvidia")

    @property
    def vendor(self) -> GpuVendor:
        """The vendor whose variables a rank gets: ``gpu_vendor``, or ``nvidia`` when none is set (no GPUs)."""
        return self.gpu_vendor or "nvidia"

    def usable_cores(self) -> tuple[int, ...]:
        """Core ids (per node) that tasks may use, in order."""
        if self.cores_per_node is None:
            raise ConfigError(f"pilot {self.name!r} is not resolved; call resolve() first")
        reserved = set(self.reserved_cores)
        return tuple(c for c in range(self.cores_per_node) if c not in reserved)

    def shape(self) -> str:
        """A one-line description used in error messages."""
        return f"pilot {self.name!r}: {self.size()}"

    def size(self) -> str:
        """``"2 node(s) x 56 usable cores x 8 GPUs (amd)"``: the shape without the name."""
        cores = "?" if self.cores_per_node is None else len(self.usable_cores())
        gpus = "?" if self.gpus_per_node is None else self.gpus_per_node
        vendor = f" ({self.gpu_vendor})" if self.gpu_vendor else ""
        return f"{self.nodes} node(s) x {cores} usable cores x {gpus} GPUs{vendor}"

    def to_mapping(self) -> dict[str, Any]:
        """The description as plain values, the keys of a pilot config file (what ``hetflow pilot show`` prints)."""
        data = dataclasses.asdict(self)
        data["reserved_cores"] = list(self.reserved_cores)
        data["gpu_cores"] = [list(c) for c in self.gpu_cores]
        data["options"] = dict(self.options)
        return data

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "<mapping>") -> "PilotDescription":
        """Build from a config mapping; errors name ``source``, the key and the allowed keys."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: a pilot config must be a mapping, got {type(data).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ConfigError(f"{source}: unknown key {unknown[0]!r} (allowed keys: {allowed})")
        values = dict(data)
        try:
            for key, parse in (("walltime", parse_duration), ("drain", parse_duration),
                               ("memory_per_node", parse_bytes)):
                if values.get(key) is not None:
                    try:
                        values[key] = parse(values[key])
                    except ConfigError as exc:
                        raise ConfigError(f"bad value for {key!r}: {exc}") from None
            if "reserved_cores" in values:
                values["reserved_cores"] = tuple(values["reserved_cores"] or ())
            if "gpu_cores" in values:
                values["gpu_cores"] = tuple(tuple(c) for c in values["gpu_cores"] or ())
            if "options" in values:
                if not isinstance(values["options"], Mapping):
                    raise ConfigError(f"bad value for 'options': {values['options']!r} (expected a mapping)")
                values["options"] = dict(values["options"])
            return cls(**values)
        except (ConfigError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from None


def _from_allocation(pilot: PilotDescription) -> PilotDescription:
    """``pilot`` shaped like the Slurm allocation this process runs in.

    Nodes, cores and GPUs per node come from the job (the smallest node's
    CPUs and GPUs when they differ); a ``cores_per_node`` or
    ``gpus_per_node`` in the config that the allocation does not match is an
    error, not silently replaced; the walltime is the job's time left, or the
    config's if shorter.
    """
    alloc = current_allocation()
    cores, gpus = min(alloc.cpus_per_node), min(alloc.gpus_per_node)
    for key, have in (("cores_per_node", cores), ("gpus_per_node", gpus)):
        wanted = getattr(pilot, key)
        if wanted is not None and wanted != have:
            raise ConfigError(f"pilot {pilot.name!r}: {key}={wanted} but Slurm job {alloc.job_id} has {have} "
                              f"per node ({', '.join(alloc.nodes)}); leave {key} out of a slurm pilot's config")
    return dataclasses.replace(pilot, nodes=len(alloc.nodes), cores_per_node=cores, gpus_per_node=gpus,
                               walltime=job_walltime(pilot.walltime, alloc.seconds_left))


def job_walltime(configured: float | None, seconds_left: float | None) -> float | None:
    """The pilot's walltime inside a job: the config's, or the job's time left less :func:`end_margin`
    when that is shorter (at least one second)."""
    if seconds_left is None:
        return configured
    usable = seconds_left - end_margin(seconds_left)
    walltime = usable if configured is None else min(configured, usable)
    return max(walltime, 1.0)


def end_margin(seconds_left: float) -> float:
    """Seconds kept at the end of a job: the run must be recorded and, in a chain, its successor
    submitted before Slurm's time limit kills the batch script (a pilot ending at the limit
    itself was cut off 2 s after printing STOPPED, its successor never submitted).  A tenth of the
    job, at least 5 s and at most 60 s."""
    return min(60.0, max(5.0, 0.1 * seconds_left))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value: Any, key: str, *, real: bool = False) -> bool:
    """``value`` is an integer (or, with ``real``, a finite number) within ``LIMITS[key]``."""
    low, high = LIMITS[key]
    if real:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
    elif not _is_int(value):
        return False
    return bool(low <= value <= high)


def _allowed(key: str) -> str:
    low, high = LIMITS[key]
    return f"an integer in {low:,}..{high:,}"


_CLOCK = re.compile(r"(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)")
DURATION_FORMS = "a finite number of seconds (5400), 'HH:MM:SS' ('01:30:00') or 'D-HH:MM:SS' ('1-00:00:00')"


def parse_duration(value: Any) -> float:
    """Seconds from a number, a string of digits, ``HH:MM:SS`` or Slurm's ``D-HH:MM:SS``.

    Decision: a two-field ``A:B`` is refused, not read.  Slurm reads ``00:20`` as
    minutes:seconds (20 s) where most people mean hours:minutes; whichever hetflow
    chose, someone would get an allocation 60 times too short or too long.
    """
    number: float | int | None = None
    text = value.strip() if isinstance(value, str) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    elif text is not None and text.isdigit():
        number = int(text)
    elif text is not None and (clock := _CLOCK.fullmatch(text)):
        days, hours, minutes, seconds = (int(part or 0) for part in clock.groups())
        number = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    elif text is not None and re.fullmatch(r"\d+:\d+", text):
        first, second = (int(part) for part in text.split(":"))
        raise ConfigError(f"ambiguous duration {value!r}: as hours:minutes write '{_clock(first * 3600 + second * 60)}', "
                          f"as minutes:seconds (Slurm's reading) write '{_clock(first * 60 + second)}'")
    if number is None or (isinstance(number, float) and not math.isfinite(number)):
        raise ConfigError(f"bad duration {value!r} (expected {DURATION_FORMS})")
    if abs(number) > YEAR:  # before float(), which overflows on huge integers
        raise ConfigError(f"bad duration {value!r} (expected at most {YEAR} s, a year)")
    return float(number)


def _clock(seconds: int) -> str:
    hours, rest = divmod(seconds, 3600)
    return f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"


def _detect_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


# ---------------------------------------------------------------- config files
@functools.cache
def _config_loader() -> type:
    """YAML's safe loader, except that ``20:00`` stays the text it is.

    YAML 1.1 reads an unquoted ``20:00`` as the base-60 integer 1200 (Slurm's
    minutes:seconds again); as text it reaches :func:`parse_duration`, which refuses it.
    Made on first use: a pilot built in Python (and every rank) never imports PyYAML.
    """
    import yaml

    class ConfigLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no type stubs here
        pass

    def number_or_clock(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        text = loader.construct_scalar(node)
        if isinstance(text, str) and ":" in text:
            return text
        if node.tag.endswith(":int"):
            return loader.construct_yaml_int(node)
        return loader.construct_yaml_float(node)

    ConfigLoader.add_constructor("tag:yaml.org,2002:int", number_or_clock)
    ConfigLoader.add_constructor("tag:yaml.org,2002:float", number_or_clock)
    return ConfigLoader


def config_names() -> list[str]:
    """Names of the pilot configs shipped with hetflow."""
    root = resources.files("hetflow.pilot_configs")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def config_parent(name: str) -> str | None:
    """The config that shipped config ``name`` extends (its ``extends:``), ``None`` when it extends none."""
    import yaml

    text = resources.files("hetflow.pilot_configs").joinpath(f"{name}.yaml").read_text()
    data = yaml.safe_load(text)
    parent = data.get("extends") if isinstance(data, dict) else None
    return str(parent) if parent is not None else None


def load_pilot(spec: "str | os.PathLike[str] | PilotDescription") -> PilotDescription:
    """A pilot from a shipped config name, a YAML path, or a description (returned as is).

    A config may start from another with ``extends: <shipped name or path>``;
    its own keys override the parent's (so a user file can be
    ``extends: ornl-frontier`` plus ``account: ABC123``).
    """
    if isinstance(spec, PilotDescription):
        return spec
    text_spec = os.fspath(spec)
    return PilotDescription.from_mapping(_read_config(text_spec, set()), source=_source(text_spec))


def absolute_spec(spec: str, base: "str | os.PathLike[str]") -> str:
    """``spec`` as :func:`load_pilot` reads it, with a relative config path made absolute against ``base``
    (a shipped config name as it is)."""
    return os.path.join(os.fspath(base), spec) if _is_path(spec) else spec


def _source(spec: str) -> str:
    return spec if _is_path(spec) else f"pilot-configs/{spec}.yaml"


def _is_path(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or os.sep in spec


def _read_config(spec: str, seen: set[str]) -> dict[str, Any]:
    """The mapping of one config, with ``extends: <shipped name or path>`` applied (child wins)."""
    source = _source(spec)
    if _is_path(spec):
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"pilot config {spec!r} does not exist")
        text = path.read_text()
    else:
        names = config_names()
        if spec not in names:
            raise ConfigError(f"unknown pilot {spec!r} (shipped configs: {names}; or give a path to a .yaml file)")
        text = resources.files("hetflow.pilot_configs").joinpath(f"{spec}.yaml").read_text()
    import yaml

    try:
        data = yaml.load(text, Loader=_config_loader())  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a pilot config must be a mapping, got {type(data).__name__}")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"{source}: bad value for 'extends': {parent!r} (expected a shipped config name or a path)")
    if _is_path(parent) and not os.path.isabs(parent) and _is_path(spec):
        parent = str(Path(spec).parent / parent)
    if parent in seen:
        raise ConfigError(f"{source}: 'extends' forms a cycle through {parent!r}")
    merged = _read_config(parent, seen | {spec})
    merged.update(data)
    return merged
