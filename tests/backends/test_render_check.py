"""``pilot render`` for every shipped config and backend, ``pilot check``, and the backend registry."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest

from hetflow.tasks.backends import backend_names, get_backend, require
from hetflow.tasks.description import ResourceRequest
from hetflow.tasks.errors import ConfigError, MissingExtraError
from hetflow.tasks.pilot import PilotDescription, config_names, load_pilot
from hetflow.tasks.render import check, render

SHIPPED = config_names()
BATCH_MARK = {"slurm": "#SBATCH", "lsf": "#BSUB", "pbs": "#PBS"}


def _json_after(text: str, heading: str) -> object:
    """The JSON document that follows the comment line starting with ``heading``."""
    start = text.index(heading)
    lines = text[start:].split("\n")
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return json.JSONDecoder().raw_decode("\n".join(lines))[0]


def test_shipped_configs_include_the_issue_machines() -> None:
    assert {"local", "ornl-frontier", "ornl-summit", "slurm-generic", "pbs-generic"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_render_radical_is_the_pilot_it_would_submit(name: str) -> None:
    pilot = load_pilot(name).resolve()
    text = render(pilot, "radical")
    assert text == render(pilot, "radical")  # stable
    description = _json_after(text, "# radical.pilot.PilotDescription")
    assert isinstance(description, dict)
    assert description["nodes"] == pilot.nodes
    assert description["runtime"] == int((pilot.walltime or 3600) // 60)
    if pilot.account:
        assert description["project"] == pilot.account
    if pilot.queue:
        assert description["queue"] == pilot.queue
    task = _json_after(text, "# radical.pilot.TaskDescription")
    assert isinstance(task, dict) and task["ranks"] == len(task["slots"])
    usable = set(pilot.usable_cores())
    for slot in task["slots"]:
        assert set(slot["cores"]) <= usable and all(g < (pilot.gpus_per_node or 0) for g in slot["gpus"])
    assert task["executable"] == "python" and task["arguments"][:2] == ["-m", "hetflow.tasks.worker"]
    if pilot.resource in (None, "local.localhost") or str(pilot.resource).startswith("hetflow."):
        config = _json_after(text, "# resource config written to")
        assert isinstance(config, dict)
        (host_config,) = config.values()
        assert host_config["cores_per_node"] == pilot.cores_per_node
        assert host_config["gpus_per_node"] == (pilot.gpus_per_node or 0)
    else:
        assert f"RP's shipped {pilot.resource!r}" in text


@pytest.mark.parametrize("name", SHIPPED)
def test_render_parsl_is_the_config_and_batch_script(name: str) -> None:
    pilot = load_pilot(name).resolve()
    text = render(pilot, "parsl")
    assert text == render(pilot, "parsl")
    assert "MPIExecutor(" in text and "label='hetflow'" in text
    scheduler = re.search(r"on Parsl, (\w+) scheduler", text)
    assert scheduler is not None
    kind = scheduler.group(1)
    if kind == "local":
        assert "LocalProvider(" in text and "export PBS_NODEFILE=RUN_DIR/parsl/nodefile" in text
        assert text.count("\nlocalhost") == pilot.nodes * len(pilot.usable_cores())
    else:
        mark = BATCH_MARK[kind]
        script = text[text.index("# block script"):]
        assert f"{mark}" in script and "process_worker_pool.py" in script
        assert str(pilot.account) in script and str(pilot.queue) in script
        if kind == "slurm":
            assert f"#SBATCH --nodes={pilot.nodes}" in script
        if kind == "pbs":
            assert f"select={pilot.nodes}:ncpus={pilot.cores_per_node}" in script
        if kind == "lsf":
            assert f"#BSUB -nnodes {pilot.nodes}" in script
    spec = _json_after(text, "# parsl_resource_specification")
    assert isinstance(spec, dict) and spec["num_ranks"] >= 1


def test_render_submits_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Any sbatch/bsub/qsub the render might run would be found here and leave a trace.
    for tool in ("sbatch", "bsub", "qsub"):
        script = tmp_path / tool
        script.write_text(f"#!/bin/sh\ntouch {tmp_path}/{tool}.ran\n")
        script.chmod(0o700)
    monkeypatch.setenv("PATH", f"{tmp_path}:{shutil.os.environ['PATH']}")
    for name in SHIPPED:
        render(load_pilot(name).resolve(), "parsl")
        render(load_pilot(name).resolve(), "radical")
    assert sorted(p.name for p in tmp_path.glob("*.ran")) == []


def test_render_rejects_other_backends() -> None:
    with pytest.raises(ConfigError, match="renderable backends"):
        render(load_pilot("local").resolve(), "dask")  # type: ignore[arg-type]


def test_check_local_is_clean_and_shipped_batch_configs_ask_for_account() -> None:
    assert check(load_pilot("local").resolve()) == []
    for name in SHIPPED:
        pilot = load_pilot(name)
        if pilot.backend == "local":
            continue
        problems = check(pilot)
        assert problems and all(("account" in p or "queue" in p) for p in problems), (name, problems)
        filled = dataclasses.replace(pilot, account="abc123", queue="batch")
        assert check(filled) == [], (name, check(filled))


def test_check_reports_requests_that_cannot_fit() -> None:
    summit = dataclasses.replace(load_pilot("ornl-summit"), account="abc123")
    problems = check(summit, {"train": ResourceRequest(ranks=2, gpus_per_rank=8),
                              "ok": ResourceRequest(ranks=12, gpus_per_rank=1)})
    assert len(problems) == 1
    assert "stage 'train'" in problems[0] and "8 GPUs per rank but nodes have 6 GPUs" in problems[0]


def test_check_reports_config_mistakes() -> None:
    base = dataclasses.replace(load_pilot("slurm-generic"), account="a", queue="q")
    assert check(base) == []
    wrong_launcher = dataclasses.replace(base, launcher="jsrun")
    assert any("launcher 'jsrun' with the slurm scheduler" in p for p in check(wrong_launcher))
    bad_option = dataclasses.replace(base, options={"parsl": {"schedular": "slurm"}})
    assert any("options.parsl.schedular" in p for p in check(bad_option))
    no_walltime = dataclasses.replace(base, walltime=None)
    assert any("walltime is not set" in p for p in check(no_walltime))
    long_drain = dataclasses.replace(base, drain=7200.0)
    assert any("drain" in p for p in check(long_drain))
    rp = dataclasses.replace(base, backend="radical", resource="ornl.fronteer")
    assert any("'ornl.fronteer' is not a RADICAL-Pilot resource" in p and "ornl.frontier" in p for p in check(rp))
    gpus = PilotDescription(name="g", backend="dask", cores_per_node=2, gpus_per_node=4, memory_per_node=1)
    assert any("4 GPUs per node but only 2 usable cores" in p for p in check(gpus))
    dask = PilotDescription(name="d", backend="dask", cores_per_node=2, gpus_per_node=0, memory_per_node=1,
                            options={"dask": {"communicator": "gloo"}})
    assert any("options.dask.communicator is 'gloo'" in p and "'tcp'" in p for p in check(dask))
    assert check(dataclasses.replace(dask, options={"dask": {"communicator": "tcp"}})) == []


def test_registry_knows_every_backend_and_imports_lazily() -> None:
    assert backend_names() == ["local", "slurm", "radical", "parsl", "dask"]
    for name in backend_names():
        assert get_backend(name).name == name
    with pytest.raises(ConfigError, match=r"unknown backend 'pbs' \(known backends: \['local'"):
        get_backend("pbs")


def test_missing_engine_names_the_pip_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetflow.tasks import backends

    monkeypatch.setitem(backends._REGISTRY, "ghost", ("ghost", "GhostBackend", ("hetflow_no_such_engine",), "ghost"))
    with pytest.raises(MissingExtraError, match=r"pip install 'hetflow\[ghost\]'") as info:
        require("ghost")
    assert isinstance(info.value, ImportError)


@pytest.mark.parametrize("name", SHIPPED)
def test_render_radical_with_raptor_shows_master_worker_and_function_task(name: str) -> None:
    base = load_pilot(name).resolve()
    options = dict(base.options)
    options["radical"] = {**dict(options.get("radical", {})), "raptor": True}
    pilot = dataclasses.replace(base, options=options)
    text = render(pilot, "radical")
    assert text == render(pilot, "radical")
    assert "# Raptor" not in render(base, "radical")  # only with the option on
    master = _json_after(text, "# Raptor master:")
    worker = _json_after(text, "# Raptor MPI worker:")
    assert isinstance(master, dict) and isinstance(worker, dict)
    assert master["mode"] == "raptor.master" and len(master["slots"]) == 1
    usable = list(pilot.usable_cores())
    assert worker["mode"] == "raptor.worker" and worker["raptor_id"] == master["uid"]
    assert worker["raptor_class"] == "HetflowWorker" and worker["raptor_file"].endswith("raptor.py")
    assert worker["ranks"] == len(usable) and [s["cores"] for s in worker["slots"]] == [[c] for c in usable]
    task = _json_after(text, "# radical.pilot.TaskDescription")
    assert isinstance(task, dict)
    if any(slot["gpus"] for slot in task["slots"]):
        assert "# Raptor: the example stage stays the RP task above: it uses GPUs" in text
    else:
        function = _json_after(text, "# Raptor function task:")
        assert isinstance(function, dict)
        assert function["mode"] == "task.function" and function["function"] == "hetflow_stage"
        assert function["raptor_id"] == master["uid"] and function["ranks"] == task["ranks"]
        assert function["args"][0] == task["arguments"][2]  # the worker spec path, nothing serialised


def test_raptor_option_must_be_a_boolean() -> None:
    pilot = PilotDescription(name="p", backend="radical", cores_per_node=2, gpus_per_node=0,
                             memory_per_node=2**30, options={"radical": {"raptor": "yes"}})
    with pytest.raises(ConfigError, match=r"options.radical.raptor.*'yes'.*true or false"):
        render(pilot, "radical")
