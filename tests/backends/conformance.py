"""The conformance pipeline and how its results are compared, shared by every backend's suite.

tests/backends/test_conformance.py runs it on this machine with each engine;
tests/slurm/test_engines_on_slurm.py runs it with the engines on the Slurm lab
cluster.  Content hashes leave out only the wall-clock columns a training stage
records.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import psutil
import pyarrow as pa

import conformance_stages as S
import hetflow as hf
from hetflow.status import RunStatus

DATASETS = ["rows", "sorted", "model", "metrics"]
TIMING_COLUMNS = ("seconds", "samples_per_s")
"""Wall-clock measurements a training stage records along with its results: they differ between any two
runs, so content hashes leave them out (and nothing else)."""


def pipeline(workdir: Path) -> hf.Pipeline:
    """An operator stage (sample sort), an ML stage (data-parallel training), a stage that fails on
    one rank and a stage that depends on the failure; every stage but the last has two ranks."""
    pipe = hf.Pipeline("conformance", workdir=workdir)
    pipe.stage(ranks=2, outputs=["rows"], params={"rows_per_rank": 300})(S.generate)
    pipe.stage(ranks=2, inputs=["rows"], outputs=["sorted"])(S.sort_rows)
    pipe.stage(ranks=2, inputs=["rows"], outputs=["model", "metrics"])(S.train)
    pipe.stage(ranks=2, inputs=["rows"], outputs=["never"])(S.fail_on_rank_one)
    pipe.stage(name="after_failure", ranks=1, inputs=["never"], outputs=["after"])(S.sort_rows)
    return pipe


def table_hash(table: pa.Table) -> str:
    """SHA-256 of the table as one Arrow IPC stream, without the timing columns and metadata."""
    table = table.drop_columns([c for c in TIMING_COLUMNS if c in table.column_names])
    metadata = dict(table.schema.metadata or {})
    if b"hetflow.model" in metadata:  # the model manifest repeats the timings of the last epoch
        manifest = json.loads(metadata[b"hetflow.model"])
        for column in TIMING_COLUMNS:
            manifest.get("metrics", {}).pop(column, None)
        metadata[b"hetflow.model"] = json.dumps(manifest, sort_keys=True).encode()
    table = table.replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def leftovers(marker: str) -> list[str]:
    """Live processes whose command line names ``marker`` (a run's work directory)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'])[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def transitions(workdir: Path, run: RunStatus) -> dict[str, list[str]]:
    """Each stage's states in the order the store recorded them."""
    db = sqlite3.connect(workdir / "hetflow.db")
    try:
        return {stage.name: [r[0] for r in db.execute(
            "SELECT state FROM events WHERE run_id=? AND kind='stage' AND name=? ORDER BY id", (run.id, stage.name))]
            for stage in run.stages}
    finally:
        db.close()


def dataset_hashes(run: RunStatus) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The content hash of each committed dataset of :data:`DATASETS`, and of each of its partitions."""
    hashes, partitions = {}, {}
    for name in DATASETS:
        if name in run.datasets:
            dataset = run.dataset(name)
            hashes[name] = table_hash(dataset.to_table())
            partitions[name] = [table_hash(part) for part in dataset.partitions()]
    return hashes, partitions
