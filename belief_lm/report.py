"""`belief-lm report`: a run's curves in one PNG and a short summary, from what the trainer
wrote into its run directory (metrics.jsonl, diagnostics.jsonl, starts.jsonl, config.yaml).

The figure: training and validation loss (spikes marked), learning rate, gradient norm,
tokens/s, MFU, data health (rows skipped per source, as a share of the rows read), the
belief diagnostics when the run logged them (‖Δ‖/‖MH‖ and cos∠(ΔW^o, X) per layer) and,
for a multi-rank run, the spread of the ranks' forward times. Several run directories are
overlaid, one colour each (a quick A/B), the diagnostics then averaged over the layers.

Resumes: every start of a run appends a line to starts.jsonl with the step it started
from, so a start at a step above 0 is a resume (after that checkpoint) and a later start
at step 0 a start over. A run directory written before starts.jsonl existed shows a
restart only where its training rows' steps stop increasing.

Torch-free; matplotlib is the `report` extra (in `dev`).
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from belief_lm.errors import BadInput

REPORT = "report.png"
"""The figure of one run, in its directory (unless --out)."""


@dataclass
class Run:
    """What a run directory holds, read."""

    path: Path
    train: list[dict]
    """metrics.jsonl rows of training steps (with a loss)."""
    val: list[dict]
    """metrics.jsonl rows of validation (val_loss)."""
    spikes: list[dict]
    """metrics.jsonl rows of loss spikes (spike_loss)."""
    diagnostics: list[dict]
    starts: list[dict]
    """starts.jsonl: one row per start of the run (the step it started from)."""
    tokens_per_step: int
    restarts: list[int] = field(default_factory=list)
    """Steps where a training row's step did not increase (runs without starts.jsonl)."""

    @property
    def name(self) -> str:
        return self.path.resolve().name


log = logging.getLogger("belief_lm.report")


def read_jsonl(path: Path) -> list[dict]:
    """The rows (JSON objects with an integer step) of `path`; a line that is none (cut
    short by a crash in the middle of a write, or not ours) is skipped with a warning."""
    if not path.is_file():
        return []
    rows, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            row = "unreadable"
        if isinstance(row, dict) and type(row.get("step")) is int:
            rows.append(row)
        elif row is not None:
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d line(s) that are no row (cut short or not ours)", path, skipped)
    return rows


def load_run(path: str | Path) -> Run:
    """Read a run directory; BadInput if it is none or has no training metrics."""
    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise BadInput(f"{path}: not a run directory (no config.yaml)")
    rows = read_jsonl(path / "metrics.jsonl")
    train = [r for r in rows if r.get("loss") is not None or "tokens_per_s" in r]
    if not train:
        raise BadInput(f"{path}: no training metrics (metrics.jsonl) to report")
    try:
        config = yaml.safe_load((path / "config.yaml").read_text())
        tokens = int(config["train"]["global_batch_size"] * config["model"]["seq_length"])
    except (ValueError, TypeError, KeyError, yaml.YAMLError) as err:
        raise BadInput(f"{path / 'config.yaml'}: not a run's config ({err!r})") from None
    restarts = [b["step"] for a, b in itertools.pairwise(train) if b["step"] <= a["step"]]
    return Run(
        path=path, train=train, val=[r for r in rows if "val_loss" in r],
        spikes=[r for r in rows if "spike_loss" in r],
        diagnostics=read_jsonl(path / "diagnostics.jsonl"),
        starts=read_jsonl(path / "starts.jsonl"), tokens_per_step=tokens, restarts=restarts,
    )  # fmt: skip


def interval_steps(run: Run) -> list[int]:
    """Steps in each logged training interval: since the previous row, or since the start
    (or resume) that came after it."""
    starts = [s["step"] for s in run.starts]
    counts, previous = [], 0
    for row in run.train:
        since = previous if row["step"] > previous else 0  # else the sequence restarted
        since = max([since, *(s for s in starts if since < s < row["step"])])
        counts.append(row["step"] - since)
        previous = row["step"]
    return counts


def summary(run: Run) -> dict:
    """The run's numbers: steps and tokens trained, first and last loss, best validation
    loss, mean throughput and MFU (over the logged intervals' time), spikes, starts."""
    steps = run.train[-1]["step"]
    counts = interval_steps(run)
    seconds = [r["step_time_s"] * n for r, n in zip(run.train, counts, strict=True)]

    def time_mean(key: str) -> float | None:
        timed = [(r[key], s) for r, s in zip(run.train, seconds, strict=True) if r.get(key)]
        total = sum(s for _, s in timed)
        return sum(v * s for v, s in timed) / total if timed and total else None

    best = min(run.val, key=lambda r: r["val_loss"]) if run.val else None
    return {
        "steps": steps,
        "tokens": steps * run.tokens_per_step,
        "first_loss": (run.train[0]["step"], run.train[0]["loss"]),
        "last_loss": (steps, run.train[-1]["loss"]),
        "best_val_loss": None if best is None else (best["step"], best["val_loss"]),
        "tokens_per_s": time_mean("tokens_per_s"),
        "mfu": time_mean("mfu"),
        "spikes": [r["step"] for r in run.spikes],
        "starts": len(run.starts),
        "resumed_after": [s["step"] for s in run.starts[1:] if s["step"] > 0],
        "started_over": sum(1 for s in run.starts[1:] if s["step"] == 0),
        "restarts": run.restarts,
    }


def format_summary(run: Run, numbers: dict) -> str:
    first, last, best = numbers["first_loss"], numbers["last_loss"], numbers["best_val_loss"]
    best_text = "-" if best is None else f"{best[1]:.4f} (step {best[0]})"
    throughput = numbers["tokens_per_s"]
    starts = f"{numbers['starts']} start(s)"
    if numbers["resumed_after"]:
        starts += ", resumed after step " + ", ".join(map(str, numbers["resumed_after"]))
    if numbers["started_over"]:
        starts += f", started over {numbers['started_over']} time(s)"
    if numbers["restarts"]:
        starts += ", step sequence restarted at " + ", ".join(map(str, numbers["restarts"]))
    lines = [
        f"{run.path}",
        f"  steps {numbers['steps']:,}, tokens {numbers['tokens']:,}",
        f"  loss {_number(first[1])} (step {first[0]}) -> {_number(last[1])} (step {last[0]}); "
        f"best validation loss {best_text}",
        "  throughput "
        + ("-" if throughput is None else f"{throughput:,.0f} tokens/s")
        + " (mean over the logged intervals), MFU "
        + ("-" if numbers["mfu"] is None else f"{numbers['mfu']:.1%}"),
        f"  loss spikes {len(numbers['spikes'])}"
        + (f" (steps {', '.join(map(str, numbers['spikes']))})" if numbers["spikes"] else "")
        + f"; {starts}",
    ]
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"  # null: a non-finite loss


def report(run_dirs: list[str], out: str | None = None) -> str:
    """Plot `run_dirs` (one: RUN_DIR/report.png unless `out`; several: overlaid into
    `out`) and return the summary text. BadInput for what the user must fix."""
    if len(run_dirs) > 1 and out is None:
        raise BadInput("several run directories are overlaid into one figure: give --out FILE")
    runs = [load_run(path) for path in run_dirs]
    target = Path(out) if out is not None else runs[0].path / REPORT
    plot(runs, target)
    texts = [format_summary(run, summary(run)) for run in runs]
    return "\n".join([*texts, f"report: {target}"])


def plot(runs: list[Run], out: Path) -> None:
    """The figure of `runs` (one, or several overlaid) as a PNG at `out`."""
    try:
        import matplotlib
    except ImportError:
        raise BadInput(
            "belief-lm report needs matplotlib, which is not installed: "
            "pip install 'belief-lm[report]'"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 6, not 6 x 10^0

    figure, axes = plt.subplots(3, 3, figsize=(16, 12), squeeze=False)
    axes = axes.ravel()
    overlay = len(runs) > 1
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, run in enumerate(runs):
        color = colors[index % len(colors)]
        label = run.name if overlay else None
        _losses(axes[0], run, color, label)
        _curve(axes[1], run.train, "lr", color, label)
        _curve(axes[2], run.train, "grad_norm", color, label)
        _curve(axes[3], run.train, "tokens_per_s", color, label)
        _curve(axes[4], run.train, "mfu", color, label, scale=100)
        _data_health(axes[5], run, color, label)
        _diagnostics(axes[6], run, "delta_over_mh", color, label, overlay)
        _diagnostics(axes[7], run, "cos_delta_wo_x", color, label, overlay)
        _rank_spread(axes[8], run, color, label)
    filled = [ax.has_data() for ax in axes]
    for run, color in zip(runs, colors, strict=False):
        for ax in (ax for ax, data in zip(axes, filled, strict=True) if data):
            for start in run.starts[1:]:  # resumes and starts over
                ax.axvline(start["step"], color=color, linestyle=":", linewidth=1)
    for ax, (title, missing) in zip(axes, PANELS, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not ax.has_data():
            ax.text(0.5, 0.5, missing, ha="center", va="center", transform=ax.transAxes)
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in (axes[0], axes[2]):  # a spike or a bad step stays readable beside the rest
        if ax.has_data():
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
    names = ", ".join(run.name for run in runs)
    figure.suptitle(f"belief-lm report: {names}")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    plt.close(figure)


PANELS = [
    ("loss (train; validation: markers; spikes: x)", "no loss"),
    ("learning rate", "no learning rate"),
    ("gradient norm", "no gradient norm"),
    ("tokens/s", "no throughput"),
    ("MFU (%)", "not known: a known GPU or run.peak_tflops"),
    ("data: rows skipped (% of rows read), per source", "no data health"),
    ("‖Δ‖/‖MH‖ per layer", "not logged: run.diagnostics_interval"),
    ("cos∠(ΔW^o, X) per layer", "not logged: run.diagnostics_interval"),
    ("forward s/step over the ranks (min-max, median)", "one rank"),
]
"""The figure's panels, in order: title, and what an empty one says."""


def _xy(rows: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
    points = [(r["step"], r[key] * scale) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _curve(ax, rows: list[dict], key: str, color: str | None, label: str | None,
           scale: float = 1.0, style: str = "-") -> None:  # fmt: skip
    steps, values = _xy(rows, key, scale)
    if steps:
        ax.plot(steps, values, style, color=color, label=label, markersize=4)


def _losses(ax, run: Run, color: str, label: str | None) -> None:
    _curve(ax, run.train, "loss", color, label or "train")
    _curve(ax, run.val, "val_loss", color, f"{label or ''} validation".strip(), style="o--")
    steps, values = _xy(run.spikes, "spike_loss")
    if steps:
        ax.plot(steps, values, "x", color="red", markersize=8)


def _data_health(ax, run: Run, color: str, label: str | None) -> None:
    sources = sorted({k.split("/")[1] for r in run.train for k in r if k.startswith("data/")})
    styles = ["-", "--", ":", "-."]
    for index, source in enumerate(sources):
        rows, skipped = f"data/{source}/rows", f"data/{source}/skipped"
        points = [(r["step"], 100 * r.get(skipped, 0) / r[rows]) for r in run.train if r.get(rows)]
        if points:
            ax.plot(*zip(*points, strict=True), styles[index % len(styles)], color=color,
                    label=f"{label + ' ' if label else ''}source {source}")  # fmt: skip


def _layers(rows: list[dict], metric: str) -> list[str]:
    names = {k.split("/")[0] for r in rows for k in r if k.endswith(f"/{metric}")}
    return sorted(names, key=lambda name: int(name.removeprefix("layer")))


def _diagnostics(ax, run: Run, metric: str, color: str, label: str | None, overlay: bool):
    layers = _layers(run.diagnostics, metric)
    if not layers:
        return
    if overlay:  # one line per run: the mean over its layers
        steps = [r["step"] for r in run.diagnostics]
        means = [statistics.fmean(r[f"{n}/{metric}"] for n in layers) for r in run.diagnostics]
        ax.plot(steps, means, "o-", color=color, markersize=3, label=f"{label} (layer mean)")
        return
    for name in layers:  # the default colour cycle, one per layer
        _curve(ax, run.diagnostics, f"{name}/{metric}", None, name, style="o-")


def _rank_spread(ax, run: Run, color: str, label: str | None) -> None:
    steps, lows = _xy(run.train, "ranks/forward_s_min")
    if not steps:
        return
    _, highs = _xy(run.train, "ranks/forward_s_max")
    _, slowest = _xy(run.train, "ranks/slowest")
    ax.fill_between(steps, lows, highs, color=color, alpha=0.25)
    named = f"median; slowest most often rank {statistics.mode(slowest):.0f}"
    _curve(ax, run.train, "ranks/forward_s_median", color, f"{label or ''} {named}".strip())
