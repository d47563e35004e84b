"""``fit``: data-parallel training of one model over a stage's ranks, with resume.

Every rank trains on its own partition.  An epoch has the same number of steps
``S = ceil(total_rows / batch_size)`` on every rank: each rank splits its
shuffled rows into ``S`` nearly equal local batches, so all rows are used once
per epoch and no rank waits for another's extra step.  Local batches may
differ in size (uneven partitions), so each rank's mean loss is scaled by
``local_rows * world / global_rows`` before DDP averages the gradients: the
update is exactly that of the mean loss over the global batch, the same as a
single process would compute on the concatenated batch.

Checkpoints (rank 0 writes, see :mod:`hetflow.ml.checkpoint`) go to
``ctx.checkpoint_dir`` after every epoch and, with ``checkpoint_every=N``,
every N steps; a rerun of the stage resumes from the newest committed one.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from hetflow.ml.artifact import model_to_table
from hetflow.ml.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from hetflow.ml.distributed import Backend, DistributedEnv, distributed
from hetflow.ml.loader import ArrowLoader, Normalization, memory_share_of
from hetflow.ml.tensors import Fill

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

LossFn = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` returns on every rank.

    ``model_table`` and ``metrics`` (the stage outputs) are set on rank 0 and
    ``None`` elsewhere; ``model`` (unwrapped, eval mode) is on every rank.
    ``layout_seconds`` is what this rank spent laying its training rows out
    row-major before the first step (0 when its loader gathers by columns;
    see :mod:`hetflow.ml.loader`): set-up time that no epoch's ``seconds``
    includes.
    """

    model: Any
    model_table: pa.Table | None
    metrics: pa.Table | None
    start_epoch: int
    start_step: int
    resumed_from: Path | None
    history: tuple[Mapping[str, float], ...]
    layout_seconds: float = 0.0


def global_normalization(comm: Any, loader: ArrowLoader) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation of every feature over all ranks (one allreduce)."""
    local = np.zeros((len(loader.columns), 3))
    for i, col in enumerate(loader.columns):
        values = col.tensor.numpy().astype(np.float64, copy=False)
        local[i] = (values.size, values.sum(), np.square(values).sum())
    total = np.empty_like(local)
    comm.Allreduce(local, total)
    stats: dict[str, tuple[float, float]] = {}
    for col, (n, s, ss) in zip(loader.columns, total):
        if n == 0:
            raise ValueError(f"cannot normalise feature {col.name!r}: no rows on any rank")
        mean = s / n
        std = math.sqrt(max(ss / n - mean * mean, 0.0))
        stats[col.name] = (mean, std if std > 0 else 1.0)
    return stats


def _weighted_eval(env: DistributedEnv, model: Any, loader: ArrowLoader | None,
                   fns: Mapping[str, LossFn]) -> dict[str, float]:
    """Mean of each function over all ranks' validation rows."""
    import torch

    sums = np.zeros(len(fns) + 1)
    if loader is not None:
        with torch.no_grad():
            for x, y in loader:
                pred = model(x)
                for i, fn in enumerate(fns.values()):
                    sums[i] += float(fn(pred, y)) * len(y)
                sums[-1] += len(y)
    total = env.all_reduce(list(sums))
    if total[-1] == 0:
        return {}
    return {name: total[i] / total[-1] for i, name in enumerate(fns)}


def fit(ctx: Any, table: pa.Table | None, *, model: Any, features: Sequence[str], label: str,
        loss: LossFn, optimizer: Callable[[Any], Any], epochs: int, batch_size: int,
        scheduler: Callable[[Any], Any] | None = None, validation: pa.Table | None = None,
        metrics: Mapping[str, LossFn] | None = None, seed: int = 0, checkpoint_every: int | None = None,
        keep_checkpoints: int = 2, normalize: bool | Normalization = True, fill: Fill = None,
        backend: Backend | None = None,
        on_epoch_end: Callable[[Mapping[str, float]], None] | None = None) -> FitResult:
    """Train ``model`` data-parallel over ``ctx``'s ranks on their partitions of a table.

    ``batch_size`` is the global batch (summed over ranks).  ``optimizer`` and
    ``scheduler`` are factories (``lambda params: torch.optim.Adam(params)``,
    ``lambda opt: StepLR(opt, 5)``) because they must be built on the
    distributed model; the scheduler steps once per epoch.  ``loss`` and the
    ``metrics`` are mean-reduced functions of ``(prediction, label)``; the
    validation loss and metrics are exact means over all ranks' validation
    rows.  ``normalize=True`` computes global feature means and standard
    deviations (an allreduce), a mapping gives them; either way they are
    applied to every batch and stored in the model manifest.

    With one rank the model is trained as it is, without a
    ``DistributedDataParallel`` wrapper: there is nothing to average, and
    the wrapper's per-step hooks and one-rank all-reduce would be all it
    adds.  Several ranks train through DDP.
    """
    import torch

    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got epochs={epochs!r}, batch_size={batch_size!r}")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be None or >= 1, got {checkpoint_every!r}")
    comm, rank, size = ctx.comm, ctx.rank, ctx.size
    schemas = [s for s in comm.allgather(None if table is None else table.schema) if s is not None]
    if not schemas:
        raise ValueError(f"stage {getattr(ctx, 'stage', '?')!r} has no training table on any of its {size} ranks")
    if table is None:  # no partition on this rank: it still takes every step, with empty batches
        table = schemas[0].empty_table()
    counts = comm.allgather(table.num_rows)
    total_rows = sum(counts)
    if total_rows == 0:
        raise ValueError(f"stage {getattr(ctx, 'stage', '?')!r} has no training rows on any of its {size} ranks")
    steps = math.ceil(total_rows / batch_size)
    # rows each rank contributes to step s: array_split of n rows into `steps` parts
    sizes = np.asarray(counts, dtype=np.int64)[:, None]
    per_step = sizes // steps + (np.arange(steps)[None, :] < sizes % steps)
    global_per_step = per_step.sum(axis=0)
    mine = per_step[rank]
    torch.manual_seed(seed + 7919 * rank)

    with distributed(ctx, backend=backend) as env:
        loader = ArrowLoader(table, features, label, num_batches=steps, shuffle=True, seed=seed, rank=rank,
                             fill=fill, device=env.device, memory_share=memory_share_of(ctx))
        if loader.copies:
            ctx.log.info("training columns copied: %s", loader.copies)
        ctx.log.info("training rows gathered by %s (row-major layout: %.3f s)", loader.layout, loader.layout_seconds)
        if normalize is True:
            norm: dict[str, tuple[float, float]] = global_normalization(comm, loader)
        elif normalize is False:
            norm = {}
        else:
            norm = {k: (float(m), float(s)) for k, (m, s) in normalize.items()}
        loader.normalize_with(norm or None)
        val_loader = None
        if validation is not None:
            val_loader = ArrowLoader(validation, features, label, batch_size=max(1, batch_size), shuffle=False,
                                     fill=fill, normalization=norm or None, device=env.device,
                                     memory_share=memory_share_of(ctx))
        ddp = env.wrap(model) if size > 1 else model.to(env.device)
        net = ddp.module if size > 1 else ddp  # the model itself: what checkpoints and the result hold
        opt = optimizer(ddp.parameters())
        sched = scheduler(opt) if scheduler is not None else None
        fns: dict[str, LossFn] = {"val_loss": loss, **{f"val_{k}": v for k, v in (metrics or {}).items()}}

        # -- resume --------------------------------------------------------------------------------
        start_epoch, start_step, global_step = 0, 0, 0
        history: list[dict[str, float]] = []
        partial = [0.0, 0.0, 0.0]  # loss sum, rows, seconds of the epoch in progress
        ckpt_root = Path(ctx.checkpoint_dir)
        found = comm.bcast(latest_checkpoint(ckpt_root) if rank == 0 else None, root=0)
        if found is not None:
            state = load_checkpoint(found, map_location=env.device)
            net.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            if sched is not None and state.get("scheduler") is not None:
                sched.load_state_dict(state["scheduler"])
            rngs = state["rng"]
            if len(rngs) == size:
                set_rng_state(rngs[rank])
            start_epoch, start_step, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
            history = [dict(h) for h in state["history"]]
            partial = [float(v) for v in state["partial"][rank]] if len(state["partial"]) == size else partial
            ctx.log.info("resuming from %s at epoch %d step %d", found, start_epoch, start_step)

        # the epoch's loss sum stays on the device (no host sync per step, so batch copies overlap steps)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)

        def collect_loss() -> None:
            partial[0] += float(loss_sum)  # waits for the device
            loss_sum.zero_()

        def checkpoint(epoch: int, step_in_epoch: int) -> None:
            rngs = comm.gather(rng_state(), root=0)
            partials = comm.gather(list(partial), root=0)
            if rank == 0:
                save_checkpoint(ckpt_root, {
                    "model": net.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict() if sched is not None else None,
                    "rng": rngs, "partial": partials, "epoch": epoch, "step_in_epoch": step_in_epoch,
                    "global_step": global_step, "history": history, "world_size": size,
                }, epoch=epoch, step=global_step, keep=keep_checkpoints)
            comm.Barrier()

        # -- train ---------------------------------------------------------------------------------
        for epoch in range(start_epoch, epochs):
            ddp.train()
            first = start_step if epoch == start_epoch else 0
            if first == 0:
                partial = [0.0, 0.0, 0.0]
            loss_sum.zero_()
            t0 = time.perf_counter()
            for s, (x, y) in enumerate(loader.batches(epoch, start=first), start=first):
                opt.zero_grad(set_to_none=True)
                pred = ddp(x)
                n = int(mine[s])
                if n:
                    local = loss(pred, y)
                    weight = n * size / float(global_per_step[s])
                    scaled = local * weight if weight != 1.0 else local  # 1.0 on one rank: no extra kernel
                    loss_sum.add_(local.detach(), alpha=n)  # accumulated in float64 (loss_sum's dtype)
                else:  # keeps this rank in DDP's gradient all-reduce with a zero contribution
                    scaled = pred.sum() * 0.0
                scaled.backward()
                opt.step()
                partial[1] += n
                global_step += 1
                if checkpoint_every is not None and global_step % checkpoint_every == 0 and s + 1 < steps:
                    collect_loss()
                    partial[2] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    checkpoint(epoch, s + 1)
            collect_loss()
            partial[2] += time.perf_counter() - t0
            loss_total, rows, seconds = env.all_reduce(partial[:2], "sum") + env.all_reduce(partial[2:], "max")
            if sched is not None:
                sched.step()
            ddp.eval()
            record: dict[str, float] = {
                "epoch": float(epoch), "step": float(global_step), "train_loss": loss_total / max(rows, 1),
                **_weighted_eval(env, net, val_loader, fns),
                "samples": rows, "seconds": seconds, "samples_per_s": rows / seconds if seconds > 0 else 0.0,
                "lr": float(opt.param_groups[0]["lr"]),
            }
            history.append(record)
            ctx.log.info("epoch %d: %s", epoch, {k: round(v, 6) for k, v in record.items()})
            report = getattr(ctx, "progress", None)  # the live view's epoch and loss (a plain ctx has none)
            if callable(report):
                report(epoch + 1, epochs, unit="epoch", loss=record["train_loss"],
                       **{k: record[k] for k in ("val_loss",) if k in record})
            partial = [0.0, 0.0, 0.0]
            checkpoint(epoch + 1, 0)
            if on_epoch_end is not None:
                on_epoch_end(record)
        trained = net.eval()

    model_table = metrics_table = None
    if rank == 0:
        last = {k: v for k, v in history[-1].items() if k not in ("epoch", "step")} if history else {}
        model_table = model_to_table(trained, features=features, label=label, normalization=norm, metrics=last)
        metrics_table = metrics_to_table(history)
    return FitResult(model=trained, model_table=model_table, metrics=metrics_table, start_epoch=start_epoch,
                     start_step=start_step, resumed_from=found, history=tuple(history),
                     layout_seconds=loader.layout_seconds)


def metrics_to_table(history: Sequence[Mapping[str, float]]) -> pa.Table:
    """Per-epoch metrics as an Arrow table (``epoch``/``step`` as int64, the rest float64)."""
    names: list[str] = []
    for record in history:
        names += [k for k in record if k not in names]
    columns = {}
    for name in names:
        values = [record.get(name) for record in history]
        typ = pa.int64() if name in ("epoch", "step") else pa.float64()
        columns[name] = pa.array([None if v is None else (int(v) if typ == pa.int64() else float(v))
                                  for v in values], typ)
    return pa.table(columns)
