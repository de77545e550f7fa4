"""The command lines: every command's flags, one parser function per command: the commands users type, then the
internal ones the batch script, the submitter and the agent run (the per-node agent, the pre-flight, the preemption
options). Nothing here imports torch or the module that owns a command, so the command modules (flux_train/train.py,
...) answer `--help`, a bad flag and a config that does not load at once (answer_early); the owner's main then
parses the same flags with the same parser. (`python -m dataprep`'s flags are dataprep/cli.py's: dataprep imports
nothing of flux_train.)"""

from __future__ import annotations

import argparse
import math
import typing
from pathlib import Path

from dataprep.cli import add_encoder_arguments, existing_path
from dataprep.format import IMAGE_SIZE
from flux_train.config import CONFIG_DIR, ContainerConfig, add_overrides, load_config
from flux_train.errors import Parser, UserError, positive_int, positive_number, report
from flux_train.precision_recipes import fp8_rows

# the rows each bench mode can measure (flux_train/tools/bench.py runs them)
BENCH_ROWS = {
    "fwdbwd": (
        "stock-eager",
        "stock",
        "ours",
        *fp8_rows("ours"),
        *fp8_rows("torchao"),
        "ours-no-graphs",
        "ours-no-compile",
        "ours-torch-rmsnorm",
    ),
    "step": ("stock", "ours"),
    "casts": fp8_rows("ours", per_row=False),  # the recipes our cast kernel serves
    "collectives": ("all-gather", "reduce-scatter"),
}
RUNTIMES = typing.get_args(typing.get_type_hints(ContainerConfig)["runtime"])


def answer_early(parser: Parser) -> None:
    """In a command module, before the module that owns the command loads torch and its compilers (seconds): --help,
    a bad flag or path, and a --config that does not load (an unknown key, a value of the wrong type or range) are
    answered as the owner's main would, in a fraction of a second."""
    args = parser.parse_args()
    if getattr(args, "config", None) is not None:
        try:
            load_config(args.config, getattr(args, "overrides", []))
        except UserError as exc:
            raise SystemExit(report(exc)) from None


def config_parser(prog: str, description: str, **config) -> Parser:
    """The parser of a command that reads a config: `--config` (its argparse options `config`), `--set` and
    `--help-config`, the command's own flags to follow."""
    p = Parser(prog=prog, description=description)
    p.add_argument("--config", **config)
    add_overrides(p)
    return p


def train_parser() -> Parser:
    p = config_parser(
        "python -m flux_train.train",
        "The training loop: `python -m flux_train.train --config configs/debug.yaml [--set section.key=value ...]`.",
        default="configs/debug.yaml",
        help="YAML config (default: configs/debug.yaml)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (defaults: merged, --set applied) as YAML and exit",
    )
    return p


def time_minutes(text: str) -> int:
    """Slurm's --time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> whole minutes, rounded up."""
    try:
        days, _, clock = text.rpartition("-")
        parts = [int(p) for p in clock.split(":")]
        if min(parts) < 0 or len(parts) > 3:
            raise ValueError
        if days:
            h, m, s = parts + [0] * (3 - len(parts))
        elif len(parts) == 3:
            h, m, s = parts
        else:
            h, m, s = 0, parts[0], parts[1] if len(parts) == 2 else 0
        seconds = int(days or 0) * 86400 + h * 3600 + m * 60 + s
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected minutes, H:MM:SS or D-HH:MM:SS, got {text!r}") from None
    if seconds < 60:
        raise argparse.ArgumentTypeError(f"must be at least 1 minute, got {text!r}")
    return math.ceil(seconds / 60)


def submit_parser() -> Parser:
    systems = ", ".join(sorted(p.stem for p in (CONFIG_DIR / "systems").glob("*.yaml")))
    p = config_parser(
        "python -m flux_train.submit",
        "`python -m flux_train.submit`: one command from a login node puts a multi-node training job on Slurm.",
        required=True,
        help=f"system config, e.g. configs/systems/<name>.yaml ({systems})",
    )
    p.add_argument("--nodes", type=positive_int, help="slurm.nodes")
    p.add_argument("--gpus-per-node", type=positive_int, help="slurm.gpus_per_node (workers per node)")
    p.add_argument("--partition", help="slurm.partition")
    p.add_argument("--account", help="slurm.account")
    p.add_argument("--qos", help="slurm.qos")
    p.add_argument("--time", type=time_minutes, help="slurm.time_min, as minutes or [D-]H:MM:SS")
    p.add_argument("--job-name", help="slurm.job_name")
    p.add_argument(
        "--exclude",
        metavar="HOSTS",
        help="slurm.exclude: nodes Slurm must not use, e.g. a node the "
        "pre-flight named (Slurm's hostlist syntax: n[3,7])",
    )
    p.add_argument(
        "--runs",
        type=positive_int,
        default=1,
        help="a campaign of N runs (a job array): seeds train.seed+i, folders <logging.out_dir>/run_<i>",
    )
    p.add_argument(
        "--skip-preflight",
        action="store_true",
        help="start training without the per-node checks and the bandwidth probe (preflight.enabled)",
    )
    p.add_argument("--runtime", choices=RUNTIMES, help="container.runtime")
    p.add_argument("--container-image", help="container.image")
    p.add_argument(
        "--mounts",
        type=lambda text: [m for m in text.split(",") if m],
        help="container.mounts, comma-separated SRC[:DST[:ro]] (replaces the config's list)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the sbatch script and per-node command only")
    mode.add_argument("--local", action="store_true", help="run the per-node agent on this machine, no Slurm")
    return p


def bench_parser() -> Parser:
    p = config_parser(
        "python -m flux_train.bench",
        "Throughput benchmark against stock diffusers, measured side by side on the same GPUs.",
        default="configs/bench.yaml",
        help="the run config whose model and perf settings are measured (default: configs/bench.yaml)",
    )
    p.add_argument(
        "--mode",
        choices=tuple(BENCH_ROWS),
        default="fwdbwd",
        help="fwdbwd: one GPU, forward+backward only; step: the whole training step under torchrun; casts: the "
        "FP8 cast kernel alone at every operand shape of a step, against its byte floor; collectives: the bus "
        "bandwidth of the layouts' all-gathers and reduce-scatters under torchrun, at the sizes they move",
    )
    p.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated rows; fwdbwd: {', '.join(BENCH_ROWS['fwdbwd'])} (default stock,ours); "
        f"step: {', '.join(BENCH_ROWS['step'])} (default stock,ours); casts: {', '.join(BENCH_ROWS['casts'])}; "
        f"collectives: {', '.join(BENCH_ROWS['collectives'])}",
    )
    p.add_argument(
        "--batch", type=positive_int, default=16, help="fwdbwd batch (step mode uses train.micro_batch_size)"
    )
    p.add_argument("--text-len", type=positive_int, default=256, help="T5 tokens per sample (default 256)")
    p.add_argument("--latent", type=positive_int, default=32, help="latent side (32 = 256x256 images)")
    p.add_argument(
        "--steps",
        type=positive_int,
        default=10,
        help="timed steps per row, run back to back (the mean step is reported)",
    )
    p.add_argument(
        "--accum",
        type=positive_int,
        default=1,
        help="step mode: micro-batches per optimizer step (stock: FSDP2's default, every micro-batch reduce-scattered)",
    )
    p.add_argument("--profile", action="store_true", help="add the GPU time per kernel kind to each row")
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="step mode: also time a checkpoint save (blocking and async) and load of the trainer's state "
        "in a new folder in DIR (that folder removed after)",
    )
    p.add_argument(
        "--same-process",
        action="store_true",
        help="fwdbwd/casts: measure every row in this process, each after the other's memory and compile state "
        "(by default each row runs in a process of its own, so that one that crashes leaves the others)",
    )
    p.add_argument("--json", default=None, help="append each row as a JSON line to this file")
    p.add_argument("--table", default=None, metavar="FILE", help="print the table of the rows in FILE and exit")
    p.add_argument("--out-dir", default="runs/bench", help="the trainer's run folder in step mode")
    return p


def node_counts(text: str) -> range:
    """argparse type: N or a range A-B."""
    first, _, last = text.partition("-")
    low, high = positive_int(first), positive_int(last or first)
    if high < low:  # argparse's own words for a ValueError: "invalid node_counts value: '8-1'"
        raise argparse.ArgumentTypeError(
            f"{text!r}: a range goes from the smaller node count to the larger, e.g. {high}-{low}"
        )
    return range(low, high + 1)


def plan_parser() -> Parser:
    p = config_parser(
        "python -m flux_train.plan",
        "What a run will take before it is spent: memory per GPU and whether it fits, step time, time-to-train from "
        "the MLPerf reference convergence points, and checkpoint disk, from measured figures.",
        required=True,
        help="the run's config, e.g. configs/systems/H200_01x08.yaml",
    )
    p.add_argument(
        "--nodes", nargs="+", type=node_counts, help="node counts: N, several, or a range A-B (default slurm.nodes)"
    )
    p.add_argument("--gpus-per-node", type=positive_int, help="slurm.gpus_per_node")
    p.add_argument("--gpu", help="the GPU kind, a name of flux_train/hardware.py's table (default preflight.gpu_name)")
    p.add_argument(
        "--measured",
        metavar="ROWS",
        help="bench rows (python -m flux_train.bench --json) of this GPU kind, used ahead of the table's",
    )
    p.add_argument(
        "--intra-gbps",
        type=positive_number,
        help="stated all-reduce bus bandwidth within a node, GB/s (the pre-flight probe on one node)",
    )
    p.add_argument(
        "--inter-gbps",
        type=positive_number,
        help="stated all-reduce bus bandwidth across nodes, GB/s (the pre-flight probe on several)",
    )
    p.add_argument(
        "--rate",
        type=positive_number,
        help="a stated training rate in samples/s per GPU (e.g. a published result) instead of the projected step",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="project every measured step row of the GPU kind from the other rows, against its measurement",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--png",
        help="the plot of time-to-train and samples/s per GPU against nodes (default <logging.out_dir>/plan.png)",
    )
    return p


def results_parser() -> Parser:
    p = Parser(
        prog="python -m flux_train.results",
        description="Results of a set of runs: score, samples to converge, compliance and RCP verdicts, a val-loss "
        "plot.",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="a run's out_dir (with mllog.log), a folder of result_*.txt, or a log file",
    )
    p.add_argument("--out", type=Path, help="where val_loss.png goes (default: the one folder given, else .)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def checkpoint_parser() -> Parser:
    p = Parser(prog="python -m flux_train.checkpoint", description="Tools for a run's checkpoints: export one's model.")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser(
        "export",
        help="write a checkpoint's model as a diffusers folder or a black-forest-labs .safetensors file",
        description="Write a checkpoint's model as a diffusers FluxTransformer2DModel folder (config.json + "
        "safetensors) or as one .safetensors file in the layout black-forest-labs released FLUX.1 in (ComfyUI, "
        "Forge, diffusers' from_single_file), without a GPU or a process group. The export is loaded back as "
        "diffusers loads it and one forward pass compared with the checkpoint's model before the command succeeds.",
    )
    ex.add_argument("--config", required=True, help="the run's config (for the model flavor)")
    ex.add_argument("--checkpoint", required=True, help="a step_XXXXXXXX folder, or a checkpoint dir (latest)")
    ex.add_argument(
        "--out", required=True, help="the folder (--format diffusers) or .safetensors file (--format bfl) to write"
    )
    ex.add_argument(
        "--format",
        choices=["diffusers", "bfl"],
        default="diffusers",
        help="diffusers: a FluxTransformer2DModel folder (from_pretrained; the default); bfl: one .safetensors file "
        "like flux1-schnell.safetensors (ComfyUI, Forge, FluxTransformer2DModel.from_single_file)",
    )
    add_overrides(ex)
    return p


def sample_parser() -> Parser:
    p = Parser(
        prog="python -m flux_train.sample",
        description="Images from a trained model's checkpoint or exported weights, through diffusers' FluxPipeline "
        "with the Flux.1-schnell sampler, from local weights only.",
    )
    p.add_argument(
        "--checkpoint",
        type=existing_path,
        required=True,
        help="a step_XXXXXXXX checkpoint folder, or a folder of them (the latest is used)",
    )
    p.add_argument(
        "--config", type=Path, help="the run's config.yaml (default: the one of the run the checkpoint belongs to)"
    )
    p.add_argument(
        "--exported",
        type=Path,
        metavar="FOLDER",
        help="also save the transformer there as a diffusers folder (as `checkpoint export` writes it)",
    )
    add_encoder_arguments(p, vae=True)
    p.add_argument("--prompts", type=existing_path, required=True, help="text file, one prompt per line")
    p.add_argument("--out", type=Path, required=True, help="the PNG grid to write, one image per prompt")
    p.add_argument(
        "--size",
        type=int,
        default=IMAGE_SIZE,
        help=f"image side in pixels, a multiple of 16 (default {IMAGE_SIZE}, what the model trains on)",
    )
    p.add_argument("--columns", type=int, default=0, help="images per grid row (default: about square)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    return p


def reduce_precision_parser() -> Parser:
    p = Parser(
        prog="python -m flux_train.reduce_precision",
        description="How much a bf16 gradient sum loses against the exact sum, on flux-schnell-wide gradients.",
    )
    p.add_argument("--ranks", type=int, default=64, help="distinct micro-batches (rank gradients) to compute")
    p.add_argument("--batch", type=int, default=1, help="samples per rank's micro-batch")
    p.add_argument("--keep", type=int, default=1 << 18, help="elements measured per tensor (at most)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's weights and the micro-batches")
    return p


# ---------------------------------------------------------------------------------------------
# the internal commands: run by slurm/flux.sbatch, the submitter and the agent rather than typed


def launch_parser() -> Parser:
    p = config_parser(
        "python -m flux_train.cluster.launch",
        "Per-node agent: one per node (one Slurm task per node), inside the container when there is one.",
        required=True,
        help="YAML config (a system file from configs/systems/)",
    )
    p.add_argument("--local", action="store_true", help="one node on this machine, even inside a Slurm job")
    return p


def preflight_parser() -> Parser:
    return config_parser(
        "python -m flux_train.training.preflight",
        "Pre-flight: find a bad node before the clock starts (`preflight.enabled`, before MLLOG init_start).",
        default="configs/debug.yaml",
        help="the run's config (what to check)",
    )


def preemption_parser() -> Parser:
    return config_parser(
        "python -m flux_train.training.preemption",
        "Print the sbatch options of the preemption contract for a config (for `sbatch $(...) slurm/flux.sbatch "
        "--config CONFIG`).",
        required=True,
        help="the run's config (its slurm.signal_delay_s)",
    )
