"""Draw the panels of a Grafana dashboard JSON as a PNG: the layout, each panel's title,
kind, unit and queries (legend and PromQL), on Grafana's 24-column grid.

It is a picture of the dashboard's definition, not a screenshot of live data: no values
are drawn. The docs show ``deploy/monitoring/grafana-dashboard.json`` this way::

    .venv/bin/python scripts/render_dashboard.py deploy/monitoring/grafana-dashboard.json \
        docs/img/grafana-dashboard.png
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.patches import FancyBboxPatch

COLUMNS = 24  # Grafana's grid width
ROW_INCHES = 0.32  # one grid row (30 px in Grafana) at the figure's scale
WIDTH_INCHES = 16.0
BACKGROUND = "#111217"
PANEL = "#181b1f"
BORDER = "#2c3235"
TITLE = "#d8d9da"
TEXT = "#9fa7b3"
ACCENT = {"stat": "#73bf69", "timeseries": "#5794f2"}


def _queries(panel: dict[str, Any]) -> list[tuple[str, str]]:
    return [(t.get("legendFormat", ""), " ".join(t.get("expr", "").split()))
            for t in panel.get("targets", [])]


def render(dashboard: dict[str, Any], out: Path) -> None:
    matplotlib.use("Agg")  # files only: no display on a build machine
    matplotlib.rcParams["text.parse_math"] = False  # PromQL is full of `$`
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    header = 1.6  # grid rows above the panels: the title and the variables
    fig_h = (rows + header) * ROW_INCHES
    fig = plt.figure(figsize=(WIDTH_INCHES, fig_h), facecolor=BACKGROUND)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, COLUMNS)
    ax.set_ylim(rows + header, 0)
    ax.axis("off")
    variables = ", ".join(v.get("label", v["name"]) for v in dashboard.get("templating", {}).get("list", []))
    ax.text(0.25, 0.55, dashboard.get("title", ""), color=TITLE, fontsize=15, weight="bold", va="center")
    ax.text(0.25, 1.15, f"variables: {variables}   |   a rendering of the dashboard JSON's panels"
            " (layout, titles, queries): no data", color=TEXT, fontsize=8.5, va="center")
    chars_per_col = 8.3  # characters of 6.5 pt text per grid column
    for p in panels:
        g = p["gridPos"]
        x, y, w, h = g["x"], g["y"] + header, g["w"], g["h"]
        ax.add_patch(FancyBboxPatch((x + 0.08, y + 0.08), w - 0.16, h - 0.16,
                                    boxstyle="round,pad=0,rounding_size=0.15",
                                    facecolor=PANEL, edgecolor=BORDER, linewidth=1))
        kind = p.get("type", "")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.text(x + 0.3, y + 0.55, p.get("title", ""), color=TITLE, fontsize=10, weight="bold", va="center")
        ax.text(x + w - 0.3, y + 0.55, f"{kind}" + (f" · {unit}" if unit else ""),
                color=ACCENT.get(kind, TEXT), fontsize=8, va="center", ha="right")
        if kind == "timeseries":  # an empty plot area where the series would be
            ax.plot([x + 0.5, x + 0.5, x + w - 0.4], [y + 1.1, y + h - 0.5, y + h - 0.5],
                    color=BORDER, linewidth=1)
        line = y + 1.25
        width = int(w * chars_per_col)
        for legend, expr in _queries(p):
            ax.text(x + 0.7, line, legend or "(series)", color=ACCENT.get(kind, TEXT),
                    fontsize=7.5, va="center")
            line += 0.42
            for part in textwrap.wrap(expr, width)[:3]:
                ax.text(x + 0.7, line, part, color=TEXT, fontsize=6.5, va="center", family="monospace")
                line += 0.36
            line += 0.15
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, facecolor=BACKGROUND)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dashboard", type=Path, help="a Grafana dashboard JSON file")
    parser.add_argument("out", type=Path, help="the PNG to write")
    args = parser.parse_args()
    render(json.loads(args.dashboard.read_text()), args.out)


if __name__ == "__main__":
    main()
