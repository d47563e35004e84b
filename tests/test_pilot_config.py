"""Pilot descriptions and config files: validation names file, key and allowed values."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetflow.tasks.errors import ConfigError
from hetflow.tasks.pilot import PilotDescription, config_names, load_pilot, parse_bytes, parse_duration


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
    ("backend: slurm\n", "backend"),
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


def test_usable_cores_skip_reserved() -> None:
    pilot = PilotDescription(name="p", nodes=2, cores_per_node=8, gpus_per_node=0, memory_per_node=1,
                             reserved_cores=(0, 4), backend="radical")
    assert pilot.usable_cores() == (1, 2, 3, 5, 6, 7)
    assert "2 node(s) x 6 usable cores x 0 GPUs" in pilot.shape()
