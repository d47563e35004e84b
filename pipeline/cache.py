"""Cache decisions: what a stage's key covers, where an intact committed output under it is, and why not.

A stage's key covers what its result depends on that hetflow can see, and
nothing else (docs/caching.md):

- its code: the stage function and the user code it reaches (helpers, classes,
  module-level values they name, local modules), not site-packages
  (:func:`hetflow.fingerprint.code_fingerprint`);
- the declared ``files=`` and their content;
- the values of the declared ``env=`` variables (:func:`env_digests`; an unset one as ``"unset"``);
- its inputs' manifests (content checksums), its declared schemas, its
  outputs' names, its rank count, the hetflow version;
- the values of the parameters it *read* when it ran: a parameter it never
  read does not re-run it.  Which ones it read is only known after a run, so
  the parameters are matched against each candidate's record, not hashed into
  the key.

A candidate is reused only when every partition file of every output is there
with its size (and its checksum, when the output is small enough to check
cheaply); a damaged one is passed over with a warning naming the file.  On a
file system, only outputs whose directory and files are this user's are reused
(:func:`foreign`): a store that users share records their runs too, and any of
them could record a run of your key whose "outputs" are files of theirs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetflow.operators import dataset as ds
from hetflow.operators.location import is_object_store
from sqlalchemy import select

from . import __version__
from .states import SUCCESS
from .store import DatasetRecord, RunRecord, StageRecord

log = logging.getLogger(__name__)

CHECKSUM_BYTES = 256 << 20
"""Outputs up to this size are checksummed before reuse; larger ones are checked by size only."""


@dataclass(frozen=True)
class KeyMaterial:
    """Everything a stage's key is made of, by part, so a change can be named."""

    code: Mapping[str, str]
    files: Mapping[str, str]
    inputs: Mapping[str, str]
    schemas: Mapping[str, str]
    outputs: tuple[str, ...]
    ranks: int
    hetflow: str = __version__
    env: Mapping[str, str] = field(default_factory=dict)
    """``{declared variable: digest of its value, or "unset"}``: digests, so no value is stored in the clear."""
    items: str = ""
    """A map stage's items: one digest of their keys in order (:mod:`hetflow.mapping`); empty for a plain stage."""

    def to_json(self) -> dict[str, Any]:
        # the inputs in the order the stage function takes them: swapping two changes the result
        found = {"code": dict(self.code), "files": dict(self.files), "inputs": dict(self.inputs),
                 "input_order": list(self.inputs),
                 "schemas": dict(self.schemas), "outputs": list(self.outputs), "ranks": self.ranks,
                 "hetflow": self.hetflow}
        if self.env:  # only then: the keys of stages that declare none stay what they were
            found["env"] = dict(self.env)
        if self.items:  # likewise: only a map stage's key has its items
            found["items"] = self.items
        return found

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Answer:
    """A cache look-up's result: the hit (its run and datasets) or why the stage must run."""

    hit: StageRecord | None
    datasets: Mapping[str, DatasetRecord]
    reason: str


def env_digests(values: Mapping[str, str | None]) -> dict[str, str]:
    """What the key records of declared environment variables: a digest of each value, ``"unset"`` for none."""
    return {name: "unset" if value is None else "sha256:" + hashlib.sha256(value.encode()).hexdigest()
            for name, value in sorted(values.items())}


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def params_match(read: Sequence[str] | None, then: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The parameters among those a stage read (``None``: all) whose value differs now; empty if none."""
    names = sorted(set(then) | set(now)) if read is None else sorted(read)
    return [n for n in names if (n in then) != (n in now) or (n in then and not _same(then[n], now[n]))]


def damage(record: DatasetRecord, data_dir: str | None = None) -> str | None:
    """Why the committed dataset ``record`` cannot be served as it is, or ``None`` if it is intact
    (:func:`hetflow.operators.dataset.damage`: on a file system or an object store alike), and this user's
    (:func:`foreign`; ``data_dir``: the run's own, where an object store's datasets must be)."""
    return foreign(record.path, data_dir) or ds.damage(record.path, fingerprint=record.fingerprint,
                                                       checksum_up_to=CHECKSUM_BYTES)


def foreign(path: str, data_dir: str | None = None) -> str | None:
    """Why the dataset at ``path`` is not this user's to reuse, or ``None``: on a file system, its directory
    or a file in it belongs to another user; on an object store, it is not under ``data_dir``, the object
    store data directory the run looking it up writes to (``--data-dir s3://bucket/prefix``).

    Decision: the cache serves only what this user's own runs wrote.  In a store that several users share,
    anyone can record a run under your stage's key (the keys are in the store) whose outputs are files of
    theirs; served, your pipeline would go on from their data as if your stage had made it.  An object has
    no owner that your credentials show (a bucket of theirs that anyone may read looks like yours), so the
    data directory you gave this run stands for "yours": an object-store output elsewhere (an earlier run's
    other bucket too) is made again rather than trusted."""
    if is_object_store(path):
        prefix = (data_dir or "").rstrip("/") + "/"
        if data_dir is None or not is_object_store(data_dir) or not path.startswith(prefix) or \
                "/../" in path[len(prefix) - 1:]:
            return (f"{path} is not under this run's data directory {data_dir or '(a local one)'}: an object "
                    "store's outputs are reused only from there")
        return None
    me = os.geteuid()
    directory = Path(path)
    try:
        entries = [directory, *directory.iterdir()]
    except OSError:
        return None  # missing or unreadable: ds.damage says which
    for entry in entries:
        try:
            owner = os.lstat(entry).st_uid
        except OSError:
            continue
        if owner != me:
            return f"{entry} belongs to another user (uid {owner}): only your own runs' outputs are reused"
    return None


def look_up(session: Any, *, run_id: str, stage: str, key: str, params: Mapping[str, Any],
            outputs: Sequence[str], now: Mapping[str, str] | None = None, observed: bool = False,
            written: Callable[[], Collection[str]] | None = None, data_dir: str | None = None,
            ) -> tuple[StageRecord | None, dict[str, DatasetRecord], list[str]]:
    """The newest committed execution under ``key`` whose read parameters match, whose outputs are intact
    and whose recorded observations (:func:`hetflow.observed.stale`) still hold ``now``, run ``run_id``'s
    own first (a resume keeps what it committed); and the damage found on the way (one line per
    passed-over candidate).  With ``observed``, a commit that recorded no observations (by a hetflow
    before them) is not served: what its ranks depended on beyond the key is unknown.  ``written``: the files
    the pipeline's stages write (:func:`written_by_stages`), which are no change when the top read them.
    ``data_dir``: the run's own data directory (:func:`foreign`)."""
    from .observed import stale

    damaged: list[str] = []
    stale_said = False
    candidates = session.scalars(select(StageRecord).where(StageRecord.cache_key == key,
                                                           StageRecord.state.in_(SUCCESS))
                                 .order_by((StageRecord.run_id == run_id).desc(), StageRecord.ended.desc()))
    for hit in candidates:
        if params_match(hit.params_read, hit.params or {}, params):
            continue
        if observed and "observed" not in (hit.cache_material or {}):
            continue
        changed = stale((hit.cache_material or {}).get("observed") or {}, now, written) if now is not None else []
        if changed:  # said once: the older candidates under the same key usually share the reason
            if not stale_said:
                damaged.append(f"{'; '.join(changed[:3])} since run {hit.run_id}")
            stale_said = True
            continue
        found = {d.name: d for d in session.scalars(select(DatasetRecord).where(
            DatasetRecord.run_id == hit.run_id, DatasetRecord.name.in_(list(outputs))))}
        if set(found) != set(outputs):
            continue
        problems = [(n, p) for n, d in sorted(found.items()) if (p := damage(d, data_dir)) is not None]
        if problems:
            name, problem = problems[0]
            damaged.append(f"output {name!r} of run {hit.run_id} is damaged: {problem}")
            continue
        return hit, found, damaged
    return None, {}, damaged


WRITTEN_RUNS = 10
"""How many of a pipeline's latest runs :func:`written_by_stages` asks."""


def written_by_stages(session: Any, pipeline: str) -> frozenset[str]:
    """The files the stages of ``pipeline``'s latest :data:`WRITTEN_RUNS` runs wrote, as recorded with the
    commits they ran or reused (their ``wrote PATH`` observations, :func:`hetflow.observed.to_record`)."""
    runs = select(RunRecord.id).where(RunRecord.pipeline == pipeline) \
        .order_by(RunRecord.created.desc()).limit(WRITTEN_RUNS).scalar_subquery()
    found: set[str] = set()
    for material in session.scalars(select(StageRecord.cache_material).where(
            StageRecord.run_id.in_(runs), StageRecord.state.in_(SUCCESS), StageRecord.cache_material.is_not(None))):
        seen = (material or {}).get("observed") or {}
        found.update(key[len("wrote "):] for key in seen if key.startswith("wrote "))
    return frozenset(found)


NO_EARLIER = "no earlier execution"
""":func:`why_run`'s reason for a stage that no run of its pipeline has committed."""


def any_committed(session: Any) -> bool:
    """Whether the store holds any committed stage execution (DONE or CACHED), of any run or pipeline.

    :func:`look_up`'s candidates and :func:`why_run`'s last execution are all such records, so where there
    is none (a first run in its work directory) both are known empty without their queries."""
    return session.scalars(select(StageRecord.id).where(StageRecord.state.in_(SUCCESS)).limit(1)).first() is not None


def why_run(session: Any, *, pipeline: str, run_id: str, stage: str, material: KeyMaterial,
            params: Mapping[str, Any], damaged: Sequence[str]) -> str:
    """Why ``stage`` has no reusable output: what changed since its last committed execution."""
    if damaged:
        return damaged[0] + "; recomputing"
    last = session.scalars(select(StageRecord).join(RunRecord, StageRecord.run_id == RunRecord.id)
                           .where(RunRecord.pipeline == pipeline, StageRecord.name == stage,
                                  StageRecord.state.in_(SUCCESS), StageRecord.cache_material.is_not(None))
                           .order_by(StageRecord.ended.desc()).limit(1)).first()
    if last is None:
        return NO_EARLIER
    return describe(last.cache_material, material.to_json(), last.params_read, last.params or {}, params)


def describe(old: Mapping[str, Any], new: Mapping[str, Any], read: Sequence[str] | None,
             old_params: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    """Name the first parts of the key that differ between two materials (and the read parameters)."""
    from .fingerprint import describe_change

    reasons: list[str] = []
    if old.get("code") != new.get("code"):
        reasons.append(describe_change(old.get("code", {}), new.get("code", {})))
    for kind, label in (("env", "env"), ("files", "file"), ("inputs", "input")):
        before, after = old.get(kind, {}), new.get(kind, {})
        for name in sorted(set(before) | set(after)):
            if name not in after:
                reasons.append(f"{label} {name} removed")
            elif name not in before:
                reasons.append(f"{label} {name} added")
            elif before[name] != after[name]:
                reasons.append(f"{label} {name} changed")
    for part, text in (("input_order", "the order of the inputs changed"), ("schemas", "declared schemas changed"), ("outputs", "declared outputs changed"),
                       ("items", "its items changed"),
                       ("ranks", f"ranks changed ({old.get('ranks')} -> {new.get('ranks')})"),
                       ("hetflow", f"hetflow version changed ({old.get('hetflow')} -> {new.get('hetflow')})")):
        if old.get(part) != new.get(part):
            reasons.append(text)
    reasons += [f"param {name} changed" for name in params_match(read, old_params, params)]
    if not reasons:
        return "no reusable output (the earlier one was withdrawn or is from an older hetflow)"
    return "; ".join(reasons[:3]) + (f" (and {len(reasons) - 3} more)" if len(reasons) > 3 else "")
