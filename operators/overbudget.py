"""``DTable`` operators over the memory budget run out of core (layer 3, called by ``DTable``).

When ``settings.current().memory_budget`` is set (a pipeline stage's ``memory_per_rank``)
and the inputs of a join, sort or group-by would need more than the budget in memory,
``DTable.join``, ``sort_by`` and ``group_by(...).aggregate`` (``algorithm="auto"``) run the
out-of-core operators of ``outofcore`` instead.  "Would need more": the largest rank's
input bytes times ``IN_MEMORY_GROWTH``, the in-memory operators' peak growth over their
input (docs/spilldir.md, "Measured").  With no budget nothing here runs, not even a
collective, so the in-memory path is exactly what it was.

Each rank works in its own private directory under ``settings.spill_dir`` (the pilot's
``node_local_dir``; else the temporary directory), so no file system has to be shared:
its partition(s) are written there as an Arrow IPC file, the operator runs with
``local=True`` (its buckets or runs in a directory of their own beside it), and its result
partition is written there too and memory-mapped.  The directory is removed before the
operator returns, however it ends: the result stays readable through the open map (Linux
frees the blocks when the table is freed), so nothing is left on disk.  The plan
(``explain()``) names the directory and the bytes spilled.

Over the budget, a sort's ties keep no particular order (the in-memory sort is stable) and
``first``, ``last`` and ``list`` aggregations are refused (they depend on row order).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from . import collectives as tc
from . import dataset as ds
from . import outofcore, settings, spilldir
from .communicator import Communicator
from .costmodel import Cost, Plan
from .errors import UnsupportedAggregationError
from .shares import SLICE_ROWS, Share, batch_lengths, slices_of
from .optiontypes import JoinHow, NullPlacement, SortOrder

log = logging.getLogger(__name__)

#: the in-memory join, sort and group-by peak at about 3-5x their input per rank (docs/spilldir.md, "Measured")
IN_MEMORY_GROWTH = 5


def needed(comm: Communicator, nbytes: int) -> bool:
    """Whether an operator whose input is ``nbytes`` on this rank must run out of core (collective when a
    budget is set; every rank must have the same settings)."""
    budget = settings.current().memory_budget
    if budget is None:
        return False
    return int(max(comm.allgather(int(nbytes)))) * IN_MEMORY_GROWTH > budget


def _share(comm: Communicator, table: pa.Table, path: Path, budget: int) -> Share:
    """``table`` written to the IPC file ``path`` and shared out as this rank's rows only (collective), in
    slices no larger than the operator's chunk (a chunk is whole slices: with a budget of a few MB the
    default slice would be larger than the chunk)."""
    spilldir.write_run(path, table, SLICE_ROWS)
    schema, lengths = batch_lengths(str(path))
    row_bytes = max(1.0, path.stat().st_size / table.num_rows if table.num_rows else 1.0)
    rows = max(1024, min(SLICE_ROWS, int(budget * outofcore.CHUNK_FRACTION / row_bytes)))
    return Share(comm, schema, slices_of(str(path), lengths, rows), row_bytes=row_bytes,
                 total_rows=tc.allreduce_sum(comm, table.num_rows))


def _mapped(directory: Path, rank: int) -> pa.Table:
    """This rank's result partition, memory-mapped (readable after its directory is removed)."""
    with pa.memory_map(str(directory / ds.partition_name(rank)), "r") as source:
        return pa.ipc.open_file(source).read_all()


def _plan(operation: str, algorithm: str, stats: dict[str, Any], nbytes: int) -> Plan:
    budget = settings.current().memory_budget
    detail = (f"out of core: input {nbytes / 1e6:.1f} MB on this rank x {IN_MEMORY_GROWTH} is over the memory "
              f"budget of {budget} B per rank; spilled {stats['spilled_bytes']} B to {stats['spill_dir']}")
    return Plan(operation, algorithm, Cost(), detail=detail)


def join(comm: Communicator, left: pa.Table, right: pa.Table, keys: Sequence[str], right_keys: Sequence[str],
         how: JoinHow, suffix: str) -> tuple[pa.Table, Plan]:
    """``DTable.join`` out of core (grace hash join, ``outofcore.join``); the result partition and the plan."""
    budget = settings.current().memory_budget
    assert budget is not None
    with spilldir.SpillDir(settings.current().spill_dir) as directory:
        stats = outofcore.join(_share(comm, left, directory / "left.arrow", budget),
                               _share(comm, right, directory / "right.arrow", budget),
                               list(keys), right_keys=list(right_keys), how=how, suffix=suffix, output=directory,
                               memory_budget=budget, spill_dir=directory.parent, local=True)
        out = _mapped(directory, comm.Get_rank())
    log.info("join spilled %d B under %s", stats["spilled_bytes"], stats["spill_dir"])
    plan = _plan("join", f"out-of-core grace hash, {stats['buckets']} bucket(s) per rank", stats,
                 int(left.nbytes + right.nbytes))
    return out, plan


def sort_by(comm: Communicator, table: pa.Table, by: Sequence[tuple[str, SortOrder]],
            nulls: NullPlacement) -> tuple[pa.Table, Plan]:
    """``DTable.sort_by`` out of core (sample sort, external merge sort, ``outofcore.sort_by``)."""
    budget = settings.current().memory_budget
    assert budget is not None
    with spilldir.SpillDir(settings.current().spill_dir) as directory:
        stats = outofcore.sort_by(_share(comm, table, directory / "input.arrow", budget), list(by), nulls=nulls,
                                  output=directory, memory_budget=budget, spill_dir=directory.parent, local=True)
        out = _mapped(directory, comm.Get_rank())
    log.info("sort spilled %d B under %s", stats["spilled_bytes"], stats["spill_dir"])
    plan = _plan("sort_by", f"out-of-core sample sort, {stats['runs']} sorted run(s) merged", stats, int(table.nbytes))
    return out, plan


def group_aggregate(comm: Communicator, table: pa.Table, keys: Sequence[str],
                    aggs: Sequence[tuple[str, str]]) -> tuple[pa.Table, Plan]:
    """``GroupBy.aggregate`` out of core (grace hash, ``outofcore.group_aggregate``) of ``table``'s
    key and aggregated columns."""
    budget = settings.current().memory_budget
    assert budget is not None
    for col, agg in aggs:  # every rank raises: they all took this path
        if agg in outofcore.ORDER_DEPENDENT:
            raise UnsupportedAggregationError(
                f"group_by {list(keys)}: aggregation {agg!r} of {col!r} depends on row order, which the out-of-core "
                f"group-by does not keep, and the input is over the memory budget of {budget} B per rank "
                "(raise the stage's memory_per_rank, or pass algorithm='shuffle' to aggregate in memory)")
    needed_columns = list(dict.fromkeys(list(keys) + [c for c, _ in aggs]))
    work = table.select(needed_columns)
    with spilldir.SpillDir(settings.current().spill_dir) as directory:
        stats = outofcore.group_aggregate(_share(comm, work, directory / "input.arrow", budget), list(keys), list(aggs),
                                          output=directory, memory_budget=budget, spill_dir=directory.parent,
                                          local=True)
        out = _mapped(directory, comm.Get_rank())
    log.info("group-by spilled %d B under %s", stats["spilled_bytes"], stats["spill_dir"])
    plan = _plan("group_by", f"out-of-core grace hash, {stats['buckets']} bucket(s) per rank", stats,
                 int(work.nbytes))
    return out, plan
