"""``hetflow submit`` on the Slurm lab cluster: a real sbatch job runs the demo pipeline on backend slurm."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import hetflow as hf
import pyarrow as pa
import pytest
from test_lab_cluster import _leftovers, _no_jobs_left, _run

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEMO = ROOT / "examples" / "demo" / "pipeline.py"
HETFLOW = str(Path(sys.executable).parent / "hetflow")


def _hashes(workdir: Path, run_id: str, env: dict[str, str]) -> dict[str, str]:
    rows = json.loads(_run([HETFLOW, "datasets", run_id, "--json", "--workdir", str(workdir)], env).stdout)
    out = {}
    for row in rows:
        sink = pa.BufferOutputStream()
        table = hf.open_dataset(row["path"]).to_table().combine_chunks()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        out[row["name"]] = hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()
    return out


def _pilot(tmp_path: Path, nodes: int) -> Path:
    config = tmp_path / f"lab-{nodes}.yaml"
    config.write_text(f"name: lab\nbackend: slurm\nnodes: {nodes}\nwalltime: '00:05:00'\n")
    return config


@pytest.mark.timeout(600)
def test_submit_runs_the_demo_to_done_and_status_follows_it(slurm_env: dict[str, str], slurm_nodes: list[str],
                                                            tmp_path: Path) -> None:
    workdir = tmp_path / "shared"
    out = _run([HETFLOW, "submit", str(DEMO), "--pilot", str(_pilot(tmp_path, 2)), "--param", "events_per_rank=5000",
                "--workdir", str(workdir)], slurm_env, timeout=180).stdout
    first = out.splitlines()[0].split()
    assert first[:3] == ["submitted", "batch", "job"] and first[4] == "run", out
    job_id, run_id = first[3].rstrip(":"), first[5]
    seen: set[str] = set()
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:  # sbatch --wait returns late: poll the queue and the store
        queued = _run(["squeue", "-h", "-j", job_id, "-o", "%T"], slurm_env).stdout.strip()
        status = subprocess.run([HETFLOW, "status", run_id, "--json", "--workdir", str(workdir)], env=slurm_env, check=False,
                                capture_output=True, text=True)
        state = json.loads(status.stdout)["state"] if status.returncode in (0, 1) else None  # 2: not started yet
        if state is not None:
            seen.add(state)
        if not queued and state not in (None, "RUNNING"):
            break
        time.sleep(1)
    final = json.loads(_run([HETFLOW, "status", run_id, "--json", "--workdir", str(workdir)], slurm_env).stdout)
    log = next((workdir / "submit").glob(f"{run_id}-{job_id}.out")).read_text()
    assert final["state"] == "DONE", (final, log)
    assert "RUNNING" in seen, seen  # status answered from this host while the job ran
    nodes = {slot["node"] for stage in final["stages"] for slot in stage["slots"]}
    assert nodes <= set(slurm_nodes[:2]) and nodes, final
    local = tmp_path / "local"
    _run([HETFLOW, "run", str(DEMO), "--param", "events_per_rank=5000", "--no-progress", "--workdir", str(local)],
         slurm_env, timeout=300)
    local_id = json.loads(_run([HETFLOW, "status", "--json", "--workdir", str(local)], slurm_env).stdout)["id"]
    submitted = _hashes(workdir, run_id, slurm_env)
    assert set(submitted) == {"events", "per_detector", "energy_quantiles"}
    assert submitted == _hashes(local, local_id, slurm_env)
    _no_jobs_left(slurm_env)
    assert _leftovers(str(tmp_path)) == []


def test_submit_refused_by_slurm_is_one_line_and_exit_2(slurm_env: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run([HETFLOW, "submit", str(DEMO), "--pilot", str(_pilot(tmp_path, 7)),
                           "--workdir", str(tmp_path / "w")], env=slurm_env, check=False, capture_output=True, text=True)
    assert done.returncode == 2, done
    assert done.stderr.startswith("hetflow: error: sbatch refused ") and done.stderr.count("\n") == 1, done.stderr
    assert "More processors requested than permitted" in done.stderr, done.stderr  # Slurm's own reason
    assert done.stdout == ""
    assert list((tmp_path / "w" / "submit").iterdir()) == []  # no batch script of a job that does not exist


@pytest.mark.timeout(600)
def test_chain_resumes_a_run_the_walltime_stopped_in_a_second_job(slurm_env: dict[str, str],
                                                                  tmp_path: Path) -> None:
    workdir, marks = tmp_path / "shared", tmp_path / "marks.txt"
    config = tmp_path / "minute.yaml"
    config.write_text("name: minute\nbackend: slurm\nnodes: 1\nwalltime: '00:01:00'\ndrain: 10\n")
    out = _run([HETFLOW, "submit", str(HERE / "chain_pipeline.py"), "--pilot", str(config), "--chain", "2",
                "--param", f"marks={marks}", "--workdir", str(workdir)], slurm_env, timeout=180).stdout
    run_id = out.splitlines()[0].split()[5]
    deadline, state = time.monotonic() + 400, None
    while time.monotonic() < deadline:
        queued = _run(["squeue", "-h", "-n", f"hetflow-{run_id}", "-o", "%i %T"], slurm_env).stdout.strip()
        status = subprocess.run([HETFLOW, "status", run_id, "--json", "--workdir", str(workdir)], env=slurm_env,
                                check=False, capture_output=True, text=True)
        state = json.loads(status.stdout)["state"] if status.returncode in (0, 1) else None
        if not queued and state not in (None, "RUNNING"):
            break
        time.sleep(1)
    logs = sorted((workdir / "submit").glob(f"{run_id}-*.out"))
    text = "\n".join(f"{log.name}:\n{log.read_text()}" for log in logs)
    assert state == "DONE", text
    # 60 s of work cannot fit one 60-s allocation: two jobs on a quiet machine (two stages each); a third
    # is allowed because a loaded machine (CI runs other tests beside this one) can fit only one stage
    # into an allocation -- what is tested is that each successor resumes the run, never redoing a stage
    assert len(logs) in (2, 3), text
    assert all("STOPPED by the walltime: submitted job" in log.read_text() for log in logs[:-1]), text
    done = [line.split() for line in marks.read_text().splitlines()]
    order = [stage for stage, _ in done]
    assert [s for i, s in enumerate(order) if i == 0 or order[i - 1] != s] == ["first", "second", "third", "fourth"], done
    for i in range(1, len(done)):  # a stage that finished never runs again; one cut off by the end of its
        if done[i][0] == done[i - 1][0]:  # allocation (the mark is written before its output commits) may
            job = done[i - 1][1]  # run again in the next job: it was the last thing its job ran
            assert done[i][1] != job and [j for _, j in done].index(done[i][1]) == i, done
    assert len({job for _, job in done}) == len(logs), done  # the run went on in each successor job
    _no_jobs_left(slurm_env)
    assert _leftovers(str(tmp_path)) == []


def test_submit_refuses_a_stage_no_node_of_the_partition_can_hold(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The pilot leaves the node shape to the job: hetflow submit asks sinfo for the partition's nodes."""
    script = tmp_path / "wide.py"
    script.write_text("import hetflow as hf\npipe = hf.Pipeline('wide')\n@pipe.stage(cores_per_rank=64, outputs=['t'])\n"
                      "def wide(ctx):\n    return {}\n")
    done = subprocess.run([HETFLOW, "submit", str(script), "--pilot", str(_pilot(tmp_path, 1)),
                           "--workdir", str(tmp_path / "w")], env=slurm_env, check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done
    assert done.stderr.startswith("hetflow: error: pipeline 'wide': stage 'wide' (ranks=1, cores_per_rank=64"), done.stderr
    assert "can never run on pilot 'lab': 1 node(s) x 2 usable cores" in done.stderr, done.stderr
    assert not (tmp_path / "w" / "submit").exists()
    assert _run(["squeue", "-h", "-n", "hetflow-wide", "-o", "%i"], slurm_env).stdout.strip() == ""


HELD = '''
import time
from pathlib import Path
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("held")

@pipe.stage(outputs=["t"], params={"mark": ""})
def hold(ctx):
    Path(ctx.params["mark"]).write_text("holding")
    time.sleep(300)
    return {"t": pa.table({"x": [1]})}
'''


@pytest.mark.timeout(300)
def test_scancel_records_the_run_interrupted_at_once(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """scancel sends the job SIGTERM: the run ends INTERRUPTED (resumable) before Slurm's SIGKILL, instead
    of showing RUNNING until its lease lapsed and then FAILED."""
    script, mark, workdir = tmp_path / "held.py", tmp_path / "mark", tmp_path / "shared"
    script.write_text(HELD)
    out = _run([HETFLOW, "submit", str(script), "--pilot", str(_pilot(tmp_path, 1)), "--param", f"mark={mark}",
                "--workdir", str(workdir)], slurm_env, timeout=120).stdout
    first = out.splitlines()[0].split()
    job_id, run_id = first[3].rstrip(":"), first[5]
    deadline = time.monotonic() + 180
    while not mark.exists():
        assert time.monotonic() < deadline, _run(["squeue", "-h", "-j", job_id, "-o", "%T %R"], slurm_env).stdout
        time.sleep(0.5)
    _run(["scancel", job_id], slurm_env)
    cancelled = time.monotonic()
    state = None
    while time.monotonic() < cancelled + 20:  # the lease alone would take LEASE_SECONDS
        status = json.loads(subprocess.run([HETFLOW, "status", run_id, "--json", "--workdir", str(workdir)],
                                           env=slurm_env, check=False, capture_output=True, text=True).stdout)
        state = status["state"]
        if state != "RUNNING":
            break
        time.sleep(0.5)
    log = next((workdir / "submit").glob(f"{run_id}-{job_id}.out")).read_text()
    assert state == "INTERRUPTED" and "SIGTERM" in status["error"], (status, log)
    assert {s["name"]: s["state"] for s in status["stages"]} == {"hold": "CANCELLED"}, status
    _no_jobs_left(slurm_env)
    assert _leftovers(str(tmp_path)) == []


MOVES = '''
import os
from pathlib import Path
import pyarrow as pa
import hetflow as hf

os.chdir(Path(__file__).parent / "data")  # common at a script's top: its relative reads are from data/
pipe = hf.Pipeline("moves")

@pipe.stage(outputs=["out"], params={"n": 1})
def make(ctx):
    return {"out": pa.table({"v": [ctx.params["n"]]})}

if __name__ == "__main__":
    pipe.run()
'''


@pytest.mark.timeout(300)
def test_submit_from_where_it_was_typed_though_the_script_changes_directory(slurm_env: dict[str, str],
                                                                            tmp_path: Path) -> None:
    """``hetflow submit p.py --pilot lab.yaml`` with relative paths, of a script whose top level moves to
    data/ (it runs here, before the job is written): the job runs this p.py with this lab.yaml, its work
    directory is ./.hetflow, and it starts here -- it runs to DONE, and the submitter is back where it was."""
    (tmp_path / "p.py").write_text(MOVES)
    (tmp_path / "data").mkdir()
    (tmp_path / "lab.yaml").write_text("name: lab\nbackend: slurm\nnodes: 1\nwalltime: '00:05:00'\n")
    done = subprocess.run([HETFLOW, "submit", "p.py", "--pilot", "lab.yaml", "--param", "n=5"], cwd=tmp_path,
                          env=slurm_env, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0].split()
    job_id, run_id = first[3].rstrip(":"), first[5]
    assert f"hetflow status {run_id} --workdir {tmp_path / '.hetflow'}" in done.stdout, done.stdout
    batch = (tmp_path / ".hetflow" / "submit" / f"{run_id}.sbatch").read_text()
    assert f"cd {tmp_path}\n" in batch and f" run {tmp_path / 'p.py'} --pilot {tmp_path / 'lab.yaml'} " in batch, batch
    deadline, state = time.monotonic() + 200, None
    while time.monotonic() < deadline:
        queued = _run(["squeue", "-h", "-j", job_id, "-o", "%T"], slurm_env).stdout.strip()
        status = subprocess.run([HETFLOW, "status", run_id, "--json"], cwd=tmp_path, env=slurm_env, check=False,
                                capture_output=True, text=True)
        state = json.loads(status.stdout)["state"] if status.returncode in (0, 1) else None
        if not queued and state not in (None, "RUNNING"):
            break
        time.sleep(1)
    log = (tmp_path / ".hetflow" / "submit" / f"{run_id}-{job_id}.out").read_text()
    assert state == "DONE", log
    assert list((tmp_path / "data").iterdir()) == []                       # nothing went where the script moved
    assert _leftovers(str(tmp_path)) == []


def _held_submit(tmp_path: Path, env: dict[str, str]) -> tuple[str, str]:
    """``hetflow submit p.py --pilot lab.yaml`` through an ``sbatch`` that holds the job (``--hold``): it waits
    in the queue, as a job does on a busy machine, until :func:`_release_and_wait` releases it."""
    out = subprocess.run([HETFLOW, "submit", "p.py", "--pilot", "lab.yaml"], cwd=tmp_path, env=env, check=False,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0].split()
    job_id, run_id = first[3].rstrip(":"), first[5]
    assert _run(["squeue", "-h", "-j", job_id, "-o", "%T"], env).stdout.strip() == "PENDING"
    return job_id, run_id


def _release_and_wait(tmp_path: Path, env: dict[str, str], job_id: str, run_id: str) -> tuple[int, str]:
    """Release the held job, wait until it has left the queue; ``hetflow status``'s exit code and the job's log."""
    _run(["scontrol", "release", job_id], env)
    deadline = time.monotonic() + 200
    while _run(["squeue", "-h", "-j", job_id, "-o", "%T"], env).stdout.strip():
        assert time.monotonic() < deadline, f"job {job_id} still queued"
        time.sleep(1)
    status = subprocess.run([HETFLOW, "status", run_id, "--json"], cwd=tmp_path, env=env, check=False,
                            capture_output=True, text=True)
    log = (tmp_path / ".hetflow" / "submit" / f"{run_id}-{job_id}.out").read_text()
    return status.returncode, log


@pytest.mark.timeout(600)
def test_a_job_starts_its_run_only_from_the_script_and_config_submit_checked(slurm_env: dict[str, str],
                                                                              tmp_path: Path) -> None:
    """Before, a job read the script and the pilot config when it started: a user who edited them while the
    job waited (to submit the next variant) had it run the edited script under the submitted run's id, and a
    config edited after the check was read unchecked.  Now the job refuses, naming the file; unchanged, it runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\nexec {shutil.which("sbatch", path=slurm_env["PATH"])} --hold "$@"\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = dict(slurm_env, PATH=f"{bin_dir}:{slurm_env['PATH']}")
    (tmp_path / "p.py").write_text(MOVES)
    (tmp_path / "data").mkdir()
    (tmp_path / "lab.yaml").write_text("name: lab\nbackend: slurm\nnodes: 1\nwalltime: '00:05:00'\n")

    job_id, run_id = _held_submit(tmp_path, env)
    (tmp_path / "p.py").write_text((tmp_path / "p.py").read_text().replace('{"n": 1}', '{"n": 2}'))
    code, log = _release_and_wait(tmp_path, env, job_id, run_id)
    assert code == 2, log  # no such run: nothing ran
    assert f"the script {tmp_path / 'p.py'} changed after hetflow submit checked it" in log, log

    job_id, run_id = _held_submit(tmp_path, env)
    (tmp_path / "lab.yaml").write_text("name: lab\nbackend: slurm\nnodes: 1\nwalltime: '00:50:00'\n")
    code, log = _release_and_wait(tmp_path, env, job_id, run_id)
    assert code == 2 and f"the pilot {tmp_path / 'lab.yaml'} changed after hetflow submit checked it" in log, log

    job_id, run_id = _held_submit(tmp_path, env)
    code, log = _release_and_wait(tmp_path, env, job_id, run_id)
    assert code == 0 and "DONE" in log, log
    _no_jobs_left(slurm_env)
    assert _leftovers(str(tmp_path)) == []
