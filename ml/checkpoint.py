"""Atomic training checkpoints: one new directory per checkpoint, commit marker last.

Layout under a checkpoint root (``ctx.checkpoint_dir``, stable across
attempts of a stage)::

    ckpt-000000000120/state.pt     torch.save of a plain dict of tensors and numbers
    ckpt-000000000120/COMMITTED    written (and fsynced) last: JSON {epoch, step}

A checkpoint exists only once its marker exists, so a process killed halfway
through a save leaves at most an uncommitted directory that readers ignore
and the next save removes.  Loading uses ``torch.load(weights_only=True)``:
no pickled code is ever executed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from hetflow.ml.errors import CheckpointError
from hetflow.operators import safeio

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
STATE_FILE = "state.pt"
_PREFIX = "ckpt-"


def checkpoint_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step!r}")
    return f"{_PREFIX}{step:012d}"


def committed_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Committed checkpoints under ``root``, oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir()
             if p.name.startswith(_PREFIX) and p.is_dir() and (p / COMMIT_MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``root``, or ``None``."""
    found = committed_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(root: str | os.PathLike[str], state: Mapping[str, Any], *, epoch: int, step: int,
                    keep: int = 2) -> Path:
    """Write ``state`` as checkpoint ``step`` under ``root`` and keep the newest ``keep``.

    ``state`` must hold only what ``torch.load(weights_only=True)`` accepts:
    tensors, numbers, strings, None and lists/tuples/dicts of those.
    """
    import torch

    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep!r}")
    base = Path(root)
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = base / checkpoint_name(step)
    tmp = base / f".tmp-{final.name}-{os.getpid()}"
    for stale in (tmp, final):
        if stale.exists():  # a save that died before its marker; never a committed one
            if (stale / COMMIT_MARKER).exists():
                raise CheckpointError(f"checkpoint {stale} is already committed")
            shutil.rmtree(stale)
    tmp.mkdir(mode=0o700)
    safeio.atomic_write(tmp / STATE_FILE, lambda fh: torch.save(dict(state), fh))   # 0600, fsynced, dir too
    os.rename(tmp, final)
    safeio.fsync_dir(base)
    # the marker is the commit: written atomically, so a crash never leaves a partial one that counts
    safeio.atomic_write(final / COMMIT_MARKER, json.dumps({"epoch": epoch, "step": step}).encode())
    log.info("checkpoint %s committed (epoch %d, step %d)", final, epoch, step)
    for old in committed_checkpoints(base)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for left in base.glob(".tmp-*"):
        if left != tmp:
            shutil.rmtree(left, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a committed checkpoint directory (``weights_only=True``)."""
    import torch

    ckpt = Path(path)
    if not (ckpt / COMMIT_MARKER).is_file():
        raise CheckpointError(f"{ckpt} is not a committed checkpoint (no {COMMIT_MARKER} marker)")
    try:
        state = torch.load(ckpt / STATE_FILE, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for a corrupt file
        raise CheckpointError(f"cannot load checkpoint {ckpt}: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {ckpt} holds {type(state).__name__}, expected a dict")
    return state


def rng_state() -> dict[str, Any]:
    """The random states of torch (CPU and CUDA), numpy's global generator and ``random``."""
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": random.getstate(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` captured.

    The states may come from :func:`load_checkpoint` with ``map_location`` a GPU, which moves every
    tensor there; torch takes RNG states only as CPU byte tensors, so each is brought back first."""
    import torch

    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
