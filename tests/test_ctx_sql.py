"""``ctx.sql`` in a real pipeline (``python script.py`` runs it on the local pilot, 2-rank stages):
the stage's inputs are tables by their declared names, extra tables join them, and the committed
output equals DuckDB's answer over the same rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SCRIPT = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("ctx-sql", pilot="local")


@pipe.stage(ranks=2, outputs=["cells", "species"])
def make(ctx):
    mine = list(range(ctx.rank, 200, ctx.size))
    cells = pa.table({"cell": mine, "species": [i % 7 for i in mine],
                      "volume": [None if i % 13 == 0 else float(i) / 3 for i in mine]})
    species = pa.table({"species": [s for s in range(7) if s % ctx.size == ctx.rank],
                        "name": [f"s{s}" for s in range(7) if s % ctx.size == ctx.rank]})
    return {"cells": cells, "species": species}


@pipe.stage(ranks=2, inputs=["cells", "species"], outputs=["summary"])
def summarize(ctx, cells, species):
    weights = pa.table({"species": [s for s in range(7) if s % ctx.size == ctx.rank],
                        "weight": [float(s + 1) for s in range(7) if s % ctx.size == ctx.rank]})
    out = ctx.sql("""
        select s.name, count(*) as n, sum(c.volume * w.weight) as weighted,
               row_number() over (order by count(*) desc, s.name) as place
        from cells c join species s on c.species = s.species join weights w on w.species = s.species
        group by s.name""", weights=weights)
    return {"summary": out.to_arrow()}


if __name__ == "__main__":
    run = pipe.run()
    assert run.ok, run.state
    import pyarrow.parquet as pq
    pq.write_table(run.dataset("summary").to_table(), "summary.parquet")
'''


def test_ctx_sql_reads_the_stage_inputs_by_name(tmp_path: Path) -> None:
    (tmp_path / "ctx_sql.py").write_text(SCRIPT, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETFLOW_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run([sys.executable, "ctx_sql.py"], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = pq.read_table(tmp_path / "summary.parquet")

    import duckdb

    cells = pa.table({"cell": list(range(200)), "species": [i % 7 for i in range(200)],
                      "volume": [None if i % 13 == 0 else float(i) / 3 for i in range(200)]})
    species = pa.table({"species": list(range(7)), "name": [f"s{s}" for s in range(7)]})
    weights = pa.table({"species": list(range(7)), "weight": [float(s + 1) for s in range(7)]})
    con = duckdb.connect()
    for name, t in {"cells": cells, "species": species, "weights": weights}.items():
        con.register(name, t)
    want = con.sql("""
        select s.name, count(*) as n, sum(c.volume * w.weight) as weighted,
               row_number() over (order by count(*) desc, s.name) as place
        from cells c join species s on c.species = s.species join weights w on w.species = s.species
        group by s.name order by place""").to_arrow_table()
    rows = sorted(got.to_pylist(), key=lambda r: r["place"])
    assert got.column_names == ["name", "n", "weighted", "place"]
    assert [(r["name"], r["n"], r["place"]) for r in rows] == [(r["name"], r["n"], r["place"]) for r in want.to_pylist()]
    for a, b in zip(rows, want.to_pylist()):
        assert abs(a["weighted"] - b["weighted"]) <= 1e-9 * abs(b["weighted"]), (a, b)
