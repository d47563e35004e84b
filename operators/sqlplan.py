"""The SQL engine's planner and executor (layer 3, behind :func:`hetflow.operators.sql`).

``optimize`` turns the query text into sqlglot's optimized tree (qualified columns, decorrelated
subqueries).  ``Executor`` runs that tree one ``SELECT`` at a time, as the steps listed in
``sql``'s docstring: per-source scans with their filters, joins ordered greedily (start from the
largest source, then join the smallest source connected to it by an equality), aggregation,
windows, projection, ``DISTINCT``, ``ORDER BY``/``LIMIT``.  Inside a ``SELECT`` a relation's
columns are named ``alias.column``, so every local fragment is plain DuckDB SQL over Arrow.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .costmodel import Cost, allgather_cost, join_costs, shuffle_cost
from .errors import SQLError

if TYPE_CHECKING:
    from .sqlengine import _Run

DIALECT = "duckdb"
#: seconds per byte a join's exchange costs beyond its Hockney time (partitioning, copies, IPC), measured
#: on the TPC-H benchmark's shuffles (docs/sql.md, "Performance"); it weighs shuffle against broadcast
EXCHANGE_SECONDS_PER_BYTE = 3e-9


# ---------------------------------------------------------------------------------------- planning
def _exp() -> Any:
    from sqlglot import exp

    return exp


def _where(node: Any, query: str) -> str:
    """``line L, column C`` of ``node`` (its first identifier) in the query, or ``""``."""
    exp = _exp()
    for n in [node, *node.find_all(exp.Identifier)] if node is not None else []:
        meta = getattr(n, "meta", None) or {}
        if "start" in meta and query:
            start = int(meta["start"])
            return f" at line {query.count(chr(10), 0, start) + 1}, column {start - query.rfind(chr(10), 0, start)}"
        if "line" in meta:
            return f" at line {meta['line']}, column {meta['col']}"
    return ""


def parse(query: str) -> Any:
    import sqlglot
    from sqlglot.errors import ParseError

    try:
        trees = sqlglot.parse(query, read=DIALECT)
    except ParseError as exc:
        e = exc.errors[0] if exc.errors else {}
        desc = str(e.get("description", exc)).split("<Token")[0].strip().rstrip(".")
        near = e.get("highlight", "")
        raise SQLError(f"SQL syntax error at line {e.get('line', '?')}, column {e.get('col', '?')}: {desc} (near {near!r})") from exc
    trees = [t for t in trees if t is not None]
    if len(trees) != 1:
        raise SQLError(f"sql() runs one statement, got {len(trees)}")
    tree: Any = trees[0]
    if not isinstance(tree, _exp().Query):
        raise SQLError(f"sql() runs a query (SELECT, WITH, UNION ...), got {tree.key.upper()}{_where(tree, query)}")
    return tree


@functools.lru_cache(maxsize=256)
def referenced_columns(query: str) -> frozenset[str] | None:
    """Lower-cased names of every column the query mentions, or ``None`` when it selects ``*`` (other
    than ``count(*)`` and ``EXISTS (SELECT * ...)``, which read no column) (memoized by the text:
    parsing costs more than running a small query)."""
    exp = _exp()
    try:
        tree = parse(query)
    except SQLError:
        return None

    def reads_columns(star: Any) -> bool:
        if isinstance(star.parent, exp.Count):
            return False
        select = star.parent
        return not (isinstance(select, exp.Select) and isinstance(select.parent, exp.Exists))

    if any(reads_columns(s) for s in tree.find_all(exp.Star)):
        return None
    return frozenset(c.name.lower() for c in tree.find_all(exp.Column))


_TYPES_MEMO: dict[str, dict[str, str]] = {}


def _duck_types(schema: pa.Schema) -> dict[str, str]:
    """DuckDB's name of each column's type (what the optimizer types expressions with), memoized by schema."""
    key = schema.remove_metadata().to_string(show_field_metadata=False)
    if key not in _TYPES_MEMO:
        if len(_TYPES_MEMO) > 256:
            _TYPES_MEMO.clear()
        _TYPES_MEMO[key] = _describe(schema)
    return _TYPES_MEMO[key]


def _describe(schema: pa.Schema) -> dict[str, str]:
    from . import kernels

    con = kernels._duck()
    t = schema.empty_table()
    con.register("__hetflow_schema", t)
    try:
        rows = con.sql("DESCRIBE SELECT * FROM __hetflow_schema").fetchall()
    finally:
        con.unregister("__hetflow_schema")
    exp = _exp()
    out = {}
    for name, typ, *_ in rows:
        try:
            exp.DataType.build(typ, dialect=DIALECT)
        except Exception:  # noqa: BLE001 - a type sqlglot cannot spell: typed as unknown for the optimizer
            typ = "UNKNOWN"
        out[name] = typ
    return out


#: optimized trees by (query, input schemas): a query run again over tables of the same schemas (a stage
#: in a loop, a benchmark's repeats) skips planning, which is pure Python
_PLANS: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Any, list[str] | None]] = {}
PLAN_CACHE_SIZE = 64


def optimize(query: str, schemas: dict[str, pa.Schema], copy: bool = True) -> tuple[Any, list[str] | None]:
    """sqlglot's optimized tree of ``query`` over tables of ``schemas`` (a copy of the cached one when the
    same text was planned over the same schemas; without ``copy``, the cached tree itself, for a caller
    that does not change it: the ``Executor``), and the output column names as the query spells
    them (the optimizer lower-cases unquoted names; ``None`` when the outer query selects ``*``);
    unknown names raise ``SQLError``."""
    key = (query, tuple(sorted((n, s.remove_metadata().to_string(show_field_metadata=False)) for n, s in schemas.items())))
    found = _PLANS.get(key)
    if found is None:
        found = _optimize(query, schemas)
        if len(_PLANS) >= PLAN_CACHE_SIZE:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = found
    return (found[0].copy() if copy else found[0]), found[1]


def _optimize(query: str, schemas: dict[str, pa.Schema]) -> tuple[Any, list[str] | None]:
    from sqlglot.errors import OptimizeError, SqlglotError
    from sqlglot.optimizer import optimize as sg_optimize

    exp = _exp()
    tree = parse(query)
    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    known = {n.lower(): n for n in schemas}
    for t in tree.find_all(exp.Table):
        if t.name.lower() not in known and t.name.lower() not in ctes:
            raise SQLError(f"unknown table {t.name!r}{_where(t, query)} (tables: {sorted(schemas)})")
    names = _name_outputs(tree)
    columns = {n.lower(): set(s.names) for n, s in schemas.items() if n.lower() not in ctes}
    for select in list(tree.find_all(exp.Select)):
        _exists_to_joins(select, columns)
    used = {t.name.lower() for t in tree.find_all(exp.Table)}
    schema: dict[str, object] = {name: _duck_types(s) for name, s in schemas.items() if name.lower() in used}
    try:
        optimized = sg_optimize(tree, schema=schema, dialect=DIALECT)
    except OptimizeError as exc:
        raise SQLError(f"{str(exc).rstrip('.')} (in the query)") from exc
    except SqlglotError as exc:
        raise SQLError(f"cannot plan the query: {exc}") from exc
    _reduce_grouped_ctes(optimized)
    return optimized, names


def _reduce_grouped_ctes(tree: Any) -> None:
    """Restrict, in place, a grouped CTE that one join reads on its group key to the keys the join can
    meet: the shape sqlglot gives a decorrelated subquery (TPC-H Q2, Q17, Q22: ``LEFT JOIN (SELECT
    agg(..), t.k AS u FROM t GROUP BY t.k) AS c ON c.u = x.key`` with ``x`` filtered by conjuncts of its
    own).  The CTE gets ``t.k IN (SELECT x.key FROM x WHERE those conjuncts)``: a group whose key no
    surviving ``x`` row holds joins no row that the query keeps, and the groups kept are whole, so the
    answer is the same, while the aggregate reads only the rows of those keys (DuckDB's own plan
    reaches the same by a delim join).  Only that plain shape is rewritten: the CTE read once, by an
    inner or left join in a ``SELECT`` whose ``x`` is a table of its ``FROM`` or inner joins with at
    least one conjunct of its own (in ``WHERE`` or an inner join's ``ON``, without subqueries); the
    CTE a ``SELECT`` with that key among its ``GROUP BY``, without ``LIMIT`` or window functions."""
    exp = _exp()
    with_ = tree.args.get("with_")
    if with_ is None:
        return
    ctes = {c.alias_or_name: c.this for c in with_.expressions if isinstance(c.this, exp.Select)}
    order = [c.alias_or_name for c in with_.expressions]
    reads: dict[str, int] = {}
    for t in tree.find_all(exp.Table):
        if not t.args.get("db"):
            reads[t.name] = reads.get(t.name, 0) + 1
    for node in list(tree.find_all(exp.Select)):
        from_ = node.args.get("from_")
        joins = node.args.get("joins") or []
        if from_ is None or not joins or any(j.side and j.side.lower() in ("right", "full") for j in joins):
            continue
        inner = [j for j in joins if not j.side and (j.kind or "").lower() in ("", "inner")]
        tables = {t.alias_or_name: t for t in [from_.this, *(j.this for j in inner)] if isinstance(t, exp.Table) and not t.args.get("db")}
        pool = conjuncts(node.args.get("where")) + [c for j in inner for c in conjuncts(j.args.get("on"))]
        for j in joins:
            table = j.this
            if not isinstance(table, exp.Table) or table.name not in ctes or reads.get(table.name) != 1:
                continue
            if j.side and j.side.lower() != "left" or (j.kind or "").lower() not in ("", "inner", "outer"):
                continue
            cte, alias = ctes[table.name], table.alias_or_name
            if any(cte.args.get(k) for k in ("limit", "offset", "having", "qualify", "distinct")) or cte.args.get("group") is None \
                    or any(True for _ in cte.find_all(exp.Window)):
                continue
            outputs = {e.alias_or_name: (e.this if isinstance(e, exp.Alias) else e) for e in cte.expressions}
            groups = {sql_of(g) for g in cte.args["group"].expressions}
            for c in conjuncts(j.args.get("on")):
                if not isinstance(c, exp.EQ):
                    continue
                mine, other = (c.left, c.right) if aliases(c.left) == {alias} else (c.right, c.left)
                if not (isinstance(mine, exp.Column) and mine.table == alias and isinstance(other, exp.Column)
                        and other.table in tables and other.table != alias):
                    continue
                key = outputs.get(mine.name)
                if key is None or sql_of(key) not in groups:
                    continue
                x = other.table
                if tables[x].name in order and order.index(tables[x].name) >= order.index(table.name):
                    continue  # a CTE the grouped one is computed before
                own = [f.copy() for f in pool if aliases(f) == {x} and not any(True for _ in f.find_all(exp.Subquery, exp.Exists, exp.Select))]
                semi = _semi_keys(node, x, ctes, order, table.name)
                # the outer rows' keys are a subset of another table's: read those (where the three columns
                # have one type, so that equality is transitive between them)
                same = [src for col, src, typ in semi if col == other.name and _one_type(typ, other.type, key.type)]
                if same and not own:
                    keys = same[0]
                else:
                    own += [exp.In(this=exp.column(col, table=x, quoted=True), query=exp.Subquery(this=src)) for col, src, _ in semi]
                    if not own:
                        continue
                    keys = exp.select(other.copy()).from_(tables[x].copy()).where(exp.and_(*own))
                cte.where(exp.In(this=key.copy(), query=exp.Subquery(this=keys)), copy=False)
                break


def _one_type(*types: Any) -> bool:
    """Whether sqlglot typed these expressions alike (and knew the type)."""
    exp = _exp()
    return all(t is not None and not t.is_type(exp.DataType.Type.UNKNOWN) for t in types) and all(t == types[0] for t in types)


def _semi_keys(node: Any, x: str, ctes: dict[str, Any], order: list[str], before: str) -> list[tuple[str, Any, Any]]:
    """The semi joins of ``node`` on its table ``x`` that sqlglot writes for ``x.c IN (SELECT ...)``:
    ``LEFT JOIN u ON u.k = x.c ... WHERE NOT u.k IS NULL`` (TPC-H Q20).  A row of ``x`` that such a
    ``WHERE`` keeps met a row of ``u`` with ``u.k = x.c``, so ``x.c`` is among ``SELECT u.k FROM u``.
    Returns ``(c, that SELECT, the type of u.k)`` for each, ``u`` an input table or a CTE computed before the CTE
    ``before`` (the grouped one the keys restrict, which then reads ``u`` too)."""
    exp = _exp()
    tested = set()
    for f in conjuncts(node.args.get("where")):
        if isinstance(f, exp.Not) and isinstance(f.this, exp.Is) and isinstance(f.this.this, exp.Column) \
                and isinstance(f.this.expression, exp.Null) and f.this.this.table:
            tested.add(f.this.this.table)
    out: list[tuple[str, Any, Any]] = []
    for j in node.args.get("joins") or []:
        u = j.this
        if not (isinstance(u, exp.Table) and not u.args.get("db") and (j.side or "").lower() == "left" and u.alias_or_name in tested):
            continue
        if u.name in ctes and (u.name not in order or order.index(u.name) >= order.index(before)):
            continue
        for c in conjuncts(j.args.get("on")):
            if not isinstance(c, exp.EQ):
                continue
            a, b = c.left, c.right
            if isinstance(b, exp.Column) and b.table == u.alias_or_name:
                a, b = b, a
            if isinstance(a, exp.Column) and a.table == u.alias_or_name and isinstance(b, exp.Column) and b.table == x:
                out.append((b.name, exp.select(a.copy()).from_(u.copy()), a.type))
                break
    return out


_INEQUALITIES = ("NEQ", "GT", "GTE", "LT", "LTE")


def _exists_to_joins(node: Any, columns: dict[str, set[str]]) -> None:
    """Rewrite, in place, ``[NOT] EXISTS (SELECT ... FROM t AS x WHERE c)`` conjuncts of ``node``'s WHERE
    whose correlation has an equality and an inequality (TPC-H Q21's ``l2.l_suppkey <> l1.l_suppkey``)
    into ``SEMI``/``ANTI JOIN t AS x ON c``: sqlglot decorrelates such subqueries into ``ARRAY_AGG``
    per key and lambda filters over the lists, where a join on the equality with the rest of ``c`` as
    its residual does the same work once.  Only the plain shape is rewritten (one table with its own
    alias in the subquery, an input table rather than a CTE (sqlglot would drop a CTE only a join
    of this kind reads), every column of ``c`` qualified, no aggregate, limit or nested subquery;
    inner or comma joins outside, no ``*``, no unqualified outer column that ``t`` also has);
    equality-only correlations are left to sqlglot, whose plan for them is already a join."""
    exp = _exp()
    where = node.args.get("where")
    if where is None or any(j.side or (j.kind or "").lower() not in ("", "inner", "cross") for j in node.args.get("joins") or []):
        return
    if any(isinstance(e, exp.Star) or (isinstance(e, exp.Column) and isinstance(e.this, exp.Star)) for e in node.expressions):
        return
    outer = {t.alias_or_name for t in [node.args["from_"].this if node.args.get("from_") else None,
                                       *(j.this for j in node.args.get("joins") or [])] if isinstance(t, exp.Table)}
    mine = [c for c in node.find_all(exp.Column) if c.find_ancestor(exp.Select) is node]
    unqualified = {c.name.lower() for c in mine if not c.table}
    keep: list[Any] = []
    added: list[tuple[str, Any]] = []
    for cond in conjuncts(where):
        negated = isinstance(cond, exp.Not)
        ex = cond.this if negated else cond
        ex = ex.this if isinstance(ex, exp.Paren) else ex
        sub = ex.this if isinstance(ex, exp.Exists) else None
        join = _semi_join_of(sub, outer | {a for a, _ in added}, unqualified, columns) if isinstance(sub, exp.Select) else None
        if join is None:
            keep.append(cond)
            continue
        table, on = join
        added.append((table.alias_or_name, exp.Join(this=table, kind="ANTI" if negated else "SEMI", on=on)))
    if not added:
        return
    for _, j in added:
        node.append("joins", j)
    node.set("where", exp.Where(this=exp.and_(*keep)) if keep else None)


def _semi_join_of(sub: Any, outer: set[str], unqualified: set[str], columns: dict[str, set[str]]) -> tuple[Any, Any] | None:
    """(the table, the join condition) of an ``EXISTS`` subquery ``_exists_to_joins`` rewrites, or ``None``."""
    exp = _exp()
    from_, where = sub.args.get("from_"), sub.args.get("where")
    if from_ is None or where is None or not isinstance(from_.this, exp.Table) or not from_.this.alias:
        return None
    if any(sub.args.get(k) for k in ("joins", "group", "having", "limit", "offset", "distinct", "qualify", "laterals", "with_")):
        return None
    if any(True for _ in where.find_all(exp.Subquery, exp.Exists, exp.AggFunc, exp.Window, exp.Select)):
        return None
    table = from_.this
    alias, name = table.alias, table.name.lower()
    if alias in outer or name not in columns or unqualified & {c.lower() for c in columns[name]}:
        return None
    cols = list(where.find_all(exp.Column))
    if any(not c.table or c.table not in outer | {alias} for c in cols):
        return None
    eq = ineq = False
    for c in conjuncts(where):
        sides = aliases(c)
        if alias in sides and sides - {alias}:
            if isinstance(c, exp.EQ) and aliases(c.left) and aliases(c.right) and len(aliases(c.left) | aliases(c.right)) == 2 \
                    and len(aliases(c.left)) == 1 and len(aliases(c.right)) == 1:
                eq = True
            elif c.key.upper() in _INEQUALITIES:
                ineq = True
    if not (eq and ineq):
        return None
    return table.copy(), where.this.copy()


def _name_outputs(tree: Any) -> list[str] | None:
    """Alias the outer query's unaliased expressions by their SQL text, as DuckDB names them; return
    the output names as written (``""`` for those, which keep the optimized tree's spelling; ``None``
    when the query selects ``*``)."""
    exp = _exp()
    node = tree
    while isinstance(node, exp.SetOperation):
        node = node.left
    if not isinstance(node, exp.Select):
        return None
    names: list[str] | None = []
    for i, e in enumerate(node.expressions):
        if isinstance(e, exp.Star) or (isinstance(e, exp.Column) and isinstance(e.this, exp.Star)):
            names = None
        elif not isinstance(e, (exp.Alias, exp.Column)):
            text = e.sql(DIALECT)
            node.expressions[i].replace(exp.alias_(e.copy(), text, quoted=True))
            names = None if names is None else names + [""]  # the name the optimized tree gives it
        elif names is not None:
            names.append(e.alias if isinstance(e, exp.Alias) else e.name)
    return names


@functools.lru_cache(maxsize=256)
def table_spellings(query: str) -> tuple[str, ...]:
    """The names of the tables ``query`` reads, as it spells them (DuckDB looks a table up by its exact
    name), memoized by the text."""
    exp = _exp()
    return tuple(sorted({t.name for t in parse(query).find_all(exp.Table) if not t.args.get("db") and t.name}))


@functools.lru_cache(maxsize=256)
def one_name_per_read(query: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``query`` with each table it reads more than once named apart in every read after the first
    (``lineitem l2`` becomes ``"lineitem__hf2" l2``; an unaliased read gets its old name as its alias,
    so its columns resolve as before; nothing else of the text changes), and the new names with the
    table each stands for; ``query`` itself when it reads no table twice (memoized by the text).
    DuckDB, reading Python variables by name, reads a name that a statement mentions several times
    once and keeps it for every mention, which copies the table; a name per read scans the same Arrow
    table in place each time (TPC-H Q21 reads lineitem three times: docs/benchmarks.md)."""
    exp = _exp()
    tree = parse(query)
    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    reads = [t for t in tree.find_all(exp.Table) if not t.args.get("db") and t.name and t.name.lower() not in ctes]
    taken = {t.name.lower() for t in reads} | ctes
    seen: dict[str, int] = {}
    edits: list[tuple[int, int, str]] = []
    renamed: list[tuple[str, str]] = []
    for t in reads:
        n = seen[t.name.lower()] = seen.get(t.name.lower(), 0) + 1
        meta = t.this.meta if isinstance(t.this, exp.Identifier) else {}
        if n == 1 or "start" not in meta or "end" not in meta:
            continue
        new, i = f"{t.name}__hf{n}", n
        while new.lower() in taken:
            i += 1
            new = f"{t.name}__hf{i}"
        taken.add(new.lower())
        first, last = int(meta["start"]), int(meta["end"]) + 1
        quoted = '"' + new.replace('"', '""') + '"'
        edits.append((first, last, quoted if t.alias else f"{quoted} AS {query[first:last]}"))
        renamed.append((new, t.name))
    for first, last, text in sorted(edits, reverse=True):
        query = query[:first] + text + query[last:]
    return query, tuple(renamed)


def output_names(tree: Any) -> list[str] | None:
    """The output column names of an optimized tree (its first ``SELECT``'s, for a set operation), as
    the distributed plan names its result before ``sql`` spells them as the query does."""
    exp = _exp()
    node = tree
    while isinstance(node, exp.SetOperation):
        node = node.left
    if not isinstance(node, exp.Select):
        return None
    return [e.alias_or_name for e in node.expressions]


_SUPPORTED: dict[int, tuple[Any, SQLError | None]] = {}


def check_supported(tree: Any) -> None:
    """Raise the ``SQLError`` the distributed plan would raise for a construct it does not run (``WITH
    RECURSIVE``, ``QUALIFY``, ``DISTINCT ON``, ``GROUPING SETS``/``CUBE``/``ROLLUP``, ``JOIN ... USING``,
    a correlated subquery the optimizer left), so that a query runs, or not, whatever the size of its
    inputs: one that rank 0 runs alone in DuckDB, which would run them, is refused the same (memoized
    by the optimized tree, which the plan cache keeps)."""
    found = _SUPPORTED.get(id(tree))
    if found is None or found[0] is not tree:
        if len(_SUPPORTED) > 2 * PLAN_CACHE_SIZE:
            _SUPPORTED.clear()
        found = (tree, _unsupported(tree))
        _SUPPORTED[id(tree)] = found
    if found[1] is not None:
        raise found[1]


def _grouping_sets(group: Any) -> bool:
    """Whether a ``GROUP BY`` has grouping sets, a cube or a rollup (as its arguments, or as its keys:
    sqlglot parses ``GROUP BY ROLLUP (x)`` so)."""
    exp = _exp()
    if group is None:
        return False
    return any(group.args.get(k) for k in ("grouping_sets", "cube", "rollup")) \
        or any(isinstance(e, (exp.Rollup, exp.Cube, exp.GroupingSets)) for e in group.expressions)


def _unsupported(tree: Any) -> SQLError | None:
    exp = _exp()
    for with_ in tree.find_all(exp.With):
        if with_.args.get("recursive"):
            return SQLError(f"WITH RECURSIVE is not supported{_where(with_, '')}")
    for node in tree.find_all(exp.Select):
        for bad in ("distinct_on", "qualify", "pivots", "laterals"):
            if node.args.get(bad):
                return SQLError(f"{bad.upper()} is not supported{_where(node.args[bad], '')}")
        distinct = node.args.get("distinct")
        if distinct is not None and distinct.args.get("on"):
            return SQLError("DISTINCT ON is not supported")
        group = node.args.get("group")
        if _grouping_sets(group):
            return SQLError("GROUPING SETS, CUBE and ROLLUP are not supported")
        for j in node.args.get("joins") or []:
            if j.args.get("using"):
                return SQLError(f"JOIN ... USING is not supported here, write ON{_where(j, '')}")
        if node is not tree and not isinstance(node.parent, (exp.CTE, exp.SetOperation)) \
                and not (isinstance(node.parent, exp.Subquery) and isinstance(node.parent.parent, (exp.From, exp.Join))):
            defined = {t.alias_or_name for t in node.find_all(exp.Table, exp.Subquery)} | {c.alias_or_name for c in node.find_all(exp.CTE)}
            free = aliases(node) - defined
            if free:
                return SQLError(f"a correlated subquery the optimizer could not turn into a join is not supported "
                                f"(it reads {sorted(free)} of the outer query): {sql_of(node)[:100]}")
    return None


# ---------------------------------------------------------------------------------------- helpers
def q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def conjuncts(e: Any) -> list[Any]:
    exp = _exp()
    if e is None:
        return []
    if isinstance(e, exp.Where):
        e = e.this
    if isinstance(e, exp.Paren):
        return conjuncts(e.this) if isinstance(e.this, exp.And) else [e]
    if isinstance(e, exp.And):
        return conjuncts(e.left) + conjuncts(e.right)
    return [e]


def aliases(e: Any) -> set[str]:
    return {c.table for c in e.find_all(_exp().Column) if c.table}


def phys(e: Any) -> Any:
    """``e`` with every qualified column ``a.c`` as the physical column ``"a.c"``."""
    exp = _exp()

    def fn(n: Any) -> Any:
        if isinstance(n, exp.Column) and n.table:
            return exp.column(f"{n.table}.{n.name}", quoted=True)
        return n

    return e.transform(fn)  # transform works on a copy


def sql_of(e: Any) -> str:
    return str(e.sql(DIALECT))


def replace_exprs(e: Any, mapping: dict[str, str]) -> Any:
    """``e`` with every subtree whose SQL is a key of ``mapping`` replaced by that column."""
    exp = _exp()

    def fn(n: Any) -> Any:
        name = mapping.get(sql_of(n)) if isinstance(n, exp.Expression) else None
        return exp.column(name, quoted=True) if name is not None else n

    return e.transform(fn)  # transform works on a copy


def _int(node: Any, what: str) -> int | None:
    if node is None:
        return None
    e = node.expression if hasattr(node, "expression") and node.expression is not None else node.this
    try:
        return int(e.this)
    except (TypeError, ValueError, AttributeError):
        raise SQLError(f"{what} must be an integer literal, got {sql_of(e)}") from None


def _canonical_key(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """One type both sides' join key cast to before hashing, so equal values go to one rank."""
    def stringy(t: pa.DataType) -> bool:
        return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))

    if stringy(a) and stringy(b):
        return pa.large_string()
    if a == b:
        return None
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return pa.int64()
    numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal)
    if any(f(a) for f in numeric) and any(f(b) for f in numeric):
        return pa.float64()
    if (pa.types.is_date(a) or pa.types.is_timestamp(a)) and (pa.types.is_date(b) or pa.types.is_timestamp(b)):
        return pa.timestamp("us")
    return a


def key_range(table: pa.Table, column: str | None) -> tuple[int, int] | str | None:
    """``(min, max)`` of an integer column of this rank's ``table``, ``"empty"`` when no value is
    there (no rows or only NULLs), ``None`` when it cannot be routed by ranges (no such column, not
    an integer type)."""
    import pyarrow.compute as pc

    if column is None or column not in table.column_names or not pa.types.is_integer(table.schema.field(column).type):
        return None
    mm = pc.min_max(table.column(column)).as_py()
    return "empty" if mm["min"] is None else (int(mm["min"]), int(mm["max"]))


def key_nulls(table: pa.Table, column: str | None) -> int:
    """The NULLs of ``column`` in this rank's ``table`` (0 when there is no such column)."""
    return int(table.column(column).null_count) if column is not None and column in table.column_names else 0


#: the ranks' ``[lower bounds]`` and ``[ranks]`` of a range partitioning: rank ``ranks[i]`` holds the
#: key values from ``lower[i]`` up to ``lower[i + 1]`` (the first also those below, the last those above)
Bounds = tuple[tuple[int, ...], tuple[int, ...]]


def range_bounds(ranges: Sequence[tuple[int, int] | str | None], touching: bool = False) -> Bounds | None:
    """The bounds of the ranks' ``key_range``s when the ranks holding values hold disjoint intervals in
    rank order (data sorted by the key and split by rows, as generators and simulations write it):
    every key value is then on one rank.  With ``touching``, an interval may also start at the value
    the one before ends with (a key's rows split at the boundary: routing them moves those rows).
    ``None`` otherwise."""
    lower: list[int] = []
    ranks: list[int] = []
    last: int | None = None
    for rank, r in enumerate(ranges):
        if r is None:
            return None
        if not isinstance(r, tuple):  # "empty"
            continue
        lo, hi = r
        if last is not None and (lo < last or lo == last and not touching):
            return None
        lower.append(lo)
        ranks.append(rank)
        last = hi
    return (tuple(lower), tuple(ranks)) if ranks else None


def range_moved(ranges: Sequence[tuple[int, int] | str | None], sizes: Sequence[float], bounds: Bounds) -> float | None:
    """The bytes that routing rows of the ranks' ``ranges`` (``sizes`` bytes each) to ``bounds`` would
    move, taking values spread evenly over each rank's interval; ``None`` when a range is unknown."""
    lower, ranks = bounds
    moved = 0.0
    for rank, (r, size) in enumerate(zip(ranges, sizes)):
        if r is None:
            return None
        if not isinstance(r, tuple):  # "empty"
            continue
        lo, hi = r
        if rank not in ranks:
            moved += size
            continue
        i = ranks.index(rank)
        own_lo = lower[i] if i > 0 else lo  # the first rank takes every value below, the last every value above
        own_hi = lower[i + 1] - 1 if i + 1 < len(lower) else hi
        inside = max(0, min(hi, own_hi) - max(lo, own_lo) + 1)
        moved += size * (1.0 - inside / (hi - lo + 1))
    return moved


def range_part(column: str, bounds: Bounds) -> Part:
    """The partitioning mark of rows placed by ``bounds`` on ``column`` (never equal to a hash mark)."""
    return ((column, "range:" + ",".join(map(str, bounds[0])) + "@" + ",".join(map(str, bounds[1]))),)


# ---------------------------------------------------------------------------------------- execution
#: schema metadata of a result that is hash-partitioned over the ranks: ``[[column, hashed type], ...]``
PART_KEY = b"hetflow.sql.partitioned_by"
Part = tuple[tuple[str, str], ...]


def with_part(table: pa.Table, part: Part | None) -> pa.Table:
    """``table`` marked as hash-partitioned on ``part`` (columns and the types their values were hashed
    as), so that a join or a group-by on those columns needs no exchange; ``None`` clears the mark."""
    import json

    meta = dict(table.schema.metadata or {})
    meta.pop(PART_KEY, None)
    if part:
        meta[PART_KEY] = json.dumps([list(c) for c in part]).encode()
    return table.replace_schema_metadata(meta or None)


def part_of(table: pa.Table) -> Part | None:
    import json

    raw = (table.schema.metadata or {}).get(PART_KEY)
    return tuple((str(a), str(b)) for a, b in json.loads(raw)) if raw else None


_JOIN_SQL = {"inner": "JOIN", "left": "LEFT JOIN", "right": "RIGHT JOIN", "full": "FULL JOIN", "semi": "SEMI JOIN",
             "anti": "ANTI JOIN", "cross": "CROSS JOIN"}


class Rel:
    """A relation on this rank: the rows of ``base`` and the local joins (the other side already here:
    broadcast, or co-partitioned by a shuffle) and filters still to apply, which the next fragment runs
    with its own work, so DuckDB pipelines them without an Arrow table in between."""

    def __init__(self, base: pa.Table, part: Part | None = None, equal: dict[str, set[str]] | None = None) -> None:
        self.base = base
        self.part = part  # the rows are hash-partitioned on these physical columns (hashed as these types)
        self.tables: dict[str, pa.Table] = {}
        self.steps: list[str] = []
        self.where: list[str] = []
        self.equal: dict[str, set[str]] = dict(equal or {})  # columns an inner join's equality made equal in every row
        self.whole: dict[str, str] = {}  # column -> the pending joined table holding it whole on every rank (broadcast)

    def add_equal(self, a: str, b: str) -> None:
        group = self.equal.get(a, {a}) | self.equal.get(b, {b})
        for c in group:
            self.equal[c] = group

    def covering(self, column: str, names: Any) -> str | None:
        """``column``, or a column equal to it in every row, that is among ``names``."""
        return next((c for c in [column, *sorted(self.equal.get(column, ()))] if c in names), None)

    @property
    def pending(self) -> bool:
        return bool(self.steps or self.where)

    def add_join(self, how: str, table: pa.Table, on_sql: str, whole: bool = False, where: str | None = None) -> None:
        """Join ``table`` in the next fragment, the rows of it that ``where`` keeps; ``whole``: every rank
        holds all of its rows."""
        name = f"__j{len(self.tables)}"
        self.tables[name] = table
        src = f"(SELECT * FROM {name} WHERE {where}) AS {name}" if where else name
        self.steps.append(f" {_JOIN_SQL[how]} {src}" + ("" if how == "cross" else f" ON {on_sql}"))
        if whole and how == "inner":
            self.whole.update({c: name for c in table.column_names})

    def add_where(self, cond: str) -> None:
        self.where.append(cond)

    def column_type(self, name: str) -> pa.DataType | None:
        for t in (self.base, *self.tables.values()):
            if name in t.schema.names:
                return t.schema.field(name).type
        return None

    def source(self) -> tuple[str, dict[str, pa.Table]]:
        """``FROM`` text and the tables it reads."""
        if not self.pending:
            return "__r", {"__r": self.base}
        where = f" WHERE {' AND '.join(self.where)}" if self.where else ""
        return f"(SELECT * FROM __r{''.join(self.steps)}{where})", {"__r": self.base, **self.tables}


#: distinct counts of tables' columns by ``id`` of the table (with a weak reference that tells a table
#: that is still the one counted from a new one at the same address): the inputs of a query run again,
#: as a database keeps a table's statistics, are not counted again
_NDV: dict[int, tuple[Any, dict[str, int]]] = {}
NDV_CACHE_SIZE = 256


def _known_ndv(origin: tuple[pa.Table, dict[str, str], pa.Table] | None, columns: Sequence[str], alias: str) -> list[int] | None:
    """The remembered distinct counts of ``alias``'s ``columns`` in the table it reads, or ``None``."""
    if origin is None:
        return None
    table, names, _ = origin
    entry = _NDV.get(id(table))
    if entry is None or entry[0]() is not table:
        return None
    found = [entry[1].get(names.get(f"{alias}.{c}", "")) for c in columns]
    return None if any(v is None for v in found) else [int(v) for v in found]  # type: ignore[arg-type]


def _remember_ndv(origin: tuple[pa.Table, dict[str, str], pa.Table] | None, columns: Sequence[str], alias: str, ndv: Sequence[int]) -> None:
    import weakref

    if origin is None:
        return
    table, names, _ = origin
    entry = _NDV.get(id(table))
    if entry is None or entry[0]() is not table:
        if len(_NDV) >= NDV_CACHE_SIZE:
            for key in [k for k, (ref, _) in _NDV.items() if ref() is None] or [next(iter(_NDV))]:
                del _NDV[key]
        entry = _NDV[id(table)] = (weakref.ref(table), {})
    for c, n in zip(columns, ndv):
        if f"{alias}.{c}" in names:
            entry[1][names[f"{alias}.{c}"]] = int(n)


def filtered_ndv(ndv: int, rows: int, kept: int) -> int:
    """The distinct values a column of ``ndv`` distinct values over ``rows`` rows is expected to keep in
    ``kept`` of those rows taken at random (each value's ``rows / ndv`` rows all left out with probability
    ``(1 - kept / rows) ** (rows / ndv)``): the filtered source's count without counting its rows again."""
    if rows <= 0 or kept <= 0 or ndv <= 0:
        return 0
    if kept >= rows:
        return ndv
    share = 1.0 - float((1.0 - kept / rows) ** (rows / ndv))
    return max(1, min(kept, round(ndv * share)))


class Executor:
    """Runs one query tree (and its CTEs) on this rank; every method is collective.  The tree is read,
    never changed (``optimize`` hands the cached tree itself): expressions are rewritten on copies."""

    def __init__(self, run: _Run, env: dict[str, pa.Table]) -> None:
        self.r = run
        self.env = dict(env)
        self.subqueries: dict[str, pa.Table] = {}  # materialized uncorrelated subqueries, on every rank
        # each source alias's table as read (an input or a CTE's result), its columns' names there by
        # physical name (``alias.column``), and the table of those physical columns
        self.origins: dict[str, tuple[pa.Table, dict[str, str], pa.Table]] = {}

    def local(self, sql: str, **tables: pa.Table) -> pa.Table:
        """A local fragment, with the materialized subqueries it names."""
        extra = {k: v for k, v in self.subqueries.items() if k in sql}
        return self.r.local(sql, **tables, **extra)

    def materialize(self, e: Any) -> Any:
        """``e`` with each subquery that the optimizer left in an expression (uncorrelated: ``x IN
        (SELECT ...)``, ``EXISTS``, a scalar) run first and broadcast, then read by name in the local
        fragments, so that DuckDB applies SQL's semantics (NULLs in ``NOT IN`` included)."""
        exp = _exp()
        if e is None:
            return None
        e = e.copy()
        for sub in list(e.find_all(exp.Subquery, exp.Select)):
            if isinstance(sub, exp.Select) and isinstance(sub.parent, exp.Subquery):
                continue
            inner = sub.this if isinstance(sub, exp.Subquery) else sub
            if sub.find_ancestor(exp.Subquery, exp.Select) is not None and sub.find_ancestor(exp.Subquery, exp.Select) is not e:
                continue  # nested in another subquery of e: runs with it
            defined = {t.alias_or_name for t in inner.find_all(exp.Table, exp.Subquery)} | {c.alias_or_name for c in inner.find_all(exp.CTE)}
            free = aliases(inner) - defined
            if free:
                raise SQLError(f"a correlated subquery the optimizer could not turn into a join is not supported "
                               f"(it reads {sorted(free)} of the outer query): {sql_of(inner)[:100]}")
            table = Executor(self.r, self.env).run(inner)
            r = self.r
            if r.p > 1:
                before = table
                table = r.broadcast(table)
                r.plan_exchange("subquery", "broadcast of its result", "allgather", before,
                                detail=f"uncorrelated subquery of {table.num_rows} row(s)")
            name = f"__sq{len(self.subqueries)}"
            self.subqueries[name] = table
            repl = exp.select("*").from_(exp.to_identifier(name))
            sub.replace(exp.Subquery(this=repl) if isinstance(sub, exp.Subquery) else repl)
        return e

    def run(self, node: Any, top: bool = False) -> pa.Table:
        exp = _exp()
        if isinstance(node, exp.Subquery):
            node = node.this
        with_ = node.args.get("with_")
        if with_ is not None:
            if with_.args.get("recursive"):
                raise SQLError(f"WITH RECURSIVE is not supported{_where(with_, '')}")
            for cte in with_.expressions:
                self.env[cte.alias_or_name] = Executor(self.r, self.env).run(cte.this)
        if isinstance(node, exp.SetOperation):
            return self.set_operation(node, top)
        if isinstance(node, exp.Select):
            return self.select(node, top)
        raise SQLError(f"unsupported query node {node.key.upper()}: {sql_of(node)[:80]}")

    # ------------------------------------------------------------------ sources
    def source(self, src: Any, needed: dict[str, set[str]]) -> tuple[str, pa.Table, Part | None]:
        exp = _exp()
        if isinstance(src, exp.Table) and not src.args.get("db"):
            name = src.name
            table = self.env.get(name)
            if table is None:
                lower = {k.lower(): v for k, v in self.r.inputs.items()}
                table = self.r.inputs.get(name, lower.get(name.lower()))
            if table is None:
                raise SQLError(f"unknown table {name!r}{_where(src, '')}")
            alias = src.alias_or_name
        elif isinstance(src, exp.Subquery):
            table = Executor(self.r, self.env).run(src.this)
            alias = src.alias_or_name
            cols = src.args["alias"].columns if src.args.get("alias") is not None else []
            if cols:
                part = part_of(table)
                names = [c.name for c in cols] + table.column_names[len(cols):]
                renamed = dict(zip(table.column_names, names))
                table = with_part(table.rename_columns(names), tuple((renamed[c], t) for c, t in part) if part else None)
        else:
            raise SQLError(f"unsupported FROM item {sql_of(src)[:80]!r}{_where(src, '')}")
        want = needed.get(alias, set())
        by_lower = {n.lower(): n for n in table.column_names}
        keep = [(by_lower.get(c.lower(), c), c) for c in sorted(want) if c in table.column_names or c.lower() in by_lower]
        if not keep:  # count(*) and the like need only the rows
            keep = [(table.column_names[0], table.column_names[0])] if table.num_columns else []
        out = with_part(table.select([a for a, _ in keep]).rename_columns([f"{alias}.{c}" for _, c in keep]), None)
        found = self.r.derived.get(id(table))
        if found is not None and found[0] is table:  # a projection of another table: that table's statistics
            self.origins[alias] = (found[1], {f"{alias}.{c}": found[2][a] for a, c in keep if a in found[2]}, out)
        else:
            self.origins[alias] = (table, {f"{alias}.{c}": a for a, c in keep}, out)
        part = part_of(table)
        physical = {a: f"{alias}.{c}" for a, c in keep}
        if part is not None:
            part = tuple((physical[c], t) for c, t in part) if all(c in physical for c, _ in part) else None
        return alias, out, part

    # ------------------------------------------------------------------ joins
    def rows_of(self, rel: Rel) -> pa.Table:
        """``rel``'s rows as one Arrow table (its pending joins and filters run now)."""
        if not rel.pending:
            return rel.base
        src, tables = rel.source()
        return self.local(f"SELECT * FROM {src} AS __m", **tables)

    def join(self, left_rel: Rel, right: pa.Table, lal: set[str], ral: set[str], on: list[Any], how: str,
             right_part: Part | None = None, right_where: str | None = None) -> Rel:
        """Join a relation with a table on the conjuncts ``on``: exchange (hash shuffle on the equality
        keys of the sides not already partitioned on them, or a broadcast of one side), then a local
        join with the whole condition, left pending in the returned relation (inner, left and cross
        joins) for the next fragment to run.  ``right_where``: conditions on the right's columns alone
        (inner, left, semi and anti joins), applied before the right's rows move, or, when only the
        rows about the boundaries of the left's key intervals move (``held_range``), in the join."""
        exp = _exp()
        r = self.r
        left = left_rel.base
        keys = []
        for c in on:
            if isinstance(c, exp.EQ):
                a, b = aliases(c.left), aliases(c.right)
                if a and b and a <= lal and b <= ral:
                    keys.append((c.left, c.right))
                elif a and b and a <= ral and b <= lal:
                    keys.append((c.right, c.left))
        cond = " AND ".join(f"({sql_of(phys(c))})" for c in on) or "TRUE"
        whole = False  # the right side broadcast: all of it on every rank
        cols = [(f"{a.table}.{a.name}" if isinstance(a, exp.Column) and a.table else None,
                 f"{b.table}.{b.name}" if isinstance(b, exp.Column) and b.table else None) for a, b in keys]
        # the left's rows already placed by key intervals of one of its key columns (an earlier range join
        # or group-by): the right's rows can be routed to those intervals, whatever the left's base holds
        held = self.held_range(left_rel, cols, right) if r.p > 1 else None
        if right_where is not None and held is None:  # the right's rows may all move: they move filtered
            right = self.local(f"SELECT * FROM t WHERE {right_where}", t=right)
            right_where = None
        # sizes of the left's base (its pending joins are not run to size it) and the key columns' ranges, in one allgather
        mine = (int(left.nbytes), int(right.nbytes), [(key_range(left, la), key_range(right, rb)) for la, rb in cols] if r.p > 1 else [],
                [key_nulls(left, la) for la, _ in cols])
        stats = r.comm.allgather(mine) if r.p > 1 else [mine]
        lsizes, rsizes = [float(x[0]) for x in stats], [float(x[1]) for x in stats]
        ranged = self.range_choice([[x[2][i] for x in stats] for i in range(len(keys))], lsizes, rsizes) if r.p > 1 else None
        if held is not None:
            i, bounds = held
            routed = 0.0 if right_part == range_part(cols[i][1], bounds) else range_moved([x[2][i][1] for x in stats], rsizes, bounds)  # type: ignore[arg-type]
            if routed is not None and (ranged is None or routed <= ranged[0]):
                ranged = (routed, i, "left", bounds)
        rkeep: str | None = None  # the condition that keeps this rank's own rows of a right side routed in place
        detail = f"{how} join of {sorted(lal)} ({sum(lsizes) / 1e6:.2f} MB) with {sorted(ral)} ({sum(rsizes) / 1e6:.2f} MB)"
        types, lsig, rsig = self.key_signatures(left_rel, right, keys)
        left_ready = lsig is not None and left_rel.part == lsig  # already hash-partitioned on these keys
        right_ready = rsig is not None and right_part == rsig
        if r.p == 1:
            r.plan("join", "local (1 rank)", Cost(), detail)
        elif keys and left_ready and right_ready:  # co-partitioned: nothing moves
            r.plan("join", "co-partitioned: both sides already hash-partitioned on the keys, nothing moves", Cost(), detail)
        elif keys:
            costs = join_costs(r.model, lsizes, rsizes, how)
            if left_ready or right_ready:  # only the other side moves
                costs["hash"] = shuffle_cost(r.model, rsizes if left_ready else lsizes) + Cost(compute_s=costs["hash"].compute_s)
            if ranged is not None:  # both sides placed by one side's key intervals: only the rows outside them move
                costs["range"] = Cost(exchange_bytes=ranged[0], exchange_s=r.model.alpha * 2 * (r.p - 1),
                                      compute_s=costs["hash"].compute_s * r.p / len(ranged[3][1]))  # on the ranks holding keys
            # the local join work of the cost model, plus the exchanged bytes at the rate a shuffle partitions,
            # copies and sends them (the Hockney time of the exchange alone leaves that work out)
            choice = min((k for k in ("range", "hash", "broadcast", "broadcast_left") if k in costs),
                         key=lambda k: costs[k].compute_s + costs[k].exchange_bytes * EXCHANGE_SECONDS_PER_BYTE)
            alts = {k: c.seconds for k, c in costs.items() if k != "sort"}
            if right_where is not None and not (choice == "range" and ranged is not None and ranged[2] == "left"):
                right = self.local(f"SELECT * FROM t WHERE {right_where}", t=right)  # its rows move: filtered first
                right_where = None
            if choice == "range":
                _, i, giver, bounds = ranged  # type: ignore[misc]
                lcol, rcol = cols[i]
                # the result is range-partitioned on the left key unless NULL keys the join keeps sit on several ranks
                mark = range_part(lcol, bounds) if how in ("inner", "semi") or not any(x[3][i] for x in stats) else None  # type: ignore[arg-type]
                if giver == "left":  # the left's rows are in their intervals already
                    if how not in ("inner", "left", "semi", "anti"):  # a right or full join keeps unmatched right rows
                        right = r.route(right, rcol, bounds)  # type: ignore[arg-type]
                    elif right_where is not None or right_part != range_part(rcol, bounds):  # type: ignore[arg-type]
                        # the rows that leave are sent, those that stay are kept by a condition of the join (no copy)
                        right, rkeep = r.route_in_place(right, rcol, bounds)  # type: ignore[arg-type]
                    if left_rel.part is None:
                        left_rel.part = mark
                else:
                    left_rel = self.route_rel(left_rel, lcol, bounds, mark)  # type: ignore[arg-type]
                algo = (f"range: the {'right' if giver == 'left' else 'left'} side's rows outside the {giver} side's "
                        f"intervals of {lcol if giver == 'left' else rcol} move")
            elif choice == "hash":
                if types is None:  # keys that are expressions: their common types from their values
                    left_rel = Rel(self.rows_of(left_rel), None, left_rel.equal)
                    lk0 = self.key_columns(left_rel.base, [a for a, _ in keys])
                    rk0 = self.key_columns(right, [b for _, b in keys])
                    types = [_canonical_key(x.type, y.type) or x.type for x, y in zip(lk0.schema, rk0.schema)]
                moved = []
                if not left_ready:
                    left = self.rows_of(left_rel)
                    left = r.shuffle_by(left, self.hash_keys(left, [a for a, _ in keys], types))
                    left_rel = Rel(left, lsig, left_rel.equal)
                    moved.append("left")
                if not right_ready:
                    right = r.shuffle_by(right, self.hash_keys(right, [b for _, b in keys], types))
                    moved.append("right")
                algo = f"hash shuffle of the {' and '.join(moved)} side{'s' if len(moved) > 1 else ''} on {[sql_of(a) for a, _ in keys]}"
            elif choice == "broadcast":
                right = r.broadcast(right)
                whole = True
                algo = "broadcast right"
            else:
                left_rel = Rel(r.broadcast(self.rows_of(left_rel)), None, left_rel.equal)
                algo = "broadcast left"
            r.plan("join", algo, costs[choice], detail, alts)
        else:  # no equality: broadcast one side (both to rank 0 for a full join)
            small_right = sum(rsizes) <= sum(lsizes)
            choice = ({"inner": "broadcast" if small_right else "broadcast_left", "cross": "broadcast" if small_right else "broadcast_left",
                       "left": "broadcast", "semi": "broadcast", "anti": "broadcast", "right": "broadcast_left"}).get(how, "gather")
            model = r.model
            if choice == "broadcast":
                right = r.broadcast(right)
                whole = True
                cost = allgather_cost(model, rsizes)
            elif choice == "broadcast_left":
                left_rel = Rel(r.broadcast(self.rows_of(left_rel)))
                cost = allgather_cost(model, lsizes)
            else:
                left_rel, right = Rel(r.gather(self.rows_of(left_rel))), r.gather(right)
                cost = shuffle_cost(model, [a + b for a, b in zip(lsizes, rsizes)])
            r.plan("join", {"broadcast": "broadcast right", "broadcast_left": "broadcast left", "gather": "gather both sides to rank 0"}[choice],
                   cost, detail)
        # the right's own conditions not applied before the exchange, and the condition that keeps the rows
        # of a right side routed in place that are this rank's: a filter of the right side inside the join's
        # statement (in its ON, a left join's conditions would keep DuckDB from making it an inner join)
        rfilter = " AND ".join(f"({c})" for c in (right_where, rkeep) if c) or None
        if how in ("inner", "left", "cross"):
            left_rel.add_join(how, right, cond, whole, rfilter)
            if how == "inner":
                for a, b in keys:
                    if isinstance(a, exp.Column) and a.table and isinstance(b, exp.Column) and b.table:
                        left_rel.add_equal(f"{a.table}.{a.name}", f"{b.table}.{b.name}")
            return left_rel
        # a semi or anti join keeps some of the left's rows as they are: where they are, with their equalities
        part, equal = (left_rel.part, left_rel.equal) if how in ("semi", "anti") else (None, None)
        on_sql = f" ON {cond}"
        rsql = f"(SELECT * FROM r WHERE {rfilter}) AS r" if rfilter else "r"
        return Rel(self.local(f"SELECT * FROM l {_JOIN_SQL[how]} {rsql}{on_sql}", l=self.rows_of(left_rel), r=right), part, equal)

    def held_range(self, rel: Rel, cols: list[tuple[str | None, str | None]], right: pa.Table) -> tuple[int, Bounds] | None:
        """``(key index, bounds)`` when ``rel``'s rows are placed by key intervals (its mark, from a range
        join or group-by) of a column that is, or an inner join made equal to, the left column of an
        equality key whose right column is an integer one (routable to those intervals); else ``None``.
        Rank-local, the same on every rank (marks and schemas are)."""
        if rel.part is None or len(rel.part) != 1 or not rel.part[0][1].startswith("range:"):
            return None
        column, spec = rel.part[0]
        lower, ranks = spec[len("range:"):].split("@")
        bounds = (tuple(int(v) for v in lower.split(",")), tuple(int(v) for v in ranks.split(",")))
        for i, (la, rb) in enumerate(cols):
            if la is None or rb is None or rel.covering(column, {la}) is None:
                continue
            if rb in right.schema.names and pa.types.is_integer(right.schema.field(rb).type):
                return i, bounds
        return None

    def range_choice(self, ranges: list[list[tuple[Any, Any]]], lsizes: list[float], rsizes: list[float]) -> tuple[float, int, str, Bounds] | None:
        """For each key pair's ranks' ``(left range, right range)``: when one side's rows hold disjoint
        key intervals in rank order, the other side can be routed to them (``_Run.route``); returns the
        cheapest such ``(bytes moved, key index, giving side, bounds)``, the left giving on a tie (its
        pending joins then stay pending), or ``None``."""
        best: tuple[float, int, str, Bounds] | None = None
        for i, pairs in enumerate(ranges):
            lr, rr = [a for a, _ in pairs], [b for _, b in pairs]
            for giver, own, other, sizes in (("left", lr, rr, rsizes), ("right", rr, lr, lsizes)):
                bounds = range_bounds(own)
                moved = range_moved(other, sizes, bounds) if bounds is not None else None
                if moved is not None and bounds is not None and (best is None or moved < best[0]):
                    best = (moved, i, giver, bounds)
        return best

    def route_rel(self, rel: Rel, column: str, bounds: Bounds, part: Part | None) -> Rel:
        """``rel`` with its rows placed by ``bounds`` on ``column`` (``_Run.route``), marked ``part``.  A
        relation with only filters pending keeps its base in place: the rows that leave are sent and
        masked out by one more pending filter, the rows that arrive appended (no copy of the base)."""
        r = self.r
        if rel.steps:
            return Rel(r.route(self.rows_of(rel), column, bounds), part, rel.equal)
        base, keep = r.route_in_place(rel.base, column, bounds)
        out = Rel(base, part, rel.equal)
        out.where = list(rel.where) + ([keep] if keep else [])
        return out

    def key_signatures(self, left: Rel, right: pa.Table, keys: list[tuple[Any, Any]]) -> tuple[list[pa.DataType] | None, Part | None, Part | None]:
        """The type each key pair is hashed as (the sides' common type) and, where the keys are plain
        columns, each side's partitioning signature ``((column, type), ...)`` after a shuffle on them."""
        exp = _exp()
        if not keys:
            return None, None, None
        types: list[pa.DataType] = []
        lsig: list[tuple[str, str]] | None = []
        rsig: list[tuple[str, str]] | None = []
        for a, b in keys:
            la = f"{a.table}.{a.name}" if isinstance(a, exp.Column) and a.table else None
            rb = f"{b.table}.{b.name}" if isinstance(b, exp.Column) and b.table else None
            ta = left.column_type(la) if la else None
            tb = right.schema.field(rb).type if rb and rb in right.schema.names else None
            if ta is None or tb is None:
                return None, None, None
            t = _canonical_key(ta, tb) or ta
            types.append(t)
            lsig = None if lsig is None else lsig + [(la, str(t))]  # type: ignore[list-item]
            rsig = None if rsig is None else rsig + [(rb, str(t))]  # type: ignore[list-item]
        return types, tuple(lsig) if lsig else None, tuple(rsig) if rsig else None

    def hash_keys(self, table: pa.Table, exprs: list[Any], types: list[pa.DataType] | None) -> pa.Table:
        """The key values of ``exprs`` over ``table``, cast to the types both sides hash them as."""
        keys = self.key_columns(table, exprs)
        for i in range(keys.num_columns):
            if types is not None and keys.schema.field(i).type != types[i]:
                keys = keys.set_column(i, f"__k{i}", keys.column(i).cast(types[i]))
        return keys

    def key_columns(self, table: pa.Table, exprs: list[Any]) -> pa.Table:
        """The values of ``exprs`` over ``table`` as columns ``__k<i>`` (plain columns without DuckDB)."""
        exp = _exp()
        if all(isinstance(e, exp.Column) and e.table and f"{e.table}.{e.name}" in table.column_names for e in exprs):
            return pa.table({f"__k{i}": table.column(f"{e.table}.{e.name}") for i, e in enumerate(exprs)})
        return self.local("SELECT " + ", ".join(f"{sql_of(phys(e))} AS __k{i}" for i, e in enumerate(exprs)) + " FROM t", t=table)

    def _how(self, j: Any) -> str:
        side, kind = (j.side or "").lower(), (j.kind or "").lower()
        if side in ("left", "right", "full"):
            return side
        if kind in ("semi", "anti"):
            return kind
        if kind == "cross":
            return "inner"
        if kind in ("", "inner", "outer"):
            return "inner"
        raise SQLError(f"unsupported join {sql_of(j)[:80]!r}")

    def joins(self, node: Any) -> tuple[Rel, set[str], list[Any]]:
        """The FROM clause joined, with the WHERE conjuncts applied as soon as their sources are there;
        returns the relation, its aliases and the conjuncts still to apply."""
        exp = _exp()
        from_ = node.args.get("from_")
        if from_ is None:
            return Rel(pa.table({"__one": [1]}).slice(0, 1 if self.r.rank == 0 else 0)), set(), conjuncts(node.args.get("where"))
        joins = list(node.args.get("joins") or [])
        for j in joins:
            if j.args.get("using"):
                raise SQLError(f"JOIN ... USING is not supported here, write ON{_where(j, '')}")
        needed: dict[str, set[str]] = {}
        for c in node.find_all(exp.Column):
            if c.table:
                needed.setdefault(c.table, set()).add(c.name)
        plain = [j for j in joins if self._how(j) == "inner" and not j.side]
        if all(self._how(j) in ("inner", "semi", "anti") for j in joins):
            # semi and anti joins add no columns: they commute with the inner joins, which go first
            joins = plain + [j for j in joins if not any(j is k for k in plain)]
        first = 0
        while first < len(joins) and self._how(joins[first]) == "inner" and not joins[first].side:
            first += 1
        inner_srcs, rest = [from_.this] + [j.this for j in joins[:first]], joins[first:]
        outer_all = any(self._how(j) in ("right", "full") for j in rest)
        pool = [self.materialize(c) if self._has_subquery(c) else c for c in conjuncts(node.args.get("where"))]
        if outer_all:
            late, pool = pool, []
        else:
            late = []
        for j in joins[:first]:
            pool += conjuncts(j.args.get("on"))
        rels: dict[str, pa.Table] = {}
        parts: dict[str, Part | None] = {}
        for s in inner_srcs:
            alias, t, parts[alias] = self.source(s, needed)
            rels[alias] = t
        # single-source filters of the inner part: run at the scan (join_order), or by the first fragment over the first source
        filters: dict[str, str] = {}
        for alias in list(rels):
            mine = [c for c in pool if aliases(c) == {alias}]
            if mine:
                pool = [c for c in pool if not any(c is m for m in mine)]
                filters[alias] = " AND ".join(f"({sql_of(phys(c))})" for c in mine)
        cur, have, pool = self.join_order(rels, parts, pool, filters)
        # the remaining joins, in the order written
        for j in rest:
            how = self._how(j)
            on = conjuncts(j.args.get("on"))
            alias, t, tpart = self.source(j.this, needed)
            twhere = None  # the right's own conditions: join() applies them before its rows move, or in the join
            if how in ("left", "semi", "anti", "inner"):
                mine = [c for c in on if aliases(c) == {alias}]
                if mine:
                    on = [c for c in on if not any(c is m for m in mine)]
                    twhere = " AND ".join(f"({sql_of(phys(c))})" for c in mine)
            if not on and how == "inner":
                how = "cross"
            if twhere is not None and how == "cross":
                t, twhere = self.local(f"SELECT * FROM t WHERE {twhere}", t=t), None
            cur = self.join(cur, t, set(have), {alias}, on, how, tpart, twhere)
            have.add(alias)
            ready = [c for c in pool if aliases(c) <= have]
            if ready:
                pool = [c for c in pool if not any(c is x for x in ready)]
                cur.add_where(" AND ".join(f"({sql_of(phys(c))})" for c in ready))
        return cur, have, pool + late

    def join_order(self, rels: dict[str, pa.Table], parts: dict[str, Part | None], pool: list[Any],
                   filters: dict[str, str]) -> tuple[Rel, set[str], list[Any]]:
        """Join the inner sources greedily: start from the largest, then join the source whose join is
        estimated to give the fewest rows (rows of both over, for each pair of sources, the larger of the
        two sides' distinct counts of their equality columns, each side's the product of its columns'
        counts (DuckDB's ``approx_count_distinct``, summed over the ranks) but at most its rows: a
        composite key is no rarer than unique); a source linked by no equality comes last (cross join,
        broadcast).  Sizes and counts are of the rows that pass each source's ``filters`` (an input's
        distinct counts there estimated by ``filtered_ndv`` from its counts over all its rows, counted
        once and kept with the table, and the rows kept: ``sampled_rows`` for the largest); the filtered
        rows of every source but the first are materialized, the first's filter is left to the first
        fragment that reads it (the largest input is not copied)."""
        exp = _exp()
        r = self.r
        eq_cols: dict[str, list[str]] = {a: [] for a in rels}
        for c in pool:
            if isinstance(c, exp.EQ):
                for side in (c.left, c.right):
                    if isinstance(side, exp.Column) and side.table in rels and side.name not in eq_cols[side.table]:
                        eq_cols[side.table].append(side.name)
        if len(rels) <= 2:
            eq_cols = {a: [] for a in rels}  # no choice of order to make: no distinct counts needed
        # the filtered rows of every source but the largest here (the likely first) are read once, now, and
        # counted as they are; the largest's are counted through its filter (the same counts either way)
        guess = max(rels, key=lambda a: (rels[a].nbytes, -list(rels).index(a)))
        done = {a: self.local(f"SELECT * FROM t WHERE {filters[a]}", t=t) for a, t in rels.items() if a in filters and a != guess}
        local: list[list[int]] = []
        # the sources DuckDB counts, in one statement: the distinct counts of an input's columns are counted
        # once, over all its rows, and kept with the table; a filtered source's are estimated from those
        # and the rows its filter keeps (``filtered_ndv``), so that only its rows are counted (nothing for
        # a source already filtered into ``done``)
        counted: dict[int, tuple[str, list[str]]] = {}
        whole: dict[int, list[int]] = {}  # the remembered distinct counts over all the rows, of filtered sources
        for i, (a, t) in enumerate(rels.items()):
            # (no choice of order between two sources: their unfiltered sizes pick the first)
            known = _known_ndv(self.origins.get(a), eq_cols[a], a) if eq_cols[a] else None
            if known is not None and a in filters:
                whole[i], known = known, None
            if eq_cols[a] and known is None:
                if i in whole:  # the rows its filter keeps: counted on a sample (``sampled_rows``) or already here
                    cols = []
                else:
                    cols = [f"count(*) AS __n{i}"] + [f"approx_count_distinct({q(f'{a}.{c}')}) AS __d{i}_{j}" for j, c in enumerate(eq_cols[a])]
                if cols:
                    counted[i] = (a, cols)
            local.append([t.num_rows, int(t.nbytes)] + (known or []))
        # an input filtered here, its distinct counts not yet known: counted once over all its rows (as an
        # unfiltered input's are), beside the rows its filter keeps
        inputs = {id(v) for v in self.r.inputs.values()}
        uncounted = {i: a for i, a in enumerate(rels) if eq_cols[a] and a in filters and i not in whole
                     and self.origins.get(a) is not None and id(self.origins[a][0]) in inputs}
        for i, a in uncounted.items():
            counted[i] = (a, [f"count(*) AS __n{i}", f"count(*) FILTER (WHERE {filters[a]}) AS __f{i}"]
                          + [f"approx_count_distinct({q(f'{a}.{c}')}) AS __d{i}_{j}" for j, c in enumerate(eq_cols[a])])
        names = list(rels)
        row: dict[str, Any] = {}
        if counted:
            row = self.local("SELECT * FROM " + ", ".join(
                f"(SELECT {', '.join(cols)} FROM __s{i}{f' WHERE {filters[a]}' if a in filters and a not in done and i not in uncounted else ''})"
                for i, (a, cols) in counted.items()),
                **{f"__s{i}": rels[a] if i in uncounted else done.get(a, rels[a]) for i, (a, _) in counted.items()}).to_pylist()[0]
        for i, a in enumerate(names):
            if i not in counted and i not in whole:
                continue
            t = rels[a]
            if i in uncounted:
                distinct_counts = [int(row[f"__d{i}_{j}"] or 0) for j in range(len(eq_cols[a]))]
                _remember_ndv(self.origins.get(a), eq_cols[a], a, distinct_counts)
                whole[i] = distinct_counts
                n = int(row[f"__f{i}"] or 0)
            elif i in whole:
                n = done[a].num_rows if a in done else self.sampled_rows(t, filters[a])
            else:
                n = int(row[f"__n{i}"] or 0)
                distinct_counts = [int(row[f"__d{i}_{j}"] or 0) for j in range(len(eq_cols[a]))]
                if a not in filters:
                    _remember_ndv(self.origins.get(a), eq_cols[a], a, distinct_counts)
            if i in whole:
                distinct_counts = [filtered_ndv(d, t.num_rows, n) for d in whole[i]]
            local[i] = [n, int(t.nbytes * n / t.num_rows) if t.num_rows else 0] + distinct_counts
        # one source: no order to choose, and its sizes estimate nothing (the ranks skip the allgather alike)
        stats = r.comm.allgather(local) if r.p > 1 and len(rels) > 1 else [local]
        rows, nbytes, ndv = {}, {}, {}
        for i, a in enumerate(rels):
            rows[a] = sum(s[i][0] for s in stats)
            nbytes[a] = sum(s[i][1] for s in stats)
            for j, c in enumerate(eq_cols[a]):
                ndv[(a, c)] = max(1, min(rows[a], sum(s[i][2 + j] for s in stats)))

        def distinct(e: Any, owner_rows: float) -> float:
            if isinstance(e, exp.Column) and (e.table, e.name) in ndv:
                return float(min(ndv[(e.table, e.name)], max(owner_rows, 1)))
            return float(max(owner_rows, 1))

        order = list(rels)
        first = max(order, key=lambda a: (nbytes[a], -order.index(a)))
        for a, t in list(rels.items()):
            if a in filters and a != first:
                rels[a] = done[a] if a in done else self.local(f"SELECT * FROM t WHERE {filters[a]}", t=t)
        base = rels.pop(first)
        cur, have, cur_rows = Rel(done.get(first, base), parts[first]), {first}, float(rows[first])
        if first in filters and first not in done:
            cur.add_where(filters[first])
        while rels:
            best: tuple[float, int, str] | None = None
            for a in rels:
                eqs = [c for c in pool if isinstance(c, exp.EQ) and a in aliases(c) and aliases(c) - {a} and aliases(c) - {a} <= have]
                if not eqs:
                    continue
                mine_n, other_n = 1.0, 1.0  # the distinct counts of the equality columns taken together, on each side
                for c in eqs:
                    mine, other = (c.left, c.right) if aliases(c.left) == {a} else (c.right, c.left)
                    mine_n, other_n = mine_n * distinct(mine, rows[a]), other_n * distinct(other, cur_rows)
                est = float(cur_rows) * rows[a] / max(min(mine_n, max(rows[a], 1)), min(other_n, max(cur_rows, 1)))
                if best is None or (est, order.index(a)) < best[:2]:
                    best = (est, order.index(a), a)
            nxt = best[2] if best is not None else min(rels, key=lambda a: (nbytes[a], order.index(a)))
            est_rows = best[0] if best is not None else cur_rows * rows[nxt]
            on = [c for c in pool if nxt in aliases(c) and aliases(c) <= have | {nxt}]
            pool = [c for c in pool if not any(c is o for o in on)]
            whole_table = rels.pop(nxt)
            table = self.semi_reduce(cur, nxt, whole_table, on, ndv)
            width = sum(nbytes[a] / max(rows[a], 1) for a in have)  # bytes of a joined row, estimated
            # (a source semi-reduced to a broadcast table's keys is small: broadcast, the pending joins stay pending)
            if (cur.steps and on and table is whole_table and cur_rows * self.MATERIALIZE_SHRINK <= rows[first]
                    and cur_rows * width <= nbytes[nxt] and nbytes[nxt] >= self.MATERIALIZE_MIN_RIGHT):
                # the joins pending in ``cur`` are estimated to keep few of its base's rows, fewer bytes than the
                # next source holds: run them now, so that this join is sized by those rows (its base's bytes would
                # make it broadcast the other side) and its key columns' ranges are known (their rows can be
                # routed to the other side's intervals)
                cur = Rel(self.rows_of(cur), cur.part, cur.equal)
            cur = self.join(cur, table, set(have), {nxt}, on, "inner" if on else "cross", parts[nxt])
            have.add(nxt)
            cur_rows = est_rows  # the estimate: the join itself may still be pending in ``cur``
        return cur, have, pool

    #: the joins pending over the first source run before the next join (``join_order``) when they are
    #: estimated to keep at most 1 / this of its rows that pass its filter, in fewer bytes than the next
    #: source holds, and that source holds at least ``MATERIALIZE_MIN_RIGHT`` bytes over the ranks (a
    #: smaller one is broadcast either way); more rows cost more to copy than the next join's exchange
    #: can save (TPC-H SF 1 Q5: 456,000 rows a rank, 2.5 times slower)
    MATERIALIZE_SHRINK = 8
    MATERIALIZE_MIN_RIGHT = 1 << 20

    #: ``sampled_rows`` counts a filter's rows on this many slices of this many rows (the whole table when
    #: it has no more rows than that)
    SAMPLE_SLICES = (8, 8192)

    def sampled_rows(self, table: pa.Table, where: str) -> int:
        """The rows of this rank's ``table`` that ``where`` keeps, estimated from a sample of
        ``SAMPLE_SLICES`` slices spread over it: the join order's estimate of a filtered source whose
        distinct counts are known, without scanning all of it twice (its first fragment filters it)."""
        n, (slices, step) = table.num_rows, self.SAMPLE_SLICES
        sample = table if n <= slices * step else pa.concat_tables(
            [table.slice(k * (n - step) // (slices - 1), step) for k in range(slices)])
        kept = int(self.local(f"SELECT count(*) AS n FROM t WHERE {where}", t=sample).column(0)[0].as_py() or 0)
        return kept if sample is table else round(n * kept / sample.num_rows)

    #: a source is restricted to the keys of a whole table already joined when that table has at most
    #: this fraction of the source's distinct values of the key
    SEMI_REDUCE_FRACTION = 0.5

    def semi_reduce(self, cur: Rel, alias: str, table: pa.Table, on: list[Any], ndv: dict[tuple[str, str], int]) -> pa.Table:
        """``table`` (the source ``alias``, about to be inner-joined with ``cur`` on ``on``) without the rows
        whose key cannot meet ``cur``: where an equality of ``on`` makes a column of ``alias`` equal to a
        column of ``cur`` that inner joins made equal to a column of a table every rank holds whole (a
        broadcast side, pending in ``cur``), every row the join keeps has a key among that table's values,
        so the rows of ``table`` with other keys go before the join's exchange sizes it (TPC-H Q9:
        partsupp, joined after the parts of one name, keeps the rows of those parts instead of being
        broadcast whole).  Only where that table has at most ``SEMI_REDUCE_FRACTION`` of the source's
        distinct key values (the same choice on every rank: whole tables and the allgathered counts)."""
        exp = _exp()
        if self.r.p == 1 or not cur.whole:
            return table
        for c in on:
            if not isinstance(c, exp.EQ) or not (isinstance(c.left, exp.Column) and isinstance(c.right, exp.Column)):
                continue
            mine, other = (c.left, c.right) if c.left.table == alias else (c.right, c.left)
            if mine.table != alias or other.table == alias or (alias, mine.name) not in ndv:
                continue
            col = f"{other.table}.{other.name}"
            for k in sorted(cur.equal.get(col, {col})):
                held = cur.whole.get(k)
                if held is None or cur.tables[held].num_rows > self.SEMI_REDUCE_FRACTION * ndv[(alias, mine.name)]:
                    continue
                return self.local(f"SELECT * FROM t WHERE {q(f'{alias}.{mine.name}')} IN (SELECT {q(k)} FROM k)",
                                  t=table, k=cur.tables[held])
        return table

    def _has_subquery(self, e: Any) -> bool:
        exp = _exp()
        return any(True for _ in e.find_all(exp.Subquery, exp.Exists)) or any(isinstance(x.args.get("query"), exp.Expression) for x in e.find_all(exp.In))

    # ------------------------------------------------------------------ select
    def select(self, node: Any, top: bool) -> pa.Table:
        exp = _exp()
        for bad in ("distinct_on", "qualify", "pivots", "laterals"):
            if node.args.get(bad):
                raise SQLError(f"{bad.upper()} is not supported{_where(node.args[bad], '')}")
        distinct = node.args.get("distinct")
        if distinct is not None and distinct.args.get("on"):
            raise SQLError("DISTINCT ON is not supported")
        cur, _, pending = self.joins(node)
        if pending:  # the residual WHERE: run by the next fragment
            cur.add_where(" AND ".join(f"({sql_of(phys(c))})" for c in pending))
        outputs = [(e.alias_or_name, e.this if isinstance(e, exp.Alias) else e) for e in node.expressions]
        by_alias = {name: e for name, e in outputs}
        order = []
        for o in (node.args.get("order").expressions if node.args.get("order") else []):
            e = o.this
            if isinstance(e, exp.Column) and not e.table and e.name in by_alias:
                e = by_alias[e.name]
            elif isinstance(e, exp.Literal) and not e.is_string:
                e = outputs[int(e.this) - 1][1]
            order.append((e, bool(o.args.get("desc")), bool(o.args.get("nulls_first"))))
        having = node.args.get("having")
        group = node.args.get("group")
        if _grouping_sets(group):
            raise SQLError("GROUPING SETS, CUBE and ROLLUP are not supported")
        exprs = [phys(self.materialize(e)) if self._has_subquery(e) else phys(e) for _, e in outputs]
        having_e = phys(self.materialize(having.this)) if having is not None else None
        order_e = [(phys(e), d, nf) for e, d, nf in order]
        aggs = self._aggregates(exprs + ([having_e] if having_e is not None else []) + [e for e, _, _ in order_e])
        if group is not None or aggs:
            if group is not None and group.args.get("all"):  # GROUP BY ALL: every output without an aggregate
                keys = [e for e in exprs if not self._aggregates([e]) and not any(True for _ in e.find_all(exp.Window))]
            else:
                keys = [phys(g) for g in (group.expressions if group is not None else [])]
            tables, source, mapping, part = self.aggregate(cur, keys, aggs)
            exprs = [replace_exprs(e, mapping) for e in exprs]
            having_e = replace_exprs(having_e, mapping) if having_e is not None else None
            order_e = [(replace_exprs(e, mapping), d, nf) for e, d, nf in order_e]
            filter_sql = sql_of(having_e) if having_e is not None else ""
        elif having_e is not None:
            raise SQLError("HAVING without GROUP BY or an aggregate")
        else:
            (source, tables), filter_sql, part = cur.source(), "", cur.part
        windows = [w for e in exprs for w in e.find_all(exp.Window)]
        if windows:  # the rows of each window partition on one rank: materialize, then exchange
            where = f" WHERE {filter_sql}" if filter_sql else ""  # HAVING before the windows
            rows = self.local(f"SELECT * FROM {source} AS __src{where}", **tables)
            source, tables, filter_sql = "__w", {"__w": self.window_exchange(rows, windows)}, ""
        names = [n for n, _ in outputs]
        out_sql = {sql_of(e): n for e, n in zip(exprs, names)}
        hidden, order_cols = [], []
        for i, (e, d, nf) in enumerate(order_e):
            name = out_sql.get(sql_of(e))
            if name is None:
                if distinct is not None:
                    raise SQLError("for SELECT DISTINCT, ORDER BY expressions must appear in the select list")
                name = f"__o{i}"
                hidden.append(f"{sql_of(e)} AS {q(name)}")
            order_cols.append((name, d, nf))
        if not top and not hidden and not filter_sql and distinct is None and not order_cols \
                and node.args.get("limit") is None and node.args.get("offset") is None:
            plain = self._projection(tables.get(source), exprs, names, self._output_part(part, exprs, names))
            if plain is not None:
                return plain
        proj = ", ".join([f"{sql_of(e)} AS {q(n)}" for e, n in zip(exprs, names)] + hidden)
        where = f" WHERE {filter_sql}" if filter_sql else ""
        table = self.local(f"SELECT {proj} FROM {source} AS __src{where}", **tables)
        if distinct is not None:
            table = self.distinct(table)
        limit, offset = _int(node.args.get("limit"), "LIMIT"), _int(node.args.get("offset"), "OFFSET")
        table = self.order_limit(table, order_cols, limit, offset, top)
        if hidden:
            table = table.select(table.column_names[: len(names)])
        moved = bool(windows) or distinct is not None or bool(order_cols and (limit is not None or offset or top))
        return with_part(table, None if moved else self._output_part(part, exprs, names))

    def _projection(self, base: pa.Table | None, exprs: list[Any], names: list[str], part: Part | None) -> pa.Table | None:
        """``base``'s columns as ``names``, without a copy, when every expression is one of them (a CTE
        that only renames an input's columns, as sqlglot writes for a table a query reads twice);
        ``None`` otherwise; marked as partitioned by ``part``.  The result remembers the table its columns
        are from (``source``), whose statistics then serve it."""
        exp = _exp()
        if base is None or len(set(names)) != len(names) \
                or not all(isinstance(e, exp.Column) and not e.table and e.name in base.column_names for e in exprs):
            return None
        out = with_part(base.select([e.name for e in exprs]).rename_columns(names), part)
        origin = self.origins_of(base)
        if origin is not None:
            self.r.derived[id(out)] = (out, origin[0], {n: origin[1][e.name] for e, n in zip(exprs, names) if e.name in origin[1]})
        return out

    def origins_of(self, table: pa.Table) -> tuple[pa.Table, dict[str, str]] | None:
        """The table whose columns ``table`` holds and, by column of ``table``, the name there."""
        for origin, names, read in self.origins.values():
            if read is table:
                return origin, names
        return None

    def _output_part(self, part: Part | None, exprs: list[Any], names: list[str]) -> Part | None:
        """The partitioning of a result whose outputs include the partitioning columns as they are."""
        exp = _exp()
        if part is None:
            return None
        plain = {e.name: n for e, n in zip(exprs, names) if isinstance(e, exp.Column) and not e.table}
        if not all(c in plain for c, _ in part) or len(set(names)) != len(names):
            return None
        return tuple((plain[c], t) for c, t in part)

    def _aggregates(self, exprs: Sequence[Any]) -> list[Any]:
        exp = _exp()
        seen: dict[str, Any] = {}
        for e in exprs:
            for n in e.find_all(exp.AggFunc):
                if isinstance(n.parent, exp.Window) and n.parent.this is n:
                    continue
                if isinstance(n.parent, exp.Filter):
                    n = n.parent
                if any(isinstance(a, exp.AggFunc) for a in n.iter_expressions() for a in [a, *a.find_all(exp.AggFunc)] if a is not n):
                    continue
                seen.setdefault(sql_of(n), n)
        return list(seen.values())

    def aggregate(self, cur: Rel, keys: list[Any], aggs: list[Any]) -> tuple[dict[str, pa.Table], str, dict[str, str], Part | None]:
        """Group the rows of ``cur`` by ``keys``: partial aggregates, shuffle of the partials, final
        aggregates (or the rows shuffled, for aggregates whose partials do not combine).  Returns the
        tables and the ``FROM`` text that groups them (columns ``__g<i>`` and ``__a<j>``; the caller's
        projection runs it in the same fragment), the map from expression SQL to those columns, and the
        partitioning of the grouped rows (``__g<i>`` columns)."""
        src, tabs = cur.source()
        exp = _exp()
        r = self.r
        mapping = {sql_of(k): f"__g{i}" for i, k in enumerate(keys)}
        mapping.update({sql_of(a): f"__a{j}" for j, a in enumerate(aggs)})
        gsel = [f"{sql_of(k)} AS __g{i}" for i, k in enumerate(keys)]
        gcols = [f"__g{i}" for i in range(len(keys))]
        gby = f" GROUP BY {', '.join(gcols)}" if keys else ""
        by_key = {k.name: i for i, k in enumerate(keys) if isinstance(k, exp.Column) and not k.table}
        placed = r.p > 1 and keys and cur.part is not None and all(cur.covering(c, by_key) for c, _ in cur.part)
        if r.p > 1 and keys and not placed:
            cur, placed = self.range_place(cur, [c for c in by_key if c in cur.base.column_names
                                                 and pa.types.is_integer(cur.base.schema.field(c).type)])
        if placed and cur.part is not None:
            # the rows are hash- or range-partitioned on some of the group keys: every group is on one rank already
            how = "range" if any(t.startswith("range:") for _, t in cur.part) else "hash"
            r.plan("aggregate", f"local: the rows are already {how}-partitioned on {[c for c, _ in cur.part]}, nothing moves", Cost(),
                   f"keys {[sql_of(k) for k in keys]}, {len(aggs)} aggregate(s)")
            src, tabs = cur.source()
            body = ', '.join(gsel + [f'{sql_of(a)} AS __a{j}' for j, a in enumerate(aggs)])
            part = tuple((f"__g{by_key[cur.covering(c, by_key) or c]}", t) for c, t in cur.part)
            return tabs, f"(SELECT {body} FROM {src} AS t GROUP BY {', '.join(sql_of(k) for k in keys)})", mapping, part
        decomposable = r.p > 1 and all(type(a).__name__ in ("Count", "Sum", "Min", "Max", "Avg") and not any(True for _ in a.find_all(exp.Distinct)) for a in aggs)
        if decomposable:
            partial, final = [], []
            for j, a in enumerate(aggs):
                arg = "*" if isinstance(a.this, exp.Star) or a.this is None else sql_of(a.this)
                kind = type(a).__name__
                if kind == "Count":
                    partial.append(f"count({arg}) AS __p{j}")
                    final.append(f"CAST(coalesce(sum(__p{j}), 0) AS BIGINT) AS __a{j}")
                elif kind == "Avg":
                    partial += [f"sum({arg}) AS __p{j}", f"count({arg}) AS __c{j}"]
                    final.append(f"CAST(sum(__p{j}) AS DOUBLE) / sum(__c{j}) AS __a{j}")
                else:
                    partial.append(f"{kind.lower()}({arg}) AS __p{j}")
                    final.append(f"{kind.lower()}(__p{j}) AS __a{j}")
            part = self.local(f"SELECT {', '.join(gsel + partial)} FROM {src} AS t{gby}", **tabs)
            if keys:
                r.plan_exchange("aggregate", "partial aggregate, hash shuffle of the partials on the keys, final aggregate" if r.p > 1 else "local (1 rank)",
                                "shuffle", part, detail=f"keys {[sql_of(k) for k in keys]}, {len(aggs)} aggregate(s)")
                part = r.shuffle(part, gcols)
            else:
                r.plan_exchange("aggregate", "partial aggregate, gather of the partials to rank 0, final aggregate" if r.p > 1 else "local (1 rank)",
                                "shuffle", part, detail=f"{len(aggs)} aggregate(s)")
                part = r.gather(part)
            return _final_aggregate(part, gcols + final, gby, keys, gcols, r.rank, mapping)
        if r.p == 1:  # one rank: the aggregate in one fragment
            r.plan("aggregate", "local (1 rank)", Cost(), f"keys {[sql_of(k) for k in keys]}, {len(aggs)} aggregate(s)")
            body = ', '.join(gsel + [f'{sql_of(a)} AS __a{j}' for j, a in enumerate(aggs)])
            return tabs, f"(SELECT {body} FROM {src} AS t" + (f" GROUP BY {', '.join(sql_of(k) for k in keys)})" if keys else ")"), mapping, None
        pre = self.local(f"SELECT {', '.join(['*'] + gsel)} FROM {src} AS t", **tabs) if keys else self.rows_of(cur)
        r.plan_exchange("aggregate", ("hash shuffle of the rows on the keys, aggregate" if keys else "gather of the rows to rank 0, aggregate") if r.p > 1 else "local (1 rank)",
                        "shuffle", pre, detail=f"aggregates whose partials do not combine: {[sql_of(a)[:40] for a in aggs]}")
        pre = r.shuffle(pre, gcols) if keys else r.gather(pre)
        return _final_aggregate(pre, gcols + [f'{sql_of(a)} AS __a{j}' for j, a in enumerate(aggs)], gby, keys, gcols,
                                r.rank, mapping)

    #: fewest distinct values a rank's key interval spans for a group-by to be placed by key ranges
    #: (fewer: the partial aggregates are small, and a boundary value may hold many rows)
    RANGE_MIN_SPAN = 1024

    def range_place(self, cur: Rel, columns: list[str]) -> tuple[Rel, bool]:
        """``cur`` with every value of one of the integer base ``columns`` on one rank, when the ranks'
        intervals of it are disjoint in rank order, or touch (the rows of the boundary values move,
        ``_Run.route``) and span at least ``RANGE_MIN_SPAN`` values each: ``(rel, True)``; else
        ``(cur, False)``.  Collective (one allgather) when there are ``columns``."""
        r = self.r
        if not columns:
            return cur, False
        stats = r.comm.allgather([(key_range(cur.base, c), key_nulls(cur.base, c)) for c in columns])
        for i, c in enumerate(columns):
            ranges = [x[i][0] for x in stats]
            if sum(1 for x in stats if x[i][1]) > 1:  # NULL keys (one group) on several ranks
                continue
            if any(isinstance(x, tuple) and x[1] - x[0] + 1 < self.RANGE_MIN_SPAN for x in ranges):
                continue
            bounds = range_bounds(ranges, touching=True)
            if bounds is None:
                continue
            if range_bounds(ranges) is None:  # touching: the boundary values' rows move
                cur = self.route_rel(cur, c, bounds, None)
            cur.part = range_part(c, bounds)
            return cur, True
        return cur, False

    def window_exchange(self, cur: pa.Table, windows: list[Any]) -> pa.Table:
        """Bring each window partition onto one rank: hash shuffle on the common ``PARTITION BY``, else gather."""
        r = self.r
        parts = {tuple(sql_of(p) for p in (w.args.get("partition_by") or [])) for w in windows}
        if r.p == 1:
            r.plan("window", "local (1 rank)", Cost(), f"{len(windows)} window function(s)")
            return cur
        if len(parts) == 1 and next(iter(parts)):
            keys = next(iter(parts))
            r.plan_exchange("window", f"hash shuffle on PARTITION BY {list(keys)}", "shuffle", cur, detail=f"{len(windows)} window function(s)")
            wk = r.local("SELECT " + ", ".join(f"{k} AS __w{i}" for i, k in enumerate(keys)) + " FROM t", t=cur)
            return r.shuffle_by(cur, wk)
        r.plan_exchange("window", "gather to rank 0 (no common PARTITION BY)", "shuffle", cur, detail=f"{len(windows)} window function(s)")
        return r.gather(cur)

    def distinct(self, table: pa.Table) -> pa.Table:
        r = self.r
        if r.p > 1:
            r.plan_exchange("distinct", "hash shuffle on all columns", "shuffle", table)
            table = r.shuffle_all(table)
        return r.local("SELECT DISTINCT * FROM t", t=table)

    def order_limit(self, table: pa.Table, order: list[tuple[str, bool, bool]], limit: int | None, offset: int | None, top: bool) -> pa.Table:
        r = self.r
        off = offset or 0
        keys = ", ".join(f"{q(n)} {'DESC' if d else 'ASC'} NULLS {'FIRST' if nf else 'LAST'}" for n, d, nf in order)
        if order and (limit is not None or top or off):
            tail = (f" LIMIT {limit}" if limit is not None else "") + (f" OFFSET {off}" if off else "")
            if r.p > 1:
                r.plan_exchange("order_by", ("local top-k, " if limit is not None else "") + "gather to rank 0, sort", "shuffle", table,
                                detail=f"ORDER BY {keys}{tail}")
                if limit is not None:
                    table = r.local(f"SELECT * FROM t ORDER BY {keys} LIMIT {limit + off}", t=table)
                table = r.gather(table)
            else:
                r.plan("order_by", "local sort (1 rank)", Cost(), f"ORDER BY {keys}{tail}")
            if r.rank == 0 or r.p == 1:
                table = r.local(f"SELECT * FROM t ORDER BY {keys}{tail}", t=table)
            return table
        if limit is not None or off:
            counts = r.comm.allgather(table.num_rows) if r.p > 1 else [table.num_rows]
            before = sum(counts[: r.rank])
            end = before + table.num_rows
            lo, hi = off, off + limit if limit is not None else float("inf")
            start, stop = max(before, lo), min(end, hi)
            table = table.slice(start - before, max(0, int(stop - start)) if stop > start else 0)
        return table

    # ------------------------------------------------------------------ set operations
    def set_operation(self, node: Any, top: bool) -> pa.Table:
        exp = _exp()
        r = self.r
        a = Executor(self.r, self.env).run(node.left)
        b = Executor(self.r, self.env).run(node.right)
        if a.num_columns != b.num_columns:
            raise SQLError(f"{node.key.upper()}: the two sides have {a.num_columns} and {b.num_columns} columns")
        b = b.rename_columns(a.column_names)
        schema = r.local("SELECT * FROM a UNION ALL SELECT * FROM b LIMIT 0", a=a.slice(0, 0), b=b.slice(0, 0)).schema
        a, b = a.cast(schema), b.cast(schema)
        distinct = node.args.get("distinct", True) is not False
        op = {"union": "UNION", "intersect": "INTERSECT", "except": "EXCEPT"}[node.key]
        if op == "UNION" and not distinct:
            out = pa.concat_tables([a, b])
            r.plan("union", "local concat (UNION ALL)")
        else:
            if r.p > 1:
                r.plan_exchange(op.lower(), "hash shuffle both sides on all columns", "shuffle", a, b)
                a, b = r.shuffle_all(a), r.shuffle_all(b)
            out = r.local(f"SELECT * FROM a {op}{'' if distinct else ' ALL'} SELECT * FROM b", a=a, b=b)
        order = []
        for o in (node.args.get("order").expressions if node.args.get("order") else []):
            e = o.this
            if isinstance(e, exp.Literal) and not e.is_string:
                name = out.column_names[int(e.this) - 1]
            elif isinstance(e, exp.Column) and e.name in out.column_names:
                name = e.name
            else:
                raise SQLError(f"ORDER BY of a set operation must name an output column, got {sql_of(e)}")
            order.append((name, bool(o.args.get("desc")), bool(o.args.get("nulls_first"))))
        return self.order_limit(out, order, _int(node.args.get("limit"), "LIMIT"), _int(node.args.get("offset"), "OFFSET"), top)


def _final_aggregate(part: pa.Table, columns: list[str], gby: str, keys: Sequence[Any], gcols: list[str], rank: int,
                     mapping: Any) -> tuple[dict[str, pa.Table], str, Any, tuple[tuple[str, str], ...] | None]:
    """The aggregate's last fragment over the exchanged rows ``part`` (``__p``): by the keys, or, without
    keys, on rank 0 only (the others return no row); with the key columns' types when grouped."""
    sql = f"SELECT {', '.join(columns)} FROM __p{gby}"
    if not keys and rank != 0:
        sql = f"SELECT * FROM ({sql}) LIMIT 0"
    grouped = tuple((g, str(part.schema.field(g).type)) for g in gcols) if keys else None
    return {"__p": part}, f"({sql})", mapping, grouped
