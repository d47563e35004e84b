"""``hetflow submit``: write a pipeline's Slurm batch script and ``sbatch`` it.

The run id is chosen here, before the job exists, so the submitter can print
it and ``hetflow status RUN`` finds the run from the submitting host; the job
runs ``hetflow run SCRIPT --run-id ID --backend slurm`` with the same work
directory and state store (which must therefore be on a file system both
hosts see).  ``--run-id`` starts the run under that id, or resumes it if it
exists, so a requeued job continues rather than starts over.  The batch
script lives beside the job's log in ``WORKDIR/submit/``.

Nothing is submitted that would fail in the queue for a reason visible here:
the script is executed as ``hetflow run`` executes it, up to its first
``pipe.run()`` (which runs nothing, :func:`declared_pipelines`), so a
SyntaxError or a bad declaration is refused at once; each pipeline is
validated against the pilot, shaped by the config or else by ``sinfo`` for
the job's partition (:func:`job_shape`); each ``--param`` is checked against
the stages' declarations as ``hetflow run`` checks it; and a pilot without a
walltime is refused (the job would get the partition's default time limit,
whatever it is).  Every path is read from the directory the command was typed
in, before the script's top level runs (it may ``os.chdir``), and the job
starts there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import runpy
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hetflow.tasks.batch import batch_script, parse_job_id, sbatch_argv
from hetflow.tasks.errors import ConfigError, HetflowError
from hetflow.tasks.pilot import PilotDescription, absolute_spec, load_pilot

from .datadir import check_data_dir
from .errors import absolute_db
from .params import from_command_line
from .pipeline import Declared, Pipeline, RunOptions, run_options

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SubmitError(HetflowError):
    """The job could not be submitted (no ``sbatch``, or Slurm refused it)."""


class SubmitRefused(SubmitError):
    """``sbatch`` ran and refused the job."""


class ScriptError(SubmitError):
    """The pipeline script fails before it reaches its run (a SyntaxError, an exception at its top level)."""


class ChangedInQueue(SubmitError):
    """The job would start its run from a script or pilot config that changed after ``hetflow submit`` checked it."""


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_id: str
    script: Path
    """The batch script that was submitted."""
    log: Path
    """Where the job's stdout and stderr go (``%j`` is the job id)."""


def new_run_id(script: Path) -> str:
    """A fresh run id named after the script (the pipeline's name is only known once it runs)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", script.stem).lstrip("._-") or "run"
    return f"{stem[:64]}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise HetflowError(f"bad run id {run_id!r} (expected letters, digits and ._- , at most 128, "
                           "not starting with ._-)")
    return run_id


def job_command(script: Path, *, pilot: str, run_id: str, workdir: Path, db: str | None,
                params: Sequence[str], data_dir: str | None = None, checked: Path | None = None) -> list[str]:
    """The ``hetflow run`` argv the job executes (this Python, so the same installation runs it).
    ``checked``: the note of what was checked (:func:`write_checked`), compared when the job starts the run."""
    argv = [sys.executable, "-m", "hetflow.cli", "run", str(script), "--pilot", pilot, "--backend", "slurm",
            "--run-id", run_id, "--workdir", str(workdir), "--no-progress"]
    if checked is not None:
        argv += ["--submitted", str(checked)]
    if db is not None:
        argv += ["--db", db]
    if data_dir is not None:
        argv += ["--data-dir", data_dir]
    for param in params:  # KEY=VALUE as the user typed it: the job parses it as hetflow run does
        argv += ["--param", param]
    return argv


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def write_checked(note: Path, script: Path, pilot: str) -> None:
    """Note the digests of the script and of the pilot config file (``pilot``, when it names a file rather
    than a shipped config) as ``hetflow submit`` checked them, for :func:`check_unchanged` in the job."""
    files = {"script": str(script)}
    if Path(pilot).is_file():
        files["pilot"] = pilot
    data = {"submitted": time.time(), "files": {what: [path, _digest(Path(path))] for what, path in files.items()}}
    fd = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(data, out)


def check_unchanged(note: Path, run_id: str, workdir: Path, db: str | None) -> None:
    """In the job, before the script runs: raise :class:`ChangedInQueue` when run ``run_id`` does not exist
    yet and the script or pilot config differs from what ``hetflow submit`` checked (``note``).

    Decision: a job waits in the queue, and the files it reads are read when it starts.  A user who edits
    the script (or the config) and submits again would otherwise get two jobs that both run the last
    version, each reported as the run that was submitted; so a job starts its run only from what was
    checked, and says what changed.  Once the run exists (a requeued job, a chained successor, the batch
    script run again after fixing a failure) it is resumed from the files as they are then, as
    ``hetflow resume`` would; the modules the script imports are read when the job runs."""
    from .store import Store

    if Store.for_workdir(workdir, db).find_run(run_id) is not None:
        return
    try:
        data = json.loads(note.read_text())
        files = {what: (str(path), digest) for what, (path, digest) in data["files"].items()}
        submitted = float(data["submitted"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ChangedInQueue(f"run {run_id}: cannot read what hetflow submit checked ({note}: {exc}); "
                             "submit the script again") from None
    for what, (path, digest) in sorted(files.items()):
        if _digest(Path(path)) != digest:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(submitted))
            raise ChangedInQueue(f"run {run_id}: the {what} {path} changed after hetflow submit checked it "
                                 f"({when}): this job runs nothing; submit it again")


def successor_command(run_id: str, batch: Path, *, workdir: Path, db: str | None) -> list[str]:
    """What a chained job runs after the pipeline: :func:`submit_successor` (the jobs left follow)."""
    argv = [sys.executable, "-m", "hetflow.submit", "successor", run_id, str(batch), "--workdir", str(workdir)]
    return argv + (["--db", db] if db is not None else [])


def _sbatch(argv: list[str], batch: Path) -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SubmitError("sbatch not found on PATH: hetflow submit needs a Slurm client (or run the pipeline "
                          "with hetflow run inside salloc)")
    argv[0] = sbatch
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:  # after a timeout the job may exist: keep its script
        raise SubmitError(f"sbatch could not be run: {exc}") from None
    if done.returncode != 0:
        why = " | ".join(line.strip() for line in done.stderr.splitlines() if line.strip()) or "no message"
        raise SubmitRefused(f"sbatch refused {batch} (exit {done.returncode}): {why}")
    return parse_job_id(done.stdout)


def submit_successor(run_id: str, batch: Path, left: int, *, workdir: Path, db: str | None) -> str | None:
    """In a chained job, after its pipeline: if the walltime STOPPED run ``run_id`` and ``left`` further
    jobs are allowed, submit ``batch`` again to start once this job ends (``afterany``), with one fewer;
    returns the new job's id, or None when the run needs no successor or none is allowed."""
    from .store import Store

    store = Store.for_workdir(workdir, db)
    try:
        record = store.find_run(run_id)
        state = record.state if record is not None and record.id == run_id else None
    finally:
        store.close()
    if state != "STOPPED":
        print(f"hetflow: run {run_id} is {state or 'not recorded'}: no successor job")
        return None
    if left <= 0:
        print(f"hetflow: run {run_id} STOPPED by the walltime and its chain is used up; resume it with: "
              f"sbatch {batch}")
        return None
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise SubmitError("no SLURM_JOB_ID: a successor job is submitted from inside the chained job")
    job_id = _sbatch(sbatch_argv(batch, dependency=f"afterany:{job}", args=[str(left - 1)]), batch)
    print(f"hetflow: run {run_id} STOPPED by the walltime: submitted job {job_id} to resume it after job {job} "
          f"({left - 1} more allowed)")
    return job_id


def declared_pipelines(script: Path) -> list[Pipeline]:
    """The pipelines ``script`` declares, found as ``hetflow run`` finds them, with no stage run.

    The script is executed as ``__main__`` (its directory on ``sys.path``, ``sys.argv`` its own
    path) up to its first ``pipe.run()``, which stops it (:class:`~hetflow.pipeline.Declared`);
    a script that runs none gives the pipelines left in its namespace.  Raises :class:`ScriptError`
    (one line) when the script fails before that.
    """
    path = script.resolve()
    saved_argv, saved_path, saved_cwd = sys.argv[:], sys.path[:], os.getcwd()
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.parent))
    try:
        with run_options(RunOptions(declare_only=True)):
            namespace = runpy.run_path(str(path), run_name="__main__")
    except Declared as declared:
        return [declared.pipeline]
    except HetflowError:
        raise  # a bad declaration: its own message names the stage
    except SyntaxError as exc:
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else f"line {exc.lineno}"
        raise ScriptError(f"pipeline script {script} does not compile: {type(exc).__name__} in {where}: "
                          f"{exc.msg}") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever the user's top level raises, said in one line
        text = (str(exc).strip().splitlines() or [""])[0]
        raise ScriptError(f"pipeline script {script} failed before its run: {type(exc).__name__}"
                          + (f": {text}" if text else "")) from None
    finally:
        sys.argv, sys.path = saved_argv, saved_path
        os.chdir(saved_cwd)  # the top level may change directory (os.chdir(DATA)): the caller's paths stay its own
    pipelines = [value for value in namespace.values() if isinstance(value, Pipeline)]
    if not pipelines:
        raise ScriptError(f"pipeline script {script} declares no hetflow.Pipeline and runs none")
    return pipelines


def job_shape(pilot: PilotDescription) -> PilotDescription:
    """``pilot`` as the job will see it (backend ``slurm``), with the cores and GPUs per node the config
    leaves out taken from ``sinfo`` for its partition: the largest node's, so only a request no node
    of the partition can hold is refused.  Left unshaped when ``sinfo`` cannot say."""
    shaped = dataclasses.replace(pilot, backend="slurm")
    if shaped.cores_per_node is not None and shaped.gpus_per_node is not None:
        return shaped
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return shaped
    argv = [sinfo, "--noheader", "--Node", "--format=%c|%G|%P"]
    if pilot.queue is not None:
        argv.append(f"--partition={pilot.queue}")
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return shaped
    shape = partition_shape(done.stdout, queue=pilot.queue) if done.returncode == 0 else None
    if shape is None:
        return shaped
    cores, gpus = shape
    return dataclasses.replace(
        shaped, cores_per_node=shaped.cores_per_node if shaped.cores_per_node is not None else cores,
        gpus_per_node=shaped.gpus_per_node if shaped.gpus_per_node is not None else gpus)


def partition_shape(sinfo: str, *, queue: str | None) -> tuple[int, int] | None:
    """The largest CPU and GPU counts of one node in ``sinfo --Node --format=%c|%G|%P`` output; without
    ``queue``, of the default partition's nodes (its name marked ``*``).  ``None`` when no node is listed."""
    cores: list[int] = []
    gpus: list[int] = []
    for line in sinfo.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not parts[0].isdigit() or (queue is None and not parts[2].endswith("*")):
            continue
        cores.append(int(parts[0]))
        gpus.append(sum(int(m) for m in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", parts[1])))
    return (max(cores), max(gpus)) if cores else None


def submit(script: str, *, pilot: str, params: Sequence[str], workdir: Path, db: str | None,
           chain: int = 0, walltime: float | None = None, data_dir: str | None = None) -> Submitted:
    """Write the batch script for ``script`` on ``pilot`` and submit it; raises :class:`SubmitError`.

    ``chain``: how many more jobs may follow, each submitted by its predecessor when the
    walltime drain stopped the run (:func:`submit_successor`).  ``walltime`` (seconds) replaces
    the config's; a pilot with neither is refused.  ``data_dir`` (``--data-dir``) is where the job's
    datasets go (:mod:`hetflow.datadir`), checked here.  ``params`` (``KEY=VALUE``) are checked as
    ``hetflow run`` checks them (:func:`~hetflow.params.from_command_line`: a key no stage declares, a
    value not of its declared type), before the job is submitted.

    Every path is taken from the current directory as it is when this is called, before the script's
    top level runs (it may change directory), and the job starts in that directory.
    """
    path = Path(script)
    if not path.is_file():
        raise HetflowError(f"pipeline script {script!r} does not exist")
    start = Path.cwd()
    path, workdir = path.resolve(), workdir.resolve()
    pilot_arg = absolute_spec(pilot, start)
    if db is not None:
        db = absolute_db(db, start)
    description = load_pilot(pilot_arg)  # a bad config fails here, not in the queue
    if walltime is not None:
        description = dataclasses.replace(description, walltime=walltime)
    if description.walltime is None:
        raise ConfigError(f"pilot {description.name!r} has no walltime: the job would get the partition's "
                          "default time limit; set walltime: 'HH:MM:SS' in the config or pass --walltime HH:MM:SS")
    if data_dir is not None:
        data_dir = check_data_dir(data_dir, what="--data-dir")
    shaped = job_shape(description)
    texts = dict(param.partition("=")[::2] for param in params)  # as hetflow run reads --param: the last wins
    for pipe in declared_pipelines(path):  # what would fail in the job fails here, before the queue
        pipe.validate(shaped)
        from_command_line(texts, pipe.stages.values())
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch not found on PATH: hetflow submit needs a Slurm client (or run the pipeline "
                          "with hetflow run inside salloc)")
    if chain < 0:
        raise HetflowError(f"--chain {chain}: expected the number of further jobs allowed, 0 or more")
    run_id = new_run_id(path)
    folder = workdir / "submit"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    log = folder / f"{run_id}-%j.out"
    checked = folder / f"{run_id}.checked.json"
    write_checked(checked, path, pilot_arg)
    command = job_command(path, pilot=pilot_arg, run_id=run_id, workdir=workdir, db=db, params=params,
                          data_dir=data_dir, checked=checked)
    batch = folder / f"{run_id}.sbatch"
    text = batch_script(description, command, job_name=f"hetflow-{run_id}"[:128], output=log, chdir=start,
                        successor=successor_command(run_id, batch, workdir=workdir, db=db), chain=chain,
                        resume=batch)
    fd = os.open(batch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # may carry a --db URL with a password
    with os.fdopen(fd, "w") as out:
        out.write(text)
    try:
        job_id = _sbatch(sbatch_argv(batch), batch)
    except SubmitRefused:
        batch.unlink()  # no script lies beside the logs for a job that does not exist
        checked.unlink()
        raise
    return Submitted(job_id=job_id, run_id=run_id, script=batch, log=log)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetflow.submit successor RUN BATCH LEFT``: the last line of a chained batch script."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hetflow.submit")
    sub = parser.add_subparsers(dest="command", required=True)
    successor = sub.add_parser("successor")
    successor.add_argument("run")
    successor.add_argument("batch", type=Path)
    successor.add_argument("--workdir", type=Path, required=True)
    successor.add_argument("--db")
    successor.add_argument("left", type=int)
    args = parser.parse_args(argv)
    try:
        submit_successor(args.run, args.batch, args.left, workdir=args.workdir, db=args.db)
    except HetflowError as exc:
        print(f"hetflow: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
