"""Pilot descriptions and config files: validation names file, key and allowed values."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from hetflow.tasks.errors import ConfigError
from hetflow.tasks.pilot import (LIMITS, YEAR, PilotDescription, config_names, load_pilot, parse_bytes,
                                 parse_duration)


def test_every_shipped_config_loads_and_validates() -> None:
    names = config_names()
    assert "local" in names
    for name in names:
        pilot = load_pilot(name)
        assert pilot.nodes >= 1


def test_local_detects_this_machine() -> None:
    import os

    pilot = load_pilot("local").resolve()
    assert pilot.cores_per_node == len(os.sched_getaffinity(0))
    assert pilot.memory_per_node and pilot.memory_per_node > 0


def test_unknown_key_names_file_key_and_allowed(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\ncores_per_nod: 4\n")
    with pytest.raises(ConfigError) as info:
        load_pilot(path)
    message = str(info.value)
    assert str(path) in message and "'cores_per_nod'" in message and "cores_per_node" in message


@pytest.mark.parametrize("body, key", [
    ("backend: pbs\n", "backend"),
    ("nodes: 0\n", "nodes"),
    ("launcher: aprun\n", "launcher"),
    ("nodes: 2\ncores_per_node: 8\ngpus_per_node: 0\nmemory_per_node: 1GiB\nreserved_cores: [9]\n", "reserved_cores"),
    ("walltime: soon\n", "duration"),
    ("memory_per_node: lots\n", "size"),
])
def test_bad_values_are_named(tmp_path: Path, body: str, key: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=key):
        load_pilot(path)


def test_multi_node_pilot_must_declare_its_shape() -> None:
    with pytest.raises(ConfigError, match="cores_per_node"):
        PilotDescription(name="big", backend="radical", nodes=4)


def test_extends_overrides_parent_keys(tmp_path: Path) -> None:
    path = tmp_path / "child.yaml"
    path.write_text("extends: local\nname: child\ncores_per_node: 6\ngpus_per_node: 2\nmemory_per_node: 8GiB\n")
    pilot = load_pilot(path)
    assert (pilot.name, pilot.cores_per_node, pilot.gpus_per_node, pilot.memory_per_node) == ("child", 6, 2, 8 * 2**30)
    cyclic = tmp_path / "cycle.yaml"
    cyclic.write_text(f"extends: {cyclic}\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_pilot(cyclic)


def test_unknown_pilot_name_lists_shipped_configs() -> None:
    with pytest.raises(ConfigError, match=r"unknown pilot 'nope' \(shipped configs: \[.*'local'"):
        load_pilot("nope")


def test_parsers() -> None:
    assert parse_duration("01:30:00") == 5400 and parse_duration(90) == 90
    assert parse_bytes("512GiB") == 512 * 2**30 and parse_bytes(10) == 10


@pytest.mark.parametrize("text, seconds", [
    ("90", 90), ("'90'", 90), ("'01:30:00'", 5400), ("01:30:00", 5400), ("'1-02:00:00'", 93600), ("1.5", 1.5)])
def test_durations_in_the_forms_the_docs_name(tmp_path: Path, text: str, seconds: float) -> None:
    path = _yaml(tmp_path / "ok.yaml", walltime=text)
    assert load_pilot(path).walltime == seconds


@pytest.mark.parametrize("text, hours_minutes, minutes_seconds", [
    ("'00:20'", "00:20:00", "00:00:20"),  # Slurm reads it as 20 s; a user meant 20 minutes
    ("00:20", "00:20:00", "00:00:20"),
    ("20:00", "20:00:00", "00:20:00"),    # unquoted, YAML 1.1 reads it as the base-60 integer 1200
    ("'2:30'", "02:30:00", "00:02:30")])
def test_a_two_field_duration_is_refused_with_both_readings(tmp_path: Path, text: str, hours_minutes: str,
                                                           minutes_seconds: str) -> None:
    path = _yaml(tmp_path / "ambiguous.yaml", walltime=text)
    with pytest.raises(ConfigError) as info:
        load_pilot(path)
    message = str(info.value)
    assert str(path) in message and "'walltime'" in message and "ambiguous duration" in message, message
    assert f"write '{hours_minutes}'" in message and f"write '{minutes_seconds}'" in message, message
    assert "\n" not in message


def test_usable_cores_skip_reserved() -> None:
    pilot = PilotDescription(name="p", nodes=2, cores_per_node=8, gpus_per_node=0, memory_per_node=1,
                             reserved_cores=(0, 4), backend="radical")
    assert pilot.usable_cores() == (1, 2, 3, 5, 6, 7)
    assert "2 node(s) x 6 usable cores x 0 GPUs" in pilot.shape()


# ----------------------------------------------------------------- bounds


_SHAPE = {"name": "p", "backend": "parsl", "nodes": 2, "cores_per_node": 8, "gpus_per_node": 0,
          "memory_per_node": "1GiB"}


def _yaml(path: Path, **changes: object) -> Path:
    values = {**_SHAPE, **changes}
    path.write_text("".join(f"{key}: {value}\n" for key, value in values.items()))
    return path


@pytest.mark.parametrize("key, value, allowed", [
    ("nodes", "100000000000000000000", "1..1,000,000"),
    ("nodes", "1000001", "1..1,000,000"),
    ("cores_per_node", "100000000000000000000", "1..4,096"),
    ("cores_per_node", "4097", "1..4,096"),
    ("gpus_per_node", "65", "0..64"),
    ("memory_per_node", "100000000000000000000000", "0..1,125,899,906,842,624"),
    ("memory_per_node", "2PiB", "size"),
    ("memory_per_node", "2000TiB", "0..1,125,899,906,842,624"),
    ("walltime", ".nan", "finite"),
    ("walltime", ".inf", "finite"),
    ("walltime", "-.inf", "finite"),
    ("walltime", "100000000000000000000", "a year"),
    ("walltime", "'9999:00:00'", "a year"),
    ("drain", ".nan", "finite"),
    ("drain", ".inf", "finite"),
    ("drain", "31536001", "a year"),
    ("reserved_cores", "[1.5]", "integers"),
    ("gpu_cores", "[" + ",".join(["[0]"] * 65) + "]", "at most 64"),
])
def test_values_out_of_bounds_name_file_key_and_range(tmp_path: Path, key: str, value: str, allowed: str) -> None:
    path = _yaml(tmp_path / "bad.yaml", **{key: value})
    with pytest.raises(ConfigError) as info:
        load_pilot(path)
    message = str(info.value)
    assert str(path) in message and f"'{key}'" in message and allowed in message


@pytest.mark.parametrize("key", ["walltime", "drain"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_python_built_pilot_rejects_nan_and_inf(key: str, value: float) -> None:
    shape = {k: v for k, v in _SHAPE.items() if k != "memory_per_node"}
    with pytest.raises(ConfigError, match=f"bad value for '{key}'.*finite"):
        PilotDescription(**shape, memory_per_node=2**30, **{key: value})


def test_frontier_class_shapes_are_within_bounds() -> None:
    frontier = PilotDescription(name="frontier-full", backend="parsl", nodes=9408, cores_per_node=56,
                                gpus_per_node=8, memory_per_node=512 * 2**30, walltime=24 * 3600.0, drain=300.0)
    assert len(frontier.usable_cores()) == 56
    edge = PilotDescription(name="edge", backend="parsl", nodes=LIMITS["nodes"][1],
                            cores_per_node=int(LIMITS["cores_per_node"][1]), gpus_per_node=int(LIMITS["gpus_per_node"][1]),
                            memory_per_node=int(LIMITS["memory_per_node"][1]), walltime=float(YEAR), drain=float(YEAR))
    assert edge.nodes == 1_000_000
    assert parse_bytes("1.5GiB") == 3 * 2**29


def test_pilot_check_on_a_huge_value_answers_at_once(tmp_path: Path) -> None:
    """The user-found failure: cores_per_node: 10**20 made ``hetflow pilot check`` hang."""
    path = _yaml(tmp_path / "huge.yaml", cores_per_node="100000000000000000000")
    done = subprocess.run([sys.executable, "-m", "hetflow.cli", "pilot", "check", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert str(path) in done.stderr and "'cores_per_node'" in done.stderr and "1..4,096" in done.stderr


@pytest.mark.parametrize("configured, left, expected", [
    (None, None, None),        # outside Slurm's time accounting: the config's
    (3600.0, None, 3600.0),
    (None, 60.0, 54.0),        # a one-minute job: 6 s kept to record the run and submit a successor
    (None, 30.0, 25.0),        # at least 5 s
    (None, 7200.0, 7140.0),    # at most 60 s
    (600.0, 7200.0, 600.0),    # the config's when shorter
    (None, 3.0, 1.0),          # never below one second
])
def test_a_job_keeps_a_margin_before_its_time_limit(configured: float | None, left: float | None,
                                                     expected: float | None) -> None:
    from hetflow.tasks.pilot import job_walltime

    assert job_walltime(configured, left) == expected


def test_pilot_check_flags_a_slurm_pilot_without_walltime(tmp_path: Path) -> None:
    """``hetflow submit`` refuses such a pilot; ``pilot check`` says so before the user tries."""
    def check(body: str) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "lab.yaml"
        path.write_text(body)
        return subprocess.run([sys.executable, "-m", "hetflow.cli", "pilot", "check", str(path)], capture_output=True,
                              text=True, timeout=60, check=False)

    missing = check("name: lab\nbackend: slurm\nnodes: 2\n")
    assert missing.returncode == 2, missing
    assert missing.stdout.startswith("problem: walltime is not set: hetflow submit refuses a slurm pilot without one")
    timed = check("name: lab\nbackend: slurm\nnodes: 2\nwalltime: '00:30:00'\n")
    assert timed.returncode == 0 and timed.stdout.startswith(f"{tmp_path / 'lab.yaml'}: ok"), timed
