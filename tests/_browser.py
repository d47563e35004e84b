"""A real headless Chromium driven over the DevTools protocol (``--remote-debugging-pipe``), for tests
that measure a page's layout or read it while a run goes on: open a URL in a window of a given size,
evaluate JavaScript in it.  Standard library only (the protocol is JSON messages ended by a NUL byte on
file descriptors 3 and 4 of the browser)."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _high(*fds: int) -> tuple[int, ...]:
    """``fds`` moved above 4, so that putting them at 3 and 4 in the child cannot overwrite one another."""
    moved = []
    for fd in fds:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(fd)
        moved.append(high)
    return tuple(moved)


class Browser:
    """One headless Chromium with one page of ``width`` x ``height`` CSS pixels."""

    def __init__(self, profile: Path, *, width: int = 1200, height: int = 900) -> None:
        assert CHROMIUM is not None
        to_browser, self._in = _high(*os.pipe())      # we write commands, the browser reads fd 3
        self._out, from_browser = _high(*os.pipe())   # the browser writes fd 4, we read

        def fds() -> None:
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--window-size={width},{height}", f"--user-data-dir={profile}", "--remote-debugging-pipe",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=fds, pass_fds=(3, 4))
        os.close(to_browser)
        os.close(from_browser)
        self._id = 0
        self._buffer = b""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def call(self, method: str, *, session: bool = False, timeout: float = 60.0, **params: Any) -> Any:
        """Send one command and return its result (events in between are dropped)."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._in, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([self._out], [], [], max(left, 0.0))
                if not ready:
                    raise TimeoutError(f"chromium did not answer {method} in {timeout} s")
                chunk = os.read(self._out, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium ended while answering {method}")
                self._buffer += chunk
            raw, _, self._buffer = self._buffer.partition(b"\0")
            answer = json.loads(raw)
            if answer.get("id") == self._id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def open(self, url: str) -> None:
        """Load ``url`` and wait until its load event has fired."""
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (awaited when it is a promise)."""
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll ``expression`` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} still false after {timeout} s")
            time.sleep(0.2)

    def overflow(self) -> dict[str, int]:
        """How far the page is wider than the window (``scrollWidth``, ``innerWidth``)."""
        value: dict[str, int] = self.evaluate(
            "({scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth,"
            " bodyScrollWidth: document.body.scrollWidth})")
        return value

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        os.close(self._in)
        os.close(self._out)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
