"""GPU vendors with fake GPUs: the variables each rank sees, detection through the vendors' tools, configs.

Detection runs real processes: small executables named ``nvidia-smi``,
``amd-smi`` and ``rocm-smi`` on ``PATH`` that print what the real tools print
on a machine with GPUs (or fail, or hang).  The local-backend tests run real
pipelines whose stages report the variables their ranks saw.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import _pipelines as P
import hetflow as hf
import pytest
from hetflow.tasks.backends.base import LaunchSpec
from hetflow.tasks.backends.dask import tcp_rank_env
from hetflow.tasks.backends.radical import rp_gpu_type, rp_options, task_description
from hetflow.tasks.errors import ConfigError
from hetflow.tasks.gpu import (
    ALL_VISIBLE_DEVICES,
    DetectedGpus,
    apply_visible_devices,
    detect_gpus,
    visible_devices_env,
)
from hetflow.tasks.pilot import PilotDescription, load_pilot
from hetflow.tasks.protocol import AttemptFiles
from hetflow.tasks.scheduler import RankSlot

NVIDIA_SMI_L = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0d5e7c6f-6a1b-4c1e-9d0a-1b2c3d4e5f60)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1d5e7c6f-6a1b-4c1e-9d0a-1b2c3d4e5f61)
GPU 2: NVIDIA A100-SXM4-40GB (UUID: GPU-2d5e7c6f-6a1b-4c1e-9d0a-1b2c3d4e5f62)
  MIG 3g.20gb     Device  0: (UUID: MIG-5c1b1ad8-1d4c-5a3e-8e1f-0a1b2c3d4e5f)
"""
AMD_SMI_LIST = """\
GPU: 0
    BDF: 0000:c1:00.0
    UUID: 8dff74a1-0000-1000-80f2-5e2b2c7fd4a5
    KFD_ID: 59095
    NODE_ID: 4
    PARTITION_ID: 0

GPU: 1
    BDF: 0000:c6:00.0
    UUID: 0bff74a1-0000-1000-8027-88f7cf6b7d1b
    KFD_ID: 20971
    NODE_ID: 5
    PARTITION_ID: 0

"""
ROCM_SMI_SHOWID = """\


============================ ROCm System Management Interface ============================
=========================================== ID ===========================================
GPU[0]\t\t: Device Name: \t\tAldebaran/MI200 [Instinct MI250X / MI250]
GPU[0]\t\t: Device ID: \t\t0x7408
GPU[0]\t\t: Device Rev: \t\t0x01
GPU[1]\t\t: Device Name: \t\tAldebaran/MI200 [Instinct MI250X / MI250]
GPU[1]\t\t: Device ID: \t\t0x7408
GPU[1]\t\t: Device Rev: \t\t0x01
GPU[2]\t\t: Device Name: \t\tAldebaran/MI200 [Instinct MI250X / MI250]
GPU[2]\t\t: Device ID: \t\t0x7408
GPU[2]\t\t: Device Rev: \t\t0x01
==========================================================================================
================================== End of ROCm SMI Log ===================================
"""


def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _printing(bin_dir: Path, name: str, output: str) -> None:
    assert "'" not in output
    _tool(bin_dir, name, f"printf '%s' '{output}'\n")  # a shell builtin: PATH holds nothing else


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty directory as the only place vendor tools are found (so a real nvidia-smi on a GPU machine is
    not), and no visible-devices variables set."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    for name in ALL_VISIBLE_DEVICES:
        monkeypatch.delenv(name, raising=False)
    return bin_dir


# ------------------------------------------------------------------ variables
def test_nvidia_rank_gets_cuda_visible_devices() -> None:
    assert visible_devices_env("nvidia", [2, 5]) == {"CUDA_VISIBLE_DEVICES": "2,5"}
    assert visible_devices_env("nvidia", []) == {"CUDA_VISIBLE_DEVICES": ""}


def test_amd_rank_gets_rocr_ids_and_hip_renumbered() -> None:
    # ROCR selects GCDs 6 and 7 and renumbers them 0, 1; HIP indexes into that list
    assert visible_devices_env("amd", [6, 7]) == {"ROCR_VISIBLE_DEVICES": "6,7", "HIP_VISIBLE_DEVICES": "0,1"}
    assert visible_devices_env("amd", []) == {"ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


def test_applying_drops_the_other_vendors_stale_variables() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/bin"}
    assert apply_visible_devices(env, "amd", [3]) == {"ROCR_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "0"}
    assert env == {"ROCR_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "0", "PATH": "/bin"}
    apply_visible_devices(env, "nvidia", [1])
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "PATH": "/bin"}


def test_unknown_vendor_is_rejected_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown GPU vendor 'intel' \(known: \['nvidia', 'amd'\]\)"):
        visible_devices_env("intel", [0])  # type: ignore[arg-type]


# ------------------------------------------------------------------ detection
def test_detects_nvidia_gpus_from_nvidia_smi(fake_tools: Path) -> None:
    _printing(fake_tools, "nvidia-smi", NVIDIA_SMI_L)
    _printing(fake_tools, "rocm-smi", ROCM_SMI_SHOWID)  # not asked: nvidia-smi answered first
    assert detect_gpus() == DetectedGpus("nvidia", 3)  # the MIG line is not a fourth GPU


def test_detects_amd_gpus_from_amd_smi(fake_tools: Path) -> None:
    _printing(fake_tools, "amd-smi", AMD_SMI_LIST)
    assert detect_gpus() == DetectedGpus("amd", 2)


def test_detects_amd_gpus_from_rocm_smi_when_amd_smi_is_absent(fake_tools: Path) -> None:
    _printing(fake_tools, "rocm-smi", ROCM_SMI_SHOWID)
    assert detect_gpus() == DetectedGpus("amd", 3)


def test_failing_or_hanging_tools_count_as_no_gpus(fake_tools: Path) -> None:
    _tool(fake_tools, "nvidia-smi", "echo 'NVIDIA-SMI has failed because it could not communicate' >&2\nexit 9\n")
    _tool(fake_tools, "amd-smi", "exec /bin/sleep 30\n")
    _printing(fake_tools, "rocm-smi", ROCM_SMI_SHOWID)
    assert detect_gpus(timeout=1.0) == DetectedGpus("amd", 3)  # nvidia-smi failed, amd-smi timed out
    (fake_tools / "rocm-smi").unlink()
    assert detect_gpus(timeout=1.0) == DetectedGpus(None, 0)


def test_no_tools_no_gpus(fake_tools: Path) -> None:
    assert detect_gpus() == DetectedGpus(None, 0)


def test_a_set_visible_devices_variable_decides(fake_tools: Path) -> None:
    _printing(fake_tools, "nvidia-smi", NVIDIA_SMI_L)
    assert detect_gpus({"ROCR_VISIBLE_DEVICES": "4,5"}) == DetectedGpus("amd", 2)
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == DetectedGpus("nvidia", 1)
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == DetectedGpus(None, 0)


def test_local_pilot_resolves_count_and_vendor(fake_tools: Path) -> None:
    _printing(fake_tools, "amd-smi", AMD_SMI_LIST)
    pilot = load_pilot("local").resolve()
    assert (pilot.gpus_per_node, pilot.gpu_vendor) == (2, "amd")
    assert "2 GPUs (amd)" in pilot.shape()


def test_declared_vendor_wins_over_detection(fake_tools: Path) -> None:
    _printing(fake_tools, "amd-smi", AMD_SMI_LIST)
    pilot = PilotDescription(name="mine", gpu_vendor="nvidia").resolve()
    assert (pilot.gpus_per_node, pilot.gpu_vendor) == (2, "nvidia")


def test_declared_gpus_of_no_detectable_vendor_are_nvidia(fake_tools: Path) -> None:
    pilot = PilotDescription(name="fake", cores_per_node=2, gpus_per_node=4, memory_per_node=2**30).resolve()
    assert pilot.gpu_vendor == "nvidia"
    cpu_only = PilotDescription(name="cpu", cores_per_node=2, gpus_per_node=0, memory_per_node=2**30).resolve()
    assert cpu_only.gpu_vendor is None and cpu_only.vendor == "nvidia"


# ------------------------------------------------------------------ configs
def test_bad_vendor_in_a_config_names_file_key_and_allowed(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\ngpu_vendor: intel\n")
    with pytest.raises(ConfigError) as info:
        load_pilot(path)
    message = str(info.value)
    assert str(path) in message and "'gpu_vendor'" in message and "'intel'" in message
    assert "['nvidia', 'amd']" in message


@pytest.mark.parametrize("name", ["ornl-frontier", "frontier"])
def test_frontier_declares_amd_and_one_l3_region_per_gcd(name: str) -> None:
    pilot = load_pilot(name)
    assert pilot.gpu_vendor == "amd" and pilot.gpus_per_node == 8
    usable = set(pilot.usable_cores())
    assert len(usable) == 56
    regions = [{c // 8 for c in cores} for cores in pilot.gpu_cores]
    assert all(len(r) == 1 for r in regions)                      # each GCD's cores share one L3 region
    assert sorted(r.pop() for r in regions) == list(range(8))     # and the 8 GCDs cover the 8 regions
    assert sorted(c for cores in pilot.gpu_cores for c in cores) == sorted(usable)
    # the documented one-rank-per-GCD binding: GCD g -> the first usable core of its region
    assert [cores[0] for cores in pilot.gpu_cores] == [49, 57, 17, 25, 1, 9, 33, 41]


def test_radical_gpu_type_follows_the_vendor(tmp_path: Path) -> None:
    frontier = load_pilot("ornl-frontier")
    summit = load_pilot("ornl-summit")
    assert (rp_gpu_type(frontier), rp_gpu_type(summit)) == ("ROCm", "CUDA")
    spec = LaunchSpec(task_id="r/train/1", argv=("python", "-m", "hetflow.tasks.worker", "spec.json"),
                      slots=(RankSlot(0, (49,), (0,)),), cwd=tmp_path)
    assert task_description(spec, frontier, ["node0"], "t.1", tmp_path)["gpu_type"] == "ROCm"
    clash = PilotDescription.from_mapping({**frontier.to_mapping(), "options": {"radical": {"gpu_type": "CUDA"}}})
    with pytest.raises(ConfigError, match="gpu_vendor"):
        rp_options(clash)


def test_render_shows_the_vendor_and_what_a_rank_gets() -> None:
    pytest.importorskip("radical.pilot")  # rendering asks for the backend's engine; the GPU machine has none
    from hetflow.tasks.render import render

    text = render(load_pilot("ornl-frontier"), "radical")
    assert "vendor amd (a rank on GPU 7 gets ROCR_VISIBLE_DEVICES=7, HIP_VISIBLE_DEVICES=0)" in text


def test_dask_tcp_rank_env_carries_the_vendors_variables(tmp_path: Path) -> None:
    env = tcp_rank_env({"X": "1"}, 1, 2, tmp_path, "nodeB", "amd", (2, 3))
    assert env["ROCR_VISIBLE_DEVICES"] == "2,3" and env["HIP_VISIBLE_DEVICES"] == "0,1"
    assert "CUDA_VISIBLE_DEVICES" not in env and env["X"] == "1" and env["HETFLOW_COMM_RANK"] == "1"
    assert tcp_rank_env({}, 0, 2, tmp_path, "nodeA", "nvidia", (1,))["CUDA_VISIBLE_DEVICES"] == "1"


# ------------------------------------------------------------------ real runs
AMD_FAKE = hf.PilotDescription(name="fake-mi250x", cores_per_node=4, gpus_per_node=4, gpu_vendor="amd",
                               memory_per_node=2**34)


def test_local_ranks_on_amd_see_rocr_and_hip_and_no_stale_cuda(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # what a parent shell might hold: must not leak
    pipe = P.pipeline("amd", workdir=tmp_path)
    pipe.stage(ranks=1, outputs=["numbers"], params={"rows_per_rank": 10})(P.make_rows)
    pipe.stage(name="train", ranks=2, gpus_per_rank=1, inputs=["numbers"], outputs=["train_out"])(P.describe_rank)
    pipe.stage(name="infer", ranks=1, gpus_per_rank=2, inputs=["numbers"], outputs=["infer_out"])(P.describe_rank)
    pipe.stage(name="cpu", ranks=1, inputs=["numbers"], outputs=["cpu_out"])(P.describe_rank)
    run = pipe.run(pilot=AMD_FAKE)
    assert run.ok, run
    for name in ("train", "infer"):
        stage = run.stage(name)
        rows = run.dataset(f"{name}_out").to_table().sort_by("rank").to_pylist()
        assert len(rows) == len(stage.slots)
        for slot, row in zip(stage.slots, rows):
            assert row["rocr"] == ",".join(str(g) for g in slot.gpus)
            assert row["hip"] == ",".join(str(i) for i in range(len(slot.gpus)))
            assert row["cuda"] == "<unset>"
    cpu = run.dataset("cpu_out").to_table().to_pylist()[0]
    assert (cpu["rocr"], cpu["hip"], cpu["cuda"]) == ("", "", "<unset>")
    results = AttemptFiles(Path(run.run_dir) / "stages" / "infer" / "attempt-1").read_results(1)
    assert results[0] is not None and results[0].visible_devices == {
        "ROCR_VISIBLE_DEVICES": ",".join(str(g) for g in run.stage("infer").slots[0].gpus),
        "HIP_VISIBLE_DEVICES": "0,1"}


def test_local_ranks_on_nvidia_see_cuda_and_no_stale_rocm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    pilot = hf.PilotDescription(name="fake-h100", cores_per_node=2, gpus_per_node=2, gpu_vendor="nvidia",
                                memory_per_node=2**34)
    pipe = P.pipeline("nv", workdir=tmp_path)
    pipe.stage(ranks=1, outputs=["numbers"], params={"rows_per_rank": 10})(P.make_rows)
    pipe.stage(name="train", ranks=2, gpus_per_rank=1, inputs=["numbers"], outputs=["train_out"])(P.describe_rank)
    run = pipe.run(pilot=pilot)
    assert run.ok, run
    rows = run.dataset("train_out").to_table().sort_by("rank").to_pylist()
    assert sorted(r["cuda"] for r in rows) == ["0", "1"]
    assert {(r["rocr"], r["hip"]) for r in rows} == {("<unset>", "<unset>")}
    assert os.environ["ROCR_VISIBLE_DEVICES"] == "0"  # the orchestrator's own environment is untouched




def test_pilot_show_and_check_name_the_vendor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hetflow.cli import main

    assert main(["pilot", "show", "ornl-frontier"]) == 0
    assert "gpu_vendor: amd" in capsys.readouterr().out.splitlines()
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: ornl-frontier\naccount: abc123\n")
    assert main(["pilot", "check", str(mine)]) == 0
    assert "x 8 GPUs (amd))" in capsys.readouterr().out
