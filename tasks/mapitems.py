"""The items of a map stage, run by one task (a worker's ranks) one after another.

A map stage (``map_over=``) is split by the orchestrator into tasks of one or
more items each; every task has the stage's resource request.  Its ranks load
the stage function and the inputs it does not map over once, then run each
item of :attr:`WorkerSpec.items <hetflow.tasks.protocol.WorkerSpec.items>` in
order: ``ctx.item`` and ``ctx.item_index`` say which, each output goes to the
item's own directory, and one line per item is appended to
``items-<rank>.jsonl`` (:meth:`AttemptFiles.item_results
<hetflow.tasks.protocol.AttemptFiles.item_results>`) as it ends, so what ended
before a crash is kept.  A succeeded item's line names the parameters it read
(``params_read``, as a plain stage's rank result does): the orchestrator keeps
their union with the stage's record, and later runs match only those.

Isolation (decision): a one-rank task runs its items in a *runner*, a child
forked from the loaded rank, one after another in that process (an item costs
its work, not a process), and checks after each item that it left nothing a
later item would read (:mod:`hetflow.tasks.itemstate`: the user's modules'
globals, followed into their values; the working directory, the environment,
``sys.path``, threads, newly imported user modules).  An item that changed such
state still counts (it ran from the same state as every other); the items after
it run in a child each, forked from the clean rank, and its line says why
(``isolation``), which the orchestrator reports once.  An item that ends the
runner (a crash, ``os._exit``, a signal) or runs past the stage's timeout (its
runner is killed) fails alone: the lines written before stay, and a new runner
goes on with the next item.  With ``item_isolation="fork"`` (the stage's
``map_isolation``) every item runs in a child of its own, as each runner's
items do once one changed state.  A child does not use MPI: its ``ctx.comm`` is
the rank's world of one, which a one-rank item only asks for its rank and size.
The ranks of a multi-rank task stay one MPI world for all their items and run
them in the same processes, one after another; an item that fails there ends
the task (the orchestrator runs the items it did not reach again).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Mapping

from .protocol import AttemptFiles, RankResult, WorkerSpec, declared_file


def run_items(spec: WorkerSpec, rank: int, size: int, get_comm: Callable[[], Any]) -> tuple[RankResult, Any]:
    """Run the items of ``spec`` on this rank; the rank's own result says whether the loop itself ran."""
    import dataclasses

    from .protocol import RankError
    from .worker import _load_function, _observe, _observe_after, _pin, error_message

    files = AttemptFiles(spec.attempt_dir)
    log = logging.getLogger(f"hetflow.stage.{spec.stage}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{spec.stage} rank {rank}/{size}] %(levelname)s "
                                           "%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    result = RankResult(rank=rank, size=size, pid=os.getpid(), host=socket.gethostname(), started=time.time())
    files.write_pid(rank, os.getpid())
    comm: Any = None
    failed = False
    seen: dict[str, str] | None = None
    try:
        comm = get_comm()
        slot = spec.slots[rank]
        _pin(list(slot.cores), list(slot.gpus), spec.gpu_vendor, log)
        func = _load_function(spec)
        top = _observe(spec)  # what the items could depend on beyond their keys, as for a plain stage
        env = spec.env_values()  # what the key was made with, passed in this process's environment
        shared = _Shared(spec, rank, size, comm, func, log, env)
        if size == 1:
            import gc

            # what is loaded now is shared with every item's child: kept out of the children's collections,
            # which would otherwise touch (and so copy) every page of it
            import pyarrow as pa

            import hetflow.operators.settings  # noqa: F401 - what each item's run imports: once here

            pa.table({"x": [0]})  # pyarrow loads pandas on a table's first making: once here, not per child
            if spec.item_isolation == "fork":  # a child per item: what is garbage now is not copied into each
                gc.collect()
            gc.freeze()
        sink = os.open(files.item_results(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            log_path = str(files.rank_log(rank))
            if size == 1:
                _one_rank(shared, list(spec.items), sink, str(files.item_results(rank)), log_path)
            for item in spec.items if size > 1 else ():
                start = _log_size()
                line = shared.run(item)
                line["log"] = [log_path, start, _log_size()]  # what the item printed: that span of the rank's log
                os.write(sink, (json.dumps(line) + "\n").encode())
                if line["status"] != "ok":
                    failed = True  # the other ranks may wait in a collective: the task ends here
                    break
        finally:
            os.close(sink)
        # modules the items imported in this process (not in their children), the generators they drew from
        seen = _observe_after(spec, top, shared.drew)
        result = dataclasses.replace(result, status="error" if failed else "ok", error=RankError(
            "ItemFailed", "an item failed; the task's other items are run again by another task", "")
            if failed else None)
    except BaseException as exc:  # noqa: BLE001 - recorded before the abort, as run_rank does
        result = dataclasses.replace(result, status="error", error=RankError(
            type=type(exc).__name__, message=error_message(exc, spec.files), traceback=traceback.format_exc()))
        log.error("failed: %s: %s", type(exc).__name__, exc)
    finally:
        log.removeHandler(handler)
    result = dataclasses.replace(result, ended=time.time(), observed=seen)
    result.write(files.rank_result(rank))
    return result, comm


def item_file(key: str, rank: int) -> str:
    """The name of rank ``rank``'s partition of an item whose key is ``key``: the items of a map stage write
    into one directory per output (no directory made per item), each file named by its item."""
    return f"part-{key[:32]}-{rank:04d}.arrow"


def _log_size() -> int:
    """Where this rank's output (file descriptor 1, its ``rank-<r>.log``) ends now."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return os.fstat(1).st_size
    except OSError:
        return 0


class _Shared:
    """What every item of one task shares: the function, the inputs it does not map over, the context's parts."""

    def __init__(self, spec: WorkerSpec, rank: int, size: int, comm: Any, func: Callable[..., Any],
                 log: logging.Logger, env: Mapping[str, str | None]) -> None:
        from hetflow.operators.dataset import Dataset, schema_from_text

        from .worker import _open_input

        self.spec, self.rank, self.size, self.comm, self.func, self.log = spec, rank, size, comm, func, log
        self.env = env
        """The declared variables' values (:meth:`WorkerSpec.env_values`)."""
        self.declared = {name: schema_from_text(text) for name, text in spec.schemas.items()}
        self.inputs: list[Any] = []
        self.mapped_at: int | None = None
        self.mapped: Any = None
        for position, (name, path) in enumerate(spec.inputs):
            if name == spec.map_input:
                self.mapped_at, self.mapped = position, Dataset(path, verify=spec.verify)
                self.inputs.append(None)
            else:
                self.inputs.append(_open_input(path, rank, size, spec.verify))
        self.drew: frozenset[str] = frozenset()
        """The generators the task was given (:attr:`WorkerSpec.generators`) that an item drew from."""
        self.rows: Any = None
        if self.mapped is not None and any("row" in item for item in spec.items):
            self.rows = self.mapped.to_table()  # once, before the items' children are forked

    def _mapped_table(self, item: Mapping[str, Any]) -> Any:
        if "partition" in item:
            table = self.mapped.partition(int(item["partition"]))
        else:
            if self.rows is None:
                self.rows = self.mapped.to_table()
            table = self.rows.slice(int(item["row"]), 1)
        if self.size > 1:  # the item's rows shared among its ranks, in order
            share, extra = divmod(table.num_rows, self.size)
            start = self.rank * share + min(self.rank, extra)
            table = table.slice(start, share + (1 if self.rank < extra else 0))
        return table

    def run(self, item: Mapping[str, Any]) -> dict[str, Any]:
        """Run one item; its result line (never raises)."""
        from hetflow import observed
        from hetflow.operators import dataset as ds

        from .context import StageContext
        from .worker import _agree_on_schemas, _check_result, check_schema, error_message, operator_settings

        spec = self.spec
        started = time.time()
        line: dict[str, Any] = {"index": item["index"], "key": item["key"], "started": started}
        try:
            inputs = list(self.inputs)
            value: Any
            params = dict(spec.params)
            if "file" in item:
                value = declared_file(item["file"])
            elif "point" in item:
                value = dict(item["point"])
                params.update(value)
            else:
                assert self.mapped_at is not None
                table = self._mapped_table(item)
                name = spec.map_input
                if name in self.declared:
                    check_schema(spec.stage, "input", name, table.schema, self.declared[name])
                inputs[self.mapped_at] = table
                value = int(item["partition"]) if "partition" in item else \
                    (self.rows.slice(int(item["row"]), 1).to_pylist()[0])
            for (name, _), table in zip(spec.inputs, inputs):
                if name in self.declared and name != spec.map_input:
                    check_schema(spec.stage, "input", name, table.schema, self.declared[name])
            slot = spec.slots[self.rank]
            ctx = StageContext(comm=self.comm, stage=spec.stage, run_id=spec.run_id, attempt=spec.attempt,
                               params=params, workdir=spec.attempt_dir, checkpoint_dir=spec.checkpoint_dir,
                               cores=slot.cores, gpus=slot.gpus, node=spec.nodes[slot.node], log=self.log,
                               # a file item's key covers its own file only: so do its ctx.files
                               files=(value,) if "file" in item else tuple(declared_file(f) for f in spec.files),
                               env=self.env, item=value, item_index=int(item["index"]),
                               inputs={name: table for (name, _), table in zip(spec.inputs, inputs)})
            observed.restore_generators(spec.generators)  # each item as a process of its own would start it
            with operator_settings(spec):
                tables = _check_result(spec.stage, self.func(ctx, *inputs), list(spec.outputs))
            moved = observed.generators_moved(spec.generators)
            if moved:  # a runner or an item's process says so to this rank
                line["drew"] = sorted(moved)
                self.drew |= moved
            for name, out in tables.items():
                if out is not None and name in self.declared:
                    check_schema(spec.stage, "output", name, out.schema, self.declared[name])
            if self.size > 1:
                _agree_on_schemas(self.comm, spec.stage, tables)
            import pyarrow as pa

            outputs: dict[str, Any] = {}
            for name, out in tables.items():
                if out is None:
                    outputs[name] = None
                    continue
                info = ds.write_partition(item["outputs"][name], self.rank,
                                          out if isinstance(out, pa.Table) else iter(out), schema=out.schema,
                                          rank=self.rank, node=ctx.node, durable=False,
                                          name=item_file(item["key"], self.rank))
                outputs[name] = {"partition": info.to_json(), "schema": ds.schema_to_text(out.schema)}
            line.update(status="ok", outputs=outputs, params_read=_read(ctx, item))
        except BaseException as exc:  # noqa: BLE001 - an item's failure is its result, not the task's
            line.update(status="error", error=f"{type(exc).__name__}: {error_message(exc, spec.files)}",
                        traceback=traceback.format_exc())
            self.log.error("item %s failed: %s: %s", item["index"], type(exc).__name__, exc)
        line["ended"] = time.time()
        return line


def _read(ctx: Any, item: Mapping[str, Any]) -> list[str] | None:
    """The parameters the item read (``None``: all of them), less its grid point's own: those values are the
    point's, which its key holds, whatever the run's parameters (the orchestrator's
    :meth:`~hetflow.mapping.MapRun.chunk_ended` gathers them for the stage's record)."""
    read: list[str] | None = ctx.params_read
    if read is None or "point" not in item:
        return read
    return [name for name in read if name not in item["point"]]


def _one_rank(shared: _Shared, items: list[Mapping[str, Any]], sink: int, sink_path: str, log_path: str) -> None:
    """Run a one-rank task's items, each line appended to ``sink`` (the file ``sink_path``): in a runner process
    while no item changes what a later one would read (``item_isolation="checked"``), the rest (or all,
    ``"fork"``) in a child each."""
    spec = shared.spec
    why: str | None = None
    if spec.item_isolation == "checked":
        from . import itemstate

        try:
            snapshot = itemstate.take([sys.modules[shared.func.__module__]] if shared.func.__module__ in sys.modules
                                      else [])
        except itemstate.Unchecked as exc:
            why = str(exc)
        noted = False  # said on the line of the item that changed state
        while items and why is None:
            items, why, noted = _runner(shared, items, snapshot, sink, sink_path, log_path)
        if why is not None and items:
            shared.log.warning("the %d item(s) from item %s on run in a process each: %s", len(items),
                               items[0]["index"], why)
    for position, item in enumerate(items):
        start = _log_size()
        line = _forked(shared, item)
        line["log"] = [log_path, start, _log_size()]  # what the item printed: that span of the rank's log
        if position == 0 and why is not None and not noted:
            line["forked"] = why  # the orchestrator says it once
        os.write(sink, (json.dumps(line) + "\n").encode())


def _runner(shared: _Shared, items: list[Mapping[str, Any]], snapshot: Any, sink: int, sink_path: str,
            log_path: str) -> tuple[list[Mapping[str, Any]], str | None, bool]:
    """Run ``items`` one after another in one child of this rank (the *runner*), each checked against
    ``snapshot`` after it ends; the items it did not reach, why they must run in a process each
    (``None``: the runner was ended by an item, which is recorded as failed, and another may go on),
    and whether an item's line says so already (the item that changed state).

    The runner appends each item's line to ``sink`` itself and tells this rank on a pipe when one changed
    state (``L <index> <what it changed>``, after which it stops) and when it has run them all (``E``).
    With a timeout it also says when an item starts (``S <index>``, which also says that the item before
    it has ended), so an item that runs past the stage's timeout is killed with its runner.  Without one
    no message goes per item (each would wake this rank, which shares the cores with the runners): when
    the runner ends without ``E`` or ``L``, the lines it appended to ``sink`` say how far it got, and the
    item after the last of them is the one that ended its process (``os._exit``, a signal, a crash),
    named without losing the lines written before."""
    from . import itemstate

    timeout = shared.spec.item_timeout
    announce = timeout is not None  # a message as each item starts: only a deadline needs it
    mark, forked_at, log_mark = os.fstat(sink).st_size, time.time(), _log_size()
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the runner
        code = 1
        try:
            os.close(read_end)
            randoms = itemstate.RandomState()
            for item in items:
                if announce:
                    os.write(write_end, f"S {item['index']}\n".encode())
                randoms.restore()
                start = _log_size()
                line = shared.run(item)
                line["log"] = [log_path, start, _log_size()]
                what = itemstate.changed(snapshot)
                if what is not None:
                    what = " ".join(what.split())  # one line on the pipe, whatever a path holds
                    line["isolation"] = what  # the orchestrator says it once, and forks the stage's later items
                os.write(sink, (json.dumps(line) + "\n").encode())
                if line.get("drew"):  # after its line: like S, it says the item has ended
                    os.write(write_end, f"D {' '.join(line['drew'])}\n".encode())
                if what is not None:
                    os.write(write_end, f"L {item['index']} {what}\n".encode())
                    break
            else:
                os.write(write_end, b"E\n")
            code = 0
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(write_end)
    done, running, started, log_start = 0, False, 0.0, 0
    deadline: float | None = None
    why: str | None = None
    timed_out = ended = False
    pending = b""
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([pipe], [], [], wait)[0]:
                os.kill(pid, signal.SIGKILL)  # past the stage's timeout: the item ends with its runner
                timed_out = True
                break
            chunk = pipe.read(1 << 16)
            if not chunk:
                break
            *messages, pending = (pending + chunk).split(b"\n")
            for message in messages:
                kind, _, rest = message.decode().partition(" ")
                if running:  # whatever the message, the item in flight has ended (its line is written)
                    running, deadline, done = False, None, done + 1
                if kind == "S":
                    running, started, log_start = True, time.time(), _log_size()
                    deadline = None if timeout is None else time.monotonic() + timeout
                elif kind == "D":
                    shared.drew |= frozenset(rest.split())
                elif kind == "L":
                    why = f"item {rest.partition(' ')[0]} changed what later items would read: " \
                          f"{rest.partition(' ')[2]}"
                    done += 0 if announce else 1 + next(i for i, item in enumerate(items)
                                                        if str(item["index"]) == rest.partition(" ")[0])
                elif kind == "E":
                    ended = True
    _, status = os.waitpid(pid, 0)
    if not announce and not ended and why is None:  # it ended early: its lines say how far it got
        lines = _lines_since(sink_path, mark)
        done = len(lines)
        if done < len(items):
            running = True  # the item after its last line ended it
            started = lines[-1].get("ended") or forked_at if lines else forked_at
            log_start = int(lines[-1]["log"][2]) if lines and lines[-1].get("log") else log_mark
    elif ended and not announce:
        done = len(items)
    how = _how(status, timeout if timed_out else None)
    if running:  # the item in flight ended its runner
        line = _no_result(items[done], how)
        line["started"], line["log"] = started, [log_path, log_start, _log_size()]
        # on a line of its own, whatever the runner was writing when it ended (a cut line is skipped)
        os.write(sink, ("\n" + json.dumps(line) + "\n").encode())
        done += 1
    elif why is None and done < len(items):
        return items[done:], f"their runner process ended between items ({how})", False
    return items[done:], why, why is not None


def _lines_since(path: str, offset: int) -> list[dict[str, Any]]:
    """The whole result lines appended to ``path`` after byte ``offset`` (a line cut short is not one)."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    found = []
    for text in data.split(b"\n")[:-1]:  # after the last newline: a line being written when its process ended
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and "index" in line:
            found.append(line)
    return found


def _how(status: int, timeout: float | None) -> str:
    """How a process ended, from its wait status (``timeout``: it was killed for running past it)."""
    if timeout is not None:
        return f"it exceeded the stage's timeout of {timeout:g}s and was killed"
    return f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else \
        f"exit code {os.WEXITSTATUS(status)}"


def _no_result(item: Mapping[str, Any], how: str) -> dict[str, Any]:
    now = time.time()
    return {"index": item["index"], "key": item["key"], "status": "error", "started": now, "ended": now,
            "error": f"the item's process ended without a result ({how})"}


def _forked(shared: _Shared, item: Mapping[str, Any]) -> dict[str, Any]:
    """Run ``item`` in a child of this rank; its result line, or why the child ended without one."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: run the item, hand its line back, end without the parent's teardown
        code = 1
        try:
            os.close(read_end)
            data = json.dumps(shared.run(item)).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(write_end, view):]
            code = 0
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(write_end)
    chunks = []
    timeout = shared.spec.item_timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([pipe], [], [], wait)[0]:
                os.kill(pid, signal.SIGKILL)  # past the stage's timeout: this item ends, the next one starts
                timed_out = True
                break
            chunk = pipe.read(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if not timed_out:
        try:
            found: dict[str, Any] = json.loads(b"".join(chunks))
            shared.drew |= frozenset(found.get("drew") or ())
            return found
        except ValueError:
            pass
    return _no_result(item, _how(status, timeout if timed_out else None))
