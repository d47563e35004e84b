"""``hetflow submit``'s batch script and sbatch call (pure), its errors without Slurm, and ``run --run-id``.

The job itself runs on the Slurm lab cluster in tests/slurm/test_submit.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hetflow import submit as submit_module
from hetflow.tasks.batch import batch_script, parse_job_id, sbatch_argv, slurm_time
from hetflow.tasks.errors import ConfigError, HetflowError
from hetflow.tasks.pilot import PilotDescription

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo" / "pipeline.py"
HETFLOW = [sys.executable, "-m", "hetflow.cli"]


def _pilot(**kw: object) -> PilotDescription:
    return PilotDescription(**{"name": "p", "backend": "slurm", "nodes": 2, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("seconds, text", [(1, "0-00:01:00"), (60, "0-00:01:00"), (61, "0-00:02:00"),
                                           (3600, "0-01:00:00"), (86400 + 90, "1-00:02:00")])
def test_slurm_time_rounds_up_to_minutes(seconds: float, text: str) -> None:
    assert slurm_time(seconds) == text


def test_script_has_the_pilots_directives_and_one_literal_command(tmp_path: Path) -> None:
    nasty = ["python", "-m", "hetflow.cli", "run", "my script.py", "--param", "x=$(touch pwned); rm -rf /", "it's"]
    text = batch_script(_pilot(walltime=5400.0, queue="batch", account="abc123", gpus_per_node=4), nasty,
                        job_name="hetflow-r1", output=tmp_path / "r1-%j.out", chdir=tmp_path / "a dir")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=hetflow-r1", "#SBATCH --nodes=2", "#SBATCH --exclusive", "#SBATCH --no-kill",
        "#SBATCH --time=0-01:30:00", "#SBATCH --partition=batch", "#SBATCH --account=abc123", "#SBATCH --gpus-per-node=4",
        f"#SBATCH --output={tmp_path}/r1-%j.out"]
    exec_line = next(line for line in lines if line.startswith("exec "))
    assert shlex.split(exec_line)[1:] == nasty  # the shell reads back exactly the argv, nothing runs
    assert shlex.split(next(line for line in lines if line.startswith("cd ")))[1] == str(tmp_path / "a dir")
    assert subprocess.run(["bash", "-n", "-c", text], check=False).returncode == 0


def test_script_refuses_placeholders_and_values_a_directive_cannot_carry(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="account is 'YOUR_ACCOUNT': set your allocation's account"):
        batch_script(_pilot(account="YOUR_ACCOUNT"), ["x"], job_name="j", output=tmp_path / "o", chdir=tmp_path)
    with pytest.raises(ConfigError, match="bad value for 'queue': 'a b'"):
        batch_script(_pilot(queue="a b"), ["x"], job_name="j", output=tmp_path / "o", chdir=tmp_path)
    with pytest.raises(ConfigError, match="has a space"):
        batch_script(_pilot(), ["x"], job_name="j", output=tmp_path / "a b" / "o", chdir=tmp_path)


def test_sbatch_argv_and_its_reply() -> None:
    assert sbatch_argv(Path("/w/s.sbatch")) == ["sbatch", "--parsable", "/w/s.sbatch"]
    assert sbatch_argv(Path("s"), dependency="afterany:42") == ["sbatch", "--parsable", "--dependency=afterany:42",
                                                                 "s"]
    assert parse_job_id("42\n") == "42" and parse_job_id("43;cluster\n") == "43"
    with pytest.raises(HetflowError, match="not a job id"):
        parse_job_id("sbatch: error: nope")


def test_job_command_runs_the_script_under_the_chosen_id(tmp_path: Path) -> None:
    argv = submit_module.job_command(DEMO, pilot="lab", run_id="demo-1", workdir=tmp_path, db=None,
                                     params=["n=3", "s=a b"])
    assert argv[:4] == [sys.executable, "-m", "hetflow.cli", "run"]
    assert argv[argv.index("--run-id") + 1] == "demo-1" and argv[argv.index("--backend") + 1] == "slurm"
    assert argv[-4:] == ["--param", "n=3", "--param", "s=a b"]


def test_submit_without_sbatch_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    (tmp_path / "lab.yaml").write_text("name: lab\nbackend: slurm\nnodes: 2\nwalltime: '00:10:00'\n")
    done = subprocess.run([*HETFLOW, "submit", str(DEMO), "--pilot", str(tmp_path / "lab.yaml"), "--workdir",
                           str(tmp_path / "w")], cwd=tmp_path, env=env, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stderr == ("hetflow: error: sbatch not found on PATH: hetflow submit needs a Slurm client "
                           "(or run the pipeline with hetflow run inside salloc)\n")
    assert not (tmp_path / "w" / "submit").exists()


def _submit_without_sbatch(tmp_path: Path, script: Path, config: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``hetflow submit`` where no ``sbatch`` (nor ``sinfo``) is on PATH: a check that refuses must come first."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    (tmp_path / "lab.yaml").write_text(config)
    return subprocess.run([*HETFLOW, "submit", str(script), "--pilot", str(tmp_path / "lab.yaml"), "--workdir",
                           str(tmp_path / "w"), *extra], cwd=tmp_path, env=env, check=False, capture_output=True,
                          text=True, timeout=120)


NO_SBATCH = ("hetflow: error: sbatch not found on PATH: hetflow submit needs a Slurm client "
             "(or run the pipeline with hetflow run inside salloc)\n")


def test_submit_refuses_a_pilot_without_walltime_unless_given_one(tmp_path: Path) -> None:
    """Without a walltime the job would get whatever time limit the partition defaults to."""
    refused = _submit_without_sbatch(tmp_path, DEMO, "name: lab\nbackend: slurm\nnodes: 2\n")
    assert refused.returncode == 2, refused
    assert refused.stderr == ("hetflow: error: pilot 'lab' has no walltime: the job would get the partition's "
                              "default time limit; set walltime: 'HH:MM:SS' in the config or pass --walltime "
                              "HH:MM:SS\n"), refused.stderr
    given = _submit_without_sbatch(tmp_path, DEMO, "name: lab\nbackend: slurm\nnodes: 2\n", "--walltime", "00:30:00")
    assert given.returncode == 2 and given.stderr == NO_SBATCH, given.stderr  # past every check, to sbatch
    ambiguous = _submit_without_sbatch(tmp_path, DEMO, "name: lab\nbackend: slurm\nnodes: 2\n", "--walltime", "00:30")
    assert ambiguous.returncode == 2 and ambiguous.stderr.startswith(
        "hetflow: error: --walltime: ambiguous duration '00:30'"), ambiguous.stderr
    assert not (tmp_path / "w" / "submit").exists()


LAB = "name: lab\nbackend: slurm\nnodes: 2\ncores_per_node: 4\ngpus_per_node: 0\nwalltime: '00:10:00'\n"


@pytest.mark.parametrize("body, expected", [
    ("import hetflow as hf\npipe = hf.Pipeline('p')\n@pipe.stage(outputs=['t'])\ndef s(ctx)\n    return {}\n",
     "hetflow: error: pipeline script {script} does not compile: SyntaxError in {script}, line 4: expected ':'\n"),
    ("import hetflow as hf\nimport no_such_module_here\npipe = hf.Pipeline('p')\n",
     "hetflow: error: pipeline script {script} failed before its run: ModuleNotFoundError: No module named "
     "'no_such_module_here'\n"),
    ("import hetflow as hf\npipe = hf.Pipeline('p')\n@pipe.stage(gpus_per_rank=1, outputs=['t'])\n"
     "def train(ctx):\n    open(TOUCHED, 'w').close()\n    return {}\nif __name__ == '__main__':\n    pipe.run()\n",
     "hetflow: error: pipeline 'p': stage 'train' (ranks=1, cores_per_rank=1, gpus_per_rank=1) can never run on "
     "pilot 'lab': 2 node(s) x 4 usable cores x 0 GPUs: 1 GPUs per rank but nodes have 0 GPUs\n"),
    ("import hetflow as hf\npipe = hf.Pipeline('p')\n@pipe.stage(ranks=9, inputs=['x'], outputs=['t'])\n"
     "def wide(ctx, x):\n    return {}\n",
     "hetflow: error: pipeline 'p', stage 'wide': input 'x' is not produced by any stage (outputs: ['t'])\n"),
])
def test_submit_refuses_a_script_that_would_fail_in_the_job(tmp_path: Path, body: str, expected: str) -> None:
    """A SyntaxError, an import that fails or a stage no node can hold is refused before sbatch, and no stage
    runs on the submitting host (the script's pipe.run() declares only)."""
    script = tmp_path / "p.py"
    script.write_text(body.replace("TOUCHED", repr(str(tmp_path / "ran"))))
    done = _submit_without_sbatch(tmp_path, script, LAB)
    assert done.returncode == 2, done
    assert done.stderr == expected.format(script=script), done.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "w" / "submit").exists()


def test_submit_checks_requests_against_the_pilots_shape_and_runs_no_stage(tmp_path: Path) -> None:
    script = tmp_path / "p.py"
    script.write_text("import hetflow as hf\npipe = hf.Pipeline('p')\n@pipe.stage(ranks=8, cores_per_rank=4, "
                      "outputs=['t'])\ndef wide(ctx):\n    open(TOUCHED, 'w').close()\n    return {}\n"
                      "pipe.run()\nopen(TOUCHED, 'w').close()\n".replace("TOUCHED", repr(str(tmp_path / "ran"))))
    too_wide = _submit_without_sbatch(tmp_path, script, LAB)
    assert too_wide.returncode == 2 and "stage 'wide'" in too_wide.stderr and "8 ranks but at most 2 fit" in \
        too_wide.stderr, too_wide.stderr
    fits = _submit_without_sbatch(tmp_path, script, LAB.replace("nodes: 2", "nodes: 8"))
    assert fits.returncode == 2 and fits.stderr == NO_SBATCH, fits.stderr  # checked, then on to sbatch
    assert not (tmp_path / "ran").exists()  # the script stopped at its pipe.run(): nothing after it ran


def test_run_id_starts_a_new_run_under_it_then_resumes_it(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    (tmp_path / "xdg").mkdir(mode=0o700)

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*HETFLOW, "run", str(DEMO), "--param", "events_per_rank=500", "--no-progress",
                               "--workdir", str(tmp_path / "w"), *extra], env=env, check=False, capture_output=True, text=True,
                              timeout=300)

    first = run("--run-id", "chosen-1")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("run chosen-1: DONE")
    again = run("--run-id", "chosen-1")  # a requeued job: the same run, nothing computed twice
    assert again.returncode == 0, again.stderr
    status = json.loads(subprocess.run([*HETFLOW, "status", "chosen-1", "--json", "--workdir", str(tmp_path / "w")],
                                       check=False, capture_output=True, text=True).stdout)
    assert status["id"] == "chosen-1" and {s["attempts"] for s in status["stages"]} == {1}, status
    prefix = run("--run-id", "chosen")  # a prefix of an existing id is a new run, not that one
    assert prefix.stdout.startswith("run chosen: DONE"), prefix
    bad = run("--run-id", "../x")
    assert bad.returncode == 2 and bad.stderr.startswith("hetflow: error: bad run id '../x'"), bad.stderr


def test_a_chained_script_runs_the_successor_with_the_jobs_left_and_keeps_the_pipelines_status(
        tmp_path: Path) -> None:
    pipeline_exit = tmp_path / "exit.sh"
    pipeline_exit.write_text("exit 3\n")
    record = tmp_path / "successor-args"
    successor = ["bash", "-c", f'echo "$@" > {shlex.quote(str(record))}', "successor", "r 1"]
    text = batch_script(_pilot(), ["bash", str(pipeline_exit)], job_name="j", output=tmp_path / "o",
                        chdir=tmp_path, successor=successor, chain=2)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    first = subprocess.run(["bash", str(script)], check=False)  # the job hetflow submit made: no argument
    assert first.returncode == 3 and record.read_text() == "r 1 2\n"
    later = subprocess.run(["bash", str(script), "0"], check=False)  # a successor's: its argument
    assert later.returncode == 3 and record.read_text() == "r 1 0\n"
    assert "exec " in batch_script(_pilot(), ["x"], job_name="j", output=tmp_path / "o", chdir=tmp_path,
                                   successor=successor, chain=0)


def test_successor_is_submitted_only_for_a_run_the_walltime_stopped(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from hetflow.store import RunRecord, Store

    store = Store.for_workdir(tmp_path)
    with store.session() as session:
        for run_id, state in (("r-done", "DONE"), ("r-stopped", "STOPPED")):
            session.add(RunRecord(id=run_id, pipeline="p", created=0.0, run_dir=str(tmp_path), state=state,
                                  hetflow_version="0"))
    store.close()
    assert submit_module.submit_successor("r-done", tmp_path / "x.sbatch", 3, workdir=tmp_path, db=None) is None
    assert submit_module.submit_successor("r", tmp_path / "x.sbatch", 3, workdir=tmp_path, db=None) is None
    # STOPPED, but the chain is used up: no job, and the way to resume by hand
    assert submit_module.submit_successor("r-stopped", tmp_path / "x.sbatch", 0, workdir=tmp_path, db=None) is None
    assert f"resume it with: sbatch {tmp_path / 'x.sbatch'}" in capsys.readouterr().out


def test_a_failed_run_inside_a_submitted_job_says_to_resume_it_with_its_batch_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hetflow resume` on a login node would use the script's own pilot; the job's batch script resumes it."""
    batch = tmp_path / "w" / "submit" / "r 1.sbatch"
    script = batch_script(_pilot(), ["python", "p.py"], job_name="j", output=tmp_path / "o", chdir=tmp_path,
                          resume=batch)
    assert f"export HETFLOW_RESUME_BATCH={shlex.quote(str(batch))}" in script.splitlines()
    (tmp_path / "p.py").write_text("import hetflow as hf\npipe = hf.Pipeline('boom', pilot='local')\n"
                                   "@pipe.stage(outputs=['t'])\ndef boom(ctx):\n    raise ValueError('boom')\n")
    env = {**os.environ, "HETFLOW_RESUME_BATCH": str(batch)}
    done = subprocess.run([sys.executable, "-m", "hetflow.cli", "run", "p.py", "--no-progress"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    assert f"resume it with: sbatch {shlex.quote(str(batch))}  (from a login node" in done.stdout, done.stdout
    assert "hetflow resume" not in done.stdout + done.stderr
    # `python p.py` and pipe.run() raise RunFailed with the same hint
    from hetflow.errors import resume_hint

    monkeypatch.delenv("HETFLOW_RESUME_BATCH", raising=False)
    assert resume_hint("r1") == "resume it with: hetflow resume r1"
    monkeypatch.setenv("HETFLOW_RESUME_BATCH", str(batch))
    assert resume_hint("r1") == f"resume it with: sbatch {shlex.quote(str(batch))}"


def test_partition_shape_reads_sinfo_per_node_lines() -> None:
    text = ("64|gpu:a100:4(S:0-1)|gpu\n128|(null)|cpu*\n64|gpu:4|gpu\n32|(null)|cpu*\n"
            "48|gpu:a100:2,gpu:v100:2|mixed\n")
    assert submit_module.partition_shape(text, queue=None) == (128, 0)  # the default partition, marked *
    assert submit_module.partition_shape("64|gpu:a100:4(S:0-1)|gpu\n64|gpu:4|gpu\n", queue="gpu") == (64, 4)
    assert submit_module.partition_shape("48|gpu:a100:2,gpu:v100:2|mixed\n", queue="mixed") == (48, 4)
    assert submit_module.partition_shape("", queue="gpu") is None
    assert submit_module.partition_shape("64|(null)|other\n", queue=None) is None  # no default partition listed


DECLARES_N = ("import pyarrow as pa\nimport hetflow as hf\npipe = hf.Pipeline('p', pilot='local')\n"
              "@pipe.stage(outputs=['t'], params={'n': 1})\ndef make(ctx):\n    return {'t': pa.table({'v': [1]})}\n"
              "if __name__ == '__main__':\n    pipe.run()\n")


@pytest.mark.parametrize("param", ["lr=0.5", "n=abc", "nn=2", "n=1.5"])
def test_submit_refuses_a_param_as_hetflow_run_does_before_sbatch(tmp_path: Path, param: str) -> None:
    """A key no stage declares, or a value not of its declared type, fails the job's ``hetflow run`` at once:
    ``hetflow submit`` refuses it first, with the message ``hetflow run`` gives."""
    script = tmp_path / "p.py"
    script.write_text(DECLARES_N)
    ran = subprocess.run([*HETFLOW, "run", str(script), "--param", param, "--workdir", str(tmp_path / "r")],
                         cwd=tmp_path, check=False, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2 and ran.stderr.startswith(f"hetflow: error: --param {param}: "), ran.stderr
    done = _submit_without_sbatch(tmp_path, script, LAB, "--param", param)
    assert done.returncode == 2, done
    assert done.stderr == ran.stderr, done.stderr
    assert not (tmp_path / "w" / "submit").exists()
    fits = _submit_without_sbatch(tmp_path, script, LAB, "--param", "n=5", "--param", param, "--param", "n=7")
    if param.startswith("n="):                                          # the last value of a key is the one used
        assert fits.returncode == 2 and fits.stderr == NO_SBATCH, fits.stderr
    else:
        assert fits.returncode == 2 and fits.stderr == ran.stderr, fits.stderr
