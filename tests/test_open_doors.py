"""Open doors and hostile text (issue 25), attacked as an outsider would, on real processes: ``hetflow
serve`` asked with forged ``Host`` headers and bad query values (raw ``http.client`` and sockets), a run
whose output and errors carry terminal escape sequences (watched on a real terminal, through ``status``,
``logs`` and the summary), ``hetflow logs`` on a 64 MB line without a newline (the follower's peak
memory, from the kernel), and the listening sockets of a real two-rank run (psutil)."""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import pty
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

pytestmark = pytest.mark.timeout(300)

EVIL = "\x1b]0;pwned\x07\x1b[2J\rFAKE DONE \x1b]8;;http://evil.example/\x1b\\link\x1b]8;;\x1b\\ \x9b31m"
RAW = ("\x1b]0;pwned", "\x1b[2J", "\rFAKE", "\x1b]8;;http://evil", "\x9b31m")
"""What must never reach a terminal raw: a window title, clear screen, CR line spoofing, an OSC-8 link, C1 CSI."""

HOSTILE = textwrap.dedent('''
    import time
    import hetflow as hf

    EVIL = %r
    pipe = hf.Pipeline("doors", pilot="local")

    @pipe.stage(ranks=1)
    def chatty(ctx):
        print("before" + EVIL, flush=True)
        time.sleep(3.0)   # the live view redraws while this line is the stage's last output

    @pipe.stage(ranks=1)
    def boom(ctx):
        raise RuntimeError("bad thing" + EVIL + "\\nsecond line")

    pipe.run()
''') % EVIL


def hetflow(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=240)


def read_all(fd: int, until: float) -> bytes:
    data = b""
    while time.time() < until:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A run made on a real terminal whose output and error carry escape sequences: ``(dir, run id, what the
    terminal got)``."""
    tmp = tmp_path_factory.mktemp("doors")
    (tmp / "doors.py").write_text(HOSTILE)
    pid, fd = pty.fork()
    if pid == 0:  # the child: hetflow run on a real terminal (the live view, then the summary)
        os.chdir(tmp)
        os.environ["COLUMNS"] = "200"
        os.execv(sys.executable, [*HETFLOW, "run", "doors.py", "--workdir", "w"])
    out = read_all(fd, time.time() + 200).decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1, out
    rid = json.loads(hetflow("status", "--workdir", "w", "--json", cwd=tmp).stdout)["id"]
    return tmp, rid, out


def assert_tame(text: str) -> None:
    for raw in RAW:
        assert raw not in text, f"{raw!r} reached the terminal raw"


def test_live_view_and_summary_on_a_terminal_show_escape_sequences_as_text(hostile: tuple[Path, str, str]) -> None:
    _, rid, out = hostile
    assert_tame(out)
    assert "chatty" in out and "last output" in out                        # the live view was drawn
    assert "│ FAKE DONE \\x1b]8;;http://evil.example/" in out                    # the rank's last line, made visible
    assert f"run {rid}: FAILED" in out
    assert "bad thing\\x1b]0;pwned\\x07\\x1b[2J\\rFAKE DONE" in out           # the summary's error, made visible


def test_status_and_runs_show_another_runs_escape_sequences_as_text(hostile: tuple[Path, str, str]) -> None:
    tmp, rid, _ = hostile
    status = hetflow("status", "--workdir", "w", cwd=tmp)
    assert status.returncode == 1, status.stderr
    assert_tame(status.stdout + status.stderr)
    assert "bad thing\\x1b]0;pwned\\x07\\x1b[2J\\rFAKE DONE" in status.stdout
    assert "second line" in status.stdout                                    # a multi-line error keeps its lines
    as_json = json.loads(hetflow("status", "--workdir", "w", "--json", cwd=tmp).stdout)
    assert EVIL in as_json["stages"][1]["error"]                             # JSON keeps the text exact
    runs = hetflow("runs", "--workdir", "w", cwd=tmp)
    assert rid in runs.stdout and "FAILED" in runs.stdout


def test_logs_show_each_line_labelled_with_escape_sequences_as_text(hostile: tuple[Path, str, str]) -> None:
    tmp, rid, _ = hostile
    for follow in ([], ["--follow"]):
        logs = hetflow("logs", rid, "chatty", *follow, "--workdir", "w", cwd=tmp)
        assert logs.returncode == 0, logs.stderr
        assert_tame(logs.stdout)
        label = "[chatty/attempt-1 rank 0]" if follow else "[chatty rank 0]"  # a follower names every attempt
        assert f"{label} before\\x1b]0;pwned\\x07\\x1b[2J" in logs.stdout
        assert f"{label} FAKE DONE" in logs.stdout                   # after a CR: a labelled line of its own
        assert all(line.startswith(label + " ") for line in logs.stdout.splitlines())


def start_serve(tmp: Path, *extra: str) -> tuple[subprocess.Popen[str], int, str]:
    """``hetflow serve`` started for ``tmp/w``: the process, its port and the token of the address it printed."""
    serve = subprocess.Popen([*HETFLOW, "serve", "--port", "0", "--workdir", "w", *extra], cwd=tmp,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert serve.stdout is not None
    line = serve.stdout.readline()
    assert " at http://127.0.0.1:" in line, line + (serve.stderr.read() if serve.stderr else "")
    address = line.split(" at ", 1)[1].split()[0]
    port, _, token = address.removeprefix("http://127.0.0.1:").partition("/?token=")
    assert len(token) >= 40 and token.replace("-", "").replace("_", "").isalnum(), line
    return serve, int(port), token


def stop(serve: subprocess.Popen[str]) -> None:
    serve.send_signal(signal.SIGINT)
    serve.wait(timeout=30)


def request(port: int, path: str, host: str | None, token: str | None = None,
            cookie: str | None = None, header: str | None = None) -> tuple[int, str, http.client.HTTPMessage]:
    """GET ``path`` with exactly the ``Host`` header given (none when ``None``), ``token=`` added to its query
    when given, a ``Cookie`` header and an ``X-Hetflow-Token`` header (``header``) when given: the status,
    the body and the headers of the answer."""
    if token is not None:
        path += ("&" if "?" in path else "?") + f"token={token}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=40)
    conn.putrequest("GET", path, skip_host=True)
    if host is not None:
        conn.putheader("Host", host)
    if cookie is not None:
        conn.putheader("Cookie", cookie)
    if header is not None:
        conn.putheader("X-Hetflow-Token", header)
    conn.endheaders()
    answer = conn.getresponse()
    body = answer.read().decode()
    conn.close()
    return answer.status, body, answer.headers


def ask(port: int, path: str, host: str | None, token: str | None = None) -> tuple[int, str]:
    """:func:`request`'s status and body."""
    return request(port, path, host, token)[:2]


def raw_request(port: int, request: bytes) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=40) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.decode(errors="replace")


def test_serve_answers_only_its_own_host_names(hostile: tuple[Path, str, str]) -> None:
    tmp, rid, _ = hostile
    serve, port, token = start_serve(tmp)
    try:
        for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LocalHost", f"[::1]:{port}", "[::1]"):
            status, body = ask(port, "/api/status", host, token)
            assert status == 200, (host, body)
            assert json.loads(body)["id"] == rid
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", "127.0.0.1:1",
                     f"localhost.:{port}", f"0.0.0.0:{port}", "", f"127.0.0.1:{port}@evil.example"):
            for path in ("/api/status", "/", "/timeline", "/nope"):
                status, body = ask(port, path, host, token)                 # the token does not help
                assert status == 421, (host, path, status, body)
                assert body.startswith("hetflow serve does not answer for Host"), body
                assert rid not in body and "<" not in body                  # short plain text, nothing of the run
        status, body = ask(port, "/api/status", None)                      # HTTP/1.1 without a Host
        assert status == 400 and "one Host header" in body, body
        answer = raw_request(port, b"GET /api/status HTTP/1.0\r\n\r\n")   # HTTP/1.0 without a Host
        assert answer.startswith("HTTP/1.0 400") and rid not in answer, answer
        answer = raw_request(port, f"GET /api/status HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nHost: evil.example\r\n"
                                   "\r\n".encode())                         # two Host headers
        assert answer.startswith("HTTP/1.0 400") and rid not in answer, answer
    finally:
        stop(serve)


def test_serve_answers_no_route_without_its_token_and_no_cookie_carries_or_opens_it(
        hostile: tuple[Path, str, str]) -> None:
    """Loopback is not private (every user of a login node reaches 127.0.0.1): without the token the server
    printed, every route is 403 and says nothing of the run.  The token opens a route as ``?token=`` or as
    the ``X-Hetflow-Token`` header the page's own requests send, and never travels in a cookie: a browser
    sends a cookie for 127.0.0.1 to every port, so another user's server on another port would get it.  No
    answer sets a cookie, and the cookie earlier versions set opens nothing."""
    tmp, rid, _ = hostile
    serve, port, token = start_serve(tmp)
    other, other_port, other_token = start_serve(tmp)
    host = f"127.0.0.1:{port}"
    try:
        note = json.loads((tmp / "w" / "serve.json").read_text())   # the second server's note (the latest)
        assert note["token"] == other_token and oct((tmp / "w" / "serve.json").stat().st_mode & 0o777) == "0o600"
        wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
        refused = ("hetflow serve answers only with its token: open the address it printed "
                   "(http://HOST:PORT/?token=...)\n")
        for path in ("/", "/api/status", "/api/status?since=x&wait=1", "/timeline", "/nope", "/?token=",
                     f"/?token={wrong}", f"/?token={token[:20]}", f"/api/status?token={other_token}",
                     f"/?token={token}&token={token}"):
            status, body, headers = request(port, path, host)
            assert status == 403 and body == refused, (path, status, body)
            assert rid not in body and token not in body and headers["Set-Cookie"] is None, (path, headers)
        for cookie in (f"hetflow-serve-{port}={token}", f"other=1; hetflow-serve-{port}={token}",
                       f"hetflow-serve-{port}={wrong}", f"hetflow-serve-{other_port}={other_token}", "garbage\x01=;;"):
            for path in ("/", "/api/status", "/timeline"):               # the old cookie, right token or not
                assert request(port, path, host, cookie=cookie)[:2] == (403, refused), (path, cookie)
        for given in (wrong, other_token, "", token[:20], f"{token},{token}"):
            assert request(port, "/api/status", host, header=given)[0] == 403, given
        assert request(port, f"/api/status?token={wrong}", host, header=token)[0] == 403  # a wrong ?token= is wrong
        for path in ("/", "/api/status", "/timeline"):
            status, body, headers = request(port, path, host, token)     # the printed address's form
            assert status == 200 and headers["Set-Cookie"] is None, (path, status, headers)
            assert token not in str(headers) and headers["Referrer-Policy"] == "no-referrer"
            status, body, headers = request(port, path, host, header=token)   # the page's own requests
            assert status == 200 and headers["Set-Cookie"] is None, (path, status, headers)
        assert json.loads(request(port, "/api/status", host, header=token)[1])["id"] == rid
        assert request(port, "/nope", host, header=token)[0] == 404
        assert request(other_port, "/api/status", f"127.0.0.1:{other_port}", header=token)[0] == 403
        assert request(other_port, "/api/status", f"127.0.0.1:{other_port}", header=other_token)[0] == 200
    finally:
        stop(serve)
        stop(other)


def test_serve_page_in_chromium_loads_with_the_printed_address_and_leaves_no_cookie(
        hostile: tuple[Path, str, str], tmp_path: Path) -> None:
    """The page opened in a real browser from the address ``hetflow serve`` printed shows the run and its
    timeline (its requests carry the token in a header), and the browser holds no cookie afterwards: a
    page of another local server on another port, opened next, receives nothing of the token."""
    from _browser import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs it)")
    tmp, rid, _ = hostile
    serve, port, token = start_serve(tmp)
    try:
        with Browser(tmp_path / "profile") as browser:
            browser.open(f"http://127.0.0.1:{port}/?token={token}")
            assert browser.wait_for("document.body.getAttribute('data-state')") == "FAILED"
            assert browser.evaluate("document.getElementById('title').textContent") == f"hetflow run {rid}: FAILED"
            assert browser.evaluate("document.querySelectorAll('#stages tbody tr').length") == 2
            bars = ("(function () { var d = document.getElementById('timeline').contentDocument;"
                    " return d && d.body && d.body.getAttribute('data-bars'); })()")
            assert browser.wait_for(bars) == "2"                          # the timeline, fetched with the header
            assert browser.evaluate("document.getElementById('error').textContent") == ""
            assert browser.call("Storage.getCookies")["cookies"] == []    # HttpOnly ones included
    finally:
        stop(serve)


def test_serve_allow_host_adds_names_and_rejects_a_name_with_a_port(hostile: tuple[Path, str, str]) -> None:
    tmp, _, _ = hostile
    serve, port, token = start_serve(tmp, "--allow-host", "box.example", "--allow-host", "10.1.2.3")
    try:
        for host in (f"box.example:{port}", "BOX.example", "10.1.2.3", f"localhost:{port}"):
            assert ask(port, "/api/status", host, token)[0] == 200, host
        assert ask(port, "/api/status", f"evil.example:{port}", token)[0] == 421
    finally:
        stop(serve)
    bad = hetflow("serve", "--port", "0", "--allow-host", "box.example:80", "--workdir", "w", cwd=tmp)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("hetflow: error: --allow-host 'box.example:80': expected a host name or address "
                                  "without a port (e.g. mybox.example.org, 10.0.0.5, [fe80::1])")


def test_serve_refuses_query_values_that_are_not_finite_bounded_seconds(hostile: tuple[Path, str, str]) -> None:
    tmp, _, _ = hostile
    serve, port, token = start_serve(tmp)
    host = f"127.0.0.1:{port}"
    try:
        for wait in ("nan", "NaN", "inf", "-inf", "-1", "1e9", "30.5", "abc", "0x10", "1e400"):
            status, body = ask(port, f"/api/status?since=x&wait={wait}", host, token)
            assert status == 400, (wait, status, body)
            assert body.startswith("wait= takes one number of seconds from 0 to 30, got"), body
        status, body = ask(port, "/api/status?since=x&wait=1&wait=2", host, token)
        assert status == 400 and "got 2 values" in body, body
        status, body = ask(port, "/api/status?since=" + "a" * 65, host, token)
        assert status == 400 and body.startswith("since= takes a status digest of at most 64 characters"), body
        for wait in ("0", "0.5", "30"):
            assert ask(port, f"/api/status?since=x&wait={wait}", host, token)[0] == 200, wait   # the run has ended
    finally:
        stop(serve)


PEAK = """
import atexit, sys
from hetflow.cli import main

def peak():  # this process's own high-water mark: its memory map's, which began at its exec
    with open("/proc/self/status") as fh:
        sys.stderr.write(next(line for line in fh if line.startswith("VmHWM:")))

atexit.register(peak)
sys.exit(main(sys.argv[1:]))
"""


def peak_rss_kib(argv: list[str], cwd: Path, out: Path) -> tuple[int, int]:
    """``(exit code, peak resident memory in KiB)`` of the hetflow command ``argv`` run to its end with stdout
    to ``out``.  Measured by the command itself (VmHWM): the ``ru_maxrss`` of a child is at least what its
    parent (this test process) had when it was started, which hid the command's own peak."""
    assert argv[:3] == HETFLOW
    with open(out, "wb") as fh:
        done = subprocess.run([sys.executable, "-c", PEAK, *argv[3:]], cwd=cwd, stdout=fh, stderr=subprocess.PIPE,
                              text=True, check=False, timeout=300)
    line = [line for line in done.stderr.splitlines() if line.startswith("VmHWM:")]
    assert line, done.stderr
    return done.returncode, int(line[-1].split()[1])


def test_logs_of_a_huge_line_without_newline_take_bounded_memory(hostile: tuple[Path, str, str]) -> None:
    """Last in this file: it appends to the run's log that the tests above read."""
    tmp, rid, _ = hostile
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0  # the kernel reports peak RSS here
    log_dir = json.loads(hetflow("status", "--workdir", "w", "--json", cwd=tmp).stdout)["stages"][0]["logs"]
    rank_log = Path(log_dir["ranks"]["0"])
    original = rank_log.read_bytes()
    for follow in (["--follow"], []):
        argv = [*HETFLOW, "logs", rid, "chatty", *follow, "--workdir", "w"]
        code, before = peak_rss_kib(argv, tmp, tmp / "small.txt")
        assert code == 0
        size = 64 << 20
        with open(rank_log, "ab") as fh:
            fh.write(b"y" * size)                                           # one line, no newline, still growing
        code, after = peak_rss_kib(argv, tmp, tmp / "big.txt")
        assert code == 0
        assert after - before < 24 << 10, f"{after - before} KiB more for a {size >> 20} MiB line ({follow})"
        pieces = [line for line in (tmp / "big.txt").read_bytes().split(b"\n") if b"yyyy" in line]
        label = b"[chatty/attempt-1 rank 0] " if follow else b"[chatty rank 0] "  # a follower names every attempt
        assert all(p.startswith(label) for p in pieces)     # every piece labelled
        assert b"".join(p[len(label):] for p in pieces) == b"y" * size   # and nothing lost
        rank_log.write_bytes(original)


LISTENER = textwrap.dedent('''
    import sys
    import time
    import hetflow as hf

    WARM = sys.argv[1] == "warm"
    pipe = hf.Pipeline("listen", pilot=hf.PilotDescription(name="listen", options={"local": {"warm_start": WARM}}))

    @pipe.stage(ranks=2)
    def pair(ctx):
        ctx.comm.barrier()
        print("ready", flush=True)
        time.sleep(6.0)
        ctx.comm.barrier()

    @pipe.stage(ranks=1)
    def single(ctx):
        print("ready", flush=True)
        time.sleep(6.0)

    pipe.run()
''')


def listeners(root: psutil.Process) -> Iterator[tuple[psutil.Process, tuple[str, int]]]:
    """``(process, (address, port))`` of every TCP listening socket of ``root``'s process tree."""
    for proc in [root, *root.children(recursive=True)]:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    yield proc, (conn.laddr.ip, conn.laddr.port)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_a_one_node_run_keeps_the_ranks_listening_on_loopback(tmp_path: Path, start: str) -> None:
    """Every kind of rank: warm (forked by the fork server, a two-rank stage's under mpiexec's PMI, a one-rank
    stage's an MPI singleton) and cold (started by mpiexec)."""
    (tmp_path / "listen.py").write_text(LISTENER)
    run = subprocess.Popen([sys.executable, "listen.py", start], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, set[tuple[str, int]]] = {"mpiexec": set(), "warm": set()}
    hydra: set[tuple[str, int]] = set()
    try:
        root = psutil.Process(run.pid)
        while run.poll() is None:
            for proc, address in listeners(root):
                try:
                    name, command = proc.name(), " ".join(proc.cmdline())
                except psutil.NoSuchProcess:
                    continue
                if name.startswith(("mpiexec", "hydra_")):
                    hydra.add(address)     # hydra's control port: MPICH 5's hydra binds it to every address
                else:
                    seen["warm" if "hetflow.tasks.forkserver" in command else "mpiexec"].add(address)
            time.sleep(0.3)
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 0, out + err
    ranks = (seen["mpiexec"] | seen["warm"]) - hydra                      # a cold rank inherits hydra's socket
    assert ranks, f"saw no rank listening (hydra: {hydra}, all: {seen})"
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in ranks), f"ranks listen beyond loopback: {ranks}"
    # the two-rank stage's ranks: forked by the fork server when warm, children of mpiexec when cold
    assert (seen["warm"] if start == "warm" else seen["mpiexec"] - hydra), seen


def test_serve_closes_a_connection_that_sends_no_request(hostile: tuple[Path, str, str]) -> None:
    """Before, a connection that sent nothing (anyone on the host may open one, no token needed) held a
    server thread for good; now it is closed after the request timeout, and the server still answers."""
    tmp, rid, _ = hostile
    serve, port, token = start_serve(tmp)
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=40) for _ in range(20)]
        idle[0].sendall(b"GET /api/status HTTP/1.1\r\n")  # a request begun, never finished
        time.sleep(1.0)
        assert json.loads(ask(port, "/api/status", f"127.0.0.1:{port}", token)[1])["id"] == rid
        began = time.monotonic()
        for sock in idle:  # each ends (after a 408 for the one begun): recv() sees the end, no socket timeout
            while sock.recv(65536):
                pass
            sock.close()
        assert time.monotonic() - began < 30.0, "idle connections were kept open"
    finally:
        stop(serve)


def test_logs_and_serve_read_a_runs_files_only_when_they_are_regular_files(hostile: tuple[Path, str, str]) -> None:
    """A run's log or progress file replaced by a FIFO (a stage, or another user whose run a shared store
    records) made ``hetflow logs`` and every ``/api/status`` of ``serve`` wait for good; one replaced by a
    symlink showed the file it points to.  Now neither is read: ``logs`` says which file it did not show."""
    tmp, rid, _ = hostile
    attempt = tmp / "w" / "runs" / rid / "stages" / "chatty" / "attempt-1"
    log, progress = attempt / "rank-0.log", attempt / "progress-0.json"
    secret = tmp / "secret.txt"
    secret.write_text("PRIVATE KEY MATERIAL\n")
    kept = log.read_bytes()
    try:
        for plant in (lambda p: os.mkfifo(p), lambda p: p.symlink_to(secret)):
            log.unlink()
            plant(log)
            logs = subprocess.run([*HETFLOW, "logs", rid, "chatty", "--workdir", "w"], cwd=tmp, capture_output=True,
                                  text=True, timeout=60, check=False)
            assert logs.returncode == 0, logs.stderr
            assert "PRIVATE KEY" not in logs.stdout, logs.stdout
            assert f"[chatty rank 0] (not shown: refusing {log}:" in logs.stdout, logs.stdout
        os.mkfifo(progress)
        serve, port, token = start_serve(tmp)
        try:
            status, body = ask(port, "/api/status", f"127.0.0.1:{port}", token)
            assert status == 200 and json.loads(body)["stages"][0]["progress"] is None, body
        finally:
            stop(serve)
    finally:
        for path in (log, progress):
            if path.is_symlink() or path.exists():
                path.unlink()
        log.write_bytes(kept)


SHARED = textwrap.dedent('''
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import hetflow as hf

    pipe = hf.Pipeline("shared")


    @pipe.stage(files=["data/*.csv"], map_over="files", outputs=["rows"])
    def rows(ctx):
        return {"rows": pcsv.read_csv(ctx.item)}


    @pipe.stage(inputs=["rows"], outputs=["total"])
    def total(ctx, rows):
        return {"total": pa.table({"sum": [sum(rows["x"].to_pylist())]})}


    if __name__ == "__main__":
        pipe.run()
''')


@pytest.mark.skipif(os.geteuid() != 0, reason="files of another user are made with chown, which needs root")
def test_the_cache_never_serves_another_users_files_from_a_shared_store(tmp_path: Path) -> None:
    """Before, the cache served any run the store recorded under the stage's key: in a store users share,
    another user can record a run of your keys (they are in the store) whose outputs are files of theirs,
    and your stages went on from their data as CACHED.  Here the other user's run is one made in another
    work directory, its outputs then given to uid 4242: nothing of it is reused, every stage and item runs."""
    db = ["--db", f"sqlite:///{tmp_path / 'team.db'}"]
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    for where in (theirs, mine):
        (where / "data").mkdir(parents=True)
        (where / "shared.py").write_text(SHARED)
        for i in range(2):
            (where / "data" / f"{i}.csv").write_text(f"x\n{i + 1}\n")
    made = subprocess.run([*HETFLOW, "run", "shared.py", "--no-progress", *db], cwd=theirs, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    for path in [theirs / ".hetflow" / "runs", *(theirs / ".hetflow" / "runs").rglob("*")]:
        os.lchown(path, 4242, 4242)
    done = subprocess.run([*HETFLOW, "run", "shared.py", "--no-progress", *db], cwd=mine, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    status = json.loads(subprocess.run([*HETFLOW, "status", "--json", *db], cwd=mine, capture_output=True,
                                       text=True, timeout=60).stdout)
    assert status["run_dir"].startswith(str(mine)), status["run_dir"]
    states = {stage["name"]: stage["state"] for stage in status["stages"]}
    assert states == {"rows": "DONE", "total": "DONE"}, (states, done.stdout)
    assert "belongs to another user (uid 4242)" in done.stdout, done.stdout
    assert "map 2 items: 0 cached, 2 ran" in done.stdout, done.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user is made with chown, which needs root")
def test_resume_never_executes_a_script_another_user_could_have_written(tmp_path: Path) -> None:
    """Before, ``hetflow resume RUN`` executed whatever file the run's record named: anyone who can write a
    shared store could name a script of theirs in your run's record, and your resume ran their code as you.
    Now a recorded script owned by another user (or writable by others) is refused in one line, and the run,
    its record restored, still resumes."""
    import sqlite3

    (tmp_path / "shared.py").write_text(SHARED.replace('sum(rows["x"].to_pylist())', "1 / 0"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "0.csv").write_text("x\n1\n")
    failed = subprocess.run([*HETFLOW, "run", "shared.py", "--no-progress"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert failed.returncode == 1, failed.stderr
    run_id = json.loads(subprocess.run([*HETFLOW, "status", "--json"], cwd=tmp_path, capture_output=True,
                                       text=True, timeout=60).stdout)["id"]
    theirs = tmp_path / "theirs.py"
    theirs.write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').write('ran as you')\n")
    store = sqlite3.connect(tmp_path / ".hetflow" / "hetflow.db")
    for owner, mode in ((4242, 0o644), (os.geteuid(), 0o666)):
        os.chown(theirs, owner, owner)
        theirs.chmod(mode)
        with store:
            store.execute("update runs set script = ? where id = ?", (str(theirs), run_id))
        resumed = subprocess.run([*HETFLOW, "resume", run_id, "--no-progress"], cwd=tmp_path, capture_output=True,
                                 text=True, timeout=300)
        assert resumed.returncode == 2, (resumed.stdout, resumed.stderr)
        assert f"refusing to execute its recorded script {theirs}" in resumed.stderr, resumed.stderr
        assert len(resumed.stderr.strip().splitlines()) == 1, resumed.stderr
        assert not (tmp_path / "PWNED").exists()
    (tmp_path / "shared.py").write_text(SHARED)
    with store:
        store.execute("update runs set script = ? where id = ?", (str(tmp_path / "shared.py"), run_id))
    store.close()
    resumed = subprocess.run([*HETFLOW, "resume", run_id, "--no-progress"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr


def test_resume_refuses_params_and_argv_changed_in_the_store_since_the_run_started(tmp_path: Path) -> None:
    """Before, ``hetflow resume RUN`` restarted the script with the params and argv the store records: anyone
    who can write a shared store could change them in your run's record (a param naming a path your stage
    writes), and your resume ran your script with values you never gave.  Now the run's private directory
    keeps what it started with, and a resume whose record differs from it (or that has none) is refused in
    one line naming the change; the record as it was resumes."""
    import sqlite3

    script = SHARED.replace("@pipe.stage(inputs=[\"rows\"], outputs=[\"total\"])",
                            "@pipe.stage(inputs=[\"rows\"], outputs=[\"total\"], params={\"scale\": 1})")
    (tmp_path / "shared.py").write_text(script.replace('sum(rows["x"].to_pylist())', "1 / 0"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "0.csv").write_text("x\n1\n")
    failed = subprocess.run([*HETFLOW, "run", "shared.py", "--no-progress", "--param", "scale=2"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1, failed.stderr
    run_id = json.loads(subprocess.run([*HETFLOW, "status", "--json"], cwd=tmp_path, capture_output=True,
                                       text=True, timeout=60).stdout)["id"]
    store = sqlite3.connect(tmp_path / ".hetflow" / "hetflow.db")
    params, argv = store.execute("select params, argv from runs where id = ?", (run_id,)).fetchone()
    assert json.loads(params) == {"scale": 2} and json.loads(argv) == []
    kept = tmp_path / ".hetflow" / "runs" / run_id / "started.json"
    changed = "were changed in the store since it started:"
    for column, value, change in (
            ("params", '{"scale": 7}', f"params {changed} param 'scale' is 7 in the store, 2 when it started"),
            ("params", '{"scale": 2, "out": "/etc/x"}',
             f"params {changed} param 'out' is '/etc/x' in the store, absent when it started"),
            ("argv", '["--out", "/etc/x"]',
             f"argv {changed} argv is ['--out', '/etc/x'] in the store, [] when it started")):
        with store:
            store.execute(f"update runs set {column} = ? where id = ?", (value, run_id))
        resumed = subprocess.run([*HETFLOW, "resume", run_id, "--no-progress"], cwd=tmp_path, capture_output=True,
                                 text=True, timeout=300)
        assert resumed.returncode == 2, (resumed.stdout, resumed.stderr)
        assert resumed.stderr.startswith(f"hetflow: error: run {run_id}'s recorded {change}; refusing to resume"), \
            resumed.stderr
        assert len(resumed.stderr.strip().splitlines()) == 1 and resumed.stdout == "", resumed.stderr
        with store:
            store.execute("update runs set params = ?, argv = ? where id = ?", (params, argv, run_id))
    started = kept.read_bytes()
    kept.unlink()  # a run of an older hetflow: nothing to check the store's record against
    resumed = subprocess.run([*HETFLOW, "resume", run_id, "--no-progress"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 2, (resumed.stdout, resumed.stderr)
    assert f"run {run_id} has no record of what it started with ({kept} is missing" in resumed.stderr
    kept.write_bytes(started)
    kept.chmod(0o600)
    store.close()
    (tmp_path / "shared.py").write_text(script)
    resumed = subprocess.run([*HETFLOW, "resume", run_id, "--no-progress"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(subprocess.run([*HETFLOW, "status", "--json"], cwd=tmp_path, capture_output=True,
                                     text=True, timeout=60).stdout)["state"] == "DONE"


RESUMED_IN_PYTHON = textwrap.dedent('''
    import os
    import sys
    import pyarrow as pa
    import hetflow as hf

    pipe = hf.Pipeline("pyresume", workdir="wd")

    @pipe.stage(outputs=["a"])
    def a(ctx):
        return {"a": pa.table({"v": [1]})}

    @pipe.stage(inputs=["a"], outputs=["b"])
    def b(ctx, a):
        if os.environ.get("FAIL_B"):
            raise RuntimeError("b fails")
        return {"b": pa.table({"v": [2]})}

    if __name__ == "__main__":
        try:
            print("STATE", pipe.run(run_id=sys.argv[1] if len(sys.argv) > 1 else None).state)
        except hf.HetflowError as exc:
            print("REFUSED", exc)
''')


def test_a_resume_from_python_writes_only_where_the_run_started_not_where_the_store_says(tmp_path: Path) -> None:
    """Before, ``pipe.run(run_id=RUN)`` (a notebook's or a script's own resume) took the data directory from
    the store's record of the run unchecked: a user of a shared store who wrote a directory of theirs there
    received the run's new outputs (``hetflow resume`` refused it).  Now it is compared with the directory
    the run's private ``started.json`` kept: refused in one error naming both, nothing written there; the
    run's own data directory resumes."""
    import sqlite3

    (tmp_path / "p.py").write_text(RESUMED_IN_PYTHON)
    (tmp_path / "mine").mkdir()
    failed = subprocess.run([*HETFLOW, "run", "p.py", "--no-progress", "--data-dir", "mine"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "FAIL_B": "1"})
    assert failed.returncode == 1, failed.stderr
    run_id = json.loads(subprocess.run([*HETFLOW, "status", "--json", "--workdir", "wd"], cwd=tmp_path,
                                       capture_output=True, text=True, timeout=60).stdout)["id"]
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    store = sqlite3.connect(tmp_path / "wd" / "hetflow.db")
    with store:
        store.execute("update runs set pilot = json_set(pilot, '$.data_dir', ?) where id = ?", (str(theirs), run_id))
    resumed = subprocess.run([sys.executable, "p.py", run_id], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
    assert f"REFUSED run {run_id}'s recorded data_dir were changed in the store since it started: data_dir is " \
        f"{str(theirs)!r} in the store, {str(tmp_path / 'mine')!r} when it started" in resumed.stdout, \
        (resumed.stdout, resumed.stderr)
    assert list(theirs.iterdir()) == []
    with store:
        store.execute("update runs set pilot = json_set(pilot, '$.data_dir', ?) where id = ?",
                      (str(tmp_path / "mine"), run_id))
    store.close()
    resumed = subprocess.run([sys.executable, "p.py", run_id], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
    assert "STATE DONE" in resumed.stdout, (resumed.stdout, resumed.stderr)
    assert (tmp_path / "mine" / "runs" / run_id / "datasets" / "b" / "_manifest.json").is_file()
    assert list(theirs.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another user is made with chown, which needs root")
def test_a_run_refuses_a_work_directory_another_user_can_replace_things_in(tmp_path: Path) -> None:
    """Before, a run used a work directory another user owned (a colleague made ./.hetflow first, 0777 as a
    courtesy), or one others could write: whoever can rename its entries can put a state store and runs/ of
    theirs in place of yours, whose records the next run reuses as its cached results.  Now the run is
    refused in one line before it starts, the directory left as it was; status still reads it."""
    (tmp_path / "shared.py").write_text(SHARED)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "0.csv").write_text("x\n1\n")
    workdir = tmp_path / ".hetflow"
    workdir.mkdir()
    for owner, mode, problem in ((4242, 0o755, f"belongs to uid 4242, not to you (uid {os.geteuid()})"),
                                 (os.geteuid(), 0o777, "has mode 0777, which lets others write it")):
        os.chown(workdir, owner, owner)
        workdir.chmod(mode)
        done = subprocess.run([*HETFLOW, "run", "shared.py", "--no-progress"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert done.stderr == (f"hetflow: error: pipeline 'shared': work directory {workdir} {problem}: another user "
                               "could replace its state store and runs with theirs; run in a work directory of "
                               "your own (--workdir)\n")
        assert not (workdir / "runs").exists() and workdir.stat().st_mode & 0o777 == mode
    (workdir / "runs").mkdir()  # sticky (a fresh tmpfs): others cannot rename ours, but may make theirs first
    os.chown(workdir / "runs", 4242, 4242)
    workdir.chmod(0o1777)
    done = subprocess.run([*HETFLOW, "run", "shared.py", "--no-progress"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and f"{workdir} holds runs of uid 4242, not yours" in done.stderr, done.stderr
    (workdir / "runs").rmdir()
    done = subprocess.run([*HETFLOW, "run", "shared.py", "--no-progress"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_serve_closes_a_trickled_request_and_refuses_an_absolute_target(hostile: tuple[Path, str, str]) -> None:
    """Before, the request's timeout was per read: a byte every few seconds kept a connection (and its
    thread) open without limit, no token needed; and ``GET http://evil.example/api/status`` (or
    ``//evil.example/...``) was answered as its path.  Now a request has REQUEST_TIMEOUT seconds in all, and
    only an origin-form target is answered."""
    from hetflow.serve import REQUEST_TIMEOUT

    tmp, _, _ = hostile
    serve, port, token = start_serve(tmp)
    try:
        answer = raw_request(port, f"GET http://evil.example/api/status?token={token} HTTP/1.1\r\n"
                                   f"Host: 127.0.0.1:{port}\r\n\r\n".encode())
        assert answer.startswith("HTTP/1.0 400 ") and "not an absolute address" in answer, answer
        answer = raw_request(port, f"GET //evil.example/api/status?token={token} HTTP/1.1\r\n"
                                   f"Host: 127.0.0.1:{port}\r\n\r\n".encode())
        assert answer.startswith("HTTP/1.0 404 "), answer  # http.server makes it the path /evil.example/...
        assert raw_request(port, f"GET /api/status?token={token} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"
                           .encode()).startswith("HTTP/1.0 200 ")
        with socket.create_connection(("127.0.0.1", port), timeout=40) as sock:
            began = time.monotonic()
            closed = None
            for byte in b"GET /api/status HTTP/1.1\r\nX-Slow: " + b"a" * 200:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed = time.monotonic() - began
                    break
                sock.settimeout(REQUEST_TIMEOUT / 4)  # a byte every quarter of the per-read limit
                try:
                    if sock.recv(1024) == b"":
                        closed = time.monotonic() - began
                        break
                except TimeoutError:
                    pass
            assert closed is not None and closed < REQUEST_TIMEOUT + 5, closed
    finally:
        stop(serve)
