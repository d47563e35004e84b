"""The ``hetflow`` command.

Exit codes: 0 the run is DONE, 1 it did not end DONE (FAILED, CANCELLED, STOPPED),
2 bad usage or configuration, 130 interrupted (Ctrl-C or SIGTERM).  Every error a user can
cause prints one line naming what is at fault (and the extra to install, where
one is missing); a traceback is left for hetflow's own bugs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import yaml

from hetflow.tasks.errors import ConfigError, HetflowError

from . import __version__
from .errors import MissingExtraError, RunAborted, RunFailed, RunInterrupted, StoreUnreadable, absolute_db
from .filesystem import default_workdir
from .states import SUCCESS, State
from .status import RunStatus, run_status
from .storefile import default_url, iso
from .terminal import visible

if TYPE_CHECKING:  # the orchestrator (and pyarrow) load when a command runs a pipeline, not for status; SQLAlchemy
    # loads with the store, which `hetflow status` of a SQLite store does without (hetflow.storefile)
    from .pipeline import RunOptions
    from .store import Store

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
RUN_STATES = (State.RUNNING, State.DONE, State.FAILED, State.INTERRUPTED, State.CANCELLED, State.STOPPED)


class UsageError(HetflowError):
    """Bad command-line usage."""


def _param(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` as text; :func:`hetflow.params.typed` gives the value its type at run time."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _seconds(text: str) -> float:
    """A duration in seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number, 0 or more), got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (a number, 0 or more), got {text!r}")
    return value


PARAM_HELP = ("a parameter for every stage's ctx.params (repeatable); a KEY no stage declares in params= is "
              "refused. The value takes the type of the default a stage declares for KEY in params= (int, "
              "float, bool: true/false, str: as typed); for another default (None): an integer or decimal "
              "number becomes a number, true/false a bool, null None, anything else stays text (no, 1.2.3, "
              "007 are text)")


DATA_DIR_HELP = ("where the datasets go: a path or s3://BUCKET/PREFIX (credentials and endpoint from the AWS "
                 "environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE); default: "
                 "the pilot's data_dir, else the work directory")


def _raw_param(text: str) -> str:
    _param(text)  # checked here, parsed by the job's hetflow run
    return text


def _store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", help="work directory (default $HETFLOW_WORKDIR or ./.hetflow)")
    parser.add_argument("--db", help="SQLAlchemy URL of the state store (default: SQLite in the work directory)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetflow", description="Pilot-based heterogeneous workflows on Arrow data.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-vv for debug); with run/resume, stream every stage's output live, "
                             "each line labelled with its stage and rank")
    parser.add_argument("--version", action="version", version=f"hetflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a pipeline script")
    run.add_argument("script", help="path to a Python file that declares a hetflow.Pipeline")
    run.add_argument("--pilot", help="a shipped pilot config name or a path to a .yaml config")
    run.add_argument("--backend", help="override the pilot's backend (local, radical, parsl, dask)")
    run.add_argument("--data-dir", help=DATA_DIR_HELP)
    run.add_argument("--param", action="append", default=[], type=_param, metavar="KEY=VALUE", help=PARAM_HELP)
    run.add_argument("--rerun", action="append", default=[], metavar="STAGE",
                     help="run STAGE again whatever the cache says, and every stage downstream of it "
                          "(repeatable; 'all' for every stage)")
    run.add_argument("--no-progress", action="store_true", help="no live progress display")
    run.add_argument("--run-id", help="the run's id: a new run gets it, an existing run of that id is resumed "
                                      "(hetflow submit chooses it)")
    run.add_argument("--submitted", type=Path, help=argparse.SUPPRESS)  # hetflow submit's note (submit.check_unchanged)
    _store_args(run)

    submit = sub.add_parser("submit", help="write a Slurm batch script that runs a pipeline script, and sbatch it")
    submit.add_argument("script", help="path to a Python file that declares a hetflow.Pipeline")
    submit.add_argument("--pilot", required=True, help="a shipped pilot config name or a path to a .yaml config "
                                                       "(nodes, walltime, queue, account of the job)")
    submit.add_argument("--param", action="append", default=[], type=_raw_param, metavar="KEY=VALUE",
                        help="a parameter passed to every stage's ctx.params (repeatable)")
    submit.add_argument("--data-dir", help=DATA_DIR_HELP)
    submit.add_argument("--chain", type=int, default=0, metavar="N",
                        help="when the walltime drain stops the run, the job submits a successor that resumes it "
                             "(afterany dependency), up to N further jobs")
    submit.add_argument("--walltime", metavar="TIME",
                        help="the job's time limit, replacing the config's: seconds, HH:MM:SS or D-HH:MM:SS "
                             "(a pilot with no walltime in its config needs it)")
    _store_args(submit)

    resume = sub.add_parser("resume", help="resume a failed or interrupted run")
    resume.add_argument("run", help="run id (or a unique prefix)")
    resume.add_argument("--pilot", help="a pilot config for the new allocation")
    resume.add_argument("--data-dir", help=DATA_DIR_HELP + " (default: where the run began)")
    resume.add_argument("--rerun", action="append", default=[], metavar="STAGE",
                        help="run STAGE (and what is downstream) again whatever the cache says (repeatable)")
    resume.add_argument("--no-progress", action="store_true")
    _store_args(resume)

    status = sub.add_parser("status", help="show a run (the latest by default)")
    status.add_argument("run", nargs="?", help="run id (or a unique prefix)")
    status.add_argument("stage", nargs="?", help="a map stage whose items to list (with --items)")
    status.add_argument("--items", action="store_true", help="list the items of map stage STAGE")
    status.add_argument("--offset", type=int, default=0, metavar="K",
                        help="with --items: from the item at position K on (default 0)")
    status.add_argument("--limit", type=int, metavar="N",
                        help=f"with --items: at most N items (default {ITEMS_SHOWN:,} as text, all as JSON; "
                             "0: all)")
    status.add_argument("--json", action="store_true", help="print JSON")
    _store_args(status)

    datasets = sub.add_parser("datasets", help="list the committed datasets of a run")
    datasets.add_argument("run", nargs="?")
    datasets.add_argument("--json", action="store_true")
    _store_args(datasets)

    logs = sub.add_parser("logs", help="show what the ranks of a run printed, each line labelled with its rank",
                          description="RUN defaults to the latest run.  A single word is read as a run id (or "
                                      "a unique prefix) first, else as a STAGE of the latest run; a word that is "
                                      "both is refused: give RUN and STAGE.")
    logs.add_argument("run", nargs="?", help="run id (or a unique prefix; default: the latest run)")
    logs.add_argument("stage", nargs="?", help="only this stage (default: every stage)")
    logs.add_argument("--rank", type=int, metavar="N", help="only rank N's output (no launcher lines)")
    logs.add_argument("--attempt", type=int, metavar="K", help="attempt K of STAGE (default: its latest)")
    logs.add_argument("--item", type=int, metavar="K", help="only what item K of map stage STAGE printed")
    logs.add_argument("--follow", "-f", action="store_true",
                      help="keep printing new output (of new attempts too) until the run ends")
    _store_args(logs)

    runs = sub.add_parser("runs", help="list runs (oldest first)")
    runs.add_argument("--json", action="store_true", help="print JSON")
    runs.add_argument("--state", action="append", default=[], type=str.upper, metavar="STATE",
                      help=f"only runs in STATE (repeatable; one of {', '.join(RUN_STATES)})")
    _store_args(runs)

    rm = sub.add_parser("rm", help="remove runs: records, logs and datasets no other run uses")
    rm.add_argument("runs", nargs="+", metavar="RUN", help="run id (or a unique prefix)")
    rm.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    _store_args(rm)

    gc = sub.add_parser("gc", help="remove unfinished runs (all but each pipeline's latest) and leftover files",
                        description="Remove runs that ended FAILED, INTERRUPTED, CANCELLED or STOPPED, except "
                                    "the latest run of each pipeline (the one to resume), directories under "
                                    "runs/ that no run record names, and partition objects under a run's s3:// "
                                    "data directory that no committed dataset names (uploads of failed or crashed "
                                    "attempts). Keeps every DONE run, every running run and every dataset a kept "
                                    "run uses (its cache hits point into earlier runs).")
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    gc.add_argument("--grace", type=_seconds, metavar="SECONDS",
                    help="leave alone leftovers younger than this (default: 300 for directories under runs/, "
                         "3600 for objects on a store, whose clock may differ from this host's)")
    _store_args(gc)

    cancel = sub.add_parser("cancel", help="stop a running run (from any terminal or host sharing its store)")
    cancel.add_argument("run", help="run id (or a unique prefix)")
    cancel.add_argument("--no-wait", action="store_true", help="ask, and do not wait for the run to stop")
    cancel.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for the run to stop (default 60)")
    _store_args(cancel)

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

    serve = sub.add_parser("serve", help="serve a web page of a run's status and timeline (refreshing while it runs)")
    serve.add_argument("run", nargs="?", help="run id (or a unique prefix; default: the latest run, at each request)")
    serve.add_argument("--port", type=int, default=8765, help="TCP port (default 8765; 0 picks a free one)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; every request needs the "
                            "token of the address it prints)")
    serve.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                       help="also answer requests whose Host header is NAME (repeatable); by default only the "
                            "--host address, localhost, 127.0.0.1 and [::1] are answered, anything else gets 421")
    _store_args(serve)

    sub.add_parser("simulate", help="drive the scheduler with simulated time (see hetflow simulate --help)",
                   add_help=False)
    return parser


def _workdir(args: argparse.Namespace) -> Path:
    return Path(args.workdir) if getattr(args, "workdir", None) else default_workdir()


def _store_url(args: argparse.Namespace) -> str:
    """The state store's URL, as :func:`_open_store` opens it."""
    return args.db or os.environ.get("HETFLOW_DB") or default_url(_workdir(args))


def _open_store(args: argparse.Namespace) -> Store:
    from sqlalchemy.exc import SQLAlchemyError

    from .store import Store, unreadable

    workdir = _workdir(args)
    if args.db is None and not os.environ.get("HETFLOW_DB") and not (workdir / "hetflow.db").exists():
        raise UsageError(f"no hetflow state store in {workdir.resolve()} "
                         "(run a pipeline first, or pass --workdir/--db, or set HETFLOW_DB)")
    store = Store.for_workdir(workdir, args.db)
    try:
        store.runs()  # reads every run's row: a damaged file or schema shows here, not halfway through
    except SQLAlchemyError as exc:
        raise StoreUnreadable(unreadable(store.url, exc)) from None
    return store


def _run_script(script: str, options: RunOptions, args: argparse.Namespace | None = None,
                argv: Sequence[str] = ()) -> int:
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"pipeline script {script!r} does not exist")
    import dataclasses

    from .pipeline import Pipeline, run_options, wait_for_background

    options = dataclasses.replace(options, script=str(path.resolve()))
    saved_argv, saved_path, saved_cwd = sys.argv[:], sys.path[:], os.getcwd()
    began = time.time()
    sys.argv = [str(path), *argv]  # a resume: the arguments the run's script was started with
    sys.path.insert(0, str(path.resolve().parent))
    try:
        with run_options(options) as runs:
            try:
                namespace = runpy.run_path(str(path.resolve()), run_name="__main__")
                wait_for_background()
                if not runs:
                    pipelines = [v for v in namespace.values() if isinstance(v, Pipeline)]
                    if not pipelines:
                        raise UsageError(f"{script} declares no hetflow.Pipeline and runs none")
                    for pipe in pipelines:
                        pipe.run()
            except RunFailed:
                pass  # the run is in `runs`: its summary below says what failed and how to resume
    finally:
        sys.argv, sys.path = saved_argv, saved_path
        os.chdir(saved_cwd)  # a script's top level may have moved (os.chdir): the summary's paths are from here
    for status in runs:
        _print_summary(status, args, since=began)
    return EXIT_OK if runs and all(r.ok for r in runs) else EXIT_FAILED


def _check_recorded_script(script: str, run_id: str) -> None:
    """Refuse (:class:`~hetflow.errors.UnsafeScript`) to execute the script run ``run_id`` records unless it is
    this user's (or root's) and others may not write it (group-writable is allowed: with a user's private
    group, umask 002 makes every file so).

    Decision: ``hetflow resume`` executes the file the store names, and a store that users share (a
    PostgreSQL server) is written by all of them: one of them could name a script of theirs in your run's
    record, and resuming would run their code as you, as unpickling a file of theirs would
    (:func:`hetflow.tasks.shipping.read_checked`).  A script you typed yourself (``hetflow run``) is not
    checked; one the store names must be one only you (or the system) could have written."""
    import stat

    from .errors import UnsafeScript

    try:
        info = os.stat(script)
    except OSError as exc:
        raise UnsafeScript(f"run {run_id}: its script {script} cannot be read ({exc.strerror}); "
                           f"run it again with hetflow run") from None
    problems = []
    if info.st_uid not in (os.geteuid(), 0):
        problems.append(f"it is owned by uid {info.st_uid}, not by you (uid {os.geteuid()})")
    if info.st_mode & stat.S_IWOTH:
        problems.append(f"its mode {stat.S_IMODE(info.st_mode):04o} lets others write it")
    if problems:
        raise UnsafeScript(f"run {run_id}: refusing to execute its recorded script {script}: {'; '.join(problems)} "
                           "(another user may have written it or the store's record of it)")


def _resume_recorded(record: Any, args: argparse.Namespace) -> int:
    """``hetflow resume`` of a run started from Python code (a notebook, the prompt): its stages as the run
    recorded them (:mod:`hetflow.recorded`), resumed from the directory it was started in."""
    from hetflow.tasks.errors import UnsafeShippedFunction

    from . import recorded
    from .pipeline import Pipeline, RunOptions, run_options

    workdir = str(_workdir(args).resolve())  # the store's place as typed here, before the move to the run's
    db = None if args.db is None else absolute_db(args.db, os.getcwd())
    saved_cwd, saved_path = os.getcwd(), sys.path[:]
    began = time.time()
    try:
        try:
            found = recorded.load(record.id, record.run_dir)
        except (UnsafeShippedFunction, OSError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        pipe = Pipeline(found.name)
        pipe.stages = dict(found.stages)
        pipe._producers = {out: spec.name for spec in pipe.stages.values() for out in spec.outputs}
        options = RunOptions(pilot=args.pilot, workdir=workdir, params=dict(record.params), db=db, run_id=record.id,
                             progress=False if args.no_progress else None, rerun=tuple(args.rerun),
                             stream_logs=args.verbose > 0, cwd=saved_cwd)
        with run_options(options) as runs:
            try:
                pipe.run(pilot=found.pilot)
            except RunFailed:
                pass  # the run is in `runs`: its summary below says what failed and how to resume
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
    for status in runs:
        _print_summary(status, args, since=began)
    return EXIT_OK if runs and all(r.ok for r in runs) else EXIT_FAILED


def _where(args: argparse.Namespace | None) -> tuple[str, ...]:
    """The ``--workdir``/``--db`` this command was given: every follow-up command it prints carries them."""
    from .errors import store_argv

    return store_argv(getattr(args, "workdir", None), getattr(args, "db", None))


def resume_command(run_id: str, args: argparse.Namespace | None, verb: str = "resume") -> str:
    """The exact command that resumes ``run_id`` (or runs another ``verb`` on it) from where this one was
    typed: the same work directory and store, quoted for the shell."""
    from .errors import hetflow_command

    return hetflow_command(verb, run_id, _where(args))


def _print_summary(status: RunStatus, args: argparse.Namespace | None = None, since: float | None = None) -> None:
    """The end of a run: each stage's state, duration and log directory; the resume command unless DONE.
    ``since``: when this session began; a resumed run's time counts from then, not from its first session."""
    from .errors import batch_resume_command, error_text
    from .progress import elapsed_text

    status = status.for_terminal()  # another user's run (a shared store) prints no control characters
    start = status.started or status.created
    resumed = since is not None and since > start
    total = (status.ended or 0.0) - (since if resumed and since is not None else start) if status.ended else None
    print(f"run {status.id}: {status.state}" + (f" in {elapsed_text(total)}" if total is not None else "")
          + (" (this session)" if resumed and total is not None else "") + f"  ({status.run_dir})")
    for stage in status.stages:
        seconds = elapsed_text(stage.ended - stage.started) if stage.started and stage.ended else "-"
        line = f"  {stage.name:<20} {stage.state:<10} {seconds:>8}  attempts={stage.attempts}"
        if stage.error and stage.state not in SUCCESS:
            first, *rest = error_text(stage.error).splitlines()
            line += f"  {first}" + "".join(f"\n  {'':<20} {more}" for more in rest)
        elif stage.cache_reason:
            line += f"  ({stage.cache_reason})"
        print(line)
        if stage.log_dir:
            print(f"  {'':<20} logs: {stage.log_dir}")
    if not status.ok:
        from .errors import code_must_change

        if code_must_change([s.error for s in status.stages if s.state not in SUCCESS | {State.SKIPPED}]):
            print("  change the script as the error says first: resumed unchanged, it fails the same way")
        if status.error and not any(s.error for s in status.stages if s.state not in SUCCESS):
            print("  " + error_text(status.error).replace("\n", "\n  "))
        if status.script is None:
            from .errors import recorded_in, resume_hint

            hint = resume_hint(status.id, script=False, where=_where(args), shell=recorded_in(status.run_dir))
            print(f"  {hint} (after fixing the cause; finished stages are not run again)")
        elif batch := batch_resume_command():  # a job hetflow submit made: resumed by its batch script
            print(f"  resume it with: {batch}  (from a login node, after fixing the cause; finished stages "
                  f"are not run again)")
        else:
            print(f"  resume it with: {resume_command(status.id, args)}  (after fixing the cause; finished stages "
                  f"are not run again)")
    print(f"  output of every rank: {resume_command(status.id, args, 'logs')}")


ITEMS_SHOWN = 1_000
"""Items ``hetflow status RUN STAGE --items`` lists as text unless told (``--limit``): a page, not a map's
every item."""


def _status_items(args: argparse.Namespace) -> int:
    """``hetflow status RUN STAGE --items``: one line per item of a map stage (or JSON)."""
    from .status import map_items, quick_map_items

    if not (args.items and args.stage):
        print("hetflow status: give RUN STAGE --items to list a map stage's items", file=sys.stderr)
        return EXIT_USAGE
    if args.offset < 0 or (args.limit is not None and args.limit < 0):
        print(f"hetflow status: --offset and --limit must be >= 0 (got --offset {args.offset}, --limit "
              f"{args.limit})", file=sys.stderr)
        return EXIT_USAGE
    limit = args.limit if args.limit is not None else (None if args.json else ITEMS_SHOWN)
    try:
        view = quick_map_items(_store_url(args), args.run, args.stage, offset=args.offset, limit=limit or None)
        if view is None:  # not a SQLite file, a run to reconcile or to name: the store answers (hetflow.storefile)
            store = _open_store(args)
            store.reconcile_dead_runs()  # a run whose orchestrator died shows as ended, not RUNNING
            view = map_items(store, args.run, args.stage, offset=args.offset, limit=limit or None)
    except (KeyError, ValueError) as exc:
        print(f"hetflow status: {exc.args[0]}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(view, indent=2))
        return EXIT_OK
    from .terminal import visible

    counts = ", ".join(f"{n:,} {state.lower()}" for state, n in sorted(view["counts"].items()))
    print(visible(f"{view['stage']} of run {view['run']}: {view['total']:,} items: {counts}", newlines=False))
    if view["summary"]:
        print(visible(f"  {view['summary']}", newlines=False))
    for item in view["items"]:
        line = f"  {item['index']:>6}  {item['state']:<8} tries={item['tries']}  {item['label']}"
        if item["error"]:
            line += f"  {item['error'].splitlines()[0]}"
        print(visible(line, newlines=False))
    after = view["offset"] + len(view["items"])
    if view["items"] and after < view["total"]:
        print(f"  ... listed {view['offset'] + 1:,} to {after:,} of {view['total']:,}: --offset {after} for the next "
              f"{limit or len(view['items']):,}, --limit 0 for all")
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from .status import quick_status

    if args.items or args.stage:
        return _status_items(args)
    status = quick_status(_store_url(args), args.run)  # a SQLite store, read without SQLAlchemy
    if status is None:  # not a SQLite file, a run to reconcile or to name: the store answers (hetflow.storefile)
        store = _open_store(args)
        store.reconcile_dead_runs()  # a run whose orchestrator died shows as ended, not RUNNING
        status = run_status(store, args.run)
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
    else:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        status = status.for_terminal()  # control characters made visible, as everywhere text from a run is shown
        # stage names, errors and tracebacks are the user's text: escaped, never read as rich markup
        table = Table(title=escape(f"run {status.id} ({status.pipeline}): {status.state}"))
        # every cell is folded onto more lines, never cut: sweep members' names differ at their end; the start
        # reads "2026-11-27 13:18:44" (UTC), split at its space when narrow, never inside its date or time
        for column in ("stage", "state", "attempts", "started (UTC)", "seconds", "slots"):
            table.add_column(column, overflow="fold", min_width=len("2026-11-27") if column.startswith("started")
                             else None)
        for stage in status.stages:
            seconds = f"{stage.ended - stage.started:.2f}" if stage.started and stage.ended else ""
            slots = "; ".join(f"{s.node} cores {list(s.cores)}" + (f" gpus {list(s.gpus)}" if s.gpus else "")
                              for s in stage.slots)
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stage.started)) if stage.started else ""
            table.add_row(escape(stage.name), stage.state, str(stage.attempts), started, seconds,
                          escape(slots))
        console = Console()
        console.print(table)
        if status.rerun:
            console.print(f"forced by --rerun (kept by every resume): {', '.join(status.rerun)}", markup=False,
                          highlight=False)
        for stage in status.stages:
            if stage.log_dir:
                console.print(f"{stage.name}: logs: {stage.log_dir}/rank-*.log (launcher: stdout.log, stderr.log)",
                              markup=False, highlight=False, soft_wrap=True)
        for stage in status.stages:
            if stage.cache_reason:
                console.print(f"{stage.name}: {'reused' if stage.cache_hit else 'ran'}: {stage.cache_reason}",
                              markup=False, highlight=False)
        for stage in status.stages:
            if stage.state not in SUCCESS and stage.error:
                console.print(f"[bold]{escape(stage.name)}[/bold] {stage.state}: {escape(stage.error)}", markup=True,
                              highlight=False)
                if stage.traceback:
                    console.print(stage.traceback, markup=False, highlight=False)
    return EXIT_OK if status.ok else EXIT_FAILED


def _datasets(args: argparse.Namespace) -> int:
    from hetflow.operators.dataset import DatasetError, read_manifest
    from hetflow.operators.location import StorageError

    store = _open_store(args)
    status = run_status(store, args.run)
    rows: list[dict[str, Any]] = []
    for name, path in sorted(status.datasets.items()):
        try:
            manifest = read_manifest(path)
        except (DatasetError, StorageError) as exc:  # listed with what is wrong; a rerun recomputes it
            rows.append({"name": name, "rows": None, "bytes": None, "partitions": None, "producer": None,
                         "path": path, "schema": [], "damaged": str(exc)})
            continue
        rows.append({"name": name, "rows": manifest.num_rows, "bytes": manifest.num_bytes,
                     "partitions": len(manifest.partitions), "producer": manifest.producer.get("stage"),
                     "path": path, "schema": [f"{f.name}: {f.type}" for f in manifest.schema], "damaged": None})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        if not rows:
            print(visible(f"run {status.id} has no committed datasets", newlines=False))
        for row in rows:
            if row["damaged"]:
                print(visible(f"{row['name']:<24} DAMAGED: {row['damaged']}", newlines=False))
                continue
            print(visible(f"{row['name']:<24} {row['rows']:>12} rows {row['bytes']:>14} bytes {row['partitions']:>4} "
                          f"parts  from {row['producer']}  {row['path']}", newlines=False))
    return EXIT_OK


def _logs(args: argparse.Namespace) -> int:
    from .logs import LogsError, LogTail, follow, logs_target, run_logs

    store = _open_store(args)
    args.run, args.stage = logs_target(store, args.run, args.stage)
    if args.item is not None:
        from .status import item_log
        from .terminal import visible

        if args.stage is None:
            raise LogsError("--item K needs the map stage: hetflow logs RUN STAGE --item K")
        try:
            what, text = item_log(store, args.run, args.stage, args.item)
        except (KeyError, ValueError) as exc:
            raise LogsError(str(exc.args[0])) from None
        print(visible(f"== {what}", newlines=False))
        sys.stdout.write(visible(text))
        return EXIT_OK
    run, attempts = run_logs(store, args.run, args.stage, args.attempt)
    if args.rank is not None and not args.follow:
        ranks = sorted({r for a in attempts for r in a.files.rank_logs()})
        if args.rank not in ranks:
            raise LogsError(f"run {run.id}: no output of rank {args.rank}"
                            + (f" in stage {args.stage!r}" if args.stage else "") + f" (ranks with output: {ranks})")
    out = sys.stdout
    if args.follow:
        if args.attempt is not None:
            raise LogsError("--follow shows every attempt as it comes; leave out --attempt")

        def emit(line: str) -> None:
            print(line, file=out, flush=True)

        follow(store, run.id, args.stage, args.rank, emit)
        return EXIT_OK
    for attempt in attempts:  # a chunk at a time: a log of any size takes little memory
        for line in LogTail().poll(attempt.sources(args.rank), flush=True):
            print(line, file=out)
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    from .serve import host_name, make_server

    for name in args.allow_host:
        if not name or host_name(name) != (name.lower(), "") or any(c.isspace() or c in "/@" for c in name):
            raise UsageError(f"--allow-host {name!r}: expected a host name or address without a port "
                             "(e.g. mybox.example.org, 10.0.0.5, [fe80::1])")
    store = _open_store(args)
    run_id = None
    if args.run is not None:
        run_id = store.resolve_run(args.run).id
    try:
        server = make_server(store, run_id, host=args.host, port=args.port,
                             allowed_hosts=tuple(args.allow_host))
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    host, port = server.server_address[:2]
    host = host.decode() if isinstance(host, bytes) else host
    from .display import remove_serve_note, write_serve_note

    workdir = _workdir(args).resolve()
    try:  # where a run of this store is shown in a notebook, it links here (with the token: the note is 0600)
        write_serve_note(workdir, host, port, store.url, run_id, server.token)
    except OSError as exc:
        logging.getLogger(__name__).info("serve: no note in %s (%s)", workdir, exc)
    address = f"http://{f'[{host}]' if ':' in host else host}:{port}/?token={server.token}"
    print(f"serving {'run ' + run_id if run_id else 'the latest run'} at {address} (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        remove_serve_note(workdir)
    return EXIT_OK


def _runs(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.state) - set(RUN_STATES))
    if unknown:
        raise UsageError(f"--state {unknown[0]}: not a run state (states: {', '.join(RUN_STATES)})")
    store = _open_store(args)
    runs = [r for r in store.runs() if not args.state or r.state in args.state]
    if args.json:
        print(json.dumps([{"id": r.id, "pipeline": r.pipeline, "state": r.state, "created": iso(r.created),
                           "started": iso(r.started), "ended": iso(r.ended), "run_dir": r.run_dir,
                           "script": r.script, "owner": r.owner, "error": r.error} for r in runs], indent=2))
        return EXIT_OK
    for run in runs:
        print(visible(f"{run.id:<48} {run.state:<11} {iso(run.created)}", newlines=False))
    return EXIT_OK


def _removal_lines(removal: Any, dry_run: bool) -> None:
    verb = "would remove" if dry_run else "removed"
    for run_id in removal.runs:
        print(visible(f"{verb} run {run_id}", newlines=False))
    for path in removal.paths:
        print(visible(f"{verb} {path}", newlines=False))
    for path, users in sorted(removal.kept.items()):
        print(visible(f"kept {path} (used by run {', '.join(sorted(set(users)))})", newlines=False))
    if not removal.runs and not removal.paths:
        print("nothing to remove")


def _rm(args: argparse.Namespace) -> int:
    from .manage import remove_runs

    store = _open_store(args)
    ids = list(dict.fromkeys(store.resolve_run(r).id for r in args.runs))
    _removal_lines(remove_runs(store, ids, dry_run=args.dry_run, where=_where(args)), args.dry_run)
    return EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    from .manage import collect_garbage

    store = _open_store(args)
    runs_dir = _workdir(args).resolve() / "runs"
    _removal_lines(collect_garbage(store, runs_dir, dry_run=args.dry_run, grace=args.grace), args.dry_run)
    return EXIT_OK


def _cancel(args: argparse.Namespace) -> int:
    import socket
    import time

    from .errors import recorded_in, resume_hint

    store = _open_store(args)
    run = store.resolve_run(args.run)
    if run.state != State.RUNNING:
        raise UsageError(f"run {run.id} is not running (it ended {run.state}); nothing to cancel")
    if not store.request_cancel(run.id, f"{socket.gethostname()}:{os.getpid()} at {iso(time.time())}"):
        raise UsageError(f"run {run.id} ended before it could be cancelled")
    if args.no_wait:
        print(f"asked run {run.id} to stop (its orchestrator looks every second)")
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        store.reconcile_dead_runs()
        now = store.resolve_run(run.id)
        if now.state != State.RUNNING:
            shell = now.script is None and recorded_in(now.run_dir)
            print(visible(f"run {run.id} {now.state}; "
                          f"{resume_hint(run.id, script=now.script is not None, where=_where(args), shell=shell)}"))
            return EXIT_OK
        time.sleep(0.5)
    print(visible(f"hetflow: run {run.id} is still running {args.timeout:g} s after the cancel request "
                  f"(its orchestrator {run.owner} has not answered)"), file=sys.stderr)
    return EXIT_FAILED


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


def _pilots() -> int:
    """Each shipped config by its own (file) name, what it extends, and its size: a config that
    extends another inherits its ``name:``, which would make the two read alike."""
    from hetflow.tasks.pilot import config_names, config_parent, load_pilot

    for name in config_names():
        pilot = load_pilot(name)
        parent = config_parent(name)
        origin = f" (extends {parent})" if parent else ""
        print(f"{name:<16} {pilot.size()}{origin}")
    return EXIT_OK


def _need(module: str, extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` naming the extra when ``module`` cannot be imported."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(f"{what} needs {module}, which is not installed: "
                                f"pip install 'hetflow[{extra}]'") from None


def _submit(args: argparse.Namespace) -> int:
    from hetflow.tasks.pilot import parse_duration

    from .submit import submit

    walltime = None
    if args.walltime is not None:
        try:
            walltime = parse_duration(args.walltime)
        except ConfigError as exc:
            raise UsageError(f"--walltime: {exc}") from None
        if walltime <= 0:
            raise UsageError(f"--walltime {args.walltime!r}: expected a positive duration")
    done = submit(args.script, pilot=args.pilot, params=args.param, workdir=_workdir(args), db=args.db,
                  chain=args.chain, walltime=walltime, data_dir=args.data_dir)
    print(f"submitted batch job {done.job_id}: run {done.run_id}")
    print(f"  batch script {done.script}; log {str(done.log).replace('%j', done.job_id)}")
    from .errors import hetflow_command, store_argv

    where = store_argv(_workdir(args).resolve(), args.db)  # the job's own store, from any directory
    print(f"  follow it with: {hetflow_command('status', done.run_id, where)}")
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    _need("matplotlib", "report", "hetflow report")

    store = _open_store(args)
    html, png = write_report(store, args.run, Path(args.out) if args.out else None)
    print(f"wrote {html}" + (f" and {png}" if png else ""))
    return EXIT_OK


def _summary_after(run_id: str, args: argparse.Namespace) -> None:
    """The summary of a run that ended by an exception (Ctrl-C), as recorded; nothing when unreadable."""
    try:
        from .store import Store

        store = Store.for_workdir(_workdir(args), getattr(args, "db", None))
        _print_summary(run_status(store, run_id), args)
    except Exception as exc:  # noqa: BLE001 - the interruption was reported already; this is extra
        logging.getLogger(__name__).info("no summary of run %s: %s", run_id, exc)


class _VisibleFormatter(logging.Formatter):
    """Log records as text with control characters made visible: a logged error carries the run's text."""

    def format(self, record: logging.LogRecord) -> str:
        return visible(super().format(record))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":
        from hetflow.tasks.simulator import cli_main

        try:
            if "--report" in argv:
                _need("matplotlib", "report", "hetflow simulate --report")
            return int(cli_main(argv[1:]))
        except HetflowError as exc:
            print(f"hetflow: error: {visible(str(exc))}", file=sys.stderr)
            return EXIT_USAGE
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler()
    handler.setFormatter(_VisibleFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    try:
        if args.command in ("run", "resume"):
            from .pipeline import RunOptions
        if args.command == "run":
            if args.run_id is not None:
                from .submit import check_run_id

                check_run_id(args.run_id)
                if args.submitted is not None:
                    from .submit import check_unchanged

                    check_unchanged(args.submitted, args.run_id, _workdir(args), args.db)
            options = RunOptions(pilot=args.pilot, workdir=args.workdir, param_text=dict(args.param), db=args.db,
                                 data_dir=args.data_dir,
                                 backend=args.backend, progress=False if args.no_progress else None,
                                 rerun=tuple(args.rerun), stream_logs=args.verbose > 0, run_id=args.run_id,
                                 new_run_ok=args.run_id is not None, cwd=os.getcwd())
            return _run_script(args.script, options, args)
        if args.command == "submit":
            return _submit(args)
        if args.command == "resume":
            store = _open_store(args)
            record = store.resolve_run(args.run)
            from . import started

            if not record.script:
                started.check(record)
                return _resume_recorded(record, args)
            _check_recorded_script(record.script, record.id)
            started.check(record)
            options = RunOptions(pilot=args.pilot, workdir=args.workdir, params=dict(record.params), db=args.db,
                                 data_dir=args.data_dir,
                                 run_id=record.id, progress=False if args.no_progress else None,
                                 rerun=tuple(args.rerun), stream_logs=args.verbose > 0, cwd=os.getcwd())
            return _run_script(record.script, options, args, argv=record.argv or ())
        if args.command == "status":
            return _status(args)
        if args.command == "datasets":
            return _datasets(args)
        if args.command == "runs":
            return _runs(args)
        if args.command == "logs":
            return _logs(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "rm":
            return _rm(args)
        if args.command == "gc":
            return _gc(args)
        if args.command == "cancel":
            return _cancel(args)
        if args.command == "pilots":
            return _pilots()
        if args.command == "pilot":
            return _pilot(args)
        if args.command == "report":
            return _report(args)
    except (RunFailed, RunAborted) as exc:
        print(f"hetflow: {visible(str(exc))}", file=sys.stderr)
        if isinstance(exc, RunAborted):
            _summary_after(exc.run_id, args)
        return EXIT_FAILED
    except RunInterrupted as exc:
        print(f"hetflow: {visible(str(exc))}", file=sys.stderr)
        _summary_after(exc.run_id, args)
        return EXIT_INTERRUPTED
    except HetflowError as exc:
        print(f"hetflow: error: {visible(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hetflow: interrupted; running tasks were stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `hetflow runs | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return EXIT_OK
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
