"""Photometric redshifts for a galaxy survey: MPI preprocessing, then data-parallel training.

    generate ──► prepare ──► train ──► predict ──► evaluate
                   │           (2 ranks, 1 GPU each)
                   └──────► qa        (2 ranks, at the same time as train)

* ``generate`` writes the synthetic survey as many Parquet files (see generate.py).
* ``prepare`` (MPI, hetflow.operators DTable) reads them partitioned, pivots the
  long-format photometry to one row per object (a distributed group-by), joins
  the objects (shuffle-hash join), broadcast-joins the small fields table,
  drops bad photometry, corrects for extinction, computes colours and their
  global normalisation (allreduce), and splits train/validation/test by a hash
  of the object id.
* ``train`` fits an MLP regressor data-parallel on 2 ranks (GPU ranks when the
  machine has GPUs; CPU/Gloo here); ``qa`` computes catalogue statistics per
  field and band on the remaining cores meanwhile.
* ``predict`` runs batched inference on the test split; ``evaluate`` (MPI)
  computes bias, σ_NMAD and outlier fraction per redshift bin, compares with the
  trivial predictor (the training mean), and draws predicted vs true redshift.

    hetflow run examples/photoz/pipeline.py --param rows=200000
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import hetflow as hf

HERE = Path(__file__).resolve().parent
# Inputs are listed in alphabetical order: until the worker keeps the declared order
# (its spec.json is written with sorted keys), that is the order the arguments arrive in.
BANDS = ("u", "g", "r", "i", "z")
COLOURS = ("u_g", "g_r", "r_i", "i_z")
FEATURES = [*COLOURS, "r"]
BAD_FLAGS = 1 | 4  # saturated, bad pixel (blended is kept: it only inflates the error a little)
Z_EDGES = (0.0, 0.3, 0.6, 0.9, 1.2, 1.6, 2.0, 3.0)
OUTLIER = 0.15
_WORKDIR = Path(os.environ.get("HETFLOW_WORKDIR", ".hetflow")).resolve()

pipe = hf.Pipeline("photoz", pilot=str(HERE / "pilot.yaml"))


# ------------------------------------------------------------------------------------ helpers
def _whole(ctx: Any, table: pa.Table | None) -> pa.Table:
    """A small dataset in full on every rank (its rows are split over the consumer's ranks)."""
    parts = [t for t in ctx.comm.allgather(table) if t is not None and t.num_rows]
    if not parts:
        raise ValueError(f"stage {ctx.stage!r}: a small input dataset is empty on every rank")
    return pa.concat_tables(parts)


def _stats(ctx: Any, table: pa.Table | None) -> dict[str, tuple[float, float]]:
    t = _whole(ctx, table)
    return {n: (m, s) for n, m, s in zip(t["name"].to_pylist(), t["mean"].to_pylist(), t["std"].to_pylist())}


def _generator() -> Any:
    """examples/photoz/generate.py as a module, wherever this script is run from."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("photoz_generate", HERE / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sigma_nmad(dz: np.ndarray) -> float:
    return float(1.4826 * np.median(np.abs(dz - np.median(dz)))) if dz.size else float("nan")


# ------------------------------------------------------------------------------------ stages
@pipe.stage(ranks=2, outputs=["survey"],
            params={"rows": 60_000, "seed": 42, "data_dir": str(_WORKDIR / "photoz-data")})
def generate(ctx):
    """Write the synthetic survey's Parquet files (each rank its share) and list them."""
    gen = _generator()
    rows, seed = int(ctx.params["rows"]), int(ctx.params["seed"])
    out = Path(ctx.params["data_dir"]) / f"rows-{rows}-seed-{seed}"
    if not gen.survey_complete(out, rows, seed):
        gen.write_survey(out, rows, seed=seed, rank=ctx.rank, size=ctx.size)
        ctx.comm.Barrier()
        if ctx.rank == 0:
            gen.mark_complete(out, rows, seed)
    ctx.comm.Barrier()
    files = sorted(p for kind in ("objects", "photometry", "fields") for p in (out / kind).glob("*.parquet"))
    mine = files[ctx.rank::ctx.size]
    return {"survey": pa.table({"kind": [p.parent.name for p in mine], "path": [str(p) for p in mine],
                                "rows": [pq.ParquetFile(p).metadata.num_rows for p in mine]})}


def _files(ctx: Any, survey: pa.Table | None, kind: str) -> list[str]:
    listing = _whole(ctx, survey)
    return sorted(p for k, p in zip(listing["kind"].to_pylist(), listing["path"].to_pylist()) if k == kind)


def _bad(table: pa.Table) -> pa.ChunkedArray:
    return pc.not_equal(pc.bit_wise_and(table["flags"], pa.scalar(BAD_FLAGS, pa.int16())), 0)


@pipe.stage(ranks=2, inputs=["survey"], outputs=["train_set", "valid_set", "test_set", "feature_stats"])
def prepare(ctx, survey):
    """Partitioned read, pivot, joins, cleaning, extinction, colours, normalisation, split."""
    from hetflow.operators import read_parquet
    from hetflow.operators.partition import hash_keys

    objects = read_parquet(ctx.comm, _files(ctx, survey, "objects"))
    phot = read_parquet(ctx.comm, _files(ctx, survey, "photometry"))
    fields = read_parquet(ctx.comm, _files(ctx, survey, "fields"))
    dropped = phot.filter(_bad).num_rows
    phot = phot.filter(lambda t: pc.invert(_bad(t)))
    # pivot long -> wide as one distributed group-by: a (mag, err) column per band, null where
    # the band was not measured, then the max per object (its only non-null value)
    per_band = {}
    for b in BANDS:
        per_band[f"mag_{b}"] = lambda t, b=b: pc.if_else(pc.equal(t["band"].cast(pa.string()), b), t["mag"],
                                                          pa.scalar(None, pa.float32()))
    phot = phot.with_columns(**per_band)
    wide = phot.group_by("id").aggregate([(f"mag_{b}", "max") for b in BANDS])
    # join the objects (shuffle-hash join on id) and the small fields table (broadcast join)
    wide = wide.join(objects, "id").join(fields, "field", algorithm="broadcast")

    def features(t: pa.Table) -> dict[str, Any]:
        mags = {b: pc.subtract(t[f"mag_{b}_max"].cast(pa.float64()), t[f"ext_{b}"]) for b in BANDS}  # extinction
        n_bands = np.sum([pc.is_valid(mags[b]).to_numpy(zero_copy_only=False) for b in BANDS], axis=0, dtype=np.int32)
        return {**{c: pc.subtract(mags[c[0]], mags[c[2]]) for c in COLOURS}, "r": mags["r"],
                "n_bands": pa.array(n_bands, pa.int32())}

    def catalog_of(t: pa.Table) -> pa.Table:
        f = features(t)
        bucket = hash_keys(t, ["id"]) % np.uint64(100)  # train/valid/test from the id alone
        split = np.where(bucket < 70, 0, np.where(bucket < 85, 1, 2)).astype(np.int8)
        return pa.table({"id": t["id"], "field": t["field"], "z_true": t["z_true"], **f,
                         "seeing": t["seeing"], "split": split})

    catalog = wide.map_batches(catalog_of).filter(pc.field("r").is_valid() & (pc.field("n_bands") >= 3))
    sets = [catalog.filter(pc.field("split") == i).sort_by("id") for i in range(3)]
    # global normalisation statistics of the features, from the training split only
    stats = sets[0].aggregate([(c, agg) for c in [*FEATURES, "z_true"] for agg in ("mean", "stddev", "count")])
    counts = [t.num_rows for t in (catalog, *sets)]
    if ctx.rank == 0:
        ctx.log.info("catalogue: %d usable objects (train %d, valid %d, test %d); %d bad measurements dropped",
                     *counts, dropped)
    table = pa.table({"name": [*FEATURES, "z_true"],
                      "mean": [float(stats[f"{c}_mean"]) for c in [*FEATURES, "z_true"]],
                      "std": [float(stats[f"{c}_stddev"]) for c in [*FEATURES, "z_true"]],
                      "count": [int(stats[f"{c}_count"]) for c in [*FEATURES, "z_true"]]})
    return {"train_set": sets[0].to_arrow().drop_columns(["split"]),
            "valid_set": sets[1].to_arrow().drop_columns(["split"]),
            "test_set": sets[2].to_arrow().drop_columns(["split"]),
            "feature_stats": table if ctx.rank == 0 else None}


@pipe.stage(ranks=2, inputs=["survey", "test_set", "train_set", "valid_set"], outputs=["qa_fields"])
def qa(ctx, survey, test_set, train_set, valid_set):
    """Quality assurance of the catalogue per field and band (runs while `train` does)."""
    from hetflow.operators import DTable, read_parquet

    phot = read_parquet(ctx.comm, _files(ctx, survey, "photometry"))
    objects = DTable(ctx.comm, pa.concat_tables([t.select(["id", "field"]) for t in (train_set, valid_set, test_set)]))
    phot = phot.join(objects, "id").with_columns(
        band=lambda t: t["band"].cast(pa.string()),
        bad=lambda t: pc.cast(_bad(t), pa.int32()),
        snr5=lambda t: pc.cast(pc.less_equal(t["mag_err"], 0.2171), pa.int32()))
    merged = phot.group_by(["field", "band"]).aggregate(
        [("mag", "count"), ("mag", "mean"), ("mag_err", "mean"), ("bad", "mean"), ("snr5", "mean"), ("mag", "max")])
    out = merged.sort_by([("field", "ascending"), ("band", "ascending")]).to_arrow().rename_columns(
        ["field", "band", "detections", "mean_mag", "mean_err", "bad_fraction", "snr5_fraction", "faintest"])
    fields = merged.select(["field"]).unique().num_rows
    if ctx.rank == 0:
        ctx.log.info("QA: %d fields x %d bands summarised", fields, len(BANDS))
    return {"qa_fields": out}


@pipe.stage(ranks=2, gpus_per_rank=1, inputs=["feature_stats", "train_set", "valid_set"],
            outputs=["model", "metrics"],
            params={"epochs": 15, "batch_size": 512, "lr": 4e-3, "seed": 0, "crash_after_epoch": -1}, retries=1)
def train(ctx, feature_stats, train_set, valid_set):
    """An MLP regressor, data-parallel over the stage's ranks (NCCL on GPUs, Gloo on CPUs)."""
    import torch

    import hetflow.ml as ml

    stats = _stats(ctx, feature_stats)
    norm = {f: stats[f] for f in FEATURES}
    p = ctx.params
    torch.manual_seed(int(p["seed"]))
    epochs = int(p["epochs"])
    crash_after = int(p["crash_after_epoch"])

    def on_epoch_end(record: dict[str, float]) -> None:
        # fault injection for the demo: the first attempt dies after that epoch's checkpoint,
        # the retry resumes from it (the marker lives beside the checkpoints, across attempts)
        marker = Path(ctx.checkpoint_dir) / "crash-injected"
        if ctx.rank == 0 and int(record["epoch"]) == crash_after and not marker.exists():
            marker.touch()
            ctx.log.warning("injected crash after epoch %d", crash_after)
            os._exit(3)

    result = ml.fit(
        ctx, train_set, model=ml.MLP(len(FEATURES), hidden=[64, 64, 32]), features=FEATURES, label="z_true",
        loss=torch.nn.functional.smooth_l1_loss,
        optimizer=lambda params: torch.optim.Adam(params, lr=float(p["lr"])),
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs),
        metrics={"abs_dz": lambda pred, z: ((pred - z).abs() / (1 + z)).mean()},
        validation=valid_set, epochs=epochs, batch_size=int(p["batch_size"]), seed=int(p["seed"]),
        normalize=norm, fill={f: m for f, (m, _) in norm.items()}, on_epoch_end=on_epoch_end)
    if ctx.rank == 0:
        last = result.history[-1]
        ctx.log.info("trained on %s: val loss %.5f, mean |dz|/(1+z) %.4f, %.0f samples/s (resumed at epoch %d)",
                     ctx.device, last["val_loss"], last["val_abs_dz"], last["samples_per_s"], result.start_epoch)
    return {"model": result.model_table, "metrics": result.metrics}


@pipe.stage(ranks=2, inputs=["feature_stats", "model", "test_set"], outputs=["predictions"])
def predict(ctx, feature_stats, model, test_set):
    """Batched inference on the test split, keyed by object id."""
    import hetflow.ml as ml

    stats = _stats(ctx, feature_stats)
    out = ml.predict(ctx, test_set, model, key="id", output="z_phot", batch_size=4096,
                     fill={f: stats[f][0] for f in FEATURES})
    return {"predictions": out}


@pipe.stage(ranks=2, inputs=["feature_stats", "predictions", "test_set"], outputs=["photoz_metrics"],
            params={"report_dir": str(_WORKDIR / "photoz-report")})
def evaluate(ctx, feature_stats, predictions, test_set):
    """Bias, σ_NMAD and outlier fraction per redshift bin, against the trivial predictor."""
    from hetflow.operators import DTable

    z_mean = _stats(ctx, feature_stats)["z_true"][0]
    joined = DTable(ctx.comm, predictions).join(DTable(ctx.comm, test_set.select(["id", "z_true"])), "id").to_arrow()
    z = joined["z_true"].to_numpy()
    zp = joined["z_phot"].to_numpy().astype(np.float64)
    zbin = np.clip(np.searchsorted(Z_EDGES, z, side="right") - 1, 0, len(Z_EDGES) - 2)
    # one group per bin plus "all" (bin -1), each collected whole on one rank: exact medians
    rows = DTable(ctx.comm, pa.table({"bin": np.concatenate([zbin, np.full(z.size, -1)]).astype(np.int32),
                                      "dz": np.concatenate([(zp - z) / (1 + z)] * 2),
                                      "dz0": np.concatenate([(z_mean - z) / (1 + z)] * 2)}))
    groups = rows.group_by("bin").aggregate([("dz", "list"), ("dz0", "list")], algorithm="shuffle").to_arrow()
    records = []
    for b, dz_list, dz0_list in zip(groups["bin"].to_pylist(), groups["dz_list"], groups["dz0_list"]):
        dz, dz0 = np.asarray(dz_list.values), np.asarray(dz0_list.values)
        lo, hi = (Z_EDGES[0], Z_EDGES[-1]) if b < 0 else (Z_EDGES[b], Z_EDGES[b + 1])
        records.append({"bin": b, "z_lo": lo, "z_hi": hi, "n": int(dz.size), "bias": float(np.median(dz)),
                        "sigma_nmad": _sigma_nmad(dz), "outlier_fraction": float(np.mean(np.abs(dz) > OUTLIER)),
                        "sigma_nmad_trivial": _sigma_nmad(dz0),
                        "outlier_fraction_trivial": float(np.mean(np.abs(dz0) > OUTLIER))})
    gathered = ctx.comm.gather(records, root=0)
    # a sample of points for the plot (at most 20 000 in all)
    keep = np.random.default_rng(ctx.rank).random(z.size) < 20_000 / max(ctx.comm.allreduce(z.size), 1)
    points = ctx.comm.gather((z[keep], zp[keep]), root=0)
    if ctx.rank != 0:
        return {"photoz_metrics": None}
    table = pa.Table.from_pylist(sorted((r for part in gathered for r in part), key=lambda r: (r["bin"] < 0, r["bin"])))
    overall = table.filter(pc.equal(table["bin"], -1)).to_pylist()[0]
    lines = [f"{'z range':>11} {'n':>7} {'bias':>8} {'σ_NMAD':>8} {'outliers':>8} {'σ_NMAD(mean)':>13}"]
    for r in table.to_pylist():
        label = "all" if r["bin"] < 0 else f"{r['z_lo']:.1f}-{r['z_hi']:.1f}"
        lines.append(f"{label:>11} {r['n']:>7d} {r['bias']:>8.4f} {r['sigma_nmad']:>8.4f} "
                     f"{r['outlier_fraction']:>8.3f} {r['sigma_nmad_trivial']:>13.4f}")
    ratio = overall["sigma_nmad"] / overall["sigma_nmad_trivial"]
    lines.append(f"σ_NMAD model {overall['sigma_nmad']:.4f} vs trivial (training mean z = {z_mean:.3f}) "
                 f"{overall['sigma_nmad_trivial']:.4f}: ratio {ratio:.3f} (must be <= 0.5)")
    report = Path(ctx.params["report_dir"])
    report.mkdir(parents=True, exist_ok=True, mode=0o700)
    (report / "photoz_metrics.txt").write_text("\n".join(lines) + "\n")
    ctx.log.info("photo-z metrics:\n%s", "\n".join(lines))
    _plot(np.concatenate([p[0] for p in points]), np.concatenate([p[1] for p in points]), report / "photoz.png",
          overall)
    if not ratio <= 0.5:
        raise RuntimeError(f"the model does not clearly beat the trivial predictor: σ_NMAD ratio {ratio:.3f} > 0.5")
    return {"photoz_metrics": table}


def _plot(z: np.ndarray, zp: np.ndarray, path: Path, overall: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=120)
    top = float(max(z.max(initial=1.0), zp.max(initial=1.0)))
    ax.hexbin(z, zp, gridsize=80, bins="log", extent=(0, top, 0, top), cmap="viridis", mincnt=1)
    grid = np.linspace(0, top, 10)
    ax.plot(grid, grid, "k-", lw=0.8)
    for s in (1, -1):
        ax.plot(grid, grid + s * OUTLIER * (1 + grid), "r--", lw=0.7)
    ax.set(xlabel="true redshift", ylabel="photometric redshift", xlim=(0, top), ylim=(0, top),
           title=f"σ_NMAD {overall['sigma_nmad']:.4f}, outliers {overall['outlier_fraction']:.3f} "
                 f"(n = {overall['n']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    run = pipe.run()
    print(f"run {run.id}: {run.state}")
    for stage in run.stages:
        cores = sorted({c for s in stage.slots for c in s.cores})
        gpus = sorted({g for s in stage.slots for g in s.gpus})
        took = f"{stage.ended - stage.started:6.2f}s" if stage.started and stage.ended else ""
        print(f"  {stage.name:<9} {stage.state:<8} cores={cores} gpus={gpus} {took}")
    by_name = {s.name: s for s in run.stages}
    t, q = by_name.get("train"), by_name.get("qa")
    if t and q and t.started and q.started and t.ended and q.ended:
        overlap = min(t.ended, q.ended) - max(t.started, q.started)
        print(f"train and qa ran at the same time for {max(overlap, 0.0):.2f}s on disjoint slots")
    if run.ok:
        print((Path(pipe.stages["evaluate"].params["report_dir"]) / "photoz_metrics.txt").read_text())
        print(f"plot: {Path(pipe.stages['evaluate'].params['report_dir']) / 'photoz.png'}")
