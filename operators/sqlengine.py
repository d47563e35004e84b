"""SQL over distributed tables (layer 3): ``sql(comm, query, **tables) -> DTable``.

Decisions:

- **Planning is sqlglot's.**  The query is parsed and rewritten by sqlglot's optimizer (qualify
  every column, push predicates down, decorrelate ``EXISTS``/``IN``/scalar subqueries into joins
  with grouped derived tables, merge subqueries).  sqlglot is pure Python (no Java runtime, no
  native build) and hands back a plain SQL tree whose every ``SELECT`` this module can cut into
  local fragments and exchanges; docs/sql.md says why not DataFusion's or DuckDB's planner.
- **Execution is distributed, fragments are DuckDB's.**  Each ``SELECT`` becomes steps: a scan of
  each source with its single-table filters (local), joins (hash shuffle of both sides on the
  equality keys, a broadcast of the small side, or, when one side's ranks hold disjoint intervals
  of an integer key, the other side's rows routed to those intervals: whichever the cost model's
  local join work plus the exchanged bytes makes cheaper), group-by
  (local partial aggregation, hash shuffle of the partials on the group keys, final aggregation;
  ``count(distinct)`` and other non-decomposable aggregates shuffle the rows instead), windows
  (hash shuffle on ``PARTITION BY``), ``DISTINCT``/set operations (hash shuffle on all columns),
  and ``ORDER BY``/``LIMIT`` (local top-k, gather to rank 0).  Every local fragment is a DuckDB
  query over Arrow tables, so expressions, NULLs, decimals and casts follow DuckDB; between two
  exchanges the joins, filters and aggregate run as one fragment.
- A query over small inputs (under ``SMALL_QUERY_BYTES`` in the columns it names, over all ranks;
  ``SINGLE_SOURCE_BYTES`` for a query of one table) runs on rank 0 alone after one gather of those
  columns, as written, in one DuckDB statement (DuckDB plans and decorrelates it): there, each
  exchange of a distributed plan costs a rendezvous of the ranks that the work it shares out does
  not repay, and each of its fragments a DuckDB statement.  sqlglot still checks it first (unknown
  names with their position, and what the distributed plan refuses), so that whether a query runs
  does not depend on the size of its inputs.  At one rank every query runs so.
- The algorithm of each step is chosen at run time from the sizes of its inputs (the children run
  first), and recorded as a :class:`~hetflow.operators.costmodel.Plan`: the result's
  ``explain()`` lists the steps with their exchanges and estimated bytes.
- Errors: a query sqlglot cannot parse, or that names an unknown table or column, raises
  :class:`SQLError` naming the line and column in the query; a fragment DuckDB rejects raises it
  with the fragment.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from . import arrowtypes, kernels, partition
from . import collectives as tc
from .communicator import Communicator
from .costmodel import Cost, Plan, allgather_cost, hockney, shuffle_cost
from .dtable import DTable
from .errors import SQLError

log = logging.getLogger(__name__)


def sql(comm: Communicator, query: str, **tables: Any) -> DTable:
    """Run ``query`` (DuckDB's SQL dialect) over distributed tables; collective.

    :param comm: the communicator (in a stage: ``ctx.comm``).
    :param query: one ``SELECT`` (``WITH``, joins, subqueries, ``GROUP BY``, windows, set
        operations, ``ORDER BY``/``LIMIT``).
    :param tables: each name the query uses: a :class:`DTable` over ``comm``, or a Parquet file,
        directory or glob, local or on an object store (``s3://bucket/prefix/``), read in parallel,
        only the columns the query names.
    :returns: the result, distributed over the ranks of ``comm``; with ``ORDER BY`` it is
        ordered across ranks (all of it on rank 0).  Columns are named as the query spells them
        (``*``: as the inputs do); an unaliased expression by its SQL text.  ``explain()`` shows
        the distributed plan.
    :raises SQLError: a syntax error, an unknown table or column (naming its line and column), or
        a construct this engine does not run (a correlated subquery the optimizer cannot rewrite).
    """
    from . import sqlplan

    inputs = _inputs(comm, query, tables)
    tree, names = sqlplan.optimize(query, {name: dt.schema for name, dt in inputs.items()}, copy=False)  # the executor reads it only
    local = {name: dt.to_arrow() for name, dt in inputs.items()}
    if SMALL_QUERY_BYTES > 0:
        if comm.Get_size() == 1:
            return _alone_here(comm, query, tree, names, inputs, local)
        needed = _needed(query, tree, local)
        bound = min(SINGLE_SOURCE_BYTES, SMALL_QUERY_BYTES) if _single_source(tree) else SMALL_QUERY_BYTES
        if sum(int(t.nbytes) for t in needed.values()) * comm.Get_size() < 4 * bound or _may_qualify(tree, needed, comm.Get_size(), bound):
            # small enough that the query may qualify once each input keeps only the rows its own
            # conditions pass: filter here (a scan of this rank's rows), and count what is left; an
            # input too small for that to repay its statement is gathered whole
            needed = {name: _prefiltered(tree, name, table) if int(table.nbytes) * comm.Get_size() >= PREFILTER_MIN_BYTES
                      else table for name, table in needed.items()}
        mine = sum(int(t.nbytes) for t in needed.values())
        # with the bytes, each table's IPC size: the one gather that follows needs no counts of its own
        # and its host and kernel threads: the cores rank 0 may take from the ranks that wait for it
        every = comm.allgather((mine, [tc.ipc_size(needed[n]) for n in sorted(needed)] if mine < bound else None,
                                _HOST, kernels.threads()))
        sizes = [float(e[0]) for e in every]
        if sum(sizes) < bound:
            return _on_rank_zero(comm, query, tree, names, inputs, needed, sizes, [e[1] for e in every], bound,
                                 statement_threads([(e[2], e[3]) for e in every]))
    run = _Run(comm, local)
    table = _named(run.query(tree, top=True), names, inputs)
    return DTable(comm, sqlplan.with_part(table, None), _plans=tuple(run.finish()), _checked=True)


#: a query whose inputs hold fewer bytes than this in the columns it names, in the rows that pass each
#: input's own conditions (``_prefiltered``; all of a small input's: ``PREFILTER_MIN_BYTES``), summed over
#: the ranks, runs on rank 0 alone, as one DuckDB statement: those rows are gathered there (one exchange)
#: instead of exchanged step by step, each step a rendezvous of the ranks that costs more than the work it shares out on such inputs
#: (docs/benchmarks.md, TPC-H at SF 0.1 and 1); at one rank every query runs so; 0 turns this off
SMALL_QUERY_BYTES = 64 * 2**20
#: the same bound for a query that reads one table once (no join, no subquery: TPC-H Q1, Q6), whose
#: distributed plan exchanges no rows before its aggregate, only the partial aggregates after it
SINGLE_SOURCE_BYTES = 8 * 2**20

#: an input of fewer bytes than this (this rank's, times the ranks) is gathered whole for rank 0's
#: statement, without its own conditions applied first: the statement that applies them costs about as
#: much as gathering that many bytes, and DuckDB on rank 0 then plans its joins over the table as it is
#: (TPC-H Q21: its nation table filtered to its one row first made DuckDB join it last, 2-3x slower)
PREFILTER_MIN_BYTES = 1 << 20

#: the tag of rank 0's message that ends a query it ran alone (the result's schema and plan, or the error)
_DONE_TAG = 2828
_HOST = socket.gethostname()


def statement_threads(ranks: Sequence[tuple[str, int]], cores: int | None = None, load: float | None = None) -> int:
    """DuckDB threads for the statement rank 0 runs alone, given each rank's (host, kernel threads) in
    rank order: rank 0's own plus those of the other ranks on its host, which wait for the statement
    without using a core (``_await_rank_zero``), as far as the host has cores idle to run them: its
    ``cores`` (those rank 0 may run on) less its ``load`` (the 1-minute load average, rank 0's own
    running thread in it), rounded; on a host that other work keeps busy a second thread only waits
    for a core (docs/benchmarks.md, TPC-H).  Ranks on other hosts lend nothing."""
    host, own = ranks[0]
    lent = sum(t for h, t in ranks[1:] if h == host)
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    if load is None:
        load = os.getloadavg()[0] if lent else 0.0
    idle = max(0, round(cores - load))
    return max(1, min(cores, own + min(lent, idle)))


def _may_qualify(tree: Any, needed: Mapping[str, pa.Table], ranks: int, bound: int) -> bool:
    """Whether inputs too large to filter on a guess (over 4 times ``bound`` on this rank, times the
    ranks) may come under ``bound`` once each keeps only the rows its own conditions pass: each such
    condition's share of rows counted on a sample of this rank's (``_SAMPLE_SLICES`` slices spread
    over the table: a scan of all of them cost as much as the filter itself), each input's bytes
    taken in that proportion, times the ranks.  An input without such a condition counts whole; when
    those alone reach ``bound``, nothing is counted.  Rank-local and a guess: the ranks' bytes,
    exchanged after the filters, decide where the query runs."""
    whole, counted = 0, []
    for name, table in needed.items():
        where = _own_conditions(tree, name, tuple(table.column_names)) if int(table.nbytes) * ranks >= PREFILTER_MIN_BYTES else None
        if where is None or table.num_rows == 0:
            whole += int(table.nbytes)
        else:
            counted.append((table, where))
    if whole * ranks >= bound:
        return False
    estimate = float(whole)
    for table, where in counted:
        n, step = table.num_rows, _SAMPLE_SLICES[1]
        sample = table if n <= _SAMPLE_SLICES[0] * step else pa.concat_tables(
            [table.slice(i * (n - step) // (_SAMPLE_SLICES[0] - 1), step) for i in range(_SAMPLE_SLICES[0])])
        kept = kernels._duck_query(f"SELECT count(*) AS n FROM t WHERE {where}", t=sample).column(0)[0].as_py()
        estimate += table.nbytes * kept / sample.num_rows
        if estimate * ranks >= bound:
            return False
    return True


#: the sample ``_may_qualify`` counts a condition's rows on: this many slices of this many rows
_SAMPLE_SLICES = (8, 8192)


def _single_source(tree: Any) -> bool:
    """Whether ``tree`` reads one table, once, in one ``SELECT`` (no join, subquery, CTE or set operation)."""
    from sqlglot import exp

    return sum(1 for _ in tree.find_all(exp.Table)) == 1 and sum(1 for _ in tree.find_all(exp.Select)) == 1


def _needed(query: str, tree: Any, local: Mapping[str, pa.Table]) -> dict[str, pa.Table]:
    """This rank's rows of the inputs ``tree`` reads, in the columns ``query`` names (all of them for ``*``)."""
    from sqlglot import exp

    from . import sqlplan

    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    used = {t.name.lower() for t in tree.find_all(exp.Table) if not t.args.get("db")} - ctes
    columns = sqlplan.referenced_columns(query)
    out = {}
    for name, table in local.items():
        if name.lower() not in used:
            continue
        keep = [c for c in table.column_names if columns is None or c.lower() in columns]
        out[name] = table.select(keep or table.column_names[:1])
    return out


def _on_rank_zero(comm: Communicator, query: str, tree: Any, names: list[str] | None, inputs: Mapping[str, DTable],
                  needed: Mapping[str, pa.Table], sizes: list[float], ipc: list[list[int] | None], bound: int,
                  workers: int) -> DTable:
    """Gather ``needed`` (each input's columns the query names, in the rows its own conditions pass, or
    all of them) to rank 0 in one exchange and run the query there alone, as one DuckDB statement on
    ``workers`` threads (``statement_threads``); the other ranks hold no row of the result (its schema,
    the plan, or the error, sent by rank 0, which they wait for without spinning a core)."""
    from . import sqlplan

    sqlplan.check_supported(tree)   # what the distributed plan refuses is refused here too, on every rank
    whole = _gather_inputs(comm, needed, ipc)
    model = hockney(comm)
    step = Plan("query", f"gather the inputs to rank 0 and run there as one DuckDB statement on {workers} thread(s) "
                         f"(its own and those its host's waiting ranks lend; {sum(sizes) / 1e6:.2f} MB in the "
                         f"columns it names and the rows their own conditions keep, under {bound / 1e6:.2f} MB)",
                shuffle_cost(model, sizes), {}, f"inputs {sorted(needed)}", model.describe())
    if comm.Get_rank() != 0:
        payload = _await_rank_zero(comm)
        if isinstance(payload, SQLError):
            raise payload
        return DTable(comm, payload.empty_table(), _plans=(step,), _checked=True)
    assert whole is not None
    try:
        with kernels.duck_threads(workers):
            table = sqlplan.with_part(_direct(query, tree, names, inputs, whole), None)
    except Exception as exc:
        error = exc if isinstance(exc, SQLError) else SQLError(f"rank 0, running the query alone, failed: {type(exc).__name__}: {exc}")
        for dest in range(1, comm.Get_size()):
            comm.send(error, dest=dest, tag=_DONE_TAG)
        if error is exc:
            raise
        raise error from exc
    for dest in range(1, comm.Get_size()):
        comm.send(table.schema, dest=dest, tag=_DONE_TAG)
    return DTable(comm, table, _plans=(step,), _checked=True)


def _alone_here(comm: Communicator, query: str, tree: Any, names: list[str] | None, inputs: Mapping[str, DTable],
                local: Mapping[str, pa.Table]) -> DTable:
    """At one rank: the query as one DuckDB statement over the inputs."""
    from . import sqlplan

    sqlplan.check_supported(tree)
    table = sqlplan.with_part(_direct(query, tree, names, inputs, local), None)
    return DTable(comm, table, _plans=(Plan("query", "one DuckDB statement (one rank)", Cost(), {}, f"inputs {sorted(local)}", ""),), _checked=True)


def _direct(query: str, tree: Any, names: list[str] | None, inputs: Mapping[str, DTable], tables: Mapping[str, pa.Table]) -> pa.Table:
    """``query`` as written, run by DuckDB in one statement over ``tables`` (DuckDB plans it and
    decorrelates its subqueries itself), its columns named as the distributed plan names them."""
    import duckdb

    from . import sqlplan

    by_lower = {name.lower(): table for name, table in tables.items()}
    scope = {spelled: by_lower[spelled.lower()] for spelled in sqlplan.table_spellings(query) if spelled.lower() in by_lower}
    text, reads = sqlplan.one_name_per_read(query)
    scope.update({new: by_lower[old.lower()] for new, old in reads if old.lower() in by_lower})
    try:
        out = kernels._duck_query(text, **scope)
    except duckdb.Error as exc:
        raise SQLError(f"the query failed: {str(exc).splitlines()[0]}") from exc
    outputs = sqlplan.output_names(tree)
    if outputs is not None and len(outputs) == out.num_columns:
        out = out.rename_columns(outputs)
    return _named(out, names, inputs)


def _gather_inputs(comm: Communicator, needed: Mapping[str, pa.Table], ipc: list[list[int] | None]) -> dict[str, pa.Table] | None:
    """Every rank's ``needed`` tables on rank 0, each concatenated in rank order (``None`` elsewhere):
    one ``Gatherv`` of their IPC streams, whose sizes (``ipc``, by rank, the tables in name order) the
    ranks exchanged with their bytes."""
    order = sorted(needed)
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = np.array([0 if r == 0 or s is None else sum(s) for r, s in enumerate(ipc)], dtype=np.int64)
    if any(s is None for s in ipc[1:]) or int(counts.sum()) >= tc._MAX_CHUNK:  # sizes not exchanged, or too large for one message
        whole = {name: tc.gather_table(comm, needed[name], root=0) for name in order}
        return {n: pa.concat_tables(p or [], promote_options="permissive") for n, p in whole.items()} if rank == 0 else None
    from mpi4py import MPI

    if rank != 0:
        sendbuf, _ = tc.serialize([needed[n] for n in order])
        comm.Gatherv([sendbuf, MPI.BYTE], None, root=0)
        return None
    recvbuf = np.empty(int(counts.sum()), dtype=np.uint8)
    displs = np.zeros(size, dtype=np.int64)
    np.cumsum(counts[:-1], out=displs[1:])
    comm.Gatherv([np.empty(0, dtype=np.uint8), MPI.BYTE], [recvbuf, (counts, displs), MPI.BYTE], root=0)
    flat = np.array([b for s in ipc[1:] for b in (s or [])], dtype=np.int64)
    tables = tc.deserialize(recvbuf, flat)
    parts: dict[str, list[pa.Table]] = {n: [needed[n]] for n in order}
    for i, table in enumerate(tables):
        name = order[i % len(order)]
        parts[name].append(table if table is not None else needed[name].slice(0, 0))
    return {n: pa.concat_tables(p, promote_options="permissive") for n, p in parts.items()}


def _await_rank_zero(comm: Communicator) -> Any:
    """Rank 0's message ending a query it ran alone, waited for without spinning a core (``Iprobe``
    polled with short sleeps): an MPI receive's own busy wait would take a core from rank 0 on a host
    with fewer cores than processes.  A communicator without ``Iprobe`` receives at once."""
    iprobe = getattr(comm, "Iprobe", None)
    if iprobe is not None:
        while not iprobe(source=0, tag=_DONE_TAG):
            time.sleep(0.0002)
    return comm.recv(source=0, tag=_DONE_TAG)


def _prefiltered(tree: Any, name: str, table: pa.Table) -> pa.Table:
    """This rank's rows of input ``name`` that pass the conditions of its own that the query puts on it
    (``_own_conditions``), in ``table``'s schema; ``table`` itself when there is no such condition."""
    where = _own_conditions(tree, name, tuple(table.column_names))
    if where is None or table.num_rows == 0:
        return table
    kept = kernels._duck_query(f"SELECT * FROM t WHERE {where}", t=table)
    try:
        return kept.cast(table.schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a type DuckDB hands back otherwise: select by row number
        numbered = table.append_column("__hetflow_row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        rows = kernels._duck_query(f"SELECT __hetflow_row FROM t WHERE {where}", t=numbered)
        return arrowtypes.take(table, pa.array(np.sort(rows.column(0).to_numpy())))


#: ``_own_conditions`` by (the optimized tree, kept with its entry so that its id is not reused, input, columns)
_CONDITIONS: dict[tuple[int, str, tuple[str, ...]], tuple[Any, str | None]] = {}


def _own_conditions(tree: Any, name: str, columns: tuple[str, ...]) -> str | None:
    """The conditions of its own that the query puts on input ``name`` (of ``columns``), as one DuckDB
    ``WHERE`` over the input's column names, where applying them before the gather cannot change the
    answer (rank 0 applies them again): the table read once in the query, in the ``FROM`` or an inner
    join of a ``SELECT`` without right or full joins, and the conjuncts of that ``SELECT``'s ``WHERE`` (or
    of its inner join's ``ON``) that read only its columns, without subqueries, aggregates, windows or
    functions whose value changes between two runs; ``None`` when there is none (memoized: a query run
    again reads its cached tree)."""
    key = (id(tree), name, columns)
    found = _CONDITIONS.get(key)
    if found is not None and found[0] is tree:
        return found[1]
    if len(_CONDITIONS) > 1024:
        _CONDITIONS.clear()
    where = _find_own_conditions(tree, name, columns)
    _CONDITIONS[key] = (tree, where)
    return where


def _find_own_conditions(tree: Any, name: str, columns: tuple[str, ...]) -> str | None:
    from sqlglot import exp

    from . import sqlplan

    reads = [t for t in tree.find_all(exp.Table) if not t.args.get("db") and t.name.lower() == name.lower()]
    if len(reads) != 1 or not isinstance(reads[0].parent, (exp.From, exp.Join)) or not isinstance(reads[0].parent.parent, exp.Select):
        return None
    source, select = reads[0], reads[0].parent.parent
    joins = select.args.get("joins") or []
    if any((j.side or "").lower() in ("right", "full") for j in joins):
        return None
    pool = sqlplan.conjuncts(select.args.get("where"))
    if isinstance(source.parent, exp.Join):
        join = source.parent
        if join.side or (join.kind or "").lower() not in ("", "inner"):
            return None
        pool += sqlplan.conjuncts(join.args.get("on"))
    alias = source.alias_or_name
    by_lower = {c.lower(): c for c in columns}
    volatile = (exp.Subquery, exp.Select, exp.AggFunc, exp.Window, exp.Anonymous, exp.Rand, exp.CurrentDate,
                exp.CurrentTime, exp.CurrentTimestamp)
    mine = []
    for c in pool:
        cols = list(c.find_all(exp.Column))
        if cols and all(col.table == alias and col.name.lower() in by_lower for col in cols) and not any(True for _ in c.find_all(*volatile)):
            mine.append(c.transform(lambda n: exp.column(by_lower[n.name.lower()], quoted=True) if isinstance(n, exp.Column) else n))
    return " AND ".join(f"({sqlplan.sql_of(c)})" for c in mine) if mine else None


def _named(table: pa.Table, names: list[str] | None, inputs: Mapping[str, DTable]) -> pa.Table:
    """The result's columns named as the query spells them (``names``; ``*``: as the inputs do)."""
    if names is not None and len(names) == table.num_columns:
        table = table.rename_columns([n or old for n, old in zip(names, table.column_names)])
    else:  # ``*``: the inputs' spelling of a name the optimizer lower-cased
        spelled: dict[str, set[str]] = {}
        for dt in inputs.values():
            for n in dt.schema.names:
                spelled.setdefault(n.lower(), set()).add(n)
        table = table.rename_columns([next(iter(spelled[n])) if len(spelled.get(n, ())) == 1 else n for n in table.column_names])
    return table


def _inputs(comm: Communicator, query: str, tables: Mapping[str, Any]) -> dict[str, DTable]:
    from . import sqlplan

    out: dict[str, DTable] = {}
    names = sqlplan.referenced_columns(query)
    for name, value in tables.items():
        if isinstance(value, DTable):
            if value.comm is not comm and value.comm.Get_size() != comm.Get_size():
                raise SQLError(f"table {name!r} is distributed over {value.comm.Get_size()} rank(s), the query over {comm.Get_size()}")
            out[name] = value
        elif isinstance(value, (str, os.PathLike)):
            from . import filesplit
            from .errors import InputError
            from .location import redact
            from .readers import read_parquet

            try:
                files = filesplit._locate(value, "parquet")   # local, or on an object store (s3://bucket/prefix/)
            except InputError:
                files = []
            if not files:
                raise SQLError(f"table {name!r}: no Parquet file matches {redact(os.fspath(value))!r}")
            import pyarrow.parquet as pq

            with files[0].open() as source:
                schema = pq.read_schema(source)
            cols = [c for c in schema.names if names is None or c.lower() in names]
            out[name] = read_parquet(comm, value, columns=cols or schema.names[:1])
        else:
            raise SQLError(f"table {name!r} must be a DTable or a Parquet path/glob, got {type(value).__name__}")
    return out


# ---------------------------------------------------------------------------------------- execution
class _Pending(NamedTuple):
    """A step of the plan whose estimate waits for the sizes ``_Run.finish`` gathers."""

    operation: str
    algorithm: str
    exchange: str
    slot: int
    detail: str


class _Run:
    """One query's execution on this rank: local DuckDB fragments joined by exchanges."""

    def __init__(self, comm: Communicator, inputs: dict[str, pa.Table]) -> None:
        self.comm = comm
        self.p = comm.Get_size()
        self.rank = comm.Get_rank()
        self.inputs = inputs
        self.plans: list[Plan] = []
        self._later: list[int] = []  # this rank's bytes of each ``plan_exchange`` step, gathered by ``finish``
        # tables that are zero-copy projections of another: id -> (the table, the other, {column: its name there})
        self.derived: dict[int, tuple[pa.Table, pa.Table, dict[str, str]]] = {}
        # the communicator's Hockney α, β, looked up once per query: ``hockney`` is collective (it gathers
        # the host names to find its cache entry), and every cost estimate of the plan reads them
        self.model = hockney(comm)

    def local(self, sql: str, **tables: pa.Table) -> pa.Table:
        """Run one local fragment in DuckDB over this rank's Arrow tables."""
        import duckdb

        try:
            return kernels._duck_query(sql, **tables)
        except duckdb.Error as exc:
            raise SQLError(f"local fragment failed: {str(exc).splitlines()[0]} (fragment: {sql})") from exc

    def sizes(self, table: pa.Table) -> list[float]:
        """Every rank's bytes of ``table``, in rank order."""
        return [float(b) for b in self.comm.allgather(int(table.nbytes))]

    def plan(self, operation: str, algorithm: str, cost: Cost | None = None, detail: str = "",
             alternatives: Mapping[str, float] | None = None) -> None:
        cost = Cost() if cost is None else cost
        model = self.model.describe() if self.p > 1 else ""
        self.plans.append(Plan(operation, algorithm, cost, dict(alternatives or {}), detail, model))

    def plan_exchange(self, operation: str, algorithm: str, exchange: str, *tables: pa.Table, detail: str = "") -> None:
        """Record a step whose exchange (``"shuffle"``, or ``"allgather"``: a broadcast) of ``tables``
        was not chosen by their sizes: its estimate needs every rank's bytes, which ``finish`` gathers
        for all such steps of the query in one collective instead of one per step."""
        if self.p == 1:
            self.plan(operation, algorithm, Cost(), detail)
            return
        self._later.append(sum(int(t.nbytes) for t in tables))
        self.plans.append(_Pending(operation, algorithm, exchange, len(self._later) - 1, detail))  # type: ignore[arg-type]

    def finish(self) -> list[Plan]:
        """The query's plan, the estimates of ``plan_exchange``'s steps filled in; collective when there are any."""
        if not self._later:
            return self.plans
        every = self.comm.allgather(self._later)
        model, out = self.model, []
        for step in self.plans:
            if isinstance(step, _Pending):
                sizes = [float(rank[step.slot]) for rank in every]
                cost = shuffle_cost(model, sizes) if step.exchange == "shuffle" else allgather_cost(model, sizes)
                step = Plan(step.operation, step.algorithm, cost, {}, step.detail, model.describe())
            out.append(step)
        self.plans, self._later = out, []
        return out

    def shuffle_by(self, table: pa.Table, keys: pa.Table) -> pa.Table:
        """Hash-shuffle ``table``'s rows by the values of ``keys`` (same rows, one canonical type per key)."""
        if self.p == 1:
            return table
        ids = partition.partition_ids(keys, keys.column_names, self.p)
        return tc.shuffle(self.comm, table, ids)

    def shuffle(self, table: pa.Table, keys: Sequence[str]) -> pa.Table:
        """Hash-shuffle ``table`` on its columns ``keys``."""
        return self.shuffle_by(table, table.select(list(keys)))

    def shuffle_all(self, table: pa.Table) -> pa.Table:
        """Hash-shuffle on every column (``DISTINCT`` and set operations); strings hashed as one type."""
        keys = table
        for i, f in enumerate(table.schema):
            if pa.types.is_string_view(f.type):
                keys = keys.set_column(i, f.name, table.column(i).cast(pa.large_string()))
        return self.shuffle_by(table, keys)

    def route(self, table: pa.Table, column: str, bounds: tuple[tuple[int, ...], tuple[int, ...]]) -> pa.Table:
        """Move the rows of ``table`` whose integer ``column`` falls outside this rank's interval of
        ``bounds`` (see ``sqlplan.range_bounds``) to the rank whose interval holds it; the others stay
        as they are (NULL keys stay too).  Data sorted by the key and split by rows moves only the
        rows about the boundaries."""
        import numpy as np
        import pyarrow.compute as pc

        lower, ranks = bounds
        col = table.column(column)
        if self.rank in ranks:
            i = ranks.index(self.rank)
            outside = None
            if i > 0:
                outside = pc.less(col, lower[i])
            if i + 1 < len(lower):
                above = pc.greater_equal(col, lower[i + 1])
                outside = above if outside is None else pc.or_(outside, above)
        else:
            outside = pc.is_valid(col)
        if outside is None or not pc.any(outside).as_py():
            stay, leave = table, table.slice(0, 0)
        else:
            mask = pc.fill_null(outside, False).to_numpy(zero_copy_only=False)
            stay, leave = arrowtypes.take(table, pa.array(np.flatnonzero(~mask))), arrowtypes.take(table, pa.array(np.flatnonzero(mask)))
        keys = leave.column(column).to_numpy().astype(np.int64, copy=False)
        dest = np.asarray(ranks, dtype=np.int64)[np.clip(np.searchsorted(np.asarray(lower), keys, side="right") - 1, 0, None)]
        got = tc.shuffle(self.comm, leave, dest)
        return pa.concat_tables([stay, got.cast(stay.schema)]) if got.num_rows else stay

    def route_in_place(self, table: pa.Table, column: str, bounds: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[pa.Table, str | None]:
        """``route`` without copying the rows that stay: returns ``table`` with the rows that arrived
        appended, and the SQL condition that keeps only this rank's own rows of it (``None`` when no row
        left: the table is then exactly this rank's rows).  Collective."""
        import numpy as np
        import pyarrow.compute as pc

        from .sqlplan import q

        lower, ranks = bounds
        col = table.column(column)
        if self.rank in ranks:
            i = ranks.index(self.rank)
            lo = lower[i] if i > 0 else None
            hi = lower[i + 1] if i + 1 < len(lower) else None
            outside = None
            if lo is not None:
                outside = pc.less(col, lo)
            if hi is not None:
                above = pc.greater_equal(col, hi)
                outside = above if outside is None else pc.or_(outside, above)
            inside = " AND ".join(([f"{q(column)} >= {lo}"] if lo is not None else []) + ([f"{q(column)} < {hi}"] if hi is not None else []))
            keep = f"({q(column)} IS NULL OR ({inside}))" if inside else None
        else:
            outside, keep = pc.is_valid(col), f"({q(column)} IS NULL)"
        if outside is None or not pc.any(outside).as_py():
            leave = table.slice(0, 0)
            keep = None
        else:
            leave = arrowtypes.take(table, pa.array(np.flatnonzero(pc.fill_null(outside, False).to_numpy(zero_copy_only=False))))
        keys = leave.column(column).to_numpy().astype(np.int64, copy=False)
        dest = np.asarray(ranks, dtype=np.int64)[np.clip(np.searchsorted(np.asarray(lower), keys, side="right") - 1, 0, None)]
        got = tc.shuffle(self.comm, leave, dest)
        return (pa.concat_tables([table, got.cast(table.schema)]) if got.num_rows else table), keep

    def broadcast(self, table: pa.Table) -> pa.Table:
        """Every rank's rows on every rank."""
        return pa.concat_tables(tc.allgather_table(self.comm, table)) if self.p > 1 else table

    def gather(self, table: pa.Table) -> pa.Table:
        """All rows on rank 0; the other ranks keep no rows (same schema)."""
        if self.p == 1:
            return table
        parts = tc.gather_table(self.comm, table, root=0)
        return pa.concat_tables(parts) if parts is not None else table.slice(0, 0)

    def query(self, node: Any, top: bool = False) -> pa.Table:
        from .sqlplan import Executor

        return Executor(self, {}).run(node, top=top)
