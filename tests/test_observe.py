"""Seeing what a run does, as a user would: ``hetflow logs``, ``run -v``, the live view and its plain lines,
``status`` log paths, the final summary (real subprocesses, real mpiexec, real SQLite)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

pytestmark = pytest.mark.timeout(300)

TWO_RANKS = textwrap.dedent('''
    import os, signal, sys, time
    import pyarrow as pa
    import hetflow as hf

    pipe = hf.Pipeline("obs", pilot="local")

    @pipe.stage(ranks=2, outputs=["t"], params={"lines": 3, "pause": 0.0, "kill": 0})
    def talk(ctx):
        for i in range(int(ctx.params.get("lines", 3))):
            print(f"line {i} from rank {ctx.rank}", flush=True)
            ctx.progress(i + 1, int(ctx.params.get("lines", 3)), unit="step", loss=1.0 / (i + 1))
            time.sleep(float(ctx.params.get("pause", 0.0)))
        print(f"note from rank {ctx.rank}", file=sys.stderr, flush=True)
        ctx.log.info("logged by rank %d", ctx.rank)
        if ctx.params.get("kill"):
            ctx.comm.barrier()  # both ranks have written their lines before rank 1 dies (a loaded machine
                                # may start rank 0 late, and the launcher then kills it before it printed)
        if ctx.params.get("kill") and ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        ctx.comm.barrier()
        return {"t": pa.table({"r": [ctx.rank]})}

    @pipe.stage(ranks=1, inputs=["t"])
    def after(ctx, t):
        print("after saw", t.num_rows, "rows")

    pipe.run()
''')


def hetflow(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=240,
                          env=env or dict(os.environ))


def script(tmp: Path) -> Path:
    path = tmp / "obs.py"
    path.write_text(TWO_RANKS)
    return path


def run_id(cwd: Path) -> str:
    status = hetflow("status", "--workdir", "w", "--json", cwd=cwd)
    return str(json.loads(status.stdout)["id"])


def test_logs_label_each_rank_and_keep_the_launcher_banner_apart(tmp_path: Path) -> None:
    done = hetflow("run", str(script(tmp_path)), "--workdir", "w", "--param", "kill=1", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    rid = run_id(tmp_path)
    logs = hetflow("logs", rid, "--workdir", "w", cwd=tmp_path)
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    for rank in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[talk rank {rank}] ")]
        assert f"[talk rank {rank}] line 0 from rank {rank}" in mine
        assert f"[talk rank {rank}] note from rank {rank}" in mine           # stderr too, same file, in order
        assert any(f"logged by rank {rank}" in ln for ln in mine)            # ctx.log
        assert all(f"from rank {1 - rank}" not in ln for ln in mine)        # never the other rank's lines
    banner = [ln for ln in lines if "BAD TERMINATION" in ln]
    assert banner and all(ln.startswith("[talk launcher] ") for ln in banner)
    only = hetflow("logs", rid, "talk", "--rank", "1", "--workdir", "w", cwd=tmp_path)
    assert only.returncode == 0 and only.stdout.splitlines()
    assert all(ln.startswith("[talk rank 1] ") for ln in only.stdout.splitlines())
    wrong = hetflow("logs", rid, "talk", "--rank", "7", "--workdir", "w", cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.strip().count("\n") == 0 and "ranks with output: [0, 1]" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    # the summary names the logs, the durations and the exact resume command
    assert "resume it with: hetflow resume " + rid + " --workdir w" in done.stdout
    assert f"logs: {tmp_path}/w/runs/{rid}/stages/talk/attempt-1" in done.stdout
    # status shows where the logs are, in text and JSON
    status = hetflow("status", rid, "--workdir", "w", "--json", cwd=tmp_path)
    talk = next(s for s in json.loads(status.stdout)["stages"] if s["name"] == "talk")
    assert sorted(talk["logs"]["ranks"]) == ["0", "1"]
    assert Path(talk["logs"]["ranks"]["1"]).read_text().startswith("line 0 from rank 1")
    text = hetflow("status", rid, "--workdir", "w", cwd=tmp_path)
    assert f"talk: logs: {talk['logs']['directory']}/rank-*.log" in text.stdout


def test_run_verbose_streams_labelled_output_while_the_stage_runs(tmp_path: Path) -> None:
    env = dict(os.environ, HETFLOW_PROGRESS_INTERVAL="0.5")
    done = hetflow("-v", "run", str(script(tmp_path)), "--workdir", "w", "--param", "lines=4", "--param",
                   "pause=0.6", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    err = done.stderr.splitlines()
    first_line = err.index("[talk rank 1] line 0 from rank 1")
    finished = next(i for i, ln in enumerate(err) if ln.startswith("hetflow: [") and " talk DONE in " in ln)
    assert first_line < finished                                    # streamed while it ran, not dumped after
    assert "[after rank 0] after saw 2 rows" in err
    # plain progress lines (stderr is not a terminal): ctx.progress reached the display from the files
    running = [ln for ln in err if " talk RUNNING (2 ranks, 2 cores) step " in ln]
    assert running, done.stderr
    assert any("loss=" in ln for ln in running)
    # the summary has durations and log directories
    assert any(ln.strip().startswith("talk") and "DONE" in ln and "s  attempts=1" in ln for ln in done.stdout.splitlines())


def test_logs_follow_streams_a_running_stage_and_ends_with_the_run(tmp_path: Path) -> None:
    path = script(tmp_path)
    proc = subprocess.Popen([*HETFLOW, "run", str(path), "--workdir", "w", "--param", "lines=6", "--param",
                             "pause=0.5"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        started = proc.stderr.readline()
        assert "started" in started, started
        rid = started.split("run ", 1)[1].split()[0]
        follow = subprocess.Popen([*HETFLOW, "logs", rid, "--follow", "--workdir", "w"], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = follow.communicate(timeout=200)
        assert follow.returncode == 0, err
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    lines = out.splitlines()
    assert "[talk/attempt-1 rank 0] line 5 from rank 0" in lines and "[talk/attempt-1 rank 1] line 5 from rank 1" in lines
    assert "[after/attempt-1 rank 0] after saw 2 rows" in lines   # followed into the next stage, ended with the run
    assert len([ln for ln in lines if "line 3 from rank 0" in ln]) == 1   # each line once


RETRIED = textwrap.dedent('''
    import time
    import hetflow as hf

    pipe = hf.Pipeline("retried", pilot="local")

    @pipe.stage(ranks=1, retries=1)
    def flaky(ctx):
        for i in range(4):
            print(f"attempt {ctx.attempt} line {i}", flush=True)
            time.sleep(0.5)
        if ctx.attempt == 1:
            raise RuntimeError("the first attempt fails")

    pipe.run()
''')


def test_logs_follow_names_the_attempt_of_every_line_of_a_retried_stage(tmp_path: Path) -> None:
    (tmp_path / "retried.py").write_text(RETRIED)
    proc = subprocess.Popen([*HETFLOW, "run", "retried.py", "--workdir", "w"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        started = proc.stderr.readline()
        assert "started" in started, started
        follow = hetflow("logs", "--follow", "--workdir", "w", cwd=tmp_path)   # the latest run: this one
        assert follow.returncode == 0, follow.stderr
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    lines = follow.stdout.splitlines()
    for attempt in (1, 2):
        mine = [ln for ln in lines if f"attempt {attempt} line" in ln]
        assert mine == [f"[flaky/attempt-{attempt} rank 0] attempt {attempt} line {i}" for i in range(4)], lines
    assert any(ln.startswith("[flaky/attempt-1 rank 0] ") and "the first attempt fails" in ln for ln in lines)
    # without --follow: the latest attempt, named as such; --attempt 1 the first, by the stage's name alone
    latest = hetflow("logs", "flaky", "--workdir", "w", cwd=tmp_path)
    assert latest.returncode == 0, latest.stderr
    assert "[flaky/attempt-2 rank 0] attempt 2 line 3" in latest.stdout.splitlines()
    first = hetflow("logs", "flaky", "--attempt", "1", "--workdir", "w", cwd=tmp_path)
    assert "[flaky rank 0] attempt 1 line 3" in first.stdout.splitlines()


PIPE_NAMED_TALK = "import hetflow as hf\npipe = hf.Pipeline('talk', pilot='local')\n" \
                  "@pipe.stage(ranks=1)\ndef hello(ctx):\n    print('hello from the talk pipeline')\npipe.run()\n"


def test_logs_defaults_to_the_latest_run_and_reads_one_word_as_a_run_else_a_stage(tmp_path: Path) -> None:
    (tmp_path / "talkpipe.py").write_text(PIPE_NAMED_TALK)
    older = hetflow("run", "talkpipe.py", "--workdir", "w", cwd=tmp_path)   # a run whose id starts "talk-"
    assert older.returncode == 0, older.stderr
    older_id = run_id(tmp_path)
    done = hetflow("run", str(script(tmp_path)), "--workdir", "w", "--param", "lines=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rid = run_id(tmp_path)
    assert rid != older_id
    latest = hetflow("logs", "--workdir", "w", cwd=tmp_path)                 # no RUN: the latest run, like status
    assert latest.returncode == 0, latest.stderr
    assert "[talk rank 0] line 0 from rank 0" in latest.stdout.splitlines()
    assert "[after rank 0] after saw 2 rows" in latest.stdout.splitlines()
    stage = hetflow("logs", "after", "--workdir", "w", cwd=tmp_path)         # one word, not a run: a stage
    assert stage.returncode == 0, stage.stderr
    assert stage.stdout.splitlines() and all(ln.startswith("[after ") for ln in stage.stdout.splitlines())
    run = hetflow("logs", older_id[:12], "--workdir", "w", cwd=tmp_path)    # one word, a run prefix: that run
    assert run.stdout.splitlines() == ["[hello rank 0] hello from the talk pipeline"], run.stdout + run.stderr
    both = hetflow("logs", "talk", "--workdir", "w", cwd=tmp_path)          # a prefix of a run and a stage: refused
    assert both.returncode == 2 and both.stderr.count("\n") == 1, both.stderr
    assert f"run {older_id}" in both.stderr and f"hetflow logs {rid} talk" in both.stderr
    assert hetflow("logs", rid, "talk", "--workdir", "w", cwd=tmp_path).stdout.startswith("[talk rank ")
    neither = hetflow("logs", "nothing", "--workdir", "w", cwd=tmp_path)
    assert neither.returncode == 2 and neither.stderr.count("\n") == 1 and "Traceback" not in neither.stderr
    assert "'nothing' is neither a run nor a stage" in neither.stderr and "['talk', 'after']" in neither.stderr


def read_pty(fd: int, until: float) -> bytes:
    data = b""
    while time.time() < until:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    return data


def test_live_view_on_a_terminal_shows_a_row_per_stage_with_progress(tmp_path: Path) -> None:
    path = script(tmp_path)
    pid, fd = pty.fork()
    if pid == 0:  # the child: hetflow on a real terminal
        os.chdir(tmp_path)
        os.environ["COLUMNS"] = "160"
        os.execv(sys.executable, [*HETFLOW, "run", str(path), "--workdir", "w", "--param", "lines=5",
                                  "--param", "pause=0.6"])
    out = read_pty(fd, time.time() + 200).decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    for header in ("stage", "state", "ranks", "slots", "elapsed", "progress", "last output"):
        assert header in out
    assert "step 3/5" in out or "step 4/5" in out, out        # the progress column, from ctx.progress
    assert "loss=" in out and "line " in out                   # metrics and the last line a rank printed
    assert "hetflow: [" not in out                             # a terminal gets the table, not plain lines


def test_ctrl_c_prints_the_summary_with_the_exact_resume_command(tmp_path: Path) -> None:
    path = script(tmp_path)
    proc = subprocess.Popen([*HETFLOW, "run", str(path), "--workdir", "w", "--param", "lines=60", "--param",
                             "pause=0.5"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = ""
    while "talk RUNNING" not in seen:   # the plain progress line says the stage runs
        line = proc.stderr.readline()
        assert line, f"the run ended or said nothing before its stage ran: {seen}"
        seen += line
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    rid = run_id(tmp_path)
    assert f"run {rid}: INTERRUPTED" in out
    assert f"resume it with: hetflow resume {rid} --workdir w" in out
    assert f"logs: {tmp_path}/w/runs/{rid}/stages/talk/attempt-1" in out


def test_progress_text_and_fit_reports_epochs_and_loss(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (tmp_path / "fit.py").write_text(textwrap.dedent('''
        import numpy as np, pyarrow as pa, torch
        import hetflow as hf
        import hetflow.ml as ml

        pipe = hf.Pipeline("fit", pilot="local")

        @pipe.stage(ranks=1)
        def train(ctx):
            rng = np.random.default_rng(0)
            x = rng.normal(size=(64, 2)).astype(np.float32)
            table = pa.table({"a": x[:, 0], "b": x[:, 1], "y": x[:, 0] - x[:, 1]})
            ml.fit(ctx, table, model=ml.MLP(2, hidden=[4]), features=["a", "b"], label="y",
                   loss=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                   epochs=3, batch_size=16)

        pipe.run()
    '''))
    done = hetflow("run", "fit.py", "--workdir", "w", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    status = json.loads(hetflow("status", "--workdir", "w", "--json", cwd=tmp_path).stdout)
    from hetflow.progress import progress_text
    from hetflow.tasks.protocol import AttemptFiles

    reports = AttemptFiles(Path(status["stages"][0]["logs"]["directory"])).read_progress()
    assert list(reports) == [0] and reports[0]["unit"] == "epoch"
    assert (reports[0]["done"], reports[0]["total"]) == (3.0, 3.0)
    text = progress_text(reports)
    assert text.startswith("epoch 3/3 100% loss=") and "val_loss" not in text


def test_progress_text_takes_the_slowest_rank_and_rank_0_metrics() -> None:
    from hetflow.progress import progress_text

    reports = {0: {"done": 7.0, "total": 10.0, "unit": "batch", "metrics": {"loss": 0.123456}},
               1: {"done": 4.0, "total": 10.0, "unit": "batch", "metrics": {"loss": 9.0}}}
    assert progress_text(reports) == "batch 4/10 40% loss=0.1235"
    assert progress_text({}) == ""
    assert progress_text({2: {"done": 12.0, "total": None, "unit": "", "metrics": {}}}) == "12"


def test_serve_shows_a_running_run_and_refreshes_until_it_ends_in_chromium(tmp_path: Path) -> None:
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs it)")
    path = script(tmp_path)
    run = subprocess.Popen([*HETFLOW, "run", str(path), "--workdir", "w", "--param", "lines=14", "--param",
                            "pause=0.5"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    serve = None
    try:
        assert run.stderr is not None
        started = run.stderr.readline()
        rid = started.split("run ", 1)[1].split()[0]
        serve = subprocess.Popen([*HETFLOW, "serve", rid[:10], "--port", "0", "--workdir", "w"], cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert serve.stdout is not None
        line = serve.stdout.readline()
        url = line.split(" at ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and "/?token=" in url, line
        base, token = url.split("?token=")
        with urllib.request.urlopen(f"{base}api/status?token={token}", timeout=30) as answer:
            assert json.loads(answer.read())["state"] == "RUNNING"       # the page is opened mid-run
        argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=120000", "--dump-dom", url]
        dom = subprocess.run(argv, capture_output=True, text=True, timeout=200, check=True).stdout
        assert run.wait(timeout=60) == 0
    finally:
        run.kill()
        if serve is not None:
            serve.send_signal(signal.SIGINT)
            serve.wait(timeout=30)
    assert serve.returncode == 0
    # the page saw the run RUNNING, kept refreshing, and ended showing it DONE with both stages
    assert 'data-state="DONE"' in dom and 'data-seen="RUNNING DONE"' in dom, dom[:2000]
    assert f"hetflow run {rid}: DONE" in dom
    rows = re.findall(r'<tr data-stage="([^"]+)">(.*?)</tr>', dom, re.DOTALL)
    assert [name for name, _ in rows] == ["talk", "after"]
    assert all('class="state DONE"' in body for _, body in rows)
    assert f"/w/runs/{rid}/stages/talk/attempt-1" in rows[0][1]          # where the logs are


def test_serve_binds_this_machine_only_and_names_bad_requests(tmp_path: Path) -> None:
    done = hetflow("run", str(script(tmp_path)), "--workdir", "w", "--param", "lines=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    serve = subprocess.Popen([*HETFLOW, "serve", "--port", "0", "--workdir", "w"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        url = serve.stdout.readline().split(" at ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        base, token = url.split("?token=")
        with urllib.request.urlopen(f"{base}timeline?token={token}", timeout=30) as answer:
            page = answer.read().decode()
        assert "talk" in page and 'id="gantt"' in page
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}../etc/passwd?token={token}", timeout=30)
        assert missing.value.code == 404
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=30)


def test_a_bad_progress_interval_is_one_clear_line(tmp_path: Path) -> None:
    env = dict(os.environ, HETFLOW_PROGRESS_INTERVAL="soon")
    done = hetflow("run", str(script(tmp_path)), "--workdir", "w", cwd=tmp_path, env=env)
    assert done.returncode == 2
    assert done.stderr.strip() == "hetflow: error: HETFLOW_PROGRESS_INTERVAL='soon' is not a number of seconds above 0"


def test_ctx_progress_writes_one_small_file_and_never_fails_the_stage(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from hetflow.tasks.context import StageContext
    from hetflow.tasks.protocol import AttemptFiles

    comm = SimpleNamespace(Get_rank=lambda: 1, Get_size=lambda: 2)  # only its rank is read
    ctx = StageContext(comm=comm, stage="s", run_id="r", attempt=1, params={}, workdir=tmp_path,
                       checkpoint_dir=tmp_path)
    ctx.progress(1, 4, unit="file", loss=0.5, note="warm")
    ctx.progress(2, 4)                      # within 0.1 s of the last: dropped
    assert AttemptFiles(tmp_path).read_progress() == {1: {"done": 1.0, "total": 4.0, "unit": "file", "metrics":
                                                          {"loss": 0.5, "note": "warm"},
                                                          "time": pytest.approx(time.time(), abs=60)}}
    ctx.progress(4, 4)                      # the last unit always lands
    assert AttemptFiles(tmp_path).read_progress()[1]["done"] == 4.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress-1.json"]
    gone = StageContext(comm=comm, stage="s", run_id="r", attempt=1, params={}, workdir=tmp_path / "missing",
                        checkpoint_dir=tmp_path)
    with caplog.at_level("WARNING", logger="hetflow.stage"):
        gone.progress(1, 2)
        gone.progress(2, 2)
    assert len([r for r in caplog.records if "progress not recorded" in r.getMessage()]) == 1


WATCHED = textwrap.dedent('''
    import os, time
    import hetflow as hf

    pipe = hf.Pipeline("watched", pilot="local")

    @pipe.stage(ranks=2, name="train_member_of_a_learning_rate_sweep_with_a_long_name_lr_0_001",
                params={"release": ""})
    def member(ctx):
        ctx.progress(3, 10, unit="epoch", loss=0.25)
        give_up = time.time() + 180  # a test that failed half-way leaves nothing running for long
        while not os.path.exists(ctx.params["release"]) and time.time() < give_up:
            time.sleep(0.2)
        ctx.progress(10, 10, unit="epoch", loss=0.125)

    pipe.run()
''')


def test_serve_page_shows_each_running_stages_progress_and_fits_a_1200px_window(tmp_path: Path) -> None:
    from _browser import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs it)")
    (tmp_path / "watched.py").write_text(WATCHED)
    release = tmp_path / "release"
    run = subprocess.Popen([*HETFLOW, "run", "watched.py", "--workdir", "w", "--param", f"release={release}"],
                           cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    assert run.stderr is not None and "started" in run.stderr.readline()   # the store and the run exist
    serve = subprocess.Popen([*HETFLOW, "serve", "--port", "0", "--workdir", "w"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        url = serve.stdout.readline().split(" at ", 1)[1].split()[0]
        base, token = url.split("?token=")
        stage = "train_member_of_a_learning_rate_sweep_with_a_long_name_lr_0_001"
        deadline = time.time() + 120
        while True:  # the JSON API: the running stage's progress, as the terminal shows it, and per rank
            with urllib.request.urlopen(f"{base}api/status?token={token}", timeout=30) as answer:
                status = json.loads(answer.read())
            progress = next((s["progress"] for s in status["stages"] if s["name"] == stage), None)
            if progress and len(progress["ranks"]) == 2:
                break
            assert time.time() < deadline and run.poll() is None, status
            time.sleep(0.3)
        assert status["state"] == "RUNNING" and progress["text"] == "epoch 3/10 30% loss=0.25"
        assert progress["ranks"]["1"]["done"] == 3.0 and progress["ranks"]["1"]["metrics"] == {"loss": 0.25}
        with Browser(tmp_path / "profile", width=1200, height=900) as browser:
            browser.open(url)
            row = f"document.querySelector('tr[data-stage=\"{stage}\"]')"
            assert browser.wait_for(f"{row} && {row}.querySelector('td.progress').textContent") == \
                "epoch 3/10 30% loss=0.25"
            assert browser.evaluate(f"{row}.querySelector('td.state').textContent") == "RUNNING"
            width = browser.overflow()
            assert width["scrollWidth"] <= width["innerWidth"] == 1200, width   # no sideways scrolling
            release.touch()
            assert run.wait(timeout=120) == 0
            browser.wait_for("document.body.getAttribute('data-state') === 'DONE'", timeout=90)
            assert browser.evaluate(f"{row}.querySelector('td.progress').textContent") == \
                "epoch 10/10 100% loss=0.125"                                    # the last report stays
            width = browser.overflow()
            assert width["scrollWidth"] <= width["innerWidth"], width
            browser.open(f"{base}timeline?token={token}")   # the timeline alone, too
            width = browser.overflow()
            assert width["scrollWidth"] <= width["innerWidth"], width
    finally:
        release.touch()
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=30)
