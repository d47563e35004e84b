"""A one-rank GPU stage started warm by the fork server, on a real GPU (a part of scripts/gpu-check.sh).

    python scripts/gpu_check_warm.py --workdir DIR [--device cuda|cpu] [--out FILE.json]

This script imports torch at its top, so the run's fork server loads torch (with no device visible)
before it forks the stages.  Two one-rank stages with one GPU each, one after the other, each make
``torch.ones(1, device=...)`` and record who started them, their ``CUDA_VISIBLE_DEVICES`` and
``torch.cuda.device_count()``.  The checks printed at the end: both stages were forked by the fork
server (the warm start of docs/hpc.md), each saw exactly its slot's GPUs (the device count equals the
slot's GPU count, the variable names the slot's ids) and computed on the device, and the server's log
says no GPU stage was sent cold.  The second stage checks that a child's CUDA does not make the server
unsafe (only the server's own state counts).

``--device cpu`` is the dry run for a machine without a GPU: a declared (fake) GPU, the tensor on the
CPU, and the device-count check says it was skipped.  Exit status 0 when every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import hetflow as hf
import pyarrow as pa
import torch


def _forked_by_the_fork_server() -> bool:
    """This rank's parent is the run's fork server and the rank leads its own session (a warm start)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            parent = fh.read()
    except OSError:
        return False
    return b"hetflow.tasks.forkserver" in parent and os.getsid(0) == os.getpid()


def on_the_gpu(ctx: hf.StageContext) -> dict[str, pa.Table]:
    device = ctx.params["device"]
    value = float(torch.ones(1, device=device).sum().item())
    return {f"{ctx.stage}_facts": pa.table({
        "warm": [_forked_by_the_fork_server()], "value": [value],
        "cuda_visible_devices": [os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")],
        "device_count": [torch.cuda.device_count()],
        "device_name": [torch.cuda.get_device_name(0) if device == "cuda" else "cpu"]})}


def after_first(ctx: hf.StageContext, first_facts: pa.Table) -> dict[str, pa.Table]:
    return on_the_gpu(ctx)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


ARGS = _arguments()  # the stages' ranks execute this script with the same arguments

# declared at the top, as users do: each rank executes the script and finds its stage here
pipe = hf.Pipeline("gpu-check-warm", workdir=ARGS.workdir)
pipe.stage(name="first", ranks=1, gpus_per_rank=1, params={"device": ARGS.device},
           outputs=["first_facts"])(on_the_gpu)
pipe.stage(name="second", ranks=1, gpus_per_rank=1, params={"device": ARGS.device}, inputs=["first_facts"],
           outputs=["second_facts"])(after_first)


def main() -> int:
    args = ARGS
    if args.device == "cuda":
        # nvidia-smi: the orchestrator itself never starts CUDA
        from hetflow.tasks.gpu import detect_gpus

        gpus = detect_gpus().count
        if gpus < 1:
            print("FAIL no GPU detected by hetflow (nvidia-smi)")
            return 1
    else:
        gpus = 1  # declared: the dry run's rank is told a GPU id, and its torch sees none
    pilot = hf.PilotDescription(name="gpu-check-warm", cores_per_node=2, gpus_per_node=gpus, gpu_vendor="nvidia",
                                memory_per_node=2**33)
    run = pipe.run(pilot=pilot, progress=False, check=False)
    checks: dict[str, bool | None] = {"run ok": run.ok}
    if not run.ok:
        print(run)
    facts: dict[str, dict] = {}
    if run.ok:
        for name in ("first", "second"):
            (row,) = run.dataset(f"{name}_facts").to_table().to_pylist()
            slot_gpus = list(run.stage(name).slots[0].gpus)
            facts[name] = {**row, "slot_gpus": slot_gpus}
            checks[f"{name}: started warm by the fork server"] = row["warm"]
            checks[f"{name}: CUDA_VISIBLE_DEVICES is its slot's GPUs"] = (
                row["cuda_visible_devices"] == ",".join(str(g) for g in slot_gpus))
            checks[f"{name}: computed on {args.device}"] = row["value"] == 1.0
            checks[f"{name}: torch.cuda.device_count() == its slot's GPU count"] = (
                row["device_count"] == len(slot_gpus) if args.device == "cuda" else None)
        log = Path(run.run_dir) / "forkserver.log"
        text = log.read_text() if log.is_file() else ""
        checks["the fork server sent no GPU stage cold"] = "starts cold" not in text
        facts["forkserver.log"] = {"text": text[-2000:]}
    for name, ok in checks.items():
        print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {name}")
    print(json.dumps(facts, indent=1, default=str))
    if args.out is not None:
        args.out.write_text(json.dumps({"checks": checks, "facts": facts}, indent=1, default=str))
    return 0 if all(ok is not False for ok in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
