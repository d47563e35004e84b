"""The timeline report: bars, utilisation, critical path; rendered in headless Chromium."""

from __future__ import annotations

import dataclasses
import html as html_lib
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
    match = re.search(r'data-report-status="(.*?)"', dom, re.S)
    assert match, "the page's script did not run"
    return json.loads(html_lib.unescape(match.group(1)))


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


def _distance(a: str, b: str) -> float:
    ra, rb = (tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (a, b))
    return sum((x - y) ** 2 for x, y in zip(ra, rb)) ** 0.5


def test_report_colours_stages_apart_and_attempts_alike(tmp_path: Path) -> None:
    intervals = real_run_intervals() + [Interval("b2", "train#2", "node1", (3,), (), 50.0, 60.0)]
    intervals = [dataclasses.replace(iv, name=f"{iv.name}#1") if "#" not in iv.name else iv for iv in intervals]
    html = tmp_path / "run.html"
    render_timeline(intervals, small_pilot(), html)
    text = html.read_text()
    fills: dict[str, set[str]] = {}
    for task, body in re.findall(r'<g class="bar[^"]*" data-task="([^"]+)">(.*?)</g>', text, re.S):
        name = next(iv.name for iv in intervals if iv.task_id == task).split("#")[0]
        fills.setdefault(name, set()).update(re.findall(r'fill="(#[0-9a-f]{6})"', body))
    assert set(fills) == {"load", "train", "stats", "infer"}
    assert all(len(f) == 1 for f in fills.values())          # both attempts of train: one colour
    colours = [next(iter(f)) for f in fills.values()]
    assert min(_distance(a, b) for i, a in enumerate(colours) for b in colours[i + 1:]) > 80
    keys = re.findall(r'<span class="key"><i style="background:(#[0-9a-f]{6})"></i>([^<]+)</span>', text)
    assert sorted(n for _, n in keys) == ["infer", "load", "stats", "train"]   # legend by stage, not attempt


def test_report_page_has_no_debug_text_and_no_clipped_label(tmp_path: Path) -> None:
    html = tmp_path / "run.html"
    render_timeline(real_run_intervals(), small_pilot(), html, title="run 1")
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs it)")
    dom, _ = run_chromium(html, tmp_path)
    body = re.sub(r"<script.*?</script>|<style.*?</style>|<title>.*?</title>", "", dom, flags=re.S)
    visible = html_lib.unescape(re.sub(r"<[^>]+>", " ", body))
    assert "expected_bars" not in visible and "{" not in visible
    status = page_status(dom)
    assert status["errors"] == [] and status["clipped"] == 0


def test_png_labels_its_bars_and_has_a_legend(tmp_path: Path) -> None:
    from hetflow.tasks.timeline import stage_colors, timeline_figure

    intervals = [dataclasses.replace(iv, name=f"{iv.name}#1") for iv in real_run_intervals()]
    pilot = small_pilot().resolve()
    core_lane = {c: i for i, c in enumerate(pilot.usable_cores())}
    fig = timeline_figure(intervals, ["node0", "node1"], core_lane, 2, utilization_curve(intervals, pilot), 0.0,
                          critical_path(intervals), "run", stage_colors(intervals))
    gantt = fig.axes[0]
    legend = gantt.get_legend()
    assert legend is not None and sorted(t.get_text() for t in legend.get_texts()) == ["infer", "load", "stats",
                                                                                        "train"]
    labels = sorted(t.get_text() for t in gantt.texts)
    assert labels == ["infer#1", "load#1", "load#1", "stats#1", "train#1"]   # one per bar (load holds two nodes)
    png = tmp_path / "run.png"
    render_timeline(intervals, small_pilot(), tmp_path / "run.html", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_fits_a_1200px_window_without_sideways_scrolling(tmp_path: Path) -> None:
    """The report as `hetflow report` writes it, a long stage name and task id included, in a real Chromium
    window 1200 CSS px wide: the page is no wider than the window, and the charts are drawn whole (scaled)."""
    from _browser import Browser

    if CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs it)")
    long = "train_member_of_a_learning_rate_sweep_with_a_long_name_lr_0_001"
    intervals = real_run_intervals() + [Interval(f"run-20261127/{long}/1", f"{long}#1", "node1", (3,), (), 50.0, 60.0,
                                                 deps=("c",))]
    html = tmp_path / "run.html"
    render_timeline(intervals, small_pilot(), html, title=f"hetflow run {long}-20261127-101010-abcd (DONE)")
    with Browser(tmp_path / "profile", width=1200, height=900) as browser:
        browser.open(html.resolve().as_uri())
        width = browser.overflow()
        assert width["scrollWidth"] <= width["innerWidth"] == 1200, width
        for chart in ("gantt", "util"):
            box = browser.evaluate(f"[document.getElementById('{chart}').getBoundingClientRect().left, "
                                   f"document.getElementById('{chart}').getBoundingClientRect().right]")
            assert 0 <= box[0] and box[1] <= 1200, (chart, box)
        status = json.loads(browser.evaluate("document.body.getAttribute('data-report-status')"))
        assert status["errors"] == [] and status["clipped"] == 0 and status["bars"] == len(intervals)
