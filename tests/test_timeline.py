"""The timeline report: bars, utilisation, critical path; rendered in headless Chromium."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hetflow.tasks.pilot import PilotDescription, load_pilot
from hetflow.tasks.simulator import simulate
from hetflow.tasks.timeline import Interval, critical_path, render_timeline, utilization_curve
from hetflow.tasks.workload import generate

pytestmark = pytest.mark.timeout(120)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def small_pilot() -> PilotDescription:
    return PilotDescription(name="two-nodes", backend="radical", nodes=2, cores_per_node=4, gpus_per_node=2,
                            memory_per_node=2**30, gpu_cores=((0, 1), (2, 3)))


def real_run_intervals() -> list[Interval]:
    """What the orchestrator would build from a run's records: a chain a->b->c and a side task d."""
    return [
        Interval("a", "load", "node0", (0, 1), (), 0.0, 10.0),
        Interval("a", "load", "node1", (0, 1), (), 0.0, 10.0),
        Interval("b", "train", "node0", (0,), (0,), 10.0, 40.0, deps=("a",)),
        Interval("d", "stats", "node1", (2, 3), (), 10.0, 20.0, deps=("a",)),
        Interval("c", "infer", "node1", (2,), (1,), 40.0, 50.0, deps=("b", "d")),
    ]


def test_critical_path_follows_the_last_finishing_dependency() -> None:
    assert critical_path(real_run_intervals()) == ["a", "b", "c"]
    assert critical_path([]) == []


def test_utilization_curve_counts_cores_and_gpus() -> None:
    curve = dict((t, (c, g)) for t, c, g in utilization_curve(real_run_intervals(), small_pilot()))
    assert curve[0.0] == (4 / 8, 0.0)
    assert curve[10.0] == (3 / 8, 1 / 4)      # b (1 core, 1 GPU) and d (2 cores)
    assert curve[50.0] == (0.0, 0.0)


def run_chromium(html: Path, tmp: Path) -> tuple[str, str]:
    assert CHROMIUM is not None
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
            "--virtual-time-budget=2000", "--dump-dom", html.resolve().as_uri()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=True)
    return done.stdout, done.stderr


def page_status(dom: str) -> dict[str, object]:
    match = re.search(r'<pre id="report-status">(.*?)</pre>', dom, re.S)
    assert match, "the page's script did not run"
    return json.loads(match.group(1).replace("&quot;", '"'))


def check_page(html: Path, expected_bars: int, tmp: Path) -> None:
    text = html.read_text()
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', text), "the report must be self-contained"
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs it)")
    dom, log = run_chromium(html, tmp)
    status = page_status(dom)
    assert status["errors"] == []
    assert status["bars"] == status["expected_bars"] == expected_bars
    console = [line for line in log.splitlines() if ":CONSOLE" in line]
    assert console == []


def test_real_run_report_renders_in_chromium(tmp_path: Path) -> None:
    intervals = real_run_intervals()
    html, png = tmp_path / "run.html", tmp_path / "run.png"
    drawn = render_timeline(intervals, small_pilot(), html, png, title="run <1>")
    assert drawn == {"bars": len(intervals), "nodes": 2, "critical": 3}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = html.read_text()
    assert "run &lt;1&gt;" in text and text.count('class="bar critical"') == 4   # a twice, b, c
    check_page(html, len(intervals), tmp_path)


def test_simulated_run_report_is_sampled_and_renders(tmp_path: Path) -> None:
    pilot = dataclasses.replace(load_pilot("ornl-frontier"), nodes=40)
    workload = generate("mixed", tasks=600, seed=3)
    result = simulate(pilot, workload, record_nodes=6)
    nodes = {iv.node for iv in result.intervals}
    assert nodes and len(nodes) <= 6
    html = tmp_path / "sim.html"
    drawn = render_timeline(result.intervals, pilot, html, tmp_path / "sim.png", max_nodes=4,
                            utilization=result.utilization_curve)
    expected = sum(1 for iv in result.intervals if iv.node in sorted(nodes)[:4])
    assert drawn["bars"] == expected and drawn["nodes"] == min(4, len(nodes))
    assert html.stat().st_size < 2_000_000
    check_page(html, expected, tmp_path)
