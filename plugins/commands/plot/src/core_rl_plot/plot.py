"""``core-rl plot RUN_DIR [RUN_DIR ...]``: training curves of one or several runs, overlaid.

Reads each run's ``metrics.jsonl`` and writes ``plot.png`` and ``plot.html`` (the same figure as
inline SVG, plus a table of each run's first and last values) next to the first run's metrics, or
into ``--out``. Each panel plots one quantity against the step; a run's raw values are drawn faint
and their rolling mean (``--smooth`` steps, default ~1/50 of the run) solid, one colour per run.

Needs matplotlib (``pip install "core-rl[plot]"``).
"""

from __future__ import annotations

import html
import io
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import attrs
from core_rl.builtin import read_metrics
from core_rl.errors import CoreRLError

METRICS_FILE = "metrics.jsonl"
TIMING_KEYS = ("timing/generate_s", "timing/reward_s", "timing/train_s", "timing/weight_sync_s")


@attrs.frozen
class Panel:
    """One chart: ``keys`` plotted against the step (several keys: one line style each)."""

    title: str
    keys: tuple[str, ...]
    log_y: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("reward (mean)", ("reward/mean",)),
    Panel("reward parts (mean)", ()),  # filled with every reward/<part>/mean found
    Panel("KL to reference", ("actor/kl",)),
    Panel("entropy", ("actor/entropy",)),
    Panel("response length (tokens)", ("response_length/mean",)),
    Panel("truncated responses (fraction)", ("response_length/clip_fraction",)),
    Panel("clip fraction (policy ratio)", ("actor/clipped",)),
    Panel("loss", ("actor/loss",)),
    Panel("grad norm", ("actor/grad_norm",), log_y=True),
    Panel("learning rate", ("actor/lr",)),
    Panel("step time split (s)", TIMING_KEYS),
    Panel("throughput (tokens/s)", ("throughput/generated_tokens_per_s", "throughput/tokens_per_s")),
    Panel("evaluation (eval:)", ("eval/reward/mean", "eval/pass@1")),
)


@attrs.define
class Run:
    """One run's metrics: ``series[key]`` is ``(steps, values)``, sorted by step (the last record
    of a step wins)."""

    label: str
    path: Path
    series: dict[str, tuple[list[int], list[float]]]

    @property
    def steps(self) -> int:
        return max((s[-1] for s, _ in self.series.values() if s), default=0)


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # the jsonl logger writes NaN and inf as strings
        try:
            return float(value)
        except ValueError:
            return None
    return None


def load_run(run_dir: str | Path, label: str | None = None) -> Run:
    """Read ``run_dir/metrics.jsonl`` (or a metrics file given directly)."""
    path = Path(run_dir)
    metrics = path / METRICS_FILE if path.is_dir() else path
    if not metrics.is_file():
        raise CoreRLError(f"{path}: no {METRICS_FILE} here; give the run directory of a core-rl run")
    by_step: dict[int, dict[str, float]] = {}
    for record in read_metrics(metrics):  # leaves out a last line cut short by a killed run
        try:
            step = int(record["step"])
        except (KeyError, TypeError, ValueError):
            raise CoreRLError(f"{metrics}: a record without a step number: {str(record)[:120]}") from None
        values = {k: v for k, v in ((k, _number(v)) for k, v in record.items()) if v is not None}
        by_step.setdefault(step, {}).update(values)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            if key in ("step", "time"):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(value)
    run_path = metrics.parent
    return Run(label=label or run_path.name, path=run_path, series=series)


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` finite values at each position (NaN/inf skipped)."""
    out: list[float] = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(statistics.fmean(recent) if recent else math.nan)
    return out


def _labels(paths: Sequence[Path]) -> list[str]:
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [f"{p.parent.name}/{p.name}" for p in paths]


def _short_name(key: str) -> str:
    """``reward/format/checks_passed/mean`` -> ``format/checks_passed``; ``timing/train_s`` -> ``train_s``."""
    if key.startswith("reward/") and key.endswith("/mean"):
        return key[len("reward/") : -len("/mean")]
    return key.rsplit("/", 1)[-1]


def _panels(runs: Sequence[Run]) -> list[Panel]:
    parts = sorted(
        {k for r in runs for k in r.series if k.startswith("reward/") and k.endswith("/mean") and k != "reward/mean"}
    )
    return [attrs.evolve(p, keys=tuple(parts)) if p.title.startswith("reward parts") else p for p in PANELS]


def _figure(runs: Sequence[Run], smooth: int | None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CoreRLError('core-rl plot needs matplotlib: pip install "core-rl[plot]"') from None

    panels = _panels(runs)
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for ax, panel in zip(axes.flat, panels):
        ax.set_title(panel.title, fontsize=11)
        ax.set_xlabel("step", fontsize=9)
        ax.grid(alpha=0.3)
        drawn = False
        for r, run in enumerate(runs):
            for k, key in enumerate(panel.keys):
                if key not in run.series:
                    continue
                steps, values = run.series[key]
                window = smooth or max(1, len(values) // 50)
                name = _short_name(key) if len(panel.keys) > 1 else ""
                label = " ".join(x for x in (run.label if len(runs) > 1 else "", name) if x)
                # one run: a colour per key; several: a colour per run and a line style per key
                colour = colours[(k if len(runs) == 1 else r) % len(colours)]
                style = "-" if len(runs) == 1 else styles[k % len(styles)]
                if window > 1:
                    ax.plot(steps, values, color=colour, linestyle=style, alpha=0.25, linewidth=0.8)
                ax.plot(steps, rolling_mean(values, window), color=colour, linestyle=style, label=label or None)
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif panel.log_y and all(v > 0 for run in runs for k in panel.keys for v in run.series.get(k, ([], []))[1]):
            ax.set_yscale("log")
        if drawn and ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    title = ", ".join(run.label for run in runs)
    fig.suptitle(f"core-rl: {title}", fontsize=13)
    fig.tight_layout()
    return fig, plt


def _summary_rows(runs: Sequence[Run]) -> list[list[str]]:
    rows = []
    for panel in _panels(runs):
        for key in panel.keys:
            cells = [html.escape(key)]
            for run in runs:
                _, values = run.series.get(key, ([], []))
                finite = [v for v in values if math.isfinite(v)]
                cells.append(f"{finite[0]:.4g} &rarr; {finite[-1]:.4g}" if finite else "&ndash;")
            rows.append(cells)
    return rows


def _html(runs: Sequence[Run], svg: str) -> str:
    head = "".join(f"<th>{html.escape(r.label)}</th>" for r in runs)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in _summary_rows(runs))
    listing = "".join(f"<li><code>{html.escape(str(r.path))}</code>: {r.steps} steps</li>" for r in runs)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>core-rl runs</title><style>"
        "body{font-family:sans-serif;margin:1.5em} table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px} svg{max-width:100%;height:auto}"
        f"</style></head><body><h1>core-rl runs</h1><ul>{listing}</ul>{svg}"
        f"<h2>first &rarr; last value</h2><table><tr><th>metric</th>{head}</tr>{body}</table></body></html>"
    )


def plot_runs(run_dirs: Sequence[str | Path], *, out_dir: str | Path | None = None, smooth: int | None = None) -> dict:
    """Write ``plot.png`` and ``plot.html`` for ``run_dirs``; return ``{"png": path, "html": path}``."""
    if not run_dirs:
        raise CoreRLError("core-rl plot: give at least one run directory")
    paths = [Path(p) for p in run_dirs]
    runs = [load_run(p, label) for p, label in zip(paths, _labels(paths))]
    out = Path(out_dir) if out_dir is not None else runs[0].path
    out.mkdir(parents=True, exist_ok=True)
    fig, plt = _figure(runs, smooth)
    png, page = out / "plot.png", out / "plot.html"
    fig.savefig(png, dpi=110)
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    plt.close(fig)
    svg_text = svg.getvalue()
    page.write_text(_html(runs, svg_text[svg_text.find("<svg") :]), encoding="utf-8")
    return {"png": png, "html": page}
