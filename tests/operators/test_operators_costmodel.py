"""The cost model's estimates against what they model (mpiexec -n 1/2/3/5, and serially).

Under MPI: each operator runs on a ``MeteredComm``, which counts the bytes every
exchange actually sends; the estimate in the operator's plan (``DTable.plans``)
must match that count, summed over the ranks, at every rank count, and follow
it when the rows double.  Balanced seeded data: a hash or range shuffle keeps
about ``1/p`` of a rank's rows home, off by a few tenths of a percent at these
sizes, so ``TOLERANCE`` covers that and the uncounted metadata (counts, schemas).
Serially: the pure cost functions (``costmodel``).  No timings are asserted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

ROWS = 20_000  # per rank: small enough to be cheap, large enough that metadata is <1% of the bytes
TOLERANCE = 0.03


def _table(rank: int, size: int, rows: int, domain: int) -> pa.Table:
    rng = np.random.default_rng([rank, size, rows, domain])
    k = rng.integers(0, domain, rows)
    return pa.table({"k": k, "v": rng.integers(0, 1 << 40, rows), "w": rng.random(rows),
                     "s": pa.array([f"s{x:07d}" for x in k % 100_003])})


def _ops(rows: int, size: int) -> dict[str, Callable[[Any, Any], Any]]:
    """Operator runs by name: ``fn(left, small)`` on DTables of ``rows`` rows per rank."""
    return {
        "join hash": lambda t, s: t.join(t.select(["k", "w"]), "k", algorithm="hash"),
        "join broadcast": lambda t, s: t.join(s, "k", algorithm="broadcast"),
        "sort integer key": lambda t, s: t.sort_by("k"),
        "sort string key": lambda t, s: t.sort_by([("s", "descending")]),
        "group-by range": lambda t, s: t.group_by("k").aggregate([("v", "sum")], algorithm="range"),
        "group-by shuffle": lambda t, s: t.group_by("k").aggregate([("w", "mean")], algorithm="shuffle"),
        "group-by combine": lambda t, s: t.group_by("g").aggregate([("v", "sum"), ("w", "variance")], algorithm="combine"),
        "unique": lambda t, s: t.unique(["k"]),
    }


def _measure(comm: Any, rows: int, name: str) -> tuple[Any, int]:
    """(the plan of operator ``name``, bytes its exchanges sent, all ranks together)."""
    from hetflow.operators import DTable
    from hetflow.operators.costmodel import hockney
    from hetflow.operators.metered import MeteredComm

    rank, size = comm.Get_rank(), comm.Get_size()
    metered = MeteredComm(comm)
    hockney(metered)  # measured or read from the cache before the window
    base = _table(rank, size, rows, int(4.5 * rows * size))
    groups = pa.array(base.column("k").to_numpy() % (rows // 10))  # rows/10 groups on every rank: combine pays
    left = DTable(metered, base.append_column("g", groups))
    small = DTable(metered, base.select(["k", "w"]).slice(0, rows // 5))
    metered.meter.reset()
    out = _ops(rows, size)[name](left, small)
    sent = int(comm.allreduce(metered.meter.total_sent))
    return out.plans[-1], sent


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(_ops(0, 1)))
def test_estimated_exchange_bytes_equal_the_bytes_sent(comm: Any, name: str) -> None:
    size = comm.Get_size()
    seen = []
    for rows in (ROWS, 2 * ROWS):
        plan, sent = _measure(comm, rows, name)
        est = plan.cost.exchange_bytes
        ctx = f"{name}, {size} rank(s), {rows} rows per rank: estimated {est:.0f} B, sent {sent} B; {plan}"
        if size == 1:
            assert est == 0 and sent == 0, ctx
        else:
            assert sent > 0 and abs(est - sent) <= TOLERANCE * sent, ctx
        assert plan.cost.compute_s > 0 or name == "unique", ctx
        seen.append((est, sent, plan.cost.compute_s))
    (e1, s1, c1), (e2, s2, c2) = seen
    if size > 1:  # twice the rows: the estimate grows as the bytes sent do (the splitter samples do not double)
        assert s2 > s1 and abs(e2 / e1 - s2 / s1) <= 2 * TOLERANCE * s2 / s1, (name, seen)
    if name != "unique":
        assert c2 / c1 == pytest.approx(2, rel=0.05), (name, seen)


# ---------------------------------------------------------------- serial: the pure cost functions


def test_shuffle_and_allgather_volumes() -> None:
    from hetflow.operators.costmodel import Hockney, allgather_cost, shuffle_cost

    model = Hockney(alpha=1e-5, beta=1e-9)
    c = shuffle_cost(model, [300.0, 600.0, 900.0])
    assert c.exchange_bytes == pytest.approx(1800 * 2 / 3)
    assert c.exchange_s == pytest.approx(model.shuffle(3, 900.0)) and c.compute_s == 0
    g = allgather_cost(model, [100.0, 100.0, 100.0, 100.0])
    assert g.exchange_bytes == pytest.approx(400 * 3)
    assert shuffle_cost(model, [1e9]).seconds == 0 and allgather_cost(model, [1e9]).exchange_bytes == 0


def test_sort_and_group_by_have_compute_terms_that_scale_with_bytes() -> None:
    from hetflow.operators import costmodel as cm

    model = cm.Hockney(alpha=1e-5, beta=1e-9)
    one = cm.sort_cost(model, [1e8], [0.0])
    assert one.exchange_bytes == 0 and one.compute_s == pytest.approx(cm.SORT_SECONDS_PER_BYTE * 1e8)
    small, large = cm.sort_cost(model, [1e8, 1e8], [1e4, 1e4]), cm.sort_cost(model, [2e8, 2e8], [1e4, 1e4])
    assert large.compute_s == pytest.approx(2 * small.compute_s)
    assert small.exchange_bytes == pytest.approx(1e8 + 2e4)  # half of each rank's rows, and each sample to the other
    assert large.exchange_bytes == pytest.approx(2e8 + 2e4)
    g = cm.group_by_costs(model, [1e8, 1e8], [1e6, 1e6], [1e4, 1e4])
    assert set(g) == {"shuffle", "range", "combine"}
    assert g["shuffle"].compute_s == pytest.approx(cm.GROUPBY_SECONDS_PER_BYTE * 1e8)
    assert g["combine"].exchange_bytes == pytest.approx(1e6) and g["shuffle"].exchange_bytes == pytest.approx(1e8)
    assert g["range"].exchange_bytes == pytest.approx(1e8 + 2e4)
    assert set(cm.group_by_costs(model, [1e8, 1e8], None, None)) == {"shuffle"}


def test_join_costs_prefer_broadcasting_a_small_side() -> None:
    from hetflow.operators import costmodel as cm

    model = cm.Hockney(alpha=1e-5, beta=1e-9)
    even = cm.join_costs(model, [1e8, 1e8], [1e8, 1e8], "inner")
    small = cm.join_costs(model, [1e8, 1e8], [1e5, 1e5], "inner")
    assert min(even, key=lambda a: even[a].seconds) == "hash"
    assert min(small, key=lambda a: small[a].seconds) == "broadcast"
    assert even["hash"].compute_s == pytest.approx(cm.JOIN_SECONDS_PER_BYTE * 2e8)
    assert "broadcast" not in cm.join_costs(model, [1.0, 1.0], [1.0, 1.0], "full")
    assert set(cm.join_costs(model, [1e8], [1e8], "inner")) == {"hash"}


def test_plan_text_shows_bytes_and_the_split() -> None:
    from hetflow.operators.costmodel import Cost, Plan

    text = str(Plan("sort_by", "sample sort", Cost(2.5e6, 0.004, 0.006), {"x": 0.01}))
    assert "estimated 10.00 ms" in text and "exchange 2.50 MB in 4.00 ms" in text and "local 6.00 ms" in text


@pytest.mark.mpi
def test_an_mpi_communicator_keeps_its_host_names(comm: Any) -> None:
    """The host names that key the Hockney parameters are gathered once per MPI communicator and kept as
    its attribute (every rank sets it in the same collective call, so no rank skips an allgather the
    others make); a duplicate of the communicator gathers its own."""
    import socket

    from hetflow.operators import costmodel

    hosts = costmodel._hosts(comm)
    assert hosts == sorted(set(comm.allgather(socket.gethostname())))
    assert comm.Get_attr(costmodel._hosts_keyval) == tuple(hosts)
    assert costmodel._hosts(comm) == hosts
    dup = comm.Dup()
    try:
        assert dup.Get_attr(costmodel._hosts_keyval) is None
    finally:
        dup.Free()
