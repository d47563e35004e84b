"""GPU vendors: which devices a rank may see, and which GPUs this machine has.

A pilot's GPUs are NVIDIA or AMD (``gpu_vendor`` in its config, else
:func:`detect_gpus`).  Every backend hands a rank its GPUs the same way:
:func:`visible_devices_env` turns the slot's GPU ids into the variables of
the vendor's runtime, and :func:`apply_visible_devices` puts them into an
environment, removing the other vendor's variables so that no stale value
from the parent (a login shell, a Slurm step) selects other devices.

- NVIDIA: ``CUDA_VISIBLE_DEVICES=<ids>``.
- AMD: ``ROCR_VISIBLE_DEVICES=<ids>`` selects the devices at the ROCr level
  and renumbers them ``0..n-1``; ``HIP_VISIBLE_DEVICES`` then indexes into
  *that* list, so it is ``0..n-1``, not the node's ids again (which would
  point past the end for any GPU other than 0).  HIP also reads
  ``CUDA_VISIBLE_DEVICES`` as an alias of ``HIP_VISIBLE_DEVICES``, so it is
  removed on AMD.

A rank without GPUs gets the variables set to the empty string, which hides
every device from either runtime.

Detection asks the vendors' tools (argv lists, a timeout each; a tool that
is missing, fails or hangs counts as "no GPUs of that vendor"):
``nvidia-smi -L``, then ``amd-smi list``, then ``rocm-smi --showid``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

log = logging.getLogger(__name__)

GpuVendor = Literal["nvidia", "amd"]
GPU_VENDORS: tuple[str, ...] = get_args(GpuVendor)

VISIBLE_DEVICES: Mapping[str, tuple[str, ...]] = {
    "nvidia": ("CUDA_VISIBLE_DEVICES",),
    "amd": ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
}
"""The variables that choose a process's devices, per vendor."""

ALL_VISIBLE_DEVICES: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")

DETECT_TIMEOUT = 10.0
"""Seconds one vendor tool may take before detection gives up on it."""


def check_vendor(vendor: object) -> GpuVendor:
    """``vendor`` if it is a known GPU vendor, else ValueError naming the allowed ones."""
    if vendor not in GPU_VENDORS:
        raise ValueError(f"unknown GPU vendor {vendor!r} (known: {list(GPU_VENDORS)})")
    return vendor  # type: ignore[return-value]


def visible_devices_env(vendor: GpuVendor, gpus: Sequence[int]) -> dict[str, str]:
    """The variables that give a rank exactly ``gpus`` (the node's GPU ids) of a ``vendor`` machine."""
    check_vendor(vendor)
    ids = ",".join(str(int(g)) for g in gpus)
    if vendor == "nvidia":
        return {"CUDA_VISIBLE_DEVICES": ids}
    return {"ROCR_VISIBLE_DEVICES": ids, "HIP_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(gpus)))}


def apply_visible_devices(environ: MutableMapping[str, str], vendor: GpuVendor, gpus: Sequence[int]) -> dict[str, str]:
    """Set :func:`visible_devices_env` in ``environ`` and drop the other vendor's variables; returns what was set."""
    wanted = visible_devices_env(vendor, gpus)
    for name in ALL_VISIBLE_DEVICES:
        if name not in wanted:
            environ.pop(name, None)
    environ.update(wanted)
    return wanted


# ------------------------------------------------------------------ detection
@dataclass(frozen=True)
class DetectedGpus:
    """What this machine showed: a vendor (``None`` when no GPU was found) and the GPU count."""

    vendor: GpuVendor | None
    count: int


def _ask(argv: Sequence[str], timeout: float) -> str | None:
    """The tool's stdout, or ``None`` when it is absent, fails or outlasts ``timeout``."""
    tool = shutil.which(argv[0])
    if tool is None:
        return None
    try:
        return subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=timeout,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("GPU detection: %s gave no answer (%s)", argv[0], exc)
        return None


def count_nvidia_smi(text: str) -> int:
    """GPUs in ``nvidia-smi -L`` output (one ``GPU <n>: <name> (UUID: ...)`` line each; MIG lines are indented)."""
    return sum(1 for line in text.splitlines() if re.match(r"GPU \d+:", line))


def count_amd_smi(text: str) -> int:
    """GPUs in ``amd-smi list`` output (a ``GPU: <n>`` line opens each device's block)."""
    return len({m.group(1) for m in re.finditer(r"^GPU: *(\d+)\s*$", text, re.MULTILINE)})


def count_rocm_smi(text: str) -> int:
    """GPUs in ``rocm-smi --showid`` output (several ``GPU[<n>] : ...`` lines per device)."""
    return len({m.group(1) for m in re.finditer(r"^GPU\[(\d+)\]", text, re.MULTILINE)})


_TOOLS: tuple[tuple[GpuVendor, tuple[str, ...], Callable[[str], int]], ...] = (
    ("nvidia", ("nvidia-smi", "-L"), count_nvidia_smi),
    ("amd", ("amd-smi", "list"), count_amd_smi),
    ("amd", ("rocm-smi", "--showid"), count_rocm_smi),
)


def _from_environment(environ: Mapping[str, str]) -> DetectedGpus | None:
    """A visible-devices variable already set (by a batch system or the user) decides, vendor and count."""
    for vendor, name in (("amd", "ROCR_VISIBLE_DEVICES"), ("amd", "HIP_VISIBLE_DEVICES"),
                         ("nvidia", "CUDA_VISIBLE_DEVICES")):
        value = environ.get(name)
        if value is not None:
            ids = [v for v in (p.strip() for p in value.split(",")) if v and v != "-1"]
            return DetectedGpus(vendor if ids else None, len(ids))  # type: ignore[arg-type]
    return None


def detect_gpus(environ: Mapping[str, str] | None = None, timeout: float = DETECT_TIMEOUT) -> DetectedGpus:
    """The GPUs of this machine: a visible-devices variable if one is set, else the vendors' tools in turn."""
    from_env = _from_environment(os.environ if environ is None else environ)
    if from_env is not None:
        return from_env
    for vendor, argv, count in _TOOLS:
        text = _ask(argv, timeout)
        n = count(text) if text is not None else 0
        if n:
            return DetectedGpus(vendor, n)
    return DetectedGpus(None, 0)
