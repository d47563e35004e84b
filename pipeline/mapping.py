"""Map stages (``map_over=``): their items, each item's cache key, and one execution's bookkeeping.

The run plan sees a map stage as one stage with one task per attempt; the
orchestrator carries that task out as several *chunk* tasks, each with the
stage's resource request and some of its items (:mod:`hetflow.tasks.mapitems`
runs them).  This module holds what that needs and does no scheduling:

- :func:`list_items`: the items, in order, each with its identity and key.  An
  item's key is the stage's key without what the items split (the mapped files'
  or input's content) plus the item's identity: the
  file's path and content hash (an object's URI, ETag and size), the partition's checksum, the row's values, the
  grid point.  Adding a file adds one key, editing one changes one, a code change
  changes all.  Like a plain stage's key, it holds no parameter: the parameters
  are matched against the record of the run an earlier item comes from (see
  "Parameters" below).
- :class:`MapRun`: one execution's items (cached, pending, running, done,
  failed), its chunks, per-item retries and the failures it may accept.
- :func:`reusable` and :func:`assemble`: items reused from an intact earlier
  output, and the stage's output datasets made of the items' partitions in item
  order (hard links, so an earlier run's files are shared, not copied).

Parameters (decision): a map stage's record keeps, as a plain stage's does, the
parameters of its run (``params``) and the names its items read
(``params_read``: the union over the items of the output, ``None`` when one
iterated ``ctx.params`` or gave no account); an earlier item is reused only from
a run whose values of those names are today's (:func:`hetflow.cache.params_match`,
the plain stage's rule).  So a parameter no item read re-runs nothing, one an
item read re-runs every item of that run, and a first run, or one whose item read
them all, matches every parameter as before.  One record per stage, not per item:
no parameter column on 100,000 item rows, and each item line carries only the
names it read (:meth:`MapRun.chunk_ended` takes their union).  It is sound
because the union holds each item's own reads: an item served from that run read
only names whose values are unchanged, and with the same code and identity (its
key) and the same values it read, it takes the same branches, so it would read no
other name now either (a branch that would read a new one is decided by
something it read, or by its key).  An item that is new or changed runs and adds
what it reads.  Its cost is coarseness: a name read by one item re-runs every
item of that run when it changes; items of one stage share their code, so they
usually read the same names.  The union covers the items this run reused too
(the reads of the runs they came from, :func:`reusable`), and is written with
each chunk's rows (:meth:`~hetflow.mapshell.MapShell._record_items_done`), so an
orchestrator killed mid-map, or a map that failed, leaves rows that a resume or
a later run matches against the right names.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hetflow.operators import dataset as ds
from hetflow.operators import safeio

from .declaration import StageSpec
from .fingerprint import file_digests
from .states import State

CHUNK_ITEMS = 1024
"""At most this many items in one chunk task.  A chunk's start (its process, MPI, the stage's loading) is
paid once for its items; its items' results reach the store when it ends, so an orchestrator killed
meanwhile leaves at most that many items of each running chunk to run again (an item that crashes its
process costs only itself: :mod:`hetflow.tasks.mapitems`)."""

CHUNKS_PER_SLOT = 2
"""Chunk tasks per place the stage fits on the pilot at once, so a slow chunk does not hold the map's end."""

FAILURES_SHOWN = 3
"""Failed items a stage's error names (the rest are counted)."""


@dataclass(slots=True)
class Item:
    """One item of a map stage in one execution (slots: a map holds one per item, twice while it starts)."""

    index: int
    key: str
    label: str
    """For people: the file (relative to the script), the row, ``partition 3``, the grid point."""
    where: tuple[str, Any]
    """What the worker gets (:attr:`WorkerSpec.items`): ``("file", path)``, ``("row", i)``, ``("partition", i)``,
    ``("point", {...})``."""
    directory: str = ""
    state: str = State.PENDING
    tries: int = 0
    error: str | None = None
    outputs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    cached_from: str | None = None
    started: float | None = None
    ended: float | None = None
    log: list[Any] | None = None
    """``[rank 0's log file, start, end]``: the span of the file the item's output is in."""

    def again(self) -> Item:
        """This item as a new execution starts it: no outputs yet (``dataclasses.replace(item, outputs={})``, at
        a fraction of its cost per item)."""
        return Item(self.index, self.key, self.label, self.where, self.directory, self.state, self.tries, self.error,
                    {}, self.cached_from, self.started, self.ended, self.log)

    def to_spec(self, outputs: Sequence[str]) -> dict[str, Any]:
        return {"index": self.index, "key": self.key, self.where[0]: self.where[1],
                "outputs": {name: os.path.join(self.directory, name) for name in outputs}}


def _json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, default=str)


def _digest(data: Any) -> str:
    return hashlib.sha256(_json(data).encode()).hexdigest()


def list_items(spec: StageSpec, *, base: Path, stage_key: Mapping[str, Any], inputs: Mapping[str, str],
               items_dir: Path) -> list[Item]:
    """The items of map stage ``spec`` now, in order, with their keys.

    ``stage_key`` is the stage's key material without the mapped part; ``inputs`` maps each input to its
    committed dataset's directory; every item's partitions of output ``NAME`` go to ``items_dir``/NAME, each
    file named by its item's key (:func:`hetflow.tasks.mapitems.item_file`): one directory per output, not
    two per item.
    """
    mapped = spec.map_over
    assert mapped is not None
    found: list[tuple[str, tuple[str, Any], Any]] = []  # (label, field, identity)
    if mapped.kind == "files":
        from .fingerprint import resolve_files

        paths = resolve_files(spec.files, base)
        for path, content in zip(paths, file_digests(paths)):  # an object's content: its ETag and size
            if isinstance(path, str):
                shown = path   # an object's URI
            else:
                shown = path.relative_to(base).as_posix() if path.is_relative_to(base) else str(path)
            found.append((shown, ("file", str(path)), {"file": shown, "content": content}))
    elif mapped.kind == "grid":
        for point in mapped.points():
            found.append((json.dumps(point, sort_keys=True), ("point", point), {"point": point}))
    elif mapped.kind == "partitions":
        assert mapped.input is not None
        manifest = ds.read_manifest(inputs[mapped.input])
        schema = ds.schema_to_text(manifest.schema)
        for i, part in enumerate(manifest.partitions):
            found.append((f"partition {i}", ("partition", i),
                          {"partition": f"{part.checksum}:{part.rows}:{part.bytes}", "schema": schema}))
    else:
        assert mapped.input is not None
        table = ds.Dataset(inputs[mapped.input]).to_table()
        schema = ds.schema_to_text(table.schema)
        for i, row in enumerate(table.to_pylist()):
            text = json.dumps(row, sort_keys=True, default=str)
            found.append((text, ("row", i), {"row": text, "schema": schema}))
    # each key is _digest({"stage": stage_key, "kind": ..., "item": identity, "turn": n}); its JSON text is spliced
    # from the item's, made once, and the common part's, made once for all (sorted keys: item, kind, stage, turn)
    after_item = f', "kind": {_json(mapped.kind)}, "stage": {_json(stage_key)}, "turn": '
    directory = str(items_dir)
    items = []
    seen: dict[str, int] = {}
    for index, (label, where, identity) in enumerate(found):
        text = _json(identity)
        turn = seen[text] = seen.get(text, -1) + 1  # equal items (two equal rows) are told apart by their turn
        key = hashlib.sha256(f'{{"item": {text}{after_item}{turn}}}'.encode()).hexdigest()
        items.append(Item(index, key, label, where, directory=directory))
    return items


def items_digest(items: Sequence[Item]) -> str:
    """One digest of every item's key in order: a map stage's key changes when any item does."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.key.encode())
    return digest.hexdigest()


def allowed_failures(spec: StageSpec, total: int) -> int:
    """How many failed items the stage accepts (``max_failures``: a count, or a fraction of ``total``)."""
    limit = spec.max_failures
    return int(limit) if isinstance(limit, int) else math.floor(limit * total)


def capacity(spec: StageSpec, cores: int, gpus: int) -> int:
    """How many of the stage's tasks fit on the pilot at once (at least one)."""
    request = spec.request
    fits = cores // max(1, request.ranks * request.cores_per_rank)
    if request.gpus_per_rank:
        fits = min(fits, gpus // (request.ranks * request.gpus_per_rank))
    return max(1, int(fits))


def shared(values: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``values`` with the texts under ``keys`` interned (of a list, its first): every item of a map repeats its
    output's schema, its node, its rank's log file (the first of ``log``) and its directory, which the map holds
    for each of them until its end."""
    for key in keys:
        value = values.get(key)
        if isinstance(value, str):
            values[key] = sys.intern(value)
        elif isinstance(value, list) and value and isinstance(value[0], str):
            values[key] = [sys.intern(value[0]), *value[1:]]
    return values


def _intact(item: Item) -> bool:
    """Every partition file of the item is there, a regular file of this user's (another user may record items
    of your keys in a shared store: :func:`hetflow.cache.foreign`) of its size and checksum."""
    me = os.geteuid()
    for name, parts in item.outputs.items():
        for part in parts:
            path = os.path.join(item.directory, name, part["file"])
            try:
                info = os.lstat(path)
            except OSError:
                return False
            if not stat.S_ISREG(info.st_mode) or info.st_size != part["bytes"] or info.st_uid != me:
                return False
            crc = 0
            with open(path, "rb", buffering=0) as fh:
                while chunk := fh.read(8 << 20):
                    crc = zlib.crc32(chunk, crc)
            if f"crc32:{crc:08x}" != part["checksum"]:
                return False
    return True


class Earlier(NamedTuple):
    """An earlier ``map_items`` row of an item's key, the columns :func:`reusable` reads (a cached map of 100,000
    items loads as many: its texts are shared as loaded, :func:`shared_outputs`)."""

    run_id: str
    directory: str
    outputs: dict[str, list[dict[str, Any]]] | None
    cached_from: str | None


def shared_outputs(outputs: Mapping[str, list[dict[str, Any]]] | None) -> dict[str, list[dict[str, Any]]]:
    """An item's recorded ``outputs`` with the texts every item repeats shared (:func:`shared`; its partitions'
    dicts are changed in place)."""
    return {name: [shared(part, "schema", "node") for part in parts] for name, parts in (outputs or {}).items()}


def reusable(items: Sequence[Item], earlier: Mapping[str, Sequence[Any]], run_id: str) -> set[str]:
    """Mark CACHED each item that an earlier record (``earlier[key]``: records with ``directory``,
    ``outputs``, ``run_id``, ``cached_from``, such as :class:`Earlier`) produced with intact files, this run's
    own first; returns the runs whose records were reused (their parameters read go on with this run's)."""
    used: set[str] = set()
    for item in items:
        for record in sorted(earlier.get(item.key, ()), key=lambda r: r.run_id != run_id):
            outputs = shared_outputs(record.outputs)
            candidate = Item(item.index, item.key, item.label, item.where, directory=sys.intern(record.directory),
                             outputs=outputs)
            if _intact(candidate):
                item.state, item.directory, item.outputs = State.CACHED, candidate.directory, candidate.outputs
                item.cached_from = record.cached_from or (None if record.run_id == run_id else record.run_id)
                used.add(record.run_id)
                break
    return used


class MapRun:
    """One execution (plan attempt) of a map stage: its items and its chunk tasks."""

    def __init__(self, spec: StageSpec, task: Any, items: list[Item]) -> None:
        self.spec = spec
        self.task = task
        self.items = items
        self.chunks: dict[str, list[int]] = {}
        """Chunk task id -> the indices of its items, while it is queued or running."""
        self.started = False
        self.stopped: tuple[str, str] | None = None
        """(state, reason) when the map was cancelled or cut off: nothing more is started."""
        self.made = 0
        self.before: dict[str, str] = {}
        """``{label: key}`` of the items of the stage's latest earlier execution (to say what changed)."""
        self.stage_reason = ""
        """Why the stage as a whole was not reused (its record's reason at the start): when it names a change
        of the whole stage (its code, a value, a parameter), that, not each item, is what the items ran for."""
        self.progress_file: Path | None = None
        """Where the items' counts are written for ``hetflow serve`` (set when the first chunk starts)."""
        self.tally: dict[str, int] = {}
        """Items by state, kept as they change: the live view reads it at every step, whatever the map's size."""
        self.observed: dict[str, str] = {}
        """What its chunks' ranks observed beyond the items' keys (:mod:`hetflow.observed`), as recorded with
        the stage: a later run reuses its items only while that still holds."""
        self.recorded: set[int] = set()
        """The items whose store rows this execution wrote as their chunks ended (DONE, so final): the map's
        end writes only the others' (:meth:`~hetflow.mapshell.MapShell._record_map`)."""
        self.row_counts: dict[str, int] = {}
        """The stage's ``map_items`` rows of this run by state, as the store holds them (its record's
        ``item_counts``)."""
        self.row_watermark = 0
        """The largest ``map_items`` id when this execution began: rows of the stage in this run up to it are
        an earlier execution's (a resumed session's), replaced at the map's end."""
        self.isolated: str | None = None
        """Why the map's one-rank items run in a process each from now on: the first item seen to change
        state that later items would read (:mod:`hetflow.tasks.mapitems`), or ``None``."""
        self.params_read: set[str] | None = set()
        """The parameters its items read (``None``: all), with those of the runs whose items it reused: what
        its record keeps for a later run to match (the module's "Parameters")."""
        self.recount()

    def read(self, names: Any) -> None:
        """Its items (or a run they came from) read ``names`` (``None``, or anything but a list of names: every
        parameter)."""
        if self.params_read is not None:
            if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
                self.params_read = None
            elif names:
                self.params_read.update(names)

    def reads(self) -> list[str] | None:
        """:attr:`params_read` as its record keeps it: sorted, ``None`` for all."""
        return None if self.params_read is None else sorted(self.params_read)

    def recount(self) -> None:
        self.tally = {}
        for item in self.items:
            self.tally[item.state] = self.tally.get(item.state, 0) + 1

    def set_state(self, item: Item, state: str) -> None:
        self.tally[item.state] -= 1
        self.tally[state] = self.tally.get(state, 0) + 1
        item.state = state

    def progress_text(self) -> str:
        """``items 412/1,000 (3 cached), 8 running, 2 failed``: what the live view shows on the stage's row."""
        done = self.tally.get(State.DONE, 0) + self.tally.get(State.CACHED, 0)
        text = f"items {done:,}/{len(self.items):,}"
        if self.tally.get(State.CACHED):
            text += f" ({self.tally['CACHED']:,} cached)"
        if self.tally.get(State.RUNNING):
            text += f", {self.tally['RUNNING']:,} running"
        if self.tally.get(State.FAILED):
            text += f", {self.tally['FAILED']:,} failed"
        return text

    def pending(self) -> list[Item]:
        if not self.tally.get(State.PENDING):
            return []
        return [item for item in self.items if item.state == State.PENDING]

    def split(self, fits: int) -> list[tuple[str, list[Item]]]:
        """New chunk tasks for the pending items (ids ``<task>/c<n>``), recorded as queued."""
        pending = self.pending()
        if not pending or self.stopped is not None:
            return []
        count = min(len(pending), max(fits * CHUNKS_PER_SLOT, math.ceil(len(pending) / CHUNK_ITEMS)))
        size = math.ceil(len(pending) / count)
        made = []
        for start in range(0, len(pending), size):
            chunk = pending[start:start + size]
            chunk_id = f"{self.task}/c{self.made}"
            self.made += 1
            for item in chunk:
                self.set_state(item, State.QUEUED)
            self.chunks[chunk_id] = [item.index for item in chunk]
            made.append((chunk_id, chunk))
        return made

    def chunk_ended(self, chunk_id: str, lines: Mapping[int, Mapping[str, Any]], failure: str | None,
                    final: str | None = None) -> None:
        """A chunk task ended: its items' results (``lines``; several ranks' merged), and its own
        failure when it did not end well.  ``final``: a state (CANCELLED, WALLTIME) that stops the map."""
        indices = self.chunks.pop(chunk_id, [])
        if final is not None and self.stopped is None:
            self.stopped = (final, failure or final)
        missing = []
        for index in indices:
            item = self.items[index]
            line = lines.get(index)
            if line is None:
                missing.append(item)
                continue
            item.started, item.ended, item.log = line.get("started"), line.get("ended"), line.get("log")
            if line.get("isolation") and self.isolated is None:
                self.isolated = f"item {item.index} ({item.label}) changed what later items would read " \
                                f"({line['isolation']}): the items after it ran in a process each"
            elif line.get("forked") and self.isolated is None:
                self.isolated = f"the items from item {item.index} on ran in a process each ({line['forked']})"
            if line["status"] == "ok":
                self.read(line.get("params_read"))  # a line that does not say read them all
                self.set_state(item, State.DONE)
                item.error, item.outputs = None, line["outputs"]  # the line's own (hetflow.mapshell._merge)
                item.tries += 1
            else:
                self._failed(item, str(line.get("error") or "failed"))
        if not missing:
            return
        if self.stopped is not None:
            for item in missing:
                self.set_state(item, State.PENDING)  # never started: a resume runs it
            return
        # the task died: the item it was running is the first without a result; with none at all, it
        # may have died before its first item (an import error), so every item is charged
        charged = missing if len(missing) == len(indices) else missing[:1]
        for item in missing:
            if item in charged:
                self._failed(item, failure or "its task ended before the item's result was written")
            else:
                self.set_state(item, State.PENDING)

    def _failed(self, item: Item, error: str) -> None:
        item.tries += 1
        item.error = error
        self.set_state(item, State.PENDING if item.tries <= self.spec.retries else State.FAILED)

    def running(self) -> bool:
        return bool(self.chunks)

    def failed(self) -> list[Item]:
        if not self.tally.get(State.FAILED):
            return []
        return [item for item in self.items if item.state == State.FAILED]

    def counts(self) -> dict[str, int]:
        return {state: count for state, count in self.tally.items() if count}

    def summary(self, changes: str = "") -> str:
        """``map 1,000 items: 997 cached, 3 ran (data/obs-0412.csv added)``."""
        counts = self.counts()
        parts = [f"{counts.get('CACHED', 0):,} cached", f"{counts.get('DONE', 0):,} ran"]
        if counts.get(State.FAILED):
            parts.append(f"{counts['FAILED']:,} failed")
        rest = len(self.items) - sum(counts.get(s, 0) for s in (State.CACHED, State.DONE, State.FAILED))
        if rest:
            parts.append(f"{rest:,} not run")
        text = f"map {len(self.items):,} items: " + ", ".join(parts)
        text += f" ({changes})" if changes else ""
        return text + (f"; {self.isolated}" if self.isolated else "")

    def failure_text(self) -> str:
        failed = self.failed()
        shown = "; ".join(f"item {item.index} ({item.label}): {(item.error or '').splitlines()[0] if item.error else ''}"
                          for item in failed[:FAILURES_SHOWN])
        more = f"; and {len(failed) - FAILURES_SHOWN} more" if len(failed) > FAILURES_SHOWN else ""
        return f"{len(failed):,} of {len(self.items):,} items failed: {shown}{more}"


def describe_changes(before: Mapping[str, str], items: Sequence[Item], most: int = 3, stage_reason: str = "") -> str:
    """What changed in the items since an earlier execution (``before``: label -> key): added, changed, removed.

    An item's key holds the stage's key, so an edit of the stage's code changes every item's key: when no
    item kept its key and ``stage_reason`` (why the stage as a whole was not reused) names a change beyond
    the items, that is said instead of "each item changed" (``SCALE changed``, not ``data/a.csv changed``).
    An item's key holds no parameter: items that ran under the key they had before ran for a parameter they
    read (``param scale changed``), which is then said as well.

    Only items that ran are named added or changed: the words say why they ran.  An item served from the
    cache may hold another key than in ``before`` (its file edited back) and yet did not run: naming it would
    point at a file that caused nothing."""
    if not before:
        return ""
    now = {item.label: item.key for item in items}
    ran = {item.label for item in items if item.state != State.CACHED}
    added = [label for label in now if label not in before and label in ran]
    changed = [label for label in now if label in before and before[label] != now[label] and label in ran]
    removed = [label for label in before if label not in now]
    wide = [part for part in stage_reason.split("; ") if part and part != "its items changed"
            and not any(part in (f"file {label} changed", f"file {label} added", f"file {label} removed")
                        for label in (*now, *before))]
    if changed and wide and not any(label in before and before[label] == key for label, key in now.items()):
        changed = []
    elif any(label in before and before[label] == now[label] for label in ran):
        wide = [part for part in wide if part.startswith("param ")]  # items ran under the keys they had: why
    else:
        wide = []
    words = wide + [f"{label} added" for label in added] + [f"{label} changed" for label in changed] + \
        [f"{label} removed" for label in removed]
    if not words:
        return ""
    return ", ".join(words[:most]) + (f" and {len(words) - most} more" if len(words) > most else "")


def assemble(spec: StageSpec, items: Sequence[Item], datasets_dir: str, producer: Mapping[str, Any]
             ) -> dict[str, ds.Manifest]:
    """Commit each output of ``spec`` as one dataset of the succeeded items' partitions in item order.

    The partition files are hard links to the items' files (a copy where the file system refuses); under
    an object-store data directory (``s3://...``) each is uploaded to a key of its own, and the manifest,
    written last, commits them as for any dataset there.  An output for which no item returned a table is
    committed empty when the stage declares its schema.
    """
    import secrets
    import shutil

    from hetflow.operators.location import is_object_store, resolve, storage_error

    remote = is_object_store(datasets_dir)
    committed = {}
    for name in spec.outputs:
        target = f"{datasets_dir.rstrip('/')}/{name}" if remote else Path(datasets_dir) / name
        infos: list[ds.PartitionInfo] = []
        dfd: int | None = None
        schema_text: str | None = None
        first: Item | None = None
        position = 0
        try:
            for item in items:
                if item.state not in (State.DONE, State.CACHED):
                    continue
                for part in sorted(item.outputs.get(name) or (), key=lambda p: p.get("rank", 0)):
                    text = part.get("schema")
                    if schema_text is None:
                        schema_text, first = text, item
                    elif text != schema_text:
                        assert first is not None
                        raise ValueError(f"stage {spec.name!r}, output {name!r}: item {item.index} ({item.label}) "
                                         f"returned a schema that differs from item {first.index}'s ({first.label}); "
                                         "every item must return the same columns and types, or None")
                    file = f"part-{item.index:08d}-{int(part.get('rank', 0)):04d}.arrow"
                    source = os.path.join(item.directory, name, part["file"])
                    if remote:  # a key no other write of this dataset uses; the manifest names it
                        file = f"part-{item.index:08d}-{int(part.get('rank', 0)):04d}-{secrets.token_hex(6)}.arrow"
                        where = resolve(f"{target}/{file}")
                        try:
                            with open(source, "rb") as local, where.filesystem.open_output_stream(where.path) as out:
                                shutil.copyfileobj(local, out, 8 << 20)
                        except OSError as exc:
                            if isinstance(exc, FileNotFoundError) and not os.path.exists(source):
                                raise
                            raise storage_error(exc, where, "write") from exc
                    else:
                        if dfd is None:  # the dataset's directory, opened once: each link is one call, not a walk
                            dfd = safeio.open_dir_nofollow(target)
                        _link(source, file, dfd, Path(target))
                    infos.append(ds.PartitionInfo(file=file, rows=int(part["rows"]), bytes=int(part["bytes"]),
                                                  checksum=str(part["checksum"]), node=str(part.get("node", "")),
                                                  rank=position))
                    position += 1
        finally:
            if dfd is not None:
                os.close(dfd)
        if schema_text is None:
            if name not in spec.schemas:
                raise ValueError(f"stage {spec.name!r}, output {name!r}: no item returned a table "
                                 f"({len(items)} items); declare its schema (schemas=) to allow an empty output")
            schema = spec.schemas[name]
        else:
            schema = ds.schema_from_text(schema_text)
        committed[name] = ds.commit(target, name, schema, infos, producer={**producer, "ranks": max(1, position)})
    return committed


def _link(source: str, name: str, dfd: int, directory: Path) -> None:
    """Hard-link ``source`` as ``name`` in the directory open as ``dfd`` (``directory``), replacing what an
    earlier attempt left there; a copy where the file system refuses links."""
    import shutil

    try:
        os.link(source, name, dst_dir_fd=dfd, follow_symlinks=False)
        return
    except FileExistsError:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        shutil.copyfile(source, directory / name, follow_symlinks=False)
        return
    try:
        os.link(source, name, dst_dir_fd=dfd, follow_symlinks=False)
    except OSError:
        shutil.copyfile(source, directory / name, follow_symlinks=False)


def chunk_dirs(directory: Path) -> list[Path]:
    """``directory``, and when it is a map stage's chunk (``attempt-<n>-c<k>``) every chunk of that attempt."""
    head, _, chunk = directory.name.rpartition("-c")
    if not head.startswith("attempt-") or not chunk.isdigit():
        return [directory]
    found = [p for p in directory.parent.glob(f"{head}-c*") if p.name[len(head) + 2:].isdigit()]
    return sorted(set(found) | {directory})
