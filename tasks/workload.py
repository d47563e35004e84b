"""Synthetic workloads for the scheduler simulator.

A workload is a DAG of tasks in topological order, built from *pipelines*:
each pipeline is one multi-node MPI dataframe task feeding training tasks
(single- or multi-GPU), each followed by a fan-out of short single-core
analysis tasks.  A spec says how many tasks of each kind to make and how long
they run; the generator is seeded, so a spec and a seed name one workload.

Spec (YAML or JSON; every key optional)::

    name: frontier-mixed
    tasks: 100000          # total, approximately (whole pipelines)
    seed: 1
    groups: 4              # pipelines are spread over this many fair-share groups
    independent: false     # true: no dependencies, everything ready at t=0
    estimate_slack: 0.25   # estimates = actual x U(1, 1 + slack)
    kinds:
      dataframe: {per_pipeline: 1, ranks: [64, 448], cores_per_rank: 1, ranks_per_node: 56,
                  duration: {median: 300, sigma: 0.4}}
      train:     {per_pipeline: 4, ranks: [1, 8], cores_per_rank: 1, gpus_per_rank: 1,
                  after: dataframe, duration: {median: 900, sigma: 0.5}}
      analysis:  {per_pipeline: 40, ranks: 1, cores_per_rank: 1, after: train, fan: spread,
                  duration: {median: 60, sigma: 0.6}}

``ranks: [a, b]`` (also ``cores_per_rank``, ``gpus_per_rank``) draws uniformly from a..b; durations are log-normal
(``median`` seconds, ``sigma`` of the log); ``per_pipeline`` may be fractional
(a seeded draw decides which pipelines get one).  A file may start from a
builtin with ``extends: mixed``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .description import ResourceRequest
from .errors import ConfigError

BUILTIN: dict[str, dict[str, Any]] = {
    # MPI dataframe prep -> GPU training -> short single-core analysis, balanced so that
    # core-seconds / cores and GPU-seconds / GPUs are about equal on a Frontier node.
    "mixed": {
        "name": "mixed",
        "groups": 4,
        "estimate_slack": 0.25,
        "kinds": {
            "dataframe": {"per_pipeline": 1, "ranks": [112, 1120], "cores_per_rank": 1, "ranks_per_node": 56,
                          "duration": {"median": 120, "sigma": 0.4}},
            "train": {"per_pipeline": 4, "ranks": [1, 4], "cores_per_rank": 1, "gpus_per_rank": 1,
                      "after": "dataframe", "duration": {"median": 1800, "sigma": 0.5}},
            "train-node": {"per_pipeline": 0.25, "ranks": 8, "cores_per_rank": 1, "gpus_per_rank": 1,
                           "ranks_per_node": 8, "after": "dataframe", "duration": {"median": 1800, "sigma": 0.5}},
            "analysis": {"per_pipeline": 40, "ranks": 1, "cores_per_rank": 1, "after": "train", "fan": "spread",
                         "duration": {"median": 1200, "sigma": 0.6}},
        },
    },
}
# Everything ready at t=0 and durations short against the run, to measure utilisation
# of a saturated pilot (the tail of the last tasks is then a small part of the makespan).
BUILTIN["saturating"] = {
    "name": "saturating",
    "groups": 4,
    "independent": True,
    "estimate_slack": 0.25,
    "kinds": {
        "dataframe": {"per_pipeline": 1, "ranks": [112, 1120], "cores_per_rank": 1, "ranks_per_node": 56,
                      "duration": {"median": 60, "sigma": 0.25}},
        "train": {"per_pipeline": 20, "ranks": 1, "cores_per_rank": 1, "gpus_per_rank": 1,
                  "duration": {"median": 300, "sigma": 0.25}},
        "train-multi": {"per_pipeline": 0.25, "ranks": 4, "cores_per_rank": 1, "gpus_per_rank": 1,
                        "duration": {"median": 300, "sigma": 0.25}},
        "analysis": {"per_pipeline": 20, "ranks": 1, "cores_per_rank": 1, "duration": {"median": 60, "sigma": 0.25}},
    },
}

_KIND_KEYS = ("per_pipeline", "ranks", "cores_per_rank", "gpus_per_rank", "ranks_per_node", "duration",
              "after", "fan")
_SPEC_KEYS = ("name", "tasks", "seed", "groups", "independent", "estimate_slack", "kinds")


@dataclass(frozen=True)
class Workload:
    """Tasks ``0..n-1`` in topological order; ``parents`` of task i are ``deps[dep_ptr[i]:dep_ptr[i+1]]``."""

    name: str
    kinds: tuple[str, ...]
    requests: tuple[ResourceRequest, ...]   # one per distinct request
    request_of: np.ndarray                  # int32, task -> index into requests
    kind_of: np.ndarray                     # int16, task -> index into kinds
    duration: np.ndarray                    # float64, actual seconds
    estimate: np.ndarray                    # float64, declared seconds
    group_of: np.ndarray                    # int16
    dep_ptr: np.ndarray                     # int64, len n+1
    deps: np.ndarray                        # int64

    def __len__(self) -> int:
        return len(self.duration)

    def parents(self, task: int) -> np.ndarray:
        return self.deps[self.dep_ptr[task]:self.dep_ptr[task + 1]]

    def critical_path(self, durations: np.ndarray | None = None) -> np.ndarray:
        """Per task: its duration plus the longest chain of descendants (default: estimates)."""
        d = self.estimate if durations is None else durations
        cp = d.astype(np.float64).copy()
        ptr, deps = self.dep_ptr, self.deps
        for task in range(len(cp) - 1, -1, -1):
            for parent in deps[ptr[task]:ptr[task + 1]]:
                value = d[parent] + cp[task]
                if value > cp[parent]:
                    cp[parent] = value
        return cp

    def work(self) -> tuple[float, float]:
        """Total core-seconds and GPU-seconds (actual durations)."""
        cores = np.array([r.ranks * r.cores_per_rank for r in self.requests], dtype=np.float64)
        gpus = np.array([r.ranks * r.gpus_per_rank for r in self.requests], dtype=np.float64)
        return float((cores[self.request_of] * self.duration).sum()), float((gpus[self.request_of] * self.duration).sum())


def load_spec(spec: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A workload spec from a builtin name, a YAML/JSON file, or a mapping (validated)."""
    if isinstance(spec, Mapping):
        data, source = dict(spec), "<mapping>"
    elif str(spec) in BUILTIN:
        data, source = json.loads(json.dumps(BUILTIN[str(spec)])), f"builtin {spec!r}"
    else:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"unknown workload {str(spec)!r} (builtin: {sorted(BUILTIN)}; or a .yaml/.json file)")
        import yaml
        source = str(path)
        hint = ("; a pipeline script runs with `hetflow run`" if path.suffix == ".py" else "")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise ConfigError(f"{source}: not a workload spec: not YAML or JSON{at}; --workload takes a builtin "
                              f"({', '.join(sorted(BUILTIN))}) or a .yaml/.json spec{hint}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: a workload spec must be a mapping{hint}")
        if "extends" in data:
            base = data.pop("extends")
            if base not in BUILTIN:
                raise ConfigError(f"{source}: bad value for 'extends': {base!r} (builtin: {sorted(BUILTIN)})")
            merged = json.loads(json.dumps(BUILTIN[base]))
            merged.update(data)
            data = merged
    unknown = sorted(set(data) - set(_SPEC_KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r} (allowed keys: {list(_SPEC_KEYS)})")
    kinds = data.get("kinds") or BUILTIN["mixed"]["kinds"]
    for name, kind in kinds.items():
        bad = sorted(set(kind) - set(_KIND_KEYS))
        if bad:
            raise ConfigError(f"{source}: kind {name!r}: unknown key {bad[0]!r} (allowed keys: {list(_KIND_KEYS)})")
    data["kinds"] = kinds
    return data


def generate(spec: str | Path | Mapping[str, Any], *, tasks: int | None = None, seed: int | None = None) -> Workload:
    """Build the workload a spec describes (``tasks`` and ``seed`` override the spec's)."""
    data = load_spec(spec)
    total = int(tasks if tasks is not None else data.get("tasks", 10_000))
    rng = np.random.default_rng(int(seed if seed is not None else data.get("seed", 1)))
    kinds: dict[str, dict[str, Any]] = data["kinds"]
    names = tuple(kinds)
    per_pipeline = sum(float(k.get("per_pipeline", 1)) for k in kinds.values())
    if per_pipeline <= 0:
        raise ConfigError(f"workload {data.get('name')!r}: kinds make no tasks (per_pipeline sums to 0)")
    pipelines = max(1, math.ceil(total / per_pipeline))
    groups = int(data.get("groups", 1))
    slack = float(data.get("estimate_slack", 0.25))
    independent = bool(data.get("independent", False))

    # how many of each kind in each pipeline (fractional rates are spread with a seeded draw)
    counts = np.zeros((pipelines, len(names)), dtype=np.int64)
    for k, name in enumerate(names):
        rate = float(kinds[name].get("per_pipeline", 1))
        whole = int(rate)
        counts[:, k] = whole + (rng.random(pipelines) < rate - whole)
    n = int(counts.sum())
    kind_of = np.empty(n, dtype=np.int16)
    pipe_of = np.repeat(np.arange(pipelines), counts.sum(axis=1))
    kind_of[:] = np.concatenate([np.repeat(np.arange(len(names), dtype=np.int16), row) for row in counts])

    requests: list[ResourceRequest] = []
    request_ids: dict[tuple[Any, ...], int] = {}
    request_of = np.empty(n, dtype=np.int32)
    duration = np.empty(n, dtype=np.float64)
    for k, name in enumerate(names):
        kind = kinds[name]
        mask = kind_of == k
        count = int(mask.sum())
        ranks = _draw_int(kind.get("ranks", 1), count, rng)
        dur = kind.get("duration", {"median": 60, "sigma": 0.5})
        duration[mask] = float(dur.get("median", 60)) * np.exp(rng.normal(0.0, float(dur.get("sigma", 0.5)), count))
        cores = _draw_int(kind.get("cores_per_rank", 1), count, rng)
        gpus = _draw_int(kind.get("gpus_per_rank", 0), count, rng, low=0)
        ids = np.empty(count, dtype=np.int32)
        for j, r in enumerate(ranks):
            key = (int(r), int(cores[j]), int(gpus[j]), kind.get("ranks_per_node"))
            if key not in request_ids:
                request_ids[key] = len(requests)
                requests.append(ResourceRequest(ranks=key[0], cores_per_rank=key[1], gpus_per_rank=key[2],
                                                ranks_per_node=key[3]))
            ids[j] = request_ids[key]
        request_of[mask] = ids
    estimate = duration * (1.0 + slack * rng.random(n))

    # dependencies inside each pipeline: a kind with ``after: K`` depends on the pipeline's tasks
    # of kind K — all of them (``fan: all``, the default) or one, round-robin (``fan: spread``).
    dep_lists: list[np.ndarray] = []
    dep_counts = np.zeros(n, dtype=np.int64)
    if not independent:
        for name, kind in kinds.items():
            after = kind.get("after")
            if after is not None and after not in kinds:
                raise ConfigError(f"kind {name!r}: bad value for 'after': {after!r} (kinds: {list(names)})")
        starts = np.concatenate([[0], np.cumsum(counts.sum(axis=1))])
        parents_of: list[list[int]] = [[] for _ in range(n)]
        position = {name: k for k, name in enumerate(names)}
        for p in range(pipelines):
            base = int(starts[p])
            offsets = np.concatenate([[0], np.cumsum(counts[p])])
            members = [list(range(base + int(offsets[k]), base + int(offsets[k + 1]))) for k in range(len(names))]
            for k, name in enumerate(names):
                after = kinds[name].get("after")
                if after is None:
                    continue
                ups = members[position[after]]
                if not ups:
                    continue
                spread = kinds[name].get("fan", "all") == "spread"
                for i, t in enumerate(members[k]):
                    parents_of[t] = [ups[i % len(ups)]] if spread else list(ups)
        for t, ps in enumerate(parents_of):
            dep_counts[t] = len(ps)
            if ps:
                dep_lists.append(np.asarray(ps, dtype=np.int64))
    dep_ptr = np.concatenate([[0], np.cumsum(dep_counts)]).astype(np.int64)
    deps = np.concatenate(dep_lists) if dep_lists else np.zeros(0, dtype=np.int64)
    return Workload(str(data.get("name", "workload")), names, tuple(requests), request_of, kind_of,
                    duration, estimate, (pipe_of % max(1, groups)).astype(np.int16), dep_ptr, deps)


def _draw_int(value: Any, count: int, rng: np.random.Generator, low: int = 1) -> np.ndarray:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] > value[1] or value[0] < low:
            raise ConfigError(f"bad range {value!r} (expected [low, high] with {low} <= low <= high)")
        return rng.integers(int(value[0]), int(value[1]) + 1, count)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"bad count {value!r} (expected an integer >= {low} or [low, high])")
    return np.full(count, value, dtype=np.int64)
