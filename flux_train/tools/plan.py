"""`python -m flux_train.plan`: what a run will take before it is spent: memory per GPU and whether it fits,
step time, samples/s, time-to-train to the MLPerf target and checkpoint disk, for one or more node counts.

    python -m flux_train.plan --config configs/systems/H200_01x08.yaml [--nodes 1 2 8 | --nodes 1-8]
        [--set section.key=value] [--gpu H200] [--measured rows.jsonl] [--intra-gbps X] [--inter-gbps X]
        [--rate SAMPLES_S_PER_GPU] [--check] [--json] [--png FILE]

Every number comes from an input printed beside it; a missing input is named, and the times it would enter are
lower bounds. The planner's parts: its inputs (flux_train/tools/plan_figures.py), the model of a run
(flux_train/tools/plan_model.py), what it prints and draws (flux_train/tools/plan_output.py); this module is the
command, and names what submit and the tests take from the planner.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flux_train import hardware
from flux_train.cli import plan_parser
from flux_train.config import CONFIG_DIR, Config, load_config
from flux_train.errors import output_file, reports_user_errors
from flux_train.tools.plan_figures import Figures, PlanError, rcp_points
from flux_train.tools.plan_model import Notes, check, memory, project, sized
from flux_train.tools.plan_output import plot, print_check, print_plan, submit_line

__all__ = ["Figures", "Notes", "PlanError", "main", "memory", "submit_line"]


@reports_user_errors
def main(argv=None) -> int:
    args = plan_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    png = args.png or str(Path(cfg.logging.out_dir) / "plan.png")  # beside the run's outputs, not where plan ran
    output_file(Path(png), "--png")
    if args.gpus_per_node:
        cfg.slurm.gpus_per_node = args.gpus_per_node
    kind = args.gpu or cfg.preflight.gpu_name
    figs = figures(kind, args)
    if args.check:
        results = check(cfg, figs)
        print(json.dumps(results, indent=1)) if args.json else print_check(results)
        return 0
    rcp = rcp_points(cfg.train.global_batch_size)
    plans = []
    for nodes in node_counts(args.nodes, cfg):
        c, why_not = sized(cfg, nodes)
        gpus = nodes * c.slurm.gpus_per_node
        plans.append({"nodes": nodes, "gpus": gpus, "error": why_not} if why_not else project(c, figs, rcp))
    plot(plans, png, f"{Path(args.config).stem} on {kind}, GBS {rcp['gbs']}")  # first: it can fail
    if args.json:
        print(json.dumps({"config": args.config, "gpu": kind, "rcp": rcp, "plans": plans}, indent=1))
    else:
        print_plan(args.config, cfg, figs, rcp, plans, png)
    return 0


def figures(kind: str, args) -> Figures:
    """The figures of the GPU kind --gpu or preflight.gpu_name gives, with the flags' rows and stated figures;
    refused, naming the table's kinds, where it names none of them."""
    table = Path(hardware.__file__).relative_to(CONFIG_DIR.parent)
    kinds = f"the kinds {table} holds: {', '.join(k.name for k in hardware.KINDS)}"
    if not kind:
        raise PlanError(f"name the GPU kind: --gpu KIND or preflight.gpu_name ({kinds})")
    stated = {"intra_node_busbw_gbps": args.intra_gbps, "inter_node_busbw_gbps": args.inter_gbps, "rate": args.rate}
    figs = Figures(kind, args.measured, stated)
    if not figs.known:  # not even its memory: every column would be empty
        given = f"--gpu {kind}" if args.gpu else f"preflight.gpu_name {kind}"
        raise PlanError(f"{given}: no such GPU kind; give one of {kinds} (or add the kind there)")
    return figs


def node_counts(groups: list[list[int]] | None, cfg: Config) -> list[int]:
    """The node counts --nodes gives (default slurm.nodes), in order; refused past one sample per GPU."""
    counts = sorted({n for group in groups or [[cfg.slurm.nodes]] for n in group})
    most = cfg.train.global_batch_size // cfg.slurm.gpus_per_node  # one sample per GPU
    if counts[-1] > most:  # what no run can use is not computed (a range of a million once took minutes)
        raise PlanError(
            f"--nodes {counts[-1]}: GBS {cfg.train.global_batch_size} gives {cfg.slurm.gpus_per_node} GPUs per node one "
            f"sample each at {most} nodes; give node counts up to {most}"
        )
    return counts


if __name__ == "__main__":
    sys.exit(main())
