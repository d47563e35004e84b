"""The photo-z pipeline's train and predict stages on a GPU, through hetflow (a part of scripts/gpu-check.sh).

    python scripts/gpu_check_pipeline.py --workdir DIR [--device cuda|cpu] [--rows N] [--out FILE.json]

Runs examples/photoz's stage functions in a pipeline shaped for one GPU:
``generate`` and ``prepare`` (2 MPI ranks), ``train`` (1 rank, 4 cores, the
GPU; the first attempt is killed after epoch ``--crash-after`` and the retry
resumes from the checkpoint), ``qa`` (2 MPI CPU ranks, at the same time as
``train``), ``predict`` (1 rank on the GPU) and ``evaluate`` (2 MPI ranks).
The GPU stages are thin wrappers that record what the rank saw: the device
and its name, the visible-devices variable, a torch.distributed process group
initialised from the task's communicator (backend, world size, an
all-reduce), and the GPU memory before and after.  The checks printed at the
end: CUDA seen by train and predict, NCCL with one rank, checkpoint/resume on
the GPU, qa running during train, the GPU's memory back to what it was once
the stages ended (no worker process left holding any), and the photo-z
quality gate of ``evaluate``.

``--device cpu`` is the dry run for a machine without a GPU: the same
pipeline with a declared (fake) GPU, so everything up to the CUDA calls runs
(torch sees no device: the stages train on the CPU with Gloo) and the checks
that need a GPU say they were skipped.  Exit status 0 when every check that
ran passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hetflow as hf

ROOT = Path(__file__).resolve().parents[1]
FACTS = "gpu-facts.json"


def _photoz() -> Any:
    spec = importlib.util.spec_from_file_location("photoz_pipeline", ROOT / "examples" / "photoz" / "pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


photoz = _photoz()


def _raw(stage: Any) -> Callable[..., Any]:
    return getattr(stage, "__wrapped_stage__", stage)


def _gpu_facts(ctx: Any) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"stage": ctx.stage, "attempt": ctx.attempt, "pid": os.getpid(), "device": ctx.device,
                             "gpus": list(ctx.gpus),
                             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")}
    if ctx.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        facts.update(gpu=torch.cuda.get_device_name(0), free_at_start=free, total=total)
    return facts


def _write(ctx: Any, facts: dict[str, Any]) -> None:
    (Path(ctx.workdir) / FACTS).write_text(json.dumps(facts, indent=2))


def _memory(facts: dict[str, Any]) -> None:
    import torch

    if facts["device"] == "cuda":
        torch.cuda.synchronize()
        facts.update(allocated_at_end=torch.cuda.memory_allocated(), reserved_at_end=torch.cuda.memory_reserved(),
                     peak_allocated=torch.cuda.max_memory_allocated())


# The stages are module-level functions of this script (the worker imports it by path and finds them
# by name); the CPU stages are photoz's own.
def generate(ctx):
    return _raw(photoz.generate)(ctx)


def prepare(ctx, survey):
    return _raw(photoz.prepare)(ctx, survey)


def qa(ctx, survey, test_set, train_set, valid_set):
    return _raw(photoz.qa)(ctx, survey, test_set, train_set, valid_set)


def evaluate(ctx, feature_stats, predictions, test_set):
    return _raw(photoz.evaluate)(ctx, feature_stats, predictions, test_set)


def train(ctx, feature_stats, train_set, valid_set):
    """photoz's train on this rank's device, after a process-group check over the task's communicator."""
    from hetflow import ml

    facts = _gpu_facts(ctx)
    with ml.distributed(ctx) as env:  # NCCL on a GPU rank, from ctx.comm: the rendezvous hetflow uses
        facts.update(backend=env.backend, world=env.size, all_reduce=env.all_reduce([float(ctx.rank + 1)])[0],
                     torch_device=str(env.device))
    _write(ctx, facts)  # now: the first attempt is killed inside photoz's train
    out = _raw(photoz.train)(ctx, feature_stats, train_set, valid_set)
    _memory(facts)
    _write(ctx, facts)
    return out


def predict(ctx, feature_stats, model, test_set):
    """photoz's predict on this rank's device."""
    facts = _gpu_facts(ctx)
    out = _raw(photoz.predict)(ctx, feature_stats, model, test_set)
    _memory(facts)
    facts["rows"] = 0 if out["predictions"] is None else out["predictions"].num_rows
    _write(ctx, facts)
    return out


def build(workdir: Path, rows: int, epochs: int, crash_after: int) -> hf.Pipeline:
    pipe = hf.Pipeline("photoz-gpu-check", workdir=workdir)
    data_dir = str(workdir / "photoz-data")
    pipe.stage(name="generate", ranks=2, outputs=["survey"],
               params={"rows": rows, "seed": 42, "data_dir": data_dir})(generate)
    pipe.stage(name="prepare", ranks=2, inputs=["survey"],
               outputs=["train_set", "valid_set", "test_set", "feature_stats"])(prepare)
    pipe.stage(name="qa", ranks=2, inputs=["survey", "test_set", "train_set", "valid_set"],
               outputs=["qa_fields"])(qa)
    pipe.stage(name="train", ranks=1, cores_per_rank=4, gpus_per_rank=1,
               inputs=["feature_stats", "train_set", "valid_set"], outputs=["model", "metrics"],
               params={"epochs": epochs, "batch_size": 512, "lr": 4e-3, "seed": 0, "crash_after_epoch": crash_after},
               retries=1)(train)
    pipe.stage(name="predict", ranks=1, gpus_per_rank=1, inputs=["feature_stats", "model", "test_set"],
               outputs=["predictions"])(predict)
    pipe.stage(name="evaluate", ranks=2, inputs=["feature_stats", "predictions", "test_set"],
               outputs=["photoz_metrics"],
               params={"report_dir": str(workdir / "photoz-report")})(evaluate)
    return pipe


# ------------------------------------------------------------------ GPU memory from outside the stages
def _smi(*query: str) -> list[list[str]] | None:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_memory_used_mib() -> int | None:
    rows = _smi("--query-gpu=memory.used")
    return int(rows[0][0]) if rows else None


def gpu_process_pids() -> list[int] | None:
    rows = _smi("--query-compute-apps=pid")
    return None if rows is None else [int(r[0]) for r in rows if r and r[0].isdigit()]


# ------------------------------------------------------------------ checks
def check(run: Any, workdir: Path, device: str, before_mib: int | None, epochs: int,
          crash_after: int) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """(name, ok|FAIL|skipped, detail) per check, and the facts the stages wrote."""
    run_dir = Path(run.run_dir)
    facts = {}
    for stage, attempt in (("train", 1), ("train", 2), ("predict", 1)):
        path = run_dir / "stages" / stage / f"attempt-{attempt}" / FACTS
        facts[f"{stage}-{attempt}"] = json.loads(path.read_text()) if path.is_file() else None
    cuda = device == "cuda"
    results: list[tuple[str, str, str]] = []

    def add(name: str, ok: bool, detail: str, gpu_only: bool = False) -> None:
        results.append((name, "skipped" if gpu_only and not cuda else ("ok" if ok else "FAIL"), detail))

    states = {s.name: s.state for s in run.stages}
    add("every stage DONE", all(v == "DONE" for v in states.values()), str(states))
    t2, p1 = facts["train-2"] or {}, facts["predict-1"] or {}
    add("train sees the GPU", t2.get("device") == "cuda" and t2.get("torch_device") == "cuda:0",
        f"device {t2.get('device')}, torch {t2.get('torch_device')}, {t2.get('gpu')}, "
        f"CUDA_VISIBLE_DEVICES={t2.get('cuda_visible_devices')}", gpu_only=True)
    want = "nccl" if cuda else "gloo"
    add(f"{want} process group from the task's communicator, one rank",
        t2.get("backend") == want and t2.get("world") == 1 and t2.get("all_reduce") == 1.0,
        f"backend {t2.get('backend')}, world {t2.get('world')}, all_reduce {t2.get('all_reduce')}")
    train = run.stage("train")
    attempt2 = run_dir / "stages" / "train" / "attempt-2"  # ctx.log writes rank-<r>.log (stderr.log: the process's)
    resumed = any("resuming from" in log.read_text() for log in attempt2.glob("*.log"))
    metrics = run.dataset("metrics").to_table() if "metrics" in run.datasets else None
    add("checkpoint/resume on the device", train.attempts == 2 and resumed and metrics is not None
        and metrics.num_rows == epochs,
        f"attempts {train.attempts}, attempt 2 resumed: {resumed}, crash injected after epoch {crash_after}, "
        f"{0 if metrics is None else metrics.num_rows} epochs recorded")
    qa = run.stage("qa")
    overlap = 0.0
    if qa.started and qa.ended and train.started and train.ended:
        overlap = min(qa.ended, train.ended) - max(qa.started, train.started)
    cores_t = {c for s in train.slots for c in s.cores}
    cores_q = {c for s in qa.slots for c in s.cores}
    add("MPI CPU stage qa during train, disjoint cores", overlap > 0 and not cores_t & cores_q,
        f"overlap {overlap:.2f} s, train cores {sorted(cores_t)} gpus {sorted({g for s in train.slots for g in s.gpus})},"
        f" qa cores {sorted(cores_q)}")
    add("predict sees the GPU", p1.get("device") == "cuda" and (p1.get("rows") or 0) > 0,
        f"device {p1.get('device')}, {p1.get('rows')} predictions", gpu_only=True)
    after = gpu_memory_used_mib()
    pids = gpu_process_pids()
    stage_pids = {f.get("pid") for f in facts.values() if f}
    left = sorted(set(pids or []) & stage_pids)
    add("GPU memory released when the stages ended",
        pids is not None and not left and before_mib is not None and after is not None and after <= before_mib + 64,
        f"GPU memory used {before_mib} MiB before the run, {after} MiB after; stage processes still on the GPU: "
        f"{left}; train at its end: allocated {t2.get('allocated_at_end')} B, reserved {t2.get('reserved_at_end')} B,"
        f" peak {t2.get('peak_allocated')} B; free at predict's start {p1.get('free_at_start')} of {p1.get('total')} B",
        gpu_only=True)
    report = workdir / "photoz-report" / "photoz_metrics.txt"
    add("photo-z quality gate (evaluate)", states.get("evaluate") == "DONE",
        report.read_text().strip().splitlines()[-1] if report.is_file() else "no report")
    return results, facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--crash-after", type=int, default=2, help="epoch after which attempt 1 is killed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check_pipeline: --device cuda but torch sees no CUDA device", file=sys.stderr)
            return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir.resolve()
    cores = max(8, len(os.sched_getaffinity(0)))
    pilot = hf.PilotDescription(name=f"gpu-check-{args.device}", backend="local", cores_per_node=cores,
                                gpus_per_node=1, gpu_vendor="nvidia", memory_per_node=2**34)
    before = gpu_memory_used_mib() if args.device == "cuda" else None
    started = time.time()
    run = build(workdir, args.rows, args.epochs, args.crash_after).run(pilot=pilot)
    seconds = time.time() - started
    results, facts = check(run, workdir, args.device, before, args.epochs, args.crash_after)
    print(f"photo-z on {args.device} through hetflow: run {run.id} {run.state} in {seconds:.1f} s "
          f"({args.rows:,} rows, {args.epochs} epochs; pilot {pilot.shape()})")
    for stage in run.stages:
        took = f"{stage.ended - stage.started:7.2f} s" if stage.started and stage.ended else ""
        print(f"  {stage.name:<9} {stage.state:<7} attempts={stage.attempts} "
              f"cores={sorted({c for s in stage.slots for c in s.cores})} "
              f"gpus={sorted({g for s in stage.slots for g in s.gpus})} {took}")
    for name, status, detail in results:
        print(f"[{status}] {name}: {detail}")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": args.device, "run": run.id, "state": run.state, "seconds": seconds,
                                        "checks": [{"name": n, "status": s, "detail": d} for n, s, d in results],
                                        "facts": facts}, indent=2) + "\n")
    return 1 if any(status == "FAIL" for _, status, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
