"""``hetflow serve [RUN]``: a small read-only web page of a run's status and timeline.

Standard library only (``http.server``), bound to 127.0.0.1 unless told
otherwise.  Three fixed routes, nothing read from a path the client names:

- ``/``: the page (status table, links to the logs, the timeline in a frame);
- ``/api/status``: the run's status as JSON (:meth:`RunStatus.to_json` plus
  ``digest``, each stage's ``seconds`` and its latest ``ctx.progress`` as
  ``progress``, see :func:`stage_progress`); with ``since=DIGEST&wait=S`` the
  request waits up to ``S`` seconds for the status to differ from ``DIGEST``
  (a long poll: the page learns of a change as it happens, without polling
  the store from the browser every second);
- ``/timeline``: the timeline report of :mod:`hetflow.tasks.timeline`, drawn
  from the store at each request (running attempts end "now").

The page keeps polling while the run is RUNNING and stops once it has ended.
Text from the run (stage names, errors) is put into the page with
``textContent``, never as markup.

Decisions:

- Only requests whose ``Host`` names this server are answered: the address it
  is bound to, ``localhost``, ``127.0.0.1`` or ``[::1]`` (each with or without
  the server's port), and the names given with ``allowed_hosts``
  (``hetflow serve --allow-host NAME``).  Any other ``Host`` gets 421
  (Misdirected Request): after DNS rebinding, a web page the user visits
  reaches this port under its own name, and must not read the run.  A request
  without a ``Host`` (HTTP/1.0), or with two, gets 400: every browser sends
  one, and a client that does not can send ``Host: 127.0.0.1``.
- Every route answers only a request that carries the server's token
  (:func:`new_token`, a fresh one per server, printed in the address
  ``hetflow serve`` gives: ``http://127.0.0.1:PORT/?token=...``).  Loopback
  is not private: on a shared login node every local user reaches
  127.0.0.1.  The token comes as ``?token=`` (the printed address, or a
  script's request) or in the :data:`TOKEN_HEADER` request header, which the
  page's own requests carry (its script reads the token from the address it
  was opened with); anything else gets 403 and one line that names neither
  the token nor the run.  No cookie carries it, and a cookie opens nothing:
  browsers send a cookie for 127.0.0.1 to every port of that host, so
  another user's server on another port would receive it.  A page of
  another origin cannot send the header (a custom header needs a CORS
  preflight, which this server never grants).  Compared with
  :func:`hmac.compare_digest`.  The token is printed once and written only to
  the 0600 note the notebook's link is made from (:mod:`hetflow.display`).
  The Host check comes first: a wrong ``Host`` is 421 with or without a token.
- A connection has :data:`REQUEST_TIMEOUT` seconds to send its request, in all: one that sends nothing, or
  trickles it, is closed, as anyone on the host may open connections without a token.  Only an origin-form
  target (``/api/status``) is answered: an absolute one (``http://evil.example/...``) is a 400.
- The run's files the page shows (the stages' progress) are read only when they are regular files, never
  through a symlink nor from a FIFO: with a shared PostgreSQL store the run shown may be another user's,
  whose directories are theirs.
- Query values are checked, never clamped: ``wait`` is a finite number of
  seconds from 0 to :data:`MAX_WAIT`, ``since`` a digest of at most
  :data:`MAX_DIGEST` characters; anything else is a 400 naming the parameter
  and what it takes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import threading
import time
from http import HTTPStatus
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from hetflow.operators.safeio import open_regular
from hetflow.tasks.errors import HetflowError
from hetflow.tasks.protocol import AttemptFiles

from .progress import progress_text
from .report import run_intervals, stage_rows
from .states import State
from .status import run_status
from .store import Store

log = logging.getLogger(__name__)

MAX_WAIT = 30.0
"""The longest a status request may wait for a change (seconds)."""

MAX_DIGEST = 64
"""The longest ``since=`` a status request may send (a digest is 16 hex digits)."""

LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")
"""``Host`` names always answered: this machine's own loopback names."""

TOKEN_HEADER = "X-Hetflow-Token"
"""The request header the page's own requests carry the token in (never a cookie: see the module's decisions)."""

REQUEST_TIMEOUT = 10.0
"""Seconds a connection may take to send its whole request line and headers, however it trickles them (a byte
at a time keeps no connection past it), and to take each part of the answer: so connections that never
finish a request cannot hold a thread each for good."""

MAX_PROGRESS = 1 << 20
"""The most bytes of a progress file read (a map stage's counts are a few KiB)."""

RECONCILE_EVERY = 5.0
"""Seconds between looks for runs whose orchestrator died (so such a run stops showing RUNNING)."""


class RunView:
    """What the server shows: one run (``run_id``), or the latest run at each request."""

    def __init__(self, store: Store, run_id: str | None) -> None:
        self.store = store
        self.run_id = run_id
        self._reconciled = 0.0
        self._lock = threading.Lock()

    def status(self) -> dict[str, Any]:
        with self._lock:
            if time.time() - self._reconciled > RECONCILE_EVERY:
                self.store.reconcile_dead_runs()
                self._reconciled = time.time()
        status = run_status(self.store, self.run_id)
        data = status.to_json()
        for stage, record in zip(data["stages"], status.stages):
            stage["progress"] = stage_progress(record.log_dir)
        data["digest"] = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
        now = time.time()
        for stage, record in zip(data["stages"], status.stages):
            stage["seconds"] = None if record.started is None else (record.ended or now) - record.started
        return data

    def wait_for_change(self, since: str, wait: float) -> dict[str, Any]:
        deadline = time.monotonic() + wait
        while True:
            data = self.status()
            if data["digest"] != since or data["state"] != State.RUNNING or time.monotonic() >= deadline:
                return data
            time.sleep(0.5)

    def timeline(self) -> str:
        from hetflow.tasks.pilot import PilotDescription
        from hetflow.tasks.timeline import timeline_page

        run, intervals = run_intervals(self.store, self.run_id)
        pilot = PilotDescription.from_mapping(run.pilot, source=f"run {run.id}")
        page: str = timeline_page(intervals, pilot, title=f"hetflow run {run.id} ({run.state})",
                                  stages=stage_rows(self.store, run.id))
        return page


class BadRequest(HetflowError, ValueError):
    """A query value outside what the server takes (the message names the parameter and the range)."""


def seconds_param(query: dict[str, list[str]], name: str, default: float, most: float) -> float:
    """Query value ``name`` as seconds: a finite number from 0 to ``most`` (``default`` when absent)."""
    values = query.get(name, [])
    if not values:
        return default
    expected = f"{name}= takes one number of seconds from 0 to {most:g}"
    if len(values) > 1:
        raise BadRequest(f"{expected}, got {len(values)} values")
    try:
        value = float(values[0])
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0.0 <= value <= most:
        raise BadRequest(f"{expected}, got {values[0][:40]!r}")
    return value


def new_token() -> str:
    """A fresh secret for one server: 32 random bytes, URL-safe text."""
    return secrets.token_urlsafe(32)


def same_token(given: str, token: str) -> bool:
    """Whether ``given`` is ``token``, in time that does not depend on where they differ."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())


def host_name(header: str) -> tuple[str, str]:
    """``(name, port)`` of a ``Host`` header value (``port`` empty when it names none); the name lower-cased,
    an IPv6 address in brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        name, _, rest = header.partition("]")
        return name + "]", rest.removeprefix(":")
    name, _, port = header.partition(":")
    return name, port


def allowed_names(bound: str, extra: tuple[str, ...]) -> frozenset[str]:
    """The ``Host`` names a server bound to ``bound`` answers: :data:`LOCAL_NAMES`, ``bound`` and ``extra``."""
    names = {*LOCAL_NAMES, *(n.strip().lower() for n in extra)}
    names.add(f"[{bound.lower()}]" if ":" in bound else bound.lower())
    return frozenset(names)


def stage_progress(log_dir: str | None) -> dict[str, Any] | None:
    """The latest ``ctx.progress`` of a stage's latest attempt, as the terminal's live view shows it
    (``text``: the slowest rank's count, rank 0's metrics) and per rank (``ranks``); ``None`` when its
    ranks have reported none.  Kept once the stage has ended: its last count and loss stay readable."""
    if log_dir is None:
        return None
    try:  # a map stage: its items' counts (hetflow.mapshell); a regular file only (no symlink, no FIFO)
        with os.fdopen(open_regular(Path(log_dir) / "map-progress.json"), "rb") as fh:
            mapped = json.loads(fh.read(MAX_PROGRESS))
        return {"text": str(mapped["text"]), "items": dict(mapped["items"]), "total": int(mapped["total"])}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    reports = AttemptFiles(Path(log_dir)).read_progress()
    if not reports:
        return None
    return {"text": progress_text(reports), "ranks": {str(rank): report for rank, report in sorted(reports.items())}}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT  # on the socket: reading the request and writing the answer, never the long poll

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(REQUEST_TIMEOUT, self._too_slow)  # the socket's timeout is per read
        self._deadline.daemon = True
        self._deadline.start()

    def _too_slow(self) -> None:
        import socket

        try:
            self.connection.shutdown(socket.SHUT_RDWR)  # the reading thread sees the end of its request
        except OSError:
            pass

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # the request line's checks, then every header read
        self._deadline.cancel()
        if parsed and not self.path.startswith("/"):  # (a leading // is made one / by http.server)
            self.send_error(HTTPStatus.BAD_REQUEST, "hetflow serve takes only a path as the request target "
                            "(GET /api/status), not an absolute address")
            return False
        return parsed

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def _host_refused(self) -> bool:
        """Answer and return ``True`` when the request's ``Host`` does not name this server."""
        hosts = self.headers.get_all("Host") or []
        if len(hosts) != 1:
            self._send(HTTPStatus.BAD_REQUEST, "text/plain; charset=utf-8",
                       f"hetflow serve needs one Host header, got {len(hosts)} (send Host: 127.0.0.1:{self.server.port})\n"
                       .encode())
            return True
        name, port = host_name(hosts[0])
        if name in self.server.allowed and port in ("", str(self.server.port)):
            return False
        self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain; charset=utf-8",
                   (f"hetflow serve does not answer for Host {hosts[0][:80]!r} (it answers for "
                    f"{', '.join(sorted(self.server.allowed))}; add a name with hetflow serve --allow-host NAME)\n")
                   .encode("ascii", "backslashreplace"))
        return True

    def _token_refused(self, query: dict[str, list[str]]) -> bool:
        """Answer 403 and return ``True`` unless the request carries the server's token: one ``?token=``, or
        (without one) one :data:`TOKEN_HEADER` header.  A cookie is never looked at."""
        given = query.get("token", []) or self.headers.get_all(TOKEN_HEADER) or []
        if len(given) == 1 and same_token(given[0], self.server.token):
            return False
        self._send(HTTPStatus.FORBIDDEN, "text/plain; charset=utf-8",
                   b"hetflow serve answers only with its token: open the address it printed "
                   b"(http://HOST:PORT/?token=...)\n")
        return True

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if self._host_refused() or self._token_refused(query):
            return
        try:
            if url.path == "/":
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", PAGE.encode())
            elif url.path == "/api/status":
                since = query.get("since", [""])[0]
                if len(since) > MAX_DIGEST:
                    raise BadRequest(f"since= takes a status digest of at most {MAX_DIGEST} characters, "
                                     f"got {len(since)}")
                wait = seconds_param(query, "wait", 0.0, MAX_WAIT)
                data = self.server.view.wait_for_change(since, wait) if since else self.server.view.status()
                self._send(HTTPStatus.OK, "application/json", json.dumps(data).encode())
            elif url.path == "/timeline":
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.server.view.timeline().encode())
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8",
                           f"no page {url.path!r} (pages: /, /api/status, /timeline)\n".encode())
        except LookupError as exc:  # no such run (yet)
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", f"{exc}\n".encode())
        except BadRequest as exc:  # a bad wait= or since=
            self._send(HTTPStatus.BAD_REQUEST, "text/plain; charset=utf-8", f"{exc}\n".encode())
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the server
            log.warning("serve: %s failed: %s: %s", url.path, type(exc).__name__, exc)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8",
                       f"{type(exc).__name__}: {exc}\n".encode())

    def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")  # the address may hold the token
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'")
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the browser went away, or stopped reading (REQUEST_TIMEOUT)
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("serve: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], view: RunView, allowed_hosts: tuple[str, ...], token: str) -> None:
        super().__init__(address, _Handler)
        self.view = view
        self.token = token
        self.port = int(self.server_address[1])
        self.allowed = allowed_names(address[0], allowed_hosts)


def make_server(store: Store, run_id: str | None, *, host: str = "127.0.0.1", port: int = 8765,
                allowed_hosts: tuple[str, ...] = (), token: str | None = None) -> _Server:
    """A server for ``run_id`` (the latest run when ``None``); ``port=0`` picks a free port.  It answers
    requests whose ``Host`` is ``host``, a loopback name or one of ``allowed_hosts``, and that carry
    ``token`` (a fresh :func:`new_token` when ``None``; the server's ``token`` attribute), see the
    module's decisions."""
    return _Server((host, port), RunView(store, run_id), allowed_hosts, token or new_token())


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>hetflow run</title>
<style>
body { font: 14px sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 4px 0; }
#meta { color: #555; margin-bottom: 10px; }
table { border-collapse: collapse; margin-bottom: 14px; max-width: 100%; }
th, td { text-align: left; padding: 3px 10px; border-bottom: 1px solid #ddd; vertical-align: top; }
body, td { overflow-wrap: anywhere; }  /* long stage names and log paths wrap: the page fits its window */
td.num { text-align: right; }
.state { font-weight: bold; }
.RUNNING { color: #1f5fbf; } .DONE, .CACHED { color: #2a8a2a; }
.FAILED, .TIMED_OUT { color: #c0392b; } .INTERRUPTED, .CANCELLED, .SKIPPED { color: #b9770e; }
code { font-size: 12px; color: #444; }
#error { color: #c0392b; }
iframe { width: 100%; height: 760px; border: 1px solid #ddd; box-sizing: border-box; }
</style></head>
<body data-state="" data-seen="">
<h1 id="title">hetflow run</h1>
<div id="meta"></div>
<div id="error"></div>
<table id="stages"><thead><tr><th>stage</th><th>state</th><th>attempts</th><th>seconds</th><th>slots</th>
<th>progress</th><th>logs</th><th>note</th></tr></thead><tbody></tbody></table>
<iframe id="timeline" title="timeline"></iframe>
<script>
(function () {
  // The token comes from the address this page was opened with; the page's requests send it as a header
  // (never a cookie: a cookie for 127.0.0.1 reaches every port of the host).
  var token = new URLSearchParams(location.search).get("token") || "";
  function get(path) {
    return fetch(path, {cache: "no-store", headers: {"X-Hetflow-Token": token}}).then(function (r) {
      if (!r.ok) { throw new Error("status " + r.status); }
      return r;
    });
  }
  var seen = [];
  function cell(row, text, cls) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) { td.className = cls; }
    row.appendChild(td);
    return td;
  }
  function render(s) {
    document.getElementById("title").textContent = "hetflow run " + s.id + ": " + s.state;
    document.getElementById("title").className = s.state;
    var meta = "pipeline " + s.pipeline + " \\u00b7 started " + (s.started || "-") +
               (s.ended ? " \\u00b7 ended " + s.ended : "") + " \\u00b7 " + s.run_dir;
    if (s.state === "RUNNING") { meta += " \\u00b7 refreshing while it runs"; }
    document.getElementById("meta").textContent = meta;
    var body = document.querySelector("#stages tbody");
    body.textContent = "";
    s.stages.forEach(function (st) {
      var row = document.createElement("tr");
      row.setAttribute("data-stage", st.name);
      cell(row, st.name);
      cell(row, st.state, "state " + st.state);
      cell(row, String(st.attempts), "num");
      cell(row, st.seconds === null ? "" : st.seconds.toFixed(1), "num");
      cell(row, st.slots.map(function (sl) {
        return sl.node + " cores " + sl.cores.join(",") + (sl.gpus.length ? " GPUs " + sl.gpus.join(",") : "");
      }).join("; "));
      cell(row, st.progress ? st.progress.text : "", "progress");
      var logs = cell(row, "");
      if (st.logs) {
        var code = document.createElement("code");
        code.textContent = st.logs.directory;
        logs.appendChild(code);
      }
      var note = st.error && st.state !== "DONE" && st.state !== "CACHED" ? st.error.split("\\n")[0]
                 : (st.cache && st.cache.reason) || "";
      cell(row, note);
      body.appendChild(row);
    });
    if (seen[seen.length - 1] !== s.state) { seen.push(s.state); }
    document.body.setAttribute("data-state", s.state);
    document.body.setAttribute("data-seen", seen.join(" "));
  }
  var drawn = "";
  function reloadTimeline(s) {  // when a stage's state or attempts change, not at every progress report
    var shape = s.state + " " + s.stages.map(function (st) { return st.state + st.attempts; }).join(",");
    if (shape === drawn) { return; }
    drawn = shape;
    get("/timeline").then(function (r) { return r.text(); }).then(function (html) {
      document.getElementById("timeline").srcdoc = html;  // same origin and policy as this page
    }).catch(function (e) { document.getElementById("error").textContent = "timeline: " + e.message; });
  }
  function poll(since) {
    get("/api/status?wait=20&since=" + encodeURIComponent(since))
      .then(function (r) { return r.json(); })
      .then(function (s) {
        document.getElementById("error").textContent = "";
        render(s);
        reloadTimeline(s);
        if (s.state === "RUNNING") { poll(s.digest); }
      })
      .catch(function (e) {
        document.getElementById("error").textContent = "cannot reach hetflow serve (" + e.message + "); retrying";
        setTimeout(function () { poll(since); }, 2000);
      });
  }
  get("/api/status").then(function (r) { return r.json(); }).then(function (s) {
    render(s);
    reloadTimeline(s);
    if (s.state === "RUNNING") { poll(s.digest); }
  }).catch(function (e) { document.getElementById("error").textContent = String(e); });
})();
</script>
</body></html>
"""
