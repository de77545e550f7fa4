"""The run report: `report.png` in the run folder, drawn from its metrics.jsonl (rank 0, at every eval and at the
end of a run): training loss (and, with FP8 delayed scaling, the scale overflows counted so far), validation loss
against the target, validation loss by timestep t, and samples/s per GPU, over training samples.

The plotted numbers also travel inside the PNG (text chunk `flux_train.outputs.report`, JSON), so a reader (or a test)
can check them against metrics.jsonl without the run folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

REPORT_FILE = "report.png"
METRICS_FILE = "metrics.jsonl"
PNG_KEY = "flux_train.outputs.report"


def series(rows: list[dict], global_batch_size: int) -> dict:
    """[training samples, value] pairs per curve (by timestep: per t); training rows count samples as step x GBS."""
    by_t: dict[str, list[list[float]]] = {}
    for r in rows:
        for t, loss in r.get("val_loss_by_t", {}).items():
            by_t.setdefault(t, []).append([r["samples"], loss])
    return {
        "train_loss": [[r["step"] * global_batch_size, r["loss"]] for r in rows if "loss" in r],
        "val_loss": [[r["samples"], r["val_loss"]] for r in rows if "val_loss" in r],
        "val_loss_by_t": by_t,
        "samples_per_s_per_gpu": [
            [r["step"] * global_batch_size, r["samples_per_s_per_gpu"]] for r in rows if "samples_per_s_per_gpu" in r
        ],
        "fp8_overflows": [[r["step"] * global_batch_size, r["fp8_overflows"]] for r in rows if "fp8_overflows" in r],
    }


def draw_val_loss(ax: Axes, curves: dict[str, list], target: float) -> None:
    """Validation loss against training samples, one curve per name, and the target line (also `results`' plot)."""
    for name, points in curves.items():
        if points:
            ax.plot(*zip(*points), marker="o", markersize=4, label=name)
    ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set(xlabel="training samples", ylabel="validation loss")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def write_report(run_dir: Path, global_batch_size: int, target: float) -> Path:
    """report.png from run_dir/metrics.jsonl; returns its path."""
    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
    data = series(rows, global_batch_size)
    fig = Figure(figsize=(9, 13), layout="constrained")
    train_ax, val_ax, by_t_ax, speed_ax = fig.subplots(4, 1, sharex=True)
    if data["train_loss"]:
        train_ax.plot(*zip(*data["train_loss"]), color="tab:blue", marker=".")
    train_ax.set(ylabel="training loss", title="training loss (mean over each logging window)")
    overflows = data["fp8_overflows"]
    if overflows:  # FP8 delayed scaling: a count that keeps climbing after the first steps saturates values
        count_ax = train_ax.twinx()
        count_ax.plot(*zip(*overflows), color="tab:red", linewidth=1)
        count_ax.set_ylabel("FP8 scale overflows (total)", color="tab:red")
        train_ax.set_title(f"training loss (mean over each logging window); FP8 overflows: {overflows[-1][1]:,}")
    val = data["val_loss"]
    draw_val_loss(val_ax, {"validation loss": val}, target)
    reached = " (target reached)" if val and val[-1][1] <= target else ""
    val_ax.set_title(
        f"validation loss: {val[-1][1]:.4f} at {val[-1][0]:,} samples{reached}"
        if val
        else "validation loss: no eval yet"
    )
    shade = colormaps["viridis"]
    for t, points in data["val_loss_by_t"].items():  # t = k/8: the MLPerf eval's timesteps
        by_t_ax.plot(*zip(*points), color=shade(float(t)), marker=".", label=f"t = {t}")
    by_t_ax.set(ylabel="validation loss", title="validation loss by timestep t (0: data, 1: noise)")
    if data["val_loss_by_t"]:
        by_t_ax.legend(fontsize="small", ncol=4)
    if data["samples_per_s_per_gpu"]:
        speed_ax.plot(*zip(*data["samples_per_s_per_gpu"]), color="tab:green", marker=".")
    speed_ax.set(
        xlabel="training samples", ylabel="samples/s per GPU", title="throughput (mean over each logging window)"
    )
    speed_ax.set_ylim(bottom=0)
    for ax in (train_ax, by_t_ax, speed_ax):
        ax.grid(alpha=0.3)
    for ax in (train_ax, val_ax, by_t_ax):  # shared x: the labels go under the bottom panel only
        ax.set_xlabel("")
        ax.tick_params(labelbottom=False)
    last = rows[-1]["step"] if rows else 0
    fig.suptitle(f"{run_dir.name}: step {last:,}, {last * global_batch_size:,} samples (GBS {global_batch_size})")
    path = run_dir / REPORT_FILE
    fig.savefig(path, dpi=100, metadata={PNG_KEY: json.dumps({"target": target, **data})})
    return path
