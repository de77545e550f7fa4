"""The planner's output: the table of node counts with the lines under it and its sources (`print_plan`), the plot,
the check's table, and the one line `submit` prints (`submit_line`), or its refusal naming what would fit."""

from __future__ import annotations

import math
from pathlib import Path

from flux_train.config import Config
from flux_train.errors import write_output
from flux_train.model.flux import param_count
from flux_train.tools.bench_table import precision_of
from flux_train.tools.plan_figures import FIGURES_FILE, Figures, PlanError, rcp_points
from flux_train.tools.plan_model import project, sized, what_fits


def refusal(cfg: Config, figs: Figures, mem: dict) -> str:
    """Why the job cannot fit its GPUs, and what would, in one line."""
    fix = what_fits(cfg, figs)
    gpus = cfg.slurm.gpus_per_node
    return (
        f"{cfg.parallel.strategy} {precision_of('ours', cfg)} at micro-batch {cfg.train.micro_batch_size} with {gpus} "
        f"GPU(s) per node needs {mem['peak_gib']:.1f} GiB per GPU (model state {mem['state_gib']:.1f} + activations "
        f"{mem['activations_gib'] or 0:.1f}) + {mem['headroom_gib']:g} kept free, an {figs.kind} has "
        f"{mem['capacity_gib']:g} GiB; "
        + (f"what fits: --set {fix}" if fix else "no layout or micro-batch fits: use more GPUs per node")
    )


def signal_warning(cfg: Config, ck: dict, step_s: float | None) -> str | None:
    """Whether Slurm's warning signal (slurm.signal_delay_s before the limit) leaves time for the checkpoint it asks
    for: the steps to the next logged one, where the workers act, and the save at the measured write rate, with 20 %
    to spare; else what to set."""
    if ck.get("last_save_s") is None or not step_s:
        return None
    to_logged = cfg.logging.log_every * step_s
    needed = 1.2 * (to_logged + ck["last_save_s"])
    if needed <= cfg.slurm.signal_delay_s:
        return None
    return (
        f"slurm.signal_delay_s={cfg.slurm.signal_delay_s} may not leave time for the checkpoint Slurm's warning asks "
        f"for: up to {cfg.logging.log_every} steps to the next logged one ({to_logged:.0f} s), then a "
        f"{ck['gb']:.0f} GB save at the write rate measured ({ck['last_save_s']:.0f} s); set it to "
        f"{60 * math.ceil(needed / 60)} or more (less on storage that writes faster)"
    )


def submit_line(cfg: Config) -> tuple[str, list[str]]:
    """The job's plan in one line, as `submit --dry-run` prints it, and warnings for the job. Raises PlanError when
    the job's memory cannot fit its GPUs, naming the layout or micro-batch that would."""
    kind = cfg.preflight.gpu_name
    if not kind:
        return "# plan: no GPU kind to plan for (set preflight.gpu_name, e.g. H200)", []
    figs = Figures(kind)
    try:
        rcp = rcp_points(cfg.train.global_batch_size)
    except PlanError:
        rcp = None
    p = project(cfg, figs, rcp)
    mem = p["memory"]
    if mem.get("fits") is False:
        raise PlanError(refusal(cfg, figs, mem))
    bound, step_bound = (">= " if p[key] else "" for key in ("lower_bound", "step_lower_bound"))
    fits = (
        f"fits, {mem['peak_gib']:.1f} of {mem['capacity_gib']:g} GiB" if "fits" in mem else f"{mem['peak_gib']:.1f} GiB"
    )
    step = (
        f"step {step_bound}{p['step_s']:.2f} s ({p['samples_s_per_gpu']:.1f} samples/s/GPU)"
        if p["step_s"]
        else f"step: no measured rates for {kind}"
    )
    ttt = p.get("time_to_train")
    ttt = (
        f"time-to-train {bound}{ttt['mean_min']:.0f} min ({ttt['low_min']:.0f}-{ttt['high_min']:.0f}, RCP GBS "
        f"{cfg.train.global_batch_size})"
        if ttt
        else f"time-to-train: {'no RCP for GBS ' + str(cfg.train.global_batch_size) if rcp is None else 'not projected'}"
    )
    ck = p["checkpoint"]
    disk = f"checkpoint disk {ck['disk_gb']:.0f} GB ({cfg.checkpoint.keep} + 1 x {ck['gb']:.0f} GB)"
    line = (
        f"# plan ({kind} x {p['gpus']}, {p['layout']}, micro-batch {p['micro_batch']}): {fits}; {step}; {ttt}; {disk}"
    )
    warning = signal_warning(cfg, ck, p["step_s"])
    return line, [warning] if warning else []


def print_check(results: list[dict]) -> None:
    def err(projected, measured):
        return f"{100 * (projected / measured - 1):+.1f} %" if projected and measured else "-"

    print(f"{'blocks':>7s} {'GPUs':>4s} {'micro x acc':>11s} {'layout':28s} {'samples/s/GPU':>24s} {'peak GiB':>24s}")
    print(f"{'':7s} {'':4s} {'':11s} {'':28s} {'measured projected err':>24s} {'measured projected err':>24s}")
    for r in results:
        measured_peak = f"{r['measured_peak_gib']:.1f}" if r["measured_peak_gib"] else "-"
        print(
            f"{'+'.join(map(str, r['blocks'])):>7s} {r['gpus']:4d} {r['micro_batch']:>6d} x {r['accumulation']:<2d} "
            f"{r['layout']:28s} {r['measured_samples_s_per_gpu']:8.2f} {r['projected_samples_s_per_gpu'] or 0:9.2f} "
            f"{err(r['projected_samples_s_per_gpu'], r['measured_samples_s_per_gpu']):>7s} {measured_peak:>8s} "
            f"{r['projected_peak_gib']:9.1f} {err(r['projected_peak_gib'], r['measured_peak_gib']):>7s}"
        )


COLUMNS = (  # header, width
    ("nodes", 5), ("GPUs", 4), ("layout", 18), ("micro x acc", 11), ("GiB/GPU", 7), ("fits", 4), ("compute", 7),
    ("optim", 6), ("comm", 6), ("step s", 8), ("samples/s/GPU", 13), ("MFU %", 5), ("eval %", 6), ("ckpt %", 6),
    ("time-to-train min", 19), ("disk GB", 7),
)  # fmt: skip


def _cells(p: dict) -> list[str]:
    """One table line's cells; '-' where a figure is missing, '>=' on the times that are lower bounds."""

    def num(value, fmt, scale=1.0):
        return format(value * scale, fmt) if value is not None else "-"

    m, s, t, ck = p["memory"], p["step"], p.get("time_to_train", {}), p["checkpoint"]
    bound = ">=" if p["lower_bound"] else ""
    compute = s["compute_s"] + (s["buffer_s"] or 0.0) if s.get("compute_s") is not None else None
    return [
        str(p["nodes"]),
        str(p["gpus"]),
        p["layout"],
        f"{p['micro_batch']} x {p['accumulation']}",
        f"{m['peak_gib']:.1f}",
        {True: "yes", False: "NO"}.get(m.get("fits"), "?"),
        num(compute, ".3f"),
        num(s.get("optimizer_s"), ".3f"),
        num(s.get("exposed_s"), ".3f"),
        (">=" if p["step_lower_bound"] and p["step_s"] is not None else "") + num(p["step_s"], ".3f"),
        num(p["samples_s_per_gpu"], ".2f"),
        num(p.get("mfu"), ".1f", 100),
        num(t.get("eval_share"), ".1f", 100),
        num(t.get("checkpoint_share"), ".2f", 100),
        f"{bound}{t['mean_min']:.0f} ({t['low_min']:.0f}-{t['high_min']:.0f})" if t else "-",
        f"{ck['disk_gb']:.0f}",
    ]


def print_plan(config: str, cfg: Config, figs: Figures, rcp: dict, plans: list[dict], png: str) -> None:
    """The plan: a line per node count; under it, the last one's parts, where every figure came from, what is
    missing, and the plot's file."""
    print(
        f"flux-train plan: {config} on {figs.kind}; {cfg.model.flavor} {param_count(cfg.model) / 1e9:.3f} B parameters; "
        f"GBS {rcp['gbs']}: the RCPs ({rcp['rcp']}, {rcp['runs']} runs) converged in {rcp['mean'] / 1e6:.2f} M "
        f"samples on average ({rcp['low'] / 1e6:.2f}-{rcp['high'] / 1e6:.2f} M)\n"
    )
    print_table(cfg, figs, plans)
    shown = [p for p in plans if "error" not in p]
    if not shown:
        return
    last = shown[-1]
    print(memory_line(last))
    print(checkpoint_line(cfg, last["checkpoint"]))
    warning = signal_warning(cfg, last["checkpoint"], last["step_s"])
    if warning:
        print(f"warning: {warning}")
    print(f"warm-up before run_start (off the clock): {warmup_text(last['warmup'])}")
    t = last.get("time_to_train")
    if t and t["mean_min"] > cfg.slurm.time_min:
        print(f"longer than slurm.time_min {cfg.slurm.time_min}: the run goes on after requeues (slurm.max_requeue)")
    print_sources(config, cfg, figs, shown)
    print(f"plot: {png}")


def print_table(cfg: Config, figs: Figures, plans: list[dict]) -> None:
    """The header and a line per node count (or why the GBS does not split over it); one that does not fit is
    followed by what would."""
    print(" ".join(f"{h:{'<' if h == 'layout' else '>'}{w}s}" for h, w in COLUMNS))
    for p in plans:
        if "error" in p:
            print(f"{p['nodes']:>5d} {p['gpus']:>4d} {p['error']}")
            continue
        print(" ".join(f"{c:{'<' if h == 'layout' else '>'}{w}s}" for c, (h, w) in zip(_cells(p), COLUMNS)))
        if p["memory"].get("fits") is False:
            print(f"      does not fit: {refusal(sized(cfg, p['nodes'])[0], figs, p['memory'])}")


def memory_line(p: dict) -> str:
    """What a plan's memory per GPU and step are made of."""
    m, s = p["memory"], p["step"]
    line = (
        f"\nper GPU at {p['nodes']} node(s): model state {m['state_gib']:.1f} GiB + activations "
        f"{m['activations_gib'] or 0:.1f} GiB + {m.get('headroom_gib', 0):g} GiB kept free, of {m['capacity_gib']} GiB"
    )
    if s:
        line += (
            f"; step = compute (with the gradient buffer) + optimizer + the exposed part of "
            f"{s['intra_bytes'] / 1e9:.1f} GB sent within the node and {s['inter_bytes'] / 1e9:.1f} GB across nodes"
        )
    return line


def checkpoint_line(cfg: Config, ck: dict) -> str:
    """A checkpoint's size, the disk kept checkpoints take, what a save holds the loop and a resume takes."""
    line = f"checkpoints: {ck['gb']:.1f} GB each; keep {cfg.checkpoint.keep} + 1 being written = {ck['disk_gb']:.0f} GB of disk"
    if ck["every_steps"] and ck.get("stall_s") is not None:
        line += f"; a save every {ck['every_steps']} steps holds the loop {ck['stall_s']:.2f} s"
    if "resume_s" in ck:
        line += f"; a resume reads it in {ck['resume_s']:.0f} s"
    if "last_save_s" in ck:
        line += f"; a save at Slurm's warning signal writes for {ck['last_save_s']:.0f} s"
    return line


def warmup_text(w: dict) -> str:
    """The warm-up measured, or its steps and what else it takes."""
    if "steps" not in w:
        return f"{w['s']:.0f} s ({w['source']})"
    steps = f"({w['s']:.1f} s) " if w["s"] is not None else ""
    return f"{w['steps']} step(s) {steps}+ compile and initialisation: {w['source']}"


def print_sources(config: str, cfg: Config, figs: Figures, shown: list[dict]) -> None:
    """Where each figure came from, and what is missing (for a kind with nothing measured, how to measure it)."""
    print("\nsources:")
    for name, text in {k: v for p in shown for k, v in p["sources"].items()}.items():
        print(f"  {name:20s} {text}")
    missing = list(dict.fromkeys(x for p in shown for x in p["missing"]))
    if not figs.measured:
        print(f"missing: {how_to_measure(config, cfg, figs.kind)}")
    elif missing:
        print("missing (times that need them are lower bounds, marked >=):")
        for text in missing:
            print(f"  {text}")


def how_to_measure(config: str, cfg: Config, kind: str) -> str:
    """What a kind with nothing measured lacks, and the bench commands that measure it on one node."""
    rows = f"{kind}.jsonl"
    return (
        f"nothing is measured on {kind} yet, so no step, time-to-train or checkpoint time: on one {kind} node run "
        f"`python -m flux_train.bench --rows ours --json {rows}` and `torchrun --standalone "
        f"--nproc_per_node={cfg.slurm.gpus_per_node} -m flux_train.bench --mode step --config {config} --rows ours "
        f"--profile --json {rows}`, then plan with --measured {rows} (or add its rows to {FIGURES_FILE.name})"
    )


def plot(plans: list[dict], path: str, title: str) -> None:
    from matplotlib.figure import Figure

    done = [p for p in plans if "time_to_train" in p]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    nodes = [p["nodes"] for p in done]
    t = [p["time_to_train"] for p in done]
    left.plot(nodes, [x["mean_min"] for x in t], marker="o", label="RCP mean")
    bounds = [(p["nodes"], p["time_to_train"]["mean_min"]) for p in done if p["lower_bound"]]
    if bounds:  # a figure was missing: these times are lower bounds
        left.plot(*zip(*bounds), "o", markerfacecolor="white", color="C0", label="lower bound (a figure missing)")
    left.fill_between(nodes, [x["low_min"] for x in t], [x["high_min"] for x in t], alpha=0.2, label="RCP range")
    left.set(xlabel="nodes", ylabel="time-to-train (minutes)", title=title)
    right.plot(nodes, [p["samples_s_per_gpu"] for p in done], marker="o", label="training step")
    right.plot(nodes, [x["end_to_end_samples_s_per_gpu"] for x in t], marker="o", label="with evals and checkpoints")
    right.set(xlabel="nodes", ylabel="samples/s per GPU", ylim=(0, None))
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    write_output(Path(path), "--png", lambda p: fig.savefig(p, dpi=110, format="png"))
