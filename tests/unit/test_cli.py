"""The command lines explain themselves, called in this process: `--help` of every command and subcommand gives
every flag a line of help; `python -m flux_train.train --print-config` prints the resolved config; each kind of bad
input is one line and exit 2. In fresh interpreters (before torch is imported, a missing extra):
tests/runs/test_cli.py."""

import argparse
import os
from pathlib import Path

import pytest
import torch
import yaml
from tqdm import tqdm

from dataprep import progress
from dataprep.__main__ import main as dataprep
from flux_train.cluster import launch, submit
from flux_train.outputs import results
from flux_train.tools import bench, export, plan, reduce_precision, sample
from flux_train.training import preemption, preflight, train

ROOT = Path(__file__).resolve().parents[2]

COMMANDS = {
    "python -m dataprep": dataprep,
    "python -m flux_train.train": train.main,
    "python -m flux_train.submit": submit.main,
    "python -m flux_train.bench": bench.main,
    "python -m flux_train.plan": plan.main,
    "python -m flux_train.results": results.main,
    "python -m flux_train.checkpoint": export.main,
    "python -m flux_train.sample": sample.main,
    "python -m flux_train.reduce_precision": reduce_precision.main,
}


def printed_help(main, argv, monkeypatch, capsys) -> argparse.ArgumentParser:
    """Runs `main(argv + ["--help"])` for real and returns the parser whose help it printed."""
    shown = []
    real = argparse.ArgumentParser.print_help

    def spy(self, file=None):
        shown.append(self)
        real(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", spy)
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
    return shown[-1]


def undocumented(main, argv, monkeypatch, capsys) -> list[str]:
    """Flags, positionals and subcommands without help, in this (sub)command and every subcommand below it."""
    parser = printed_help(main, argv, monkeypatch, capsys)
    # what the command does, in whole sentences (a docstring's first line was cut mid-sentence)
    missing = [] if (parser.description or "").strip().endswith(".") else [" ".join(argv) + " (description)"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            described = {a.dest for a in action._choices_actions if a.help and a.help.strip()}
            for name in action.choices:
                missing += [] if name in described else [" ".join([*argv, name]) + " (subcommand)"]
                missing += undocumented(main, [*argv, name], monkeypatch, capsys)
        elif not (action.help and action.help.strip()) or action.help == argparse.SUPPRESS:
            missing.append(" ".join([*argv, action.option_strings[0] if action.option_strings else action.dest]))
    return missing


# the internal commands, whose flags flux_train/cli.py holds too: run by slurm/flux.sbatch, the submitter and the agent
INTERNAL = {
    "python -m flux_train.cluster.launch": launch.main,
    "python -m flux_train.training.preflight": preflight.main,
    "python -m flux_train.training.preemption": preemption.main,
}


@pytest.mark.parametrize("command", sorted({**COMMANDS, **INTERNAL}))
def test_every_flag_of_every_subcommand_has_help(command, monkeypatch, capsys):
    assert undocumented({**COMMANDS, **INTERNAL}[command], [], monkeypatch, capsys) == []


def test_the_help_walk_finds_a_flag_without_help(monkeypatch, capsys):
    def tool(argv):
        p = argparse.ArgumentParser(prog="tool", description="A tool.")
        sub = p.add_subparsers(dest="cmd")
        run = sub.add_parser("run", help="runs", description="Runs, cut mid-sentence by a docstring's")
        run.add_argument("--fast", help="faster")
        run.add_argument("--quiet", action="store_true")
        sub.add_parser("stop", description="Stops.")
        p.parse_args(argv)

    assert undocumented(tool, [], monkeypatch, capsys) == ["run (description)", "run --quiet", "stop (subcommand)"]


def test_print_config_shows_defaults_and_overrides_resolved(capsys):
    assert (
        train.main(
            ["--config", "configs/debug.yaml", "--set", "train.lr=0.5", "--set", "eval.batch_size=4", "--print-config"]
        )
        == 0
    )
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["lr"] == 0.5 and printed["eval"]["batch_size"] == 4  # --set
    assert printed["train"]["global_batch_size"] == 8  # the file itself
    assert printed["model"]["flavor"] == "flux-debug" and printed["model"]["num_layers"] == 2  # its defaults:
    assert printed["logging"]["mllog_stdout"] is False  # and the built-in defaults


# ---------------------------------------------------------------------------------------------------
# bad input: one line on stderr naming it and the fix, exit 2, no traceback; nothing written, no MLLOG run started

TRAIN, SUBMIT, BENCH = "python -m flux_train.train", "python -m flux_train.submit", "python -m flux_train.bench"
PLAN = "python -m flux_train.plan"
RESULTS, CHECKPOINT, DATAPREP = "python -m flux_train.results", "python -m flux_train.checkpoint", "python -m dataprep"
DEBUG = ["--config", "{root}/configs/debug.yaml", "--set", "logging.out_dir={tmp}/out"]
SYSTEM = ["--config", "{root}/configs/systems/cpu_02x02.yaml"]
EXPORT = ["export", "--config", "{root}/configs/debug.yaml", "--out", "{tmp}/exported"]
UNREACHABLE = "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"

# (id, command, argv, what the line must contain); {root}: the repository, {tmp}: the test's folder, holding empty/
# (an empty folder), notes.txt (a text file that is no config, table or log) and, where a row names it, arrow/
# (MLCommons Arrow input of shape 4,2,2)
BAD_INPUTS = [
    ("train-no-such-config", TRAIN, [*DEBUG, "--config", "{tmp}/missing.yaml"], "{tmp}/missing.yaml; pass --config"),
    ("train-config-not-a-mapping", TRAIN, [*DEBUG, "--config", "{tmp}/notes.txt"], "{tmp}/notes.txt: top level"),
    ("train-unknown-flag", TRAIN, [*DEBUG, "--bogus"], "unrecognized arguments: --bogus"),
    (
        "train-set-without-value",
        TRAIN,
        [*DEBUG, "--set", "train.lr"],
        "argument --set: 'train.lr' is not SECTION.KEY=VALUE: give the key and its value as one word, e.g. --set "
        "train.lr=VALUE",
    ),
    (
        "train-set-value-after-a-space",
        TRAIN,
        [*DEBUG, "--set", "train.lr", "0.5"],
        "'train.lr' is not SECTION.KEY=VALUE",
    ),
    (
        "train-set-quote-left-open",
        TRAIN,
        [*DEBUG, "--set", 'logging.out_dir="/x y'],
        """--set 'logging.out_dir="/x y': the value starts with " but is not a quoted string (a quote left open?)""",
    ),
    (
        "train-set-bracket-left-open",
        TRAIN,
        [*DEBUG, "--set", "logging.out_dir=[my run"],
        "--set 'logging.out_dir=[my run': the value starts with [ but is not a YAML list (a bracket left open?); "
        """close it, or quote the whole value to mean the text: --set 'logging.out_dir="[my run"'""",
    ),
    (
        "train-set-brace-left-open",
        TRAIN,
        [*DEBUG, "--set", "logging.out_dir={{my run"],
        "--set 'logging.out_dir={{my run': the value starts with {{ but is not a YAML mapping (a bracket left open?)",
    ),
    ("train-unknown-section", TRAIN, [*DEBUG, "--set", "nosuchsection.x=1"], "unknown key 'nosuchsection'"),
    ("train-unknown-key", TRAIN, [*DEBUG, "--set", "train.nosuchkey=1"], "unknown key 'train.nosuchkey'"),
    ("train-not-a-number", TRAIN, [*DEBUG, "--set", "train.lr=abc"], "train.lr: expected a number"),
    ("train-not-a-choice", TRAIN, [*DEBUG, "--set", "perf.compile=stack"], "perf.compile: 'stack' is not accepted"),
    ("train-zero-batch", TRAIN, [*DEBUG, "--set", "train.global_batch_size=0"], "train.global_batch_size: must be > 0"),
    (
        "train-val-larger-than-train",
        TRAIN,
        [*DEBUG, "--set", "data.source=synthetic", "--set", "data.synthetic_val_samples=100"],
        "data.synthetic_val_samples 100 >",
    ),
    (
        "train-graphs-with-fsdp",
        TRAIN,
        [*DEBUG, "--set", "perf.cuda_graphs=true", "--set", "parallel.strategy=fsdp"],
        "set parallel.strategy=ddp",
    ),
    (
        "train-graphs-skip-the-nan-hook",
        TRAIN,
        [
            *DEBUG,
            "--set",
            "perf.cuda_graphs=true",
            "--set",
            "parallel.strategy=ddp",
            "--set",
            "train.inject_nan_at_step=3",
        ],
        "train.inject_nan_at_step: a captured step replays without the hook",
    ),
    ("train-mesh-does-not-fit", TRAIN, [*DEBUG, "--set", "parallel.dp_shard=3"], "parallel.dp_shard=3 does not divide"),
    (
        "train-resume-from-nothing",
        TRAIN,
        [*DEBUG, "--set", "checkpoint.resume={tmp}/empty"],
        "checkpoint.resume={tmp}/empty: cannot resume from it: progress.pt is unreadable",
    ),
    (
        "train-no-dataset",
        TRAIN,
        [*DEBUG, "--set", "data.source=energon", "--set", "data.path={tmp}/nowhere"],
        "data.path {tmp}/nowhere does not exist",
    ),
    ("submit-no-config", SUBMIT, ["--nodes", "2"], "the following arguments are required: --config"),
    ("submit-unknown-flag", SUBMIT, [*SYSTEM, "--bogus"], "unrecognized arguments: --bogus"),
    ("submit-time-under-a-minute", SUBMIT, [*SYSTEM, "--time", "0:30"], "argument --time: must be at least 1 minute"),
    ("submit-no-runs", SUBMIT, [*SYSTEM, "--runs", "0"], "argument --runs: must be >= 1"),
    ("submit-dry-run-and-local", SUBMIT, [*SYSTEM, "--dry-run", "--local"], "argument --local: not allowed with"),
    ("submit-runtime-without-image", SUBMIT, [*SYSTEM, "--runtime", "podman"], "podman needs an image"),
    ("submit-mount-without-source", SUBMIT, [*SYSTEM, "--mounts", ":/data"], "container mount ':/data'"),
    (
        "submit-nodes-do-not-split-the-batch",
        SUBMIT,
        [*SYSTEM, "--nodes", "3"],
        "the node counts that split it at micro-batch 2 with 2 GPUs per node: 1, 2 (--nodes, slurm.nodes)",
    ),
    ("submit-mesh-does-not-fit", SUBMIT, [*SYSTEM, "--set", "parallel.dp_shard=3"], "parallel.dp_shard=3 does not"),
    (
        "submit-no-slurm-controller",
        SUBMIT,
        SYSTEM,
        "sbatch cannot reach the Slurm controller (Batch job submission failed: Unable to contact slurm controller",
    ),
    ("bench-no-such-config", BENCH, ["--config", "{tmp}/missing.yaml"], "{tmp}/missing.yaml"),
    ("bench-no-such-table", BENCH, ["--table", "{tmp}/missing.jsonl"], "--table {tmp}/missing.jsonl: No such file"),
    ("bench-table-not-rows", BENCH, ["--table", "{tmp}/notes.txt"], "--table {tmp}/notes.txt: line 1 is not a bench"),
    (
        "bench-unknown-row",
        BENCH,
        ["--config", "{root}/configs/bench.yaml", "--rows", "fastest"],
        "--rows: unknown row 'fastest'",
    ),
    ("bench-zero-steps", BENCH, ["--steps", "0"], "argument --steps: must be >= 1"),
    (
        "plan-gpu-not-in-the-table",
        PLAN,
        ["--config", "{root}/configs/systems/H200_01x08.yaml", "--gpu", "A100"],
        "plan: --gpu A100: no such GPU kind; give one of the kinds flux_train/hardware.py holds: H100, H200, B200, "
        "MI300X, MI325X, MI355X",
    ),
    (
        "plan-node-range-backwards",
        PLAN,
        ["--config", "{root}/configs/systems/H200_01x08.yaml", "--nodes", "8-1"],
        "argument --nodes: '8-1': a range goes from the smaller node count to the larger, e.g. 1-8",
    ),
    ("results-no-such-run", RESULTS, ["{tmp}/nowhere"], "{tmp}/nowhere does not exist"),
    ("results-no-log", RESULTS, ["{tmp}/empty"], "no readable MLLOG in {tmp}/empty"),
    ("results-out-is-a-file", RESULTS, ["{tmp}/empty", "--out", "{tmp}/notes.txt"], "--out {tmp}/notes.txt is a file"),
    ("results-no-run-given", RESULTS, [], "the following arguments are required: RUN_DIR"),
    (
        "checkpoint-not-a-checkpoint",
        CHECKPOINT,
        [*EXPORT, "--checkpoint", "{tmp}/empty"],
        "--checkpoint {tmp}/empty: no complete checkpoint there",
    ),
    (
        "checkpoint-no-such-config",
        CHECKPOINT,
        [*EXPORT, "--checkpoint", "{tmp}/empty", "--config", "{tmp}/missing.yaml"],
        "{tmp}/missing.yaml",
    ),
    ("checkpoint-no-checkpoint-given", CHECKPOINT, EXPORT, "the following arguments are required: --checkpoint"),
    (
        "checkpoint-bfl-of-another-width",
        CHECKPOINT,
        [*EXPORT, "--format", "bfl", "--checkpoint", "{tmp}/empty"],
        "--format bfl: its readers (ComfyUI, diffusers' from_single_file) assume FLUX.1's hidden size 3072; model "
        "flavor 'flux-debug' has 64: export it as a diffusers folder (--format diffusers)",
    ),
    (
        "checkpoint-bfl-not-a-safetensors-file",
        CHECKPOINT,
        [*EXPORT, "--format", "bfl", "--checkpoint", "{tmp}/empty", "--set", "model.num_attention_heads=192"],
        "--out {tmp}/exported: --format bfl writes one .safetensors file; give a path ending in .safetensors",
    ),
    ("checkpoint-unknown-command", CHECKPOINT, ["import"], "argument command: invalid choice: 'import'"),
    ("dataprep-verify-no-such-root", DATAPREP, ["verify", "{tmp}/nowhere"], "{tmp}/nowhere: no such folder"),
    (
        "dataprep-convert-no-such-input",
        DATAPREP,
        ["convert", "--train", "{tmp}/nowhere", "--out", "{tmp}/ds"],
        "--train {tmp}/nowhere: not a Hugging Face save_to_disk dataset",
    ),
    ("dataprep-convert-nothing", DATAPREP, ["convert", "--out", "{tmp}/ds"], "nothing to convert: give --train"),
    (
        "dataprep-bad-shape",
        DATAPREP,
        ["convert", "--train", "{tmp}/nowhere", "--out", "{tmp}/ds", "--shape", "4,2"],
        "argument --shape: shape '4,2': expected three positive integers",
    ),
    (
        "dataprep-every-sample-skipped",
        DATAPREP,
        [
            "convert",
            "--train",
            "{tmp}/arrow/train",
            "--out",
            "{tmp}/ds",
            "--shape",
            "8,2,2",
            "--skip-bad",
            "--workers",
            "1",
        ],
        "{tmp}/ds/train: nothing converted: all 3 input samples were skipped as bad (the first: row 0 'train-0': t5: "
        "shape [4, 4096], expected [8, 4096]; all listed in {tmp}/ds/.dataprep/train/skipped.tsv)",
    ),
    ("dataprep-unknown-command", DATAPREP, ["shuffle"], "argument command: invalid choice: 'shuffle'"),
]

# inputs that used to be refused only after init_start, or in a traceback (issue 32); the GPU rows need a host without
# one (with a GPU they are good inputs and would train)
LAUNCH = "python -m flux_train.cluster.launch"
COMMANDS[LAUNCH] = launch.main
BAD_INPUTS += [
    (
        "train-dims-unlike-the-dataset",
        TRAIN,
        [*DEBUG, "--set", "model.pooled_projection_dim=512"],
        "the dataset's samples have clip [768], the model takes clip of width model.pooled_projection_dim 512",
    ),
    (
        "launch-local-dir-is-a-file",
        LAUNCH,
        [*SYSTEM, "--local", "--set", "env.local_dir={tmp}/notes.txt"],
        "env.local_dir: cannot create {tmp}/notes.txt/",
    ),
]
if not torch.cuda.is_available():
    BAD_INPUTS += [
        ("train-cuda-without-a-gpu", TRAIN, [*DEBUG, "--set", "train.device=cuda"], "train.device=cuda but no GPU"),
        ("train-triton-rmsnorm-without-a-gpu", TRAIN, [*DEBUG, "--set", "perf.rmsnorm=triton"], "perf.rmsnorm=triton"),
    ]


def bad_input_world(tmp: Path, argv: list[str], monkeypatch) -> Path:
    """The files the rows name, and Slurm commands that cannot reach a controller (so no row can queue a job);
    returns the empty folder the command runs in."""
    (tmp / "empty").mkdir()
    (tmp / "notes.txt").write_text("not a config, a table or a log\n")
    if any("{tmp}/arrow" in arg for arg in argv):
        from dataprep.fixture import FixtureSpec, write_arrow

        write_arrow(tmp / "arrow", FixtureSpec(train=3, val=0, text_len=4, height=2, width=2))
    (tmp / "bin").mkdir()
    for name in ("sbatch", "srun"):
        (tmp / "bin" / name).write_text(f"#!/bin/sh\necho '{UNREACHABLE}' >&2\nexit 1\n")
        (tmp / "bin" / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' Triton-on-CPU, which no user has
    # a progress bar is not a message (convert draws one before it can know that every sample is bad)
    monkeypatch.setattr(progress, "bar", lambda *args, **kwargs: tqdm(disable=True))
    (tmp / "cwd").mkdir()
    monkeypatch.chdir(tmp / "cwd")
    return tmp / "cwd"


def run_in_world(command: str, argv: list[str], tmp: Path, monkeypatch, capsys) -> tuple[int, str, Path, set]:
    """The command, in-process in bad_input_world: (exit code, stderr, the folder it ran in, the paths there were
    before it ran)."""
    cwd = bad_input_world(tmp, argv, monkeypatch)
    capsys.readouterr()  # what making the inputs printed
    before = set(tmp.rglob("*"))
    try:
        code = COMMANDS[command]([arg.format(root=ROOT, tmp=tmp) for arg in argv])
    except SystemExit as exc:  # argparse's exit
        code = exc.code
    return code, capsys.readouterr().err.strip(), cwd, before


@pytest.mark.parametrize("command,argv,expected", [row[1:] for row in BAD_INPUTS], ids=[row[0] for row in BAD_INPUTS])
def test_a_bad_input_is_one_line_naming_it_and_exit_2(command, argv, expected, tmp_path, monkeypatch, capsys):
    code, err, cwd, before = run_in_world(command, argv, tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert expected.format(root=ROOT, tmp=tmp_path) in err
    assert [p for p in cwd.rglob("*") if p.is_file()] == []  # no plot, no runs/submitit/ pickles, ...
    log = tmp_path / "out" / "mllog.log"
    assert not (log.is_file() and "init_start" in log.read_text())  # the trainer started no MLLOG run
    # no lock file left, and no folder made and left empty (runs/x/.lock, runs/x/checkpoints/.lock, a convert's .lock)
    made = set(tmp_path.rglob("*")) - before
    assert [p for p in made if p.name == ".lock" or (p.is_dir() and not any(p.iterdir()))] == []


# an output path that cannot be written (/proc/nope: no file can be made there, for any user) or where a folder stands
# for a file (a file for a folder): one line, exit 2 (the path is the bad input) or 74 (the write failed), nothing
# written; plan's plot used to end in a traceback, or be written beside a folder as <folder>.png (issue 47). The
# commands that need a trained run or a log (checkpoint export, sample, results) are tried in test_sample.py and
# test_results.py; bench's --json needs a GPU.
NOPE = "/proc/nope"
ENCODERS = ["--vae", "{tmp}/empty", "--t5", "{tmp}/empty", "--clip", "{tmp}/empty"]  # folders there are (empty)
ODD_OUTPUTS = [
    ("plan-png-unwritable", PLAN, ["--config", "{root}/configs/systems/H200_01x08.yaml", "--png", NOPE], 74),
    ("plan-png-a-folder", PLAN, ["--config", "{root}/configs/systems/H200_01x08.yaml", "--png", "{tmp}/empty"], 2),
    ("train-out-dir-unwritable", TRAIN, [*DEBUG, "--set", f"logging.out_dir={NOPE}"], 2),
    ("train-out-dir-a-file", TRAIN, [*DEBUG, "--set", "logging.out_dir={tmp}/notes.txt"], 2),
    ("train-checkpoint-dir-unwritable", TRAIN, [*DEBUG, "--set", f"checkpoint.dir={NOPE}"], 2),
    ("submit-local-folder-unwritable", SUBMIT, [*SYSTEM, "--local", "--set", f"slurm.folder={NOPE}/%j"], 2),
    ("submit-folder-a-file", SUBMIT, [*SYSTEM, "--set", "slurm.folder={tmp}/notes.txt"], 2),
    ("dataprep-convert-out-unwritable", DATAPREP, ["convert", "--train", "{tmp}/nowhere", "--out", NOPE], 2),
    ("dataprep-convert-out-a-file", DATAPREP, ["convert", "--train", "{tmp}/nowhere", "--out", "{tmp}/notes.txt"], 2),
    ("dataprep-fixture-out-unwritable", DATAPREP, ["fixture", "--out", NOPE], 2),
    ("dataprep-fixture-out-a-file", DATAPREP, ["fixture", "--out", "{tmp}/notes.txt"], 2),
    ("dataprep-prepare-unwritable", DATAPREP, ["prepare", NOPE], 2),
    (
        "dataprep-encode-out-unwritable",
        DATAPREP,
        ["encode", "--split", "train", "--wds", "{tmp}/x.tar", "--out", NOPE, *ENCODERS],
        2,
    ),
    (
        "dataprep-empty-encodings-out-a-file",
        DATAPREP,
        ["empty-encodings", "--out", "{tmp}/notes.txt", *ENCODERS[2:]],
        2,
    ),
]


@pytest.mark.parametrize("command,argv,code", [row[1:] for row in ODD_OUTPUTS], ids=[row[0] for row in ODD_OUTPUTS])
def test_an_odd_output_path_is_one_line_not_a_traceback(command, argv, code, tmp_path, monkeypatch, capsys):
    got, err, cwd, _ = run_in_world(command, argv, tmp_path, monkeypatch, capsys)
    assert got == code and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert NOPE in err or str(tmp_path) in err, err  # the path is named
    assert [p for p in cwd.rglob("*") if p.is_file()] == [] and sorted(os.listdir(tmp_path / "empty")) == []
    assert (tmp_path / "notes.txt").read_text() == "not a config, a table or a log\n"


# ---------------------------------------------------------------------------------------------------
# the entry points as users run them, each in a fresh interpreter (what it imports is the point)
