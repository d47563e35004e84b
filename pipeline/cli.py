"""The ``hetflow`` command.

Exit codes: 0 the run is DONE, 1 it FAILED, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from hetflow.tasks.errors import HetflowError, TaskFailed

from .errors import RunAborted, RunInterrupted
from .pipeline import Pipeline, RunOptions, default_workdir, run_options
from .status import RunStatus, run_status
from .store import Store, iso

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(HetflowError):
    """Bad command-line usage."""


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value else ""
    except yaml.YAMLError:
        parsed = value
    return key, parsed if isinstance(parsed, (int, float, bool, str)) or parsed is None else value


def _raw_param(text: str) -> str:
    _param(text)  # checked here, parsed by the job's hetflow run
    return text


def _store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", help="work directory (default $HETFLOW_WORKDIR or ./.hetflow)")
    parser.add_argument("--db", help="SQLAlchemy URL of the state store (default: SQLite in the work directory)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetflow", description="Pilot-based heterogeneous workflows on Arrow data.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a pipeline script")
    run.add_argument("script", help="path to a Python file that declares a hetflow.Pipeline")
    run.add_argument("--pilot", help="a shipped pilot config name or a path to a .yaml config")
    run.add_argument("--backend", help="override the pilot's backend (local, radical, parsl, dask)")
    run.add_argument("--param", action="append", default=[], type=_param, metavar="KEY=VALUE",
                     help="a parameter passed to every stage's ctx.params (repeatable)")
    run.add_argument("--rerun", action="append", default=[], metavar="STAGE",
                     help="run STAGE again whatever the cache says, and every stage downstream of it "
                          "(repeatable; 'all' for every stage)")
    run.add_argument("--no-progress", action="store_true", help="no live progress display")
    run.add_argument("--run-id", help="the run's id: a new run gets it, an existing run of that id is resumed "
                                      "(hetflow submit chooses it)")
    _store_args(run)

    submit = sub.add_parser("submit", help="write a Slurm batch script that runs a pipeline script, and sbatch it")
    submit.add_argument("script", help="path to a Python file that declares a hetflow.Pipeline")
    submit.add_argument("--pilot", required=True, help="a shipped pilot config name or a path to a .yaml config "
                                                       "(nodes, walltime, queue, account of the job)")
    submit.add_argument("--param", action="append", default=[], type=_raw_param, metavar="KEY=VALUE",
                        help="a parameter passed to every stage's ctx.params (repeatable)")
    submit.add_argument("--chain", type=int, default=0, metavar="N",
                        help="when the walltime drain stops the run, the job submits a successor that resumes it "
                             "(afterany dependency), up to N further jobs")
    _store_args(submit)

    resume = sub.add_parser("resume", help="resume a failed or interrupted run")
    resume.add_argument("run", help="run id (or a unique prefix)")
    resume.add_argument("--pilot", help="a pilot config for the new allocation")
    resume.add_argument("--rerun", action="append", default=[], metavar="STAGE",
                        help="run STAGE (and what is downstream) again whatever the cache says (repeatable)")
    resume.add_argument("--no-progress", action="store_true")
    _store_args(resume)

    status = sub.add_parser("status", help="show a run (the latest by default)")
    status.add_argument("run", nargs="?", help="run id (or a unique prefix)")
    status.add_argument("--json", action="store_true", help="print JSON")
    _store_args(status)

    datasets = sub.add_parser("datasets", help="list the committed datasets of a run")
    datasets.add_argument("run", nargs="?")
    datasets.add_argument("--json", action="store_true")
    _store_args(datasets)

    runs = sub.add_parser("runs", help="list runs")
    _store_args(runs)

    sub.add_parser("pilots", help="list the shipped pilot configs")
    pilot = sub.add_parser("pilot", help="inspect a pilot config")
    pilot_sub = pilot.add_subparsers(dest="pilot_command", required=True, metavar="ACTION")
    show = pilot_sub.add_parser("show", help="print a validated config")
    show.add_argument("config", help="shipped config name or path")
    check = pilot_sub.add_parser("check", help="validate a config and report problems")
    check.add_argument("config")
    render = pilot_sub.add_parser("render", help="print what would be submitted, without submitting")
    render.add_argument("config")
    render.add_argument("--backend", required=True, choices=["radical", "parsl"])

    report = sub.add_parser("report", help="write a timeline report (HTML + PNG) of a run")
    report.add_argument("run", nargs="?")
    report.add_argument("--out", help="output HTML path (default: <run dir>/report.html)")
    _store_args(report)

    sub.add_parser("simulate", help="drive the scheduler with simulated time (see hetflow simulate --help)",
                   add_help=False)
    return parser


def _workdir(args: argparse.Namespace) -> Path:
    return Path(args.workdir) if getattr(args, "workdir", None) else default_workdir()


def _open_store(args: argparse.Namespace) -> Store:
    workdir = _workdir(args)
    if args.db is None and not os.environ.get("HETFLOW_DB") and not (workdir / "hetflow.db").exists():
        raise UsageError(f"no hetflow state store in {workdir.resolve()} "
                         "(run a pipeline first, or pass --workdir/--db, or set HETFLOW_DB)")
    return Store.for_workdir(workdir, args.db)


def _run_script(script: str, options: RunOptions) -> int:
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"pipeline script {script!r} does not exist")
    import dataclasses

    options = dataclasses.replace(options, script=str(path.resolve()))
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        with run_options(options) as runs:
            namespace = runpy.run_path(str(path.resolve()), run_name="__main__")
            if not runs:
                pipelines = [v for v in namespace.values() if isinstance(v, Pipeline)]
                if not pipelines:
                    raise UsageError(f"{script} declares no hetflow.Pipeline and runs none")
                for pipe in pipelines:
                    pipe.run()
    finally:
        sys.argv, sys.path = saved_argv, saved_path
    for status in runs:
        _print_summary(status)
    return EXIT_OK if runs and all(r.ok for r in runs) else EXIT_FAILED


def _print_summary(status: RunStatus) -> None:
    print(f"run {status.id}: {status.state}  ({status.run_dir})")
    for stage in status.stages:
        line = f"  {stage.name:<20} {stage.state:<10} attempts={stage.attempts}"
        if stage.error and stage.state not in ("DONE", "CACHED"):
            line += f"  {stage.error.splitlines()[0]}"
        elif stage.cache_reason:
            line += f"  ({stage.cache_reason})"
        print(line)
    if not status.ok:
        from .errors import resume_hint

        print(f"  {resume_hint(status.id)} (after fixing the cause; finished stages are not run again)")


def _status(args: argparse.Namespace) -> int:
    store = _open_store(args)
    store.reconcile_dead_runs()  # a run whose orchestrator died shows as ended, not RUNNING
    status = run_status(store, args.run)
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"run {status.id} ({status.pipeline}): {status.state}")
        for column in ("stage", "state", "attempts", "started", "seconds", "slots"):
            table.add_column(column)
        for stage in status.stages:
            seconds = f"{stage.ended - stage.started:.2f}" if stage.started and stage.ended else ""
            slots = "; ".join(f"{s.node} cores {list(s.cores)}" + (f" gpus {list(s.gpus)}" if s.gpus else "")
                              for s in stage.slots)
            table.add_row(stage.name, stage.state, str(stage.attempts), iso(stage.started) or "", seconds, slots)
        console = Console()
        console.print(table)
        for stage in status.stages:
            if stage.cache_reason:
                console.print(f"{stage.name}: {'reused' if stage.cache_hit else 'ran'}: {stage.cache_reason}",
                              markup=False, highlight=False)
        for stage in status.stages:
            if stage.state not in ("DONE", "CACHED") and stage.error:
                console.print(f"[bold]{stage.name}[/bold] {stage.state}: {stage.error}", markup=True, highlight=False)
                if stage.traceback:
                    console.print(stage.traceback, markup=False, highlight=False)
    return EXIT_OK if status.ok else EXIT_FAILED


def _datasets(args: argparse.Namespace) -> int:
    from hetflow.operators.dataset import DatasetError, read_manifest

    store = _open_store(args)
    status = run_status(store, args.run)
    rows = []
    for name, path in sorted(status.datasets.items()):
        try:
            manifest = read_manifest(path)
        except DatasetError as exc:  # listed with what is wrong; a rerun recomputes it
            rows.append({"name": name, "rows": None, "bytes": None, "partitions": None, "producer": None,
                         "path": path, "schema": [], "damaged": str(exc)})
            continue
        rows.append({"name": name, "rows": manifest.num_rows, "bytes": manifest.num_bytes,
                     "partitions": len(manifest.partitions), "producer": manifest.producer.get("stage"),
                     "path": path, "schema": [f"{f.name}: {f.type}" for f in manifest.schema], "damaged": None})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            if row["damaged"]:
                print(f"{row['name']:<24} DAMAGED: {row['damaged']}")
                continue
            print(f"{row['name']:<24} {row['rows']:>12} rows {row['bytes']:>14} bytes {row['partitions']:>4} parts  "
                  f"from {row['producer']}  {row['path']}")
    return EXIT_OK


def _runs(args: argparse.Namespace) -> int:
    store = _open_store(args)
    for run in store.runs():
        print(f"{run.id:<48} {run.state:<8} {iso(run.created)}")
    return EXIT_OK


def _pilot(args: argparse.Namespace) -> int:
    from hetflow.tasks.pilot import load_pilot

    pilot = load_pilot(args.config)
    if args.pilot_command == "show":
        print(yaml.safe_dump(pilot.to_mapping(), sort_keys=False), end="")
        return EXIT_OK
    from hetflow.tasks import render

    if args.pilot_command == "render":
        print(render.render(pilot, args.backend))
        return EXIT_OK
    problems = render.check(pilot)
    for problem in problems:
        print(f"problem: {problem}")
    if not problems:
        print(f"{args.config}: ok ({pilot.shape()})")
    return EXIT_USAGE if problems else EXIT_OK


def _submit(args: argparse.Namespace) -> int:
    from .submit import submit

    done = submit(args.script, pilot=args.pilot, params=args.param, workdir=_workdir(args), db=args.db,
                  chain=args.chain)
    print(f"submitted batch job {done.job_id}: run {done.run_id}")
    print(f"  batch script {done.script}; log {str(done.log).replace('%j', done.job_id)}")
    where = f" --workdir {_workdir(args).resolve()}" + (" --db URL" if args.db else "")
    print(f"  follow it with: hetflow status {done.run_id}{where}")
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    store = _open_store(args)
    html, png = write_report(store, args.run, Path(args.out) if args.out else None)
    print(f"wrote {html}" + (f" and {png}" if png else ""))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":
        from hetflow.tasks.simulator import cli_main

        return cli_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "run":
            if args.run_id is not None:
                from .submit import check_run_id

                check_run_id(args.run_id)
            options = RunOptions(pilot=args.pilot, workdir=args.workdir, params=dict(args.param), db=args.db,
                                 backend=args.backend, progress=False if args.no_progress else None,
                                 rerun=tuple(args.rerun), run_id=args.run_id, new_run_ok=args.run_id is not None)
            return _run_script(args.script, options)
        if args.command == "submit":
            return _submit(args)
        if args.command == "resume":
            store = _open_store(args)
            record = store.find_run(args.run)
            if record is None:
                raise UsageError(f"no run {args.run!r} in {store.url}")
            if not record.script:
                raise UsageError(f"run {record.id} was started from Python code, not a script; resume it with "
                                 f"pipe.run(run_id={record.id!r}) from the same code")
            options = RunOptions(pilot=args.pilot, workdir=args.workdir, params=dict(record.params), db=args.db,
                                 run_id=record.id, progress=False if args.no_progress else None,
                                 rerun=tuple(args.rerun))
            return _run_script(record.script, options)
        if args.command == "status":
            return _status(args)
        if args.command == "datasets":
            return _datasets(args)
        if args.command == "runs":
            return _runs(args)
        if args.command == "pilots":
            from hetflow.tasks.pilot import config_names, load_pilot

            for name in config_names():
                print(f"{name:<16} {load_pilot(name).shape()}")
            return EXIT_OK
        if args.command == "pilot":
            return _pilot(args)
        if args.command == "report":
            return _report(args)
    except (TaskFailed, RunAborted) as exc:
        print(f"hetflow: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except RunInterrupted as exc:
        print(f"hetflow: {exc}", file=sys.stderr)
        return 130
    except HetflowError as exc:
        print(f"hetflow: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hetflow: interrupted; running tasks were stopped", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
