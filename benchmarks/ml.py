"""Training and inference throughput of hetflow.ml against plain PyTorch over the same data.

    python benchmarks/ml.py [--device cpu|cuda] [--quick] [--rows N] [--features F] [--batch-size B]
                            [--epochs E] [--repeats R] [--hidden W,W] [--threads T] [--out FILE.json]

The data: ``rows`` × ``features`` float32 columns plus a float32 label,
written as an Arrow IPC file and memory-mapped, as a stage's input arrives.
Both sides train the same MLP (same initial weights, Adam, MSE, the same
per-batch feature normalisation) for ``epochs`` epochs on one process:

* **hetflow**: ``hf.ml.fit`` on the mapped Arrow table through a one-rank
  stage context (its process group, checkpoint after each epoch, and the
  loader: zero-copy columns laid out row-major once — that time charged to
  hetflow's figure — then pinned staging and prefetch on CUDA);
* **baseline**: what a user writes with the data already in memory as
  tensors: ``DataLoader(TensorDataset(x, y))`` fed whole batches by a
  ``BatchSampler`` over a ``RandomSampler`` (``pin_memory`` and
  ``non_blocking`` copies on CUDA), the loss summed on the device.  The
  per-row ``DataLoader(..., batch_size=B, shuffle=True)`` that tutorials show
  is timed too, for one epoch (``baseline_per_row``).

Training figures are samples/s over whole epochs (epoch 0 is warm-up and not
counted).  Inference: rows/s of ``hf.ml.predict`` against a loop over the
in-memory tensor in batches of the same size.  On CUDA the script also
measures the host→device copy rate: the pinned-memory limit (a large pinned
block copied ``non_blocking``, timed with CUDA events), the pageable rate for
comparison, the rate of the loader's own staging copies (its
``gather`` into a pinned buffer, then the copy, at the batch size), and
the loader's end-to-end feed rate with no step in between.  Targets on a GPU:
hetflow ≥ 0.9× the baseline in training, copy rate ≥ 0.8× the pinned limit.

Each measurement is repeated ``repeats`` times, alternating hetflow and the
baseline; the printed figures are medians with the min–max spread.
``--quick`` is the CI-sized run (a few thousand rows, one repeat).  ``--threads``
sets the CPU threads of both sides (on a machine shared with other work,
several OpenMP threads each can be far slower than one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pyarrow import ipc

HIDDEN = (512, 512)
QUICK = {"rows": 4096, "features": 16, "batch_size": 512, "epochs": 2, "repeats": 1, "hidden": (32,)}
FULL = {"rows": 1_000_000, "features": 32, "batch_size": 4096, "epochs": 3, "repeats": 3, "hidden": HIDDEN}


# ------------------------------------------------------------------ data
def make_table(rows: int, features: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32) * 2.0 + 1.0
    w = rng.normal(size=features).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=rows)).astype(np.float32)
    columns: dict[str, Any] = {"id": np.arange(rows, dtype=np.int64)}
    columns.update({f"f{i}": x[:, i] for i in range(features)})
    columns["y"] = y
    return pa.table(columns)


def mapped(table: pa.Table, directory: Path) -> pa.Table:
    """``table`` as an Arrow IPC file, opened memory-mapped (one chunk per column)."""
    path = directory / "data.arrow"
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return ipc.open_file(pa.memory_map(str(path))).read_all()


def feature_names(features: int) -> list[str]:
    return [f"f{i}" for i in range(features)]


# ------------------------------------------------------------------ helpers
def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _context(workdir: Path, device: str, threads: int) -> Any:
    from hetflow.tasks.context import StageContext
    from mpi4py import MPI

    return StageContext(comm=MPI.COMM_SELF, stage="bench", run_id="bench", attempt=1, params={},
                        workdir=workdir, checkpoint_dir=workdir / "checkpoints",
                        cores=tuple(sorted(os.sched_getaffinity(0)))[:threads], gpus=(0,) if device == "cuda" else ())


def _model(features: int, hidden: tuple[int, ...], seed: int) -> Any:
    import torch
    from hetflow.ml import MLP

    torch.manual_seed(seed)
    return MLP(features, hidden=list(hidden))


def _stats(table: pa.Table, names: list[str]) -> dict[str, tuple[float, float]]:
    return {n: (float(np.mean(table.column(n))), float(np.std(table.column(n))) or 1.0) for n in names}


# ------------------------------------------------------------------ training
def train_hetflow(table: pa.Table, args: argparse.Namespace, workdir: Path) -> list[float]:
    """Samples/s of each epoch of ``hf.ml.fit`` (its own per-epoch timing, device synchronised).

    The loader's row-major layout (built once before the first step; the
    baseline's ``np.stack`` into a tensor is its counterpart, untimed) is
    charged to hetflow: its seconds are spread over the epochs that count
    (all but the warm-up epoch 0).
    """
    import torch
    from hetflow import ml

    ctx = _context(workdir, args.device, args.threads)
    names = feature_names(args.features)
    result = ml.fit(ctx, table, model=_model(args.features, args.hidden, 0), features=names, label="y",
                    loss=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                    epochs=args.epochs, batch_size=args.batch_size, seed=1, normalize=_stats(table, names))
    counted = max(1, args.epochs - 1)
    return [float(h["samples"]) / (float(h["seconds"]) + result.layout_seconds / counted) for h in result.history]


def _baseline_tensors(table: pa.Table, args: argparse.Namespace) -> tuple[Any, Any]:
    """The data as a user holds it in memory: one (rows, features) float32 tensor and the labels."""
    import torch

    names = feature_names(args.features)
    x = torch.from_numpy(np.stack([np.asarray(table.column(n)) for n in names], axis=1))
    y = torch.from_numpy(np.asarray(table.column("y")).copy())
    return x, y


def train_baseline(table: pa.Table, args: argparse.Namespace, *, per_row: bool = False) -> list[float]:
    """Samples/s of each epoch of a plain PyTorch loop over an in-memory ``DataLoader``."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(args.threads)
    x, y = _baseline_tensors(table, args)
    stats = _stats(table, feature_names(args.features))
    mean = torch.tensor([m for m, _ in stats.values()], device=device)
    std = torch.tensor([s for _, s in stats.values()], device=device)
    data = TensorDataset(x, y)
    cuda = device.type == "cuda"
    if per_row:
        loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, pin_memory=cuda)
    else:
        loader = DataLoader(data, sampler=BatchSampler(RandomSampler(data), args.batch_size, drop_last=False),
                            batch_size=None, pin_memory=cuda)
    model = _model(args.features, args.hidden, 0).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rates = []
    for _ in range(1 if per_row else args.epochs):
        total = torch.zeros((), dtype=torch.float64, device=device)
        _sync(device)
        start = time.perf_counter()
        for xb, yb in loader:
            xb = (xb.to(device, non_blocking=True) - mean) / std
            yb = yb.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            total.add_(loss.detach().double(), alpha=len(yb))
        float(total)
        rates.append(len(data) / (time.perf_counter() - start))
    return rates


# ------------------------------------------------------------------ inference
def infer_hetflow(table: pa.Table, args: argparse.Namespace, workdir: Path) -> float:
    from hetflow import ml

    ctx = _context(workdir, args.device, args.threads)
    model = _model(args.features, args.hidden, 0)
    names = feature_names(args.features)
    stats = _stats(table, names)
    ml.predict(ctx, table.slice(0, min(table.num_rows, args.batch_size)), model, key="id", features=names,
               normalization=stats, batch_size=args.infer_batch_size)  # warm-up
    start = time.perf_counter()
    out = ml.predict(ctx, table, model, key="id", features=names, normalization=stats,
                     batch_size=args.infer_batch_size)
    seconds = time.perf_counter() - start
    assert out is not None and out.num_rows == table.num_rows
    return table.num_rows / seconds


def infer_baseline(table: pa.Table, args: argparse.Namespace) -> float:
    import torch

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(args.threads)
    x, _ = _baseline_tensors(table, args)
    if device.type == "cuda":
        x = x.pin_memory()
    stats = _stats(table, feature_names(args.features))
    mean = torch.tensor([m for m, _ in stats.values()], device=device)
    std = torch.tensor([s for _, s in stats.values()], device=device)
    model = _model(args.features, args.hidden, 0).to(device).eval()

    def run(rows: int) -> np.ndarray:
        outs = []
        with torch.inference_mode():
            for i in range(0, rows, args.infer_batch_size):
                xb = (x[i:i + args.infer_batch_size].to(device, non_blocking=True) - mean) / std
                outs.append(model(xb).float())
            return torch.cat(outs).cpu().numpy()

    run(min(len(x), args.batch_size))  # warm-up
    start = time.perf_counter()
    pred = run(len(x))
    seconds = time.perf_counter() - start
    assert len(pred) == len(x)
    return len(x) / seconds


# ------------------------------------------------------------------ copies (CUDA)
def copy_rates(table: pa.Table, args: argparse.Namespace) -> dict[str, float]:
    """GB/s: pinned limit, pageable, the loader's staging copies, and its end-to-end feed."""
    import torch
    from hetflow.ml import ArrowLoader

    device = torch.device("cuda", 0)
    block = 256 * 2**20

    def h2d(host: Any, times: int) -> float:
        dev = torch.empty(host.shape, dtype=host.dtype, device=device)
        dev.copy_(host, non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(times):
            dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        return host.numel() * host.element_size() * times / (start.elapsed_time(end) / 1e3) / 1e9

    pinned = h2d(torch.ones(block // 4, dtype=torch.float32).pin_memory(), 20)
    pageable = h2d(torch.ones(block // 4, dtype=torch.float32), 5)

    names = feature_names(args.features)
    loader = ArrowLoader(table, names, "y", batch_size=args.copy_batch_size, device=device, seed=2)
    batches = loader.batch_indices(0)
    staging = torch.empty((args.copy_batch_size, loader.width), dtype=torch.float32, pin_memory=True)
    dev = torch.empty_like(staging, device=device)
    copied, seconds = 0, 0.0
    for rows in batches:
        host = loader.gather(rows, staging)  # the loader's own gather (its layout) into a pinned buffer
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev[:len(rows)].copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        copied += host.numel() * 4
        seconds += start.elapsed_time(end) / 1e3
    staged = copied / seconds / 1e9

    fed = 0
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for x, y in loader.batches(1):
        fed += x.numel() * x.element_size() + y.numel() * y.element_size()
    torch.cuda.synchronize()
    feed = fed / (time.perf_counter() - begin) / 1e9
    return {"pinned_limit_gbs": pinned, "pageable_gbs": pageable, "loader_copy_gbs": staged,
            "loader_feed_gbs": feed, "copy_batch_mib": args.copy_batch_size * loader.width * 4 / 2**20}


# ------------------------------------------------------------------ driver
def _median(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/ml.py: --device cuda but torch sees no CUDA device")
    results: dict[str, list[float]] = {"train_hetflow": [], "train_baseline": [], "train_baseline_per_row": [],
                                       "infer_hetflow": [], "infer_baseline": []}
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-ml-") as tmp:
        root = Path(tmp)
        table = mapped(make_table(args.rows, args.features), root)
        warm = slice(1, None) if args.epochs > 1 else slice(None)
        for repeat in range(args.repeats):
            order: list[tuple[str, Callable[[], Any]]] = [
                ("train_hetflow", lambda r=repeat: train_hetflow(table, args, root / f"fit-{r}")),
                ("train_baseline", lambda: train_baseline(table, args)),
            ]
            for name, fn in (order if repeat % 2 == 0 else order[::-1]):  # alternate who goes first
                results[name] += fn()[warm]
            inf: list[tuple[str, Callable[[], float]]] = [
                ("infer_hetflow", lambda r=repeat: infer_hetflow(table, args, root / f"predict-{r}")),
                ("infer_baseline", lambda: infer_baseline(table, args)),
            ]
            for name, g in (inf if repeat % 2 == 0 else inf[::-1]):
                results[name].append(g())
        if args.per_row:
            results["train_baseline_per_row"] += train_baseline(table, args, per_row=True)
        copies = copy_rates(table, args) if args.device == "cuda" else {}
    summary: dict[str, Any] = {k: _median(v) for k, v in results.items() if v}
    ratios = {"train": summary["train_hetflow"]["median"] / summary["train_baseline"]["median"],
              "infer": summary["infer_hetflow"]["median"] / summary["infer_baseline"]["median"]}
    if copies:
        ratios["copy"] = copies["loader_copy_gbs"] / copies["pinned_limit_gbs"]
        ratios["feed"] = copies["loader_feed_gbs"] / copies["pinned_limit_gbs"]
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    return {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
            "cpus": len(os.sched_getaffinity(0)), "gpu": gpu, "torch": torch.__version__,
            "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "out"},
            "results": summary, "raw": results, "copies": copies, "ratios": ratios,
            "targets_met": None if args.device != "cuda" else
            {"train >= 0.9": ratios["train"] >= 0.9, "copy >= 0.8": ratios["copy"] >= 0.8}}


def profile(args: argparse.Namespace, directory: Path) -> None:
    """One ``fit`` and one ``predict`` of hetflow's side under cProfile: where the host's time goes.

    Writes ``fit.txt`` and ``predict.txt`` (the top functions by own time and by cumulative time) and the
    raw ``.prof`` files into ``directory``.  Not part of the figures: the profiler slows Python code.
    """
    import cProfile
    import io
    import pstats

    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-ml-profile-") as tmp:
        root = Path(tmp)
        table = mapped(make_table(args.rows, args.features), root)
        small = table.slice(0, min(table.num_rows, 4 * args.batch_size))
        train_hetflow(small, args, root / "warm-fit")  # imports and CUDA's start-up, not profiled
        infer_hetflow(small, args, root / "warm-predict")
        for name, fn in [("fit", lambda: train_hetflow(table, args, root / "fit")),
                         ("predict", lambda: infer_hetflow(table, args, root / "predict"))]:
            profiler = cProfile.Profile()
            start = time.perf_counter()
            profiler.runcall(fn)
            seconds = time.perf_counter() - start
            profiler.dump_stats(str(directory / f"{name}.prof"))
            text = io.StringIO()
            text.write(f"{name}: {seconds:.2f} s under cProfile ({args.rows:,} rows, batch {args.batch_size})\n")
            for key in ("tottime", "cumulative"):
                pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
            (directory / f"{name}.txt").write_text(text.getvalue())
            print(f"profile of {name}: {seconds:.2f} s, {directory / (name + '.txt')}")


def report(data: dict[str, Any]) -> str:
    r = data["results"]
    a = data["args"]
    device = f"{a['device']} ({data['gpu']})" if data["gpu"] else a["device"]
    title = (f"hetflow.ml benchmark on {device}, {data['cpus']} CPUs, torch {data['torch']}: {a['rows']:,} rows x "
             f"{a['features']} features, batch {a['batch_size']}, MLP {a['hidden']}, {a['threads']} thread(s), "
             f"{a['repeats']} repeat(s) alternated")
    lines = [title,
             f"{'':<28}{'median':>14}{'min':>14}{'max':>14}"]
    for key, label, unit in (("train_hetflow", "train hf.ml.fit", "samples/s"),
                             ("train_baseline", "train DataLoader (batched)", "samples/s"),
                             ("train_baseline_per_row", "train DataLoader (per row)", "samples/s"),
                             ("infer_hetflow", "infer hf.ml.predict", "rows/s"),
                             ("infer_baseline", "infer tensor loop", "rows/s")):
        if key in r:
            s = r[key]
            lines.append(f"{label:<28}{s['median']:>14,.0f}{s['min']:>14,.0f}{s['max']:>14,.0f}  {unit}")
    ratios = data["ratios"]
    lines.append(f"ratio train hetflow/baseline {ratios['train']:.3f}   infer {ratios['infer']:.3f}")
    if data["copies"]:
        c = data["copies"]
        lines.append(f"host->device GB/s: pinned limit {c['pinned_limit_gbs']:.1f}, pageable {c['pageable_gbs']:.1f}, "
                     f"loader staging copies {c['loader_copy_gbs']:.1f} ({c['copy_batch_mib']:.1f} MiB batches), "
                     f"loader feed {c['loader_feed_gbs']:.1f}")
        lines.append(f"ratio copy/pinned limit {ratios['copy']:.3f}   feed/pinned limit {ratios['feed']:.3f}")
        lines.append("targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in data["targets_met"].items()))
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="CI-sized run (seconds)")
    for name in ("rows", "features", "batch_size", "epochs", "repeats"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--hidden", type=lambda v: tuple(int(h) for h in v.split(",")), default=None,
                        help="hidden layer widths of the MLP, e.g. 512,512")
    parser.add_argument("--infer-batch-size", type=int, default=None, help="default: 4 x batch size")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPU threads for both sides (torch intra-op, hetflow's rank cores); default: all")
    parser.add_argument("--copy-batch-size", type=int, default=65536, help="rows per batch in the copy-rate test")
    parser.add_argument("--no-per-row", dest="per_row", action="store_false",
                        help="skip the per-row DataLoader epoch")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="instead of the benchmark: one fit and one predict of hetflow under cProfile, "
                             "their top functions written to DIR")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.hidden = tuple(args.hidden)
    if args.infer_batch_size is None:
        args.infer_batch_size = 4 * args.batch_size
    for key in ("rows", "features", "batch_size", "epochs", "repeats", "infer_batch_size", "copy_batch_size",
                "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.profile is not None:
        profile(args, args.profile)
        return 0
    data = run(args)
    print(report(data))
    if args.out is not None:
        args.out.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
