"""Timeline report: a Gantt chart per node, utilisation curves and the critical path.

Input is a list of :class:`Interval` — one per task per node it held — from a
real run (the orchestrator converts state-store records) or from the
simulator.  :func:`render_timeline` writes one self-contained HTML file (inline
SVG and a few lines of inline script, nothing fetched) and optionally a PNG
drawn with matplotlib.  Both are written 0600 (temp file and rename, under any
umask) and never through a symlink: see :func:`hetflow.tasks.paths.write_private_file`.

Large runs stay small: the Gantt chart shows the first ``max_nodes`` nodes
(and at most ``max_bars`` bars); utilisation curves cover every interval, or a
precomputed curve can be passed in (the simulator does, for all nodes).
"""

from __future__ import annotations

import html
import io
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .paths import write_private_file
from .pilot import PilotDescription

logger = logging.getLogger(__name__)

WIDTH = 1100          # px of the time axis
LEFT = 90             # px for lane labels
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#000080", "#808000")
"""Distinct colours (matplotlib's tab10, then navy and olive): stages are given them in order, so no two
stages of a run share or nearly share a colour until there are more stages than colours."""
TOP = 14              # px above the first grid line: room for its label


@dataclass(frozen=True)
class Interval:
    """One task's hold on one node: the bar drawn in the timeline."""

    task_id: str
    name: str
    node: str
    cores: tuple[int, ...]
    gpus: tuple[int, ...]
    start: float
    end: float
    state: str = "done"
    deps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"interval of task {self.task_id!r} ends ({self.end}) before it starts ({self.start})")


class StageRow(NamedTuple):
    """One stage in the report's table: texts as they are shown."""

    stage: str
    state: str
    attempts: str
    seconds: str
    items: str
    """A map stage's items by state (``1,000 items: 997 cached, 3 done``); empty for a plain stage."""
    why: str
    """Why the stage ran or was reused (the cache's reason)."""


def critical_path(intervals: Iterable[Interval]) -> list[str]:
    """Task ids of the chain that ended last, following each task's last-finishing dependency."""
    spans: dict[str, tuple[float, float, tuple[str, ...]]] = {}
    for iv in intervals:
        start, end, deps = spans.get(iv.task_id, (iv.start, iv.end, iv.deps))
        spans[iv.task_id] = (min(start, iv.start), max(end, iv.end), tuple(dict.fromkeys(deps + iv.deps)))
    if not spans:
        return []
    task = max(spans, key=lambda t: (spans[t][1], t))
    path = [task]
    seen = {task}
    while True:
        candidates = [d for d in spans[task][2] if d in spans and d not in seen]
        if not candidates:
            break
        task = max(candidates, key=lambda d: (spans[d][1], d))
        path.append(task)
        seen.add(task)
    return path[::-1]


def utilization_curve(intervals: Iterable[Interval], pilot: PilotDescription,
                      nodes: int | None = None) -> list[tuple[float, float, float]]:
    """(time, core fraction, GPU fraction) at every change, over ``nodes`` nodes (default: the pilot's)."""
    pilot = pilot.resolve()
    count = nodes or pilot.nodes
    cores_total = count * len(pilot.usable_cores())
    gpus_total = count * (pilot.gpus_per_node or 0)
    changes: dict[float, list[int]] = {}
    for iv in intervals:
        for t, sign in ((iv.start, 1), (iv.end, -1)):
            entry = changes.setdefault(t, [0, 0])
            entry[0] += sign * len(iv.cores)
            entry[1] += sign * len(iv.gpus)
    curve: list[tuple[float, float, float]] = []
    cores = gpus = 0
    for t in sorted(changes):
        cores += changes[t][0]
        gpus += changes[t][1]
        curve.append((t, cores / cores_total if cores_total else 0.0, gpus / gpus_total if gpus_total else 0.0))
    return curve


def stage_of(name: str) -> str:
    """The stage an interval belongs to: ``"train#2"`` (attempt 2) → ``"train"``."""
    return name.rsplit("#", 1)[0] if "#" in name and name.rsplit("#", 1)[1].isdigit() else name


def stage_colors(intervals: Iterable[Interval]) -> dict[str, str]:
    """One colour per stage (every attempt of it), given in sorted stage order from :data:`PALETTE`."""
    stages = sorted({stage_of(iv.name) for iv in intervals})
    return {stage: PALETTE[i % len(PALETTE)] for i, stage in enumerate(stages)}


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of lane numbers: [(first, length)]."""
    out: list[tuple[int, int]] = []
    for lane in sorted(ids):
        if out and out[-1][0] + out[-1][1] == lane:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((lane, 1))
    return out


def render_timeline(intervals: Sequence[Interval], pilot: PilotDescription, html_path: str | os.PathLike[str],
                    png_path: str | os.PathLike[str] | None = None, *, title: str = "hetflow timeline",
                    utilization: Sequence[tuple[float, float, float]] | None = None,
                    max_nodes: int = 32, max_bars: int = 20_000,
                    base: str | os.PathLike[str] | None = None,
                    stages: Sequence[StageRow] = ()) -> dict[str, int]:
    """Write the report; returns counts ``{"bars", "nodes", "critical"}`` of what was drawn.

    ``stages``: one row per stage for the table above the chart (a map stage is one row with its
    items' counts, however many chunk tasks drew its bars).

    Directories below ``base`` are never followed through a symlink (missing
    ones are made 0700); by default ``base`` is the nearest existing directory
    above each output, i.e. the part of the path the caller named and that
    exists is taken as given.  An output that is a symlink is refused.
    """
    page, summary, png = _draw(intervals, pilot, title, utilization, max_nodes, max_bars, png_path is not None,
                               stages)
    write_private_file(html_path, page.encode("utf-8"), base=_base_for(html_path, base))
    if png_path is not None and png is not None:
        write_private_file(png_path, png, base=_base_for(png_path, base))
    logger.info("timeline written to %s (%d bars on %d nodes)", html_path, summary["bars"], summary["nodes"])
    return summary


def timeline_page(intervals: Sequence[Interval], pilot: PilotDescription, *, title: str = "hetflow timeline",
                  max_nodes: int = 32, max_bars: int = 20_000, stages: Sequence[StageRow] = ()) -> str:
    """The report's HTML page as text (what :func:`render_timeline` writes), for ``hetflow serve``."""
    return _draw(intervals, pilot, title, None, max_nodes, max_bars, False, stages)[0]


def _stage_table(stages: Sequence[StageRow]) -> str:
    """The stages as an HTML table, every text escaped (stage names and reasons are the user's)."""
    if not stages:
        return ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in StageRow._fields)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in stages)
    return f'<h2>Stages</h2>\n<table id="stages"><tr>{head}</tr>{rows}</table>'


def _draw(intervals: Sequence[Interval], pilot: PilotDescription, title: str,
          utilization: Sequence[tuple[float, float, float]] | None, max_nodes: int, max_bars: int,
          want_png: bool, stages: Sequence[StageRow] = ()) -> tuple[str, dict[str, int], bytes | None]:
    pilot = pilot.resolve()
    node_names = sorted({iv.node for iv in intervals})
    shown = node_names[:max_nodes]
    shown_set = set(shown)
    bars = [iv for iv in intervals if iv.node in shown_set][:max_bars]
    path = critical_path(intervals)
    on_path = set(path)
    curve = list(utilization) if utilization is not None else utilization_curve(intervals, pilot)
    t0 = min([iv.start for iv in intervals] + [c[0] for c in curve], default=0.0)
    t1 = max([iv.end for iv in intervals] + [c[0] for c in curve], default=1.0)
    span = max(t1 - t0, 1e-9)

    def x(t: float) -> float:
        return LEFT + WIDTH * (t - t0) / span

    core_lane = {c: i for i, c in enumerate(pilot.usable_cores())}
    colors = stage_colors(intervals)
    gpus = pilot.gpus_per_node or 0
    lanes = len(core_lane) + gpus
    lane_h = max(2.0, min(8.0, 200.0 / max(lanes, 1)))
    node_h = lanes * lane_h + 18
    parts: list[str] = []
    by_node: dict[str, list[Interval]] = {name: [] for name in shown}
    for iv in bars:
        by_node[iv.node].append(iv)
    height = int(len(shown) * node_h + 30)
    parts.append(f'<svg id="gantt" xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 10}" height="{height}" '
                 f'viewBox="0 0 {LEFT + WIDTH + 10} {height}">')
    for row, name in enumerate(shown):
        top = row * node_h
        parts.append(f'<g class="node" data-node="{html.escape(name)}">'
                     f'<text x="2" y="{top + 12:.1f}" class="label">{html.escape(name)}</text>'
                     f'<rect x="{LEFT}" y="{top + 14:.1f}" width="{WIDTH}" height="{lanes * lane_h:.1f}" class="lanes"/>'
                     f'<line x1="{LEFT}" x2="{LEFT + WIDTH}" y1="{top + 14 + len(core_lane) * lane_h:.1f}" '
                     f'y2="{top + 14 + len(core_lane) * lane_h:.1f}" class="gpusep"/>')
        for iv in by_node[name]:
            tip = (f"{iv.name} (task {iv.task_id}) on {iv.node}: cores {list(iv.cores)} GPUs {list(iv.gpus)}, "
                   f"{iv.start - t0:.1f}-{iv.end - t0:.1f} s, {iv.state}")
            cls = "bar critical" if iv.task_id in on_path else "bar"
            rects = []
            lanes_held = [core_lane[c] for c in iv.cores if c in core_lane] + [len(core_lane) + g for g in iv.gpus if g < gpus]
            for first, length in _runs(lanes_held):
                rects.append(f'<rect x="{x(iv.start):.1f}" y="{top + 14 + first * lane_h:.1f}" '
                             f'width="{max(x(iv.end) - x(iv.start), 0.5):.1f}" height="{length * lane_h:.1f}" '
                             f'fill="{colors[stage_of(iv.name)]}"/>')
            parts.append(f'<g class="{cls}" data-task="{html.escape(iv.task_id)}"><title>{html.escape(tip)}</title>'
                         + "".join(rects) + "</g>")
        parts.append("</g>")
    parts.append("</svg>")
    gantt = "".join(parts)
    util = _curve_svg(curve, x, t0, t1)
    legend = "".join(f'<span class="key"><i style="background:{c}"></i>{html.escape(n)}</span>'
                     for n, c in colors.items())
    path_rows = "".join(f"<li>{html.escape(t)}</li>" for t in path)
    summary = {"bars": len(bars), "nodes": len(shown), "critical": len(path)}
    note = ""
    if len(node_names) > len(shown) or len(bars) < sum(1 for iv in intervals if iv.node in shown_set):
        note = (f"<p class='note'>Gantt chart limited to {len(shown)} of {len(node_names)} nodes and "
                f"{len(bars)} bars; utilisation covers the whole run.</p>")
    page = _PAGE.format(title=html.escape(title), shape=html.escape(pilot.shape()), legend=legend, note=note,
                        stages=_stage_table(stages),
                        gantt=gantt, util=util, path=path_rows, expected=json.dumps(summary),
                        duration=f"{span:,.1f}", width=LEFT + WIDTH + 10)
    png = _render_png(bars, shown, core_lane, gpus, curve, t0, path, title, colors) if want_png else None
    return page, summary, png


def _base_for(output: str | os.PathLike[str], base: str | os.PathLike[str] | None) -> Path:
    if base is not None:
        return Path(base)
    probe = Path(os.path.abspath(output)).parent
    while not probe.is_dir():
        probe = probe.parent
    return probe


def _curve_svg(curve: Sequence[tuple[float, float, float]], x: Callable[[float], float], t0: float, t1: float) -> str:
    h = 160.0
    def y(fraction: float) -> float:
        return TOP + h - h * fraction
    def points(col: int) -> str:
        pts: list[str] = []
        last = 0.0
        for sample in curve:
            pts.append(f"{x(sample[0]):.1f},{y(last):.1f}")
            last = sample[col]
            pts.append(f"{x(sample[0]):.1f},{y(last):.1f}")
        pts.append(f"{x(t1):.1f},{y(last):.1f}")
        return " ".join(pts)
    grid = "".join(f'<line x1="{LEFT}" x2="{LEFT + WIDTH}" y1="{y(f):.1f}" y2="{y(f):.1f}" class="grid"/>'
                   f'<text x="{LEFT - 6}" y="{y(f) + 4:.1f}" class="label" text-anchor="end">{int(100 * f)}%</text>'
                   for f in (0.0, 0.5, 1.0))
    return (f'<svg id="util" xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 10}" height="{TOP + h + 20:.0f}" '
            f'viewBox="0 0 {LEFT + WIDTH + 10} {TOP + h + 20:.0f}">'
            f'{grid}<polyline class="cores" points="{points(1)}"/><polyline class="gpus" points="{points(2)}"/>'
            f'<text x="{LEFT}" y="{TOP + h + 16:.0f}" class="label">t = 0</text>'
            f'<text x="{LEFT + WIDTH}" y="{TOP + h + 16:.0f}" class="label" text-anchor="end">'
            f't = {t1 - t0:,.0f} s</text></svg>')


def _render_png(bars: Sequence[Interval], shown: Sequence[str], core_lane: dict[int, int], gpus: int,
                curve: Sequence[tuple[float, float, float]], t0: float, path: Sequence[str],
                title: str, colors: dict[str, str]) -> bytes:
    """The PNG as bytes (the caller writes it: matplotlib would follow a symlink and obey the umask)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = timeline_figure(bars, shown, core_lane, gpus, curve, t0, path, title, colors)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def timeline_figure(bars: Sequence[Interval], shown: Sequence[str], core_lane: dict[int, int], gpus: int,
                    curve: Sequence[tuple[float, float, float]], t0: float, path: Sequence[str],
                    title: str, colors: dict[str, str]) -> Any:
    """The matplotlib figure of the PNG: bars coloured by stage and labelled with their stage (and
    attempt) where they are wide enough, a legend of the stages, node rows, utilisation below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    lanes = len(core_lane) + gpus
    fig, (ax_g, ax_u) = plt.subplots(2, 1, figsize=(12, 8), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    row_of = {name: i for i, name in enumerate(shown)}
    on_path = set(path)
    span = max([iv.end - t0 for iv in bars] + [1e-9])
    labelled: set[tuple[str, str]] = set()
    # every bar's rectangles go into one collection, added once: a broken_barh call per rectangle rescaled the
    # axes at each call, and a 400-task report took a minute (docs/benchmarks.md, "The run report's PNG")
    boxes: list[list[tuple[float, float]]] = []
    faces: list[str] = []
    edges: list[str] = []
    for iv in bars:
        base = row_of[iv.node] * (lanes + 2)
        held = [core_lane[c] for c in iv.cores if c in core_lane] + [len(core_lane) + g for g in iv.gpus if g < gpus]
        for first, length in _runs(held):
            x, width, y = iv.start - t0, max(iv.end - iv.start, 1e-9), base + first
            boxes.append([(x, y), (x, y + length), (x + width, y + length), (x + width, y)])
            faces.append(colors[stage_of(iv.name)])
            edges.append("black" if iv.task_id in on_path else "none")
        if held and (iv.task_id, iv.node) not in labelled and (iv.end - iv.start) / span > 0.04:
            labelled.add((iv.task_id, iv.node))  # one label per bar, on its first lanes
            first, length = _runs(held)[0]
            ax_g.text((iv.start + iv.end) / 2 - t0, base + first + length / 2, iv.name, ha="center",
                      va="center", fontsize=9, color="white", clip_on=True,
                      bbox={"boxstyle": "round,pad=0.1", "facecolor": "black", "alpha": 0.35, "linewidth": 0})
    if boxes:
        ax_g.add_collection(PolyCollection(boxes, facecolors=faces, edgecolors=edges, linewidths=0.6))
        ax_g.autoscale_view()
    ax_g.set_yticks([row_of[n] * (lanes + 2) + lanes / 2 for n in shown], list(shown), fontsize=8)
    ax_g.invert_yaxis()
    ax_g.set_ylabel("node (lanes: cores, then GPUs)")
    ax_g.set_title(title)
    ax_g.legend(handles=[Patch(facecolor=c, label=n) for n, c in colors.items()], title="stage",
                loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title_fontsize=8, frameon=False)
    if curve:
        times = [c[0] - t0 for c in curve]
        ax_u.step(times, [100 * c[1] for c in curve], where="post", label="cores", color="black")
        ax_u.step(times, [100 * c[2] for c in curve], where="post", label="GPUs", color="#d62728",
                  linestyle="--")
    ax_u.set_ylim(0, 105)
    ax_u.set_ylabel("utilisation %")
    ax_u.set_xlabel("seconds")
    ax_u.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px sans-serif; margin: 16px; overflow-wrap: anywhere; }}
svg {{ max-width: 100%; height: auto; }}  /* drawn {width} px wide, scaled down to fit a narrower window */
.label {{ font: 11px sans-serif; fill: #333; }}
.lanes {{ fill: #f4f4f4; }}
.gpusep {{ stroke: #999; stroke-dasharray: 3 2; }}
.bar.critical rect {{ stroke: #000; stroke-width: 1; }}
.grid {{ stroke: #ddd; }}
polyline {{ fill: none; stroke-width: 1.5; }}
polyline.cores {{ stroke: #4e79a7; }} polyline.gpus {{ stroke: #e15759; }}
.key {{ margin-right: 12px; }} .key i {{ display: inline-block; width: 10px; height: 10px; margin-right: 4px; }}
.note {{ color: #666; }}
#stages {{ border-collapse: collapse; margin-bottom: 1em; }}
#stages td, #stages th {{ border: 1px solid #ddd; padding: 2px 8px; text-align: left; }}
</style>
<script>
window.hetflowErrors = [];
window.addEventListener("error", function (e) {{ window.hetflowErrors.push(String(e.message)); }});
</script>
</head><body>
<h1>{title}</h1>
<p>{shape}; run length {duration} s. Lanes per node: usable cores, then GPUs (below the dashed line).
Bars with a black outline are on the critical path.</p>
<p>{legend}</p>
{note}
{stages}
<h2>Utilisation (<span style="color:#4e79a7">cores</span>, <span style="color:#e15759">GPUs</span>)</h2>
{util}
<h2>Tasks per node</h2>
{gantt}
<h2>Critical path</h2>
<ol id="critical-path">{path}</ol>
<script>
(function () {{
  var expected = {expected};
  var bars = document.querySelectorAll("#gantt g.bar").length;
  var status = {{bars: bars, expected_bars: expected.bars,
                critical: document.querySelectorAll("#critical-path li").length,
                errors: window.hetflowErrors}};
  var clipped = 0;
  document.querySelectorAll("svg text").forEach(function (t) {{
    var box = t.getBBox(), svg = t.ownerSVGElement;
    if (box.x < 0 || box.y < 0 || box.x + box.width > svg.width.baseVal.value ||
        box.y + box.height > svg.height.baseVal.value) {{ clipped += 1; }}
  }});
  status.clipped = clipped;
  document.body.setAttribute("data-report-status", JSON.stringify(status));  // for tests; not shown
  document.body.setAttribute("data-bars", String(bars));
}})();
</script>
</body></html>
"""
