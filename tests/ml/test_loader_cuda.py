"""The loader's CUDA path on a real GPU: pinned staging, side-stream copies, prefetch, and what a step sees.

These run where torch sees a CUDA device (``scripts/gpu-check.sh`` runs them on
the lent GPU machine); elsewhere they are skipped, and the CPU half of the
path is covered by ``test_loader_device.py``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")

from hetflow.ml import ArrowLoader, predict
from hetflow.ml.models import MLP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _table(n: int = 10_001) -> pa.Table:
    rng = np.random.default_rng(7)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.normal(size=n * 4).astype(np.float32)), 4)
    return pa.table({"id": np.arange(n), "a": rng.normal(size=n).astype(np.float32), "b": rng.normal(size=n),
                     "v": vec, "y": rng.normal(size=n).astype(np.float32)})


def _pairs(loader: ArrowLoader, epoch: int, slow_step: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for x, y in loader.batches(epoch):
        if slow_step:
            torch.cuda._sleep(2_000_000)  # a long kernel on the step's stream: copies run ahead meanwhile
        out.append((x.double().cpu().numpy(), y.double().cpu().numpy()))
    return out


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("features", [["v"], ["a", "b", "v"]])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_cuda_batches_equal_the_cpu_batches(prefetch: int, features: list[str], layout: str) -> None:
    table = _table()
    norm = {"a": (0.5, 2.0), "v": (-1.0, 3.0)}
    kwargs = {"batch_size": 512, "seed": 4, "normalization": {k: v for k, v in norm.items() if k in features}}
    cpu = ArrowLoader(table, features, "y", layout="columns", **kwargs)  # type: ignore[arg-type]
    gpu = ArrowLoader(table, features, "y", device="cuda", prefetch=prefetch, layout=layout,
                      **kwargs)  # type: ignore[arg-type]
    assert gpu.pin_memory and gpu.prefetch == prefetch and gpu.layout == layout
    for epoch in (0, 1):
        want, got = _pairs(cpu, epoch), _pairs(gpu, epoch, slow_step=True)
        assert len(want) == len(got) == len(cpu)
        for (wx, wy), (gx, gy) in zip(want, got):
            np.testing.assert_allclose(gx, wx, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(gy, wy)


def test_batches_live_on_the_device_and_stay_intact_while_later_batches_are_staged() -> None:
    table = _table(3000)
    loader = ArrowLoader(table, ["a", "b"], "y", batch_size=256, device="cuda", prefetch=2)
    held = []
    for x, y in loader:
        assert x.is_cuda and y.is_cuda and x.shape[1] == 2
        held.append(x)  # batches kept past the next ones must not change (ring reuse is only for host buffers)
    torch.cuda.synchronize()
    again = [x.cpu() for x, _ in ArrowLoader(table, ["a", "b"], "y", batch_size=256, seed=0)]
    for kept, ref in zip(held, again):
        assert torch.equal(kept.cpu(), ref)


def test_resuming_inside_an_epoch_gives_the_remaining_batches() -> None:
    loader = ArrowLoader(_table(2000), ["a"], "y", batch_size=100, device="cuda", prefetch=2, seed=9)
    full = [y.cpu() for _, y in loader.batches(3)]
    tail = [y.cpu() for _, y in loader.batches(3, start=7)]
    assert len(tail) == len(full) - 7 and all(torch.equal(a, b) for a, b in zip(full[7:], tail))


def test_predict_on_cuda_matches_cpu() -> None:
    table = _table(5000)
    torch.manual_seed(0)
    net = MLP(5, hidden=[16])
    cpu = predict(None, table, net, key="id", features=["a", "v"], batch_size=777)
    ctx = type("Ctx", (), {"device": "cuda", "cores": (0,), "comm": None})()
    gpu = predict(ctx, table, net, key="id", features=["a", "v"], batch_size=777)
    assert cpu is not None and gpu is not None and gpu["id"].equals(cpu["id"])
    np.testing.assert_allclose(gpu["prediction"].to_numpy(), cpu["prediction"].to_numpy(), rtol=1e-4, atol=1e-5)


def test_rng_state_restores_from_a_checkpoint_loaded_onto_the_gpu(tmp_path) -> None:
    """``train`` loads its checkpoint with ``map_location`` the GPU, which moves the saved RNG states
    there too; torch takes them back only as CPU byte tensors (the first GPU run failed here)."""
    from hetflow.ml.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state

    torch.manual_seed(3)
    torch.cuda.manual_seed_all(3)
    saved = save_checkpoint(tmp_path / "ckpt", {"rng": [rng_state()]}, epoch=0, step=1)
    expected = (torch.rand(4), torch.rand(4, device="cuda").cpu(), np.random.random(4))
    state = load_checkpoint(saved, map_location="cuda")
    assert state["rng"][0]["torch"].device.type == "cuda"
    set_rng_state(state["rng"][0])
    assert torch.equal(torch.rand(4), expected[0])
    assert torch.equal(torch.rand(4, device="cuda").cpu(), expected[1])
    assert np.array_equal(np.random.random(4), expected[2])
