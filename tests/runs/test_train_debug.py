"""The local debug run end to end on the CPU: it overfits, stops at the target, its MLLOG passes the official
compliance checker, and its terminal holds the metrics lines, not MLLOG's JSON or warnings meaning nothing. The
command's answers without a run: tests/unit/test_train_debug.py."""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from run_outputs import column, losses, metrics, set_flags, train, train_command
from shell import python_on_path

from flux_train.config import load_config
from flux_train.outputs.results import read_events
from flux_train.training.train import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("debug")
    proc = train(out, "--set", "logging.tensorboard=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.mark.slow
def test_debug_run_overfits_and_stops_with_success(debug_run):
    out, proc = debug_run
    rows = metrics(out)
    losses, vals = column(out, "loss"), column(out, "val_loss")
    assert len(losses) >= 3 and losses[-1] < 0.75 * losses[0], losses
    assert vals[-1] <= 0.586 < vals[0], vals
    events = read_events(out / "mllog.log")
    run_stop = [e for e in events if e["key"] == "run_stop"]
    assert len(run_stop) == 1 and run_stop[0]["metadata"]["status"] == "success"
    assert "status success" in proc.stdout
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "tflops_per_gpu", "data_wait_pct"):
        assert key in rows[0], key


@pytest.mark.slow
def test_report_png_draws_the_numbers_of_metrics_jsonl_and_tensorboard_has_them(debug_run):
    out, _ = debug_run
    rows = metrics(out)
    png = Image.open(out / "report.png")
    assert png.format == "PNG" and png.size == (900, 1300)
    drawn = json.loads(png.text["flux_train.outputs.report"])  # the numbers the panels plot
    assert drawn["target"] == 0.586
    assert drawn["val_loss"] == [[r["samples"], r["val_loss"]] for r in rows if "val_loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    assert drawn["val_loss_by_t"] == {
        str(k / 8): [[r["samples"], r["val_loss_by_t"][str(k / 8)]] for r in evals] for k in range(8)
    }
    assert drawn["train_loss"] == [[r["step"] * 8, r["loss"]] for r in rows if "loss" in r]  # GBS 8
    assert drawn["samples_per_s_per_gpu"] == [[r["step"] * 8, r["samples_per_s_per_gpu"]] for r in rows if "loss" in r]
    assert drawn["val_loss"][-1][1] <= 0.586  # the report of the run's end holds its last eval

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    for tag in ("loss", "val_loss", "samples_per_s_per_gpu"):
        logged = [r for r in rows if tag in r]
        assert [e.step for e in board.Scalars(tag)] == [r["step"] for r in logged]
        assert [e.value for e in board.Scalars(tag)] == pytest.approx([r[tag] for r in logged], rel=1e-6)
    for t in ("0.0", "0.5", "0.875"):
        values = [r["val_loss_by_t"][t] for r in evals]
        assert [e.value for e in board.Scalars(f"val_loss_by_t/{t}")] == pytest.approx(values, rel=1e-6)


@pytest.mark.slow
def test_the_readmes_next_commands_export_and_sample_the_runs_last_step(debug_run, tiny_models, tmp_path):
    """The README's commands after the debug run, as written there, in a folder whose runs/debug is this run, with
    tiny random encoders in FLUX.1-schnell's layout for the local weights (tests/support/tiny_models.py)."""
    from diffusers import FluxTransformer2DModel

    from flux_train.model.diffusers_adapter import to_diffusers
    from flux_train.tools.export import read_weights
    from flux_train.training.checkpoint import list_checkpoints

    out, proc = debug_run
    last = metrics(out)[-1]["step"]
    final = out / "checkpoints" / f"step_{last:08d}"
    assert list_checkpoints(out / "checkpoints") == [final]  # the debug config saves no other
    saved = re.search(rf"saved checkpoint {re.escape(str(final))}: ([\d.]+) GB in [\d.]+ s", proc.stdout)
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(final) for f in files)
    assert saved and float(saved[1]) == pytest.approx(written / 1e9, rel=1e-2)  # the size of the files it wrote

    weights = tmp_path / "FLUX.1-schnell"
    for name, tiny in [("vae", "vae"), ("text_encoder_2", "t5"), ("text_encoder", "clip")] + [
        (name, "tokenizer") for name in ("tokenizer", "tokenizer_2")
    ]:
        (weights / name).parent.mkdir(exist_ok=True)
        (weights / name).symlink_to(tiny_models / tiny)
    cwd = tmp_path / "cwd"
    (cwd / "runs").mkdir(parents=True)
    (cwd / "runs" / "debug").symlink_to(out)
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    commands = next(b for b in blocks if "python -m flux_train.checkpoint export" in b)
    assert "W=/models/FLUX.1-schnell" in commands
    env = python_on_path(tmp_path / "bin") | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["bash", "-euc", commands.replace("/models/FLUX.1-schnell", str(weights))],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    exported = FluxTransformer2DModel.from_pretrained(cwd / "runs" / "debug" / "exported").state_dict()
    cfg = load_config(out / "config.yaml")
    expected = to_diffusers(read_weights(cfg, final), cfg.model)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    shown = f"runs/debug/checkpoints/step_{last:08d}"
    assert f"wrote runs/debug/grid.png: 2 images of 256x256 from {shown}" in done.stdout
    grid = Image.open(cwd / "runs" / "debug" / "grid.png")
    assert grid.format == "PNG" and grid.size == (512, 256)  # two prompts side by side


@pytest.mark.slow
def test_ctrl_c_is_one_line_exit_130_and_the_same_command_goes_on_as_if_never_stopped(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the run's process group, its loader worker too), after the first
    checkpoint: one line naming the step and where the same command resumes, exit 130 (it was a 48-line traceback);
    the same command then ends with the losses of a run never interrupted."""
    from flux_train.training.checkpoint import list_checkpoints, read_progress

    flags = set_flags(
        ["train.max_steps=40", "eval.every_steps=10", "logging.log_every=10", "checkpoint.every_steps=10"]
    )
    reference = train(tmp_path / "reference", *flags)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        train_command(out, *flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    next(line for line in proc.stdout if line.startswith("flux-train: saved checkpoint"))
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    step = read_progress(list_checkpoints(out / "checkpoints")[-1]).step
    assert proc.returncode == 130 and re.fullmatch(
        rf"flux-train: interrupted at step \d+; the same command resumes from step {step}", err.strip()
    ), err
    again = train(out, *flags)
    assert again.returncode == 0 and f"at step {step}" in again.stdout, again.stderr[-3000:]
    assert reference.returncode == 0 and losses(out) == losses(tmp_path / "reference")


@pytest.mark.slow
def test_mllog_has_every_key_in_order(debug_run):
    out, _ = debug_run
    events = read_events(out / "mllog.log")
    keys = [e["key"] for e in events]
    before_run = keys[: keys.index("run_start")]
    for key in (
        "cache_clear",
        "submission_benchmark",
        "submission_org",
        "submission_platform",
        "train_samples",
        "eval_samples",
        "seed",
        "global_batch_size",
        "opt_name",
        "opt_base_learning_rate",
        "opt_learning_rate_warmup_steps",
        "opt_adamw_beta_1",
        "opt_adamw_beta_2",
        "opt_adamw_epsilon",
        "opt_adamw_weight_decay",
        "opt_gradient_clip_norm",
        "gradient_accumulation_steps",
        "evaluation_frequency",
        "init_start",
        "init_stop",
    ):
        assert key in before_run, key
    value = {e["key"]: e["value"] for e in events}
    assert value["evaluation_frequency"] == 262144 and value["train_samples"] == 1099776
    assert value["eval_samples"] == 29696 and value["submission_benchmark"] == "flux1"
    evals = [e for e in events if e["key"] == "eval_accuracy"]
    assert all(e["metadata"]["samples_count"] % 8 == 0 and e["metadata"]["samples_count"] > 0 for e in evals)
    assert keys.index("init_start") < keys.index("init_stop") < keys.index("run_start") < keys.index("block_start")


@pytest.mark.slow
def test_terminal_shows_metrics_not_mllog_or_pin_memory_warnings(debug_run):
    out, proc = debug_run
    assert ":::MLLOG" not in proc.stdout and "step 25 loss" in proc.stdout
    assert (out / "mllog.log").read_text().count(":::MLLOG") > 20  # the events are in their file
    assert "pin_memory" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_readmes_healthy_run_is_what_the_run_prints(debug_run):
    """README's example of the debug run, abridged with `...` and with another machine's rates, is this run's output:
    its lines in order, numbers aside (tests/runs/test_doc_outputs.py checks the examples a CPU reproduces exactly)."""
    out, proc = debug_run
    readme = (ROOT / "README.md").read_text()
    example = readme.split("**A healthy debug run**", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]

    def shape(line: str) -> str:
        return re.sub(r"\d+(\.\d+)?", "#", line.strip())

    printed = (shape(line) for line in proc.stdout.replace(str(out), "runs/debug").splitlines())
    # one pass over what was printed: a line of the example must come after the one before it
    assert [line for line in example.splitlines() if line != "..." and shape(line) not in printed] == []


@pytest.mark.slow
def test_the_official_checker_as_documented_accepts_the_log_and_writes_only_in_the_run_folder(debug_run, tmp_path):
    """docs/operating.md's checker command, for runs/debug: it passes, and its report lands in the run's folder (its
    default, ./compliance_checker.log, was left in the repository)."""
    out, _ = debug_run
    text = " ".join((ROOT / "docs" / "operating.md").read_text().split())
    command = re.search(r"`(python -m mlperf_logging\.compliance_checker [^`]+)`", text).group(1)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "debug").symlink_to(out)
    proc = subprocess.run(
        ["bash", "-c", command.replace("<out_dir>", "runs/debug")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=python_on_path(tmp_path / "bin"),
    )
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "runs"] and (out / "compliance_checker.log").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("final", [True, False])
def test_step_cap_ends_aborted_with_mllog_on_stdout_when_asked(tmp_path, capsys, final):
    """The run saves the step it stopped at (checkpoint.final; no periodic checkpoints here), and the same command
    again is refused: the run has finished."""
    from flux_train.training.checkpoint import list_checkpoints

    # in-process, so the synthetic source: forking energon's loader workers from pytest's process is not safe
    argv = [
        "--config",
        "configs/debug.yaml",
        *set_flags(["data.source=synthetic", f"logging.out_dir={tmp_path}", "train.max_steps=4"]),
        *set_flags(["logging.mllog_stdout=true", "eval.every_steps=2", "logging.log_every=2"]),
        *set_flags([f"checkpoint.final={str(final).lower()}"]),
    ]
    assert main(argv) == 0
    logged = (tmp_path / "mllog.log").read_text().splitlines()
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if ":::MLLOG" in line] == logged
    assert printed[-1] == (  # the step cap reads as what it is, not as "status aborted", MLLOG's word for it
        "flux-train: finished at step 4, the step cap train.max_steps 4, before an eval reached the target 0.586 "
        "(MLLOG's run_stop status: aborted)"
    )
    events = read_events(tmp_path / "mllog.log")
    assert [e["metadata"]["status"] for e in events if e["key"] == "run_stop"] == ["aborted"]
    assert len([e for e in events if e["key"] == "eval_accuracy"]) == 2
    saved = list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in saved] == (["step_00000004"] if final else [])
    assert main(argv) == 2 and "holds a finished run" in capsys.readouterr().err


@pytest.mark.slow
def test_a_rerun_after_a_kill_before_the_first_checkpoint_says_it_starts_over(tmp_path):
    """Killed (SIGKILL) before its first checkpoint, the run has nothing to resume from: the same command starts
    over, and now says so, and its records begin again."""
    flags = ["data.source=synthetic", "eval.enabled=false", "logging.log_every=1", "checkpoint.every_steps=0"]
    proc = subprocess.Popen(
        train_command(tmp_path, *set_flags([*flags, "train.max_steps=1000"])),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    next(line for line in proc.stdout if line.startswith("step 2 "))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    again = train(tmp_path, *set_flags([*flags, "train.max_steps=3"]))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        f"flux-train: {tmp_path} holds a run stopped before its first checkpoint: starting over at step 0 (mllog.log "
        "and metrics.jsonl begin again)" in again.stdout.splitlines()
    )
    assert [row["step"] for row in metrics(tmp_path) if "loss" in row] == [1, 2, 3]


def test_a_step_cap_on_an_eval_ends_the_log_with_that_eval_and_the_checker_accepts_it(tmp_path):
    """train.max_steps 20 with an eval every 4 steps: the log ends eval_stop, run_stop at the eval of step 20, as the
    MLPerf recipes' logs end at their last eval (an empty block_start/block_stop pair after it was logged before). The
    target 0 keeps the run going to the cap; latent_scale 0.02 brings an eval under 0.586, which the checker wants."""
    flags = ["data.source=synthetic", f"logging.out_dir={tmp_path}", "train.max_steps=20", "eval.every_steps=4"]
    flags += ["logging.log_every=4", "train.latent_scale=0.02", "eval.target=0", "checkpoint.final=false"]
    assert main(["--config", "configs/debug.yaml", *set_flags(flags)]) == 0
    events = read_events(tmp_path / "mllog.log")
    ending = [(e["key"], e["metadata"].get("samples_count")) for e in events[-4:]]
    assert ending == [("eval_start", 160), ("eval_accuracy", 160), ("eval_stop", 160), ("run_stop", 160)]
    keys = [e["key"] for e in events]
    assert keys.count("block_start") == keys.count("block_stop") == keys.count("eval_start") == 5
    checker = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "6.0.0"]
    proc = subprocess.run([*checker, str(tmp_path / "mllog.log")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_non_finite_step_stops_the_run_there_and_keeps_the_last_good_checkpoint(tmp_path, strategy):
    """A NaN loss at step 5 (checkpoints every 2 steps, logging every 10): the run stops at step 5, before step 6's
    checkpoint could save the bad state; run_stop is aborted, the exit code 3, and the message names the step and
    the checkpoint to resume from."""
    from flux_train.training import checkpoint

    out = tmp_path / "run"
    proc = train(
        out,
        "--set",
        "data.source=synthetic",
        "--set",
        "train.inject_nan_at_step=5",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "logging.log_every=10",
        "--set",
        "eval.enabled=false",
        "--set",
        "train.max_steps=20",
        "--set",
        f"parallel.strategy={strategy}",
    )
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    latest = checkpoint.list_checkpoints(out / "checkpoints")[-1]
    assert latest.name == "step_00000004"
    assert f"not finite at step 5; the last good checkpoint is {latest}" in proc.stdout
    assert "finished at step 6, status diverged" in proc.stdout  # found at the sync before step 6's save
    stops = [e for e in read_events(out / "mllog.log") if e["key"] == "run_stop"]
    assert len(stops) == 1 and stops[0]["metadata"]["status"] == "aborted"


def on_a_terminal(out: Path, *flags: str) -> bytes:
    """What a debug run draws on a terminal (stdout and stderr both, 200 columns wide: the bar is drawn only when
    stderr is a terminal, as wide as the terminal), the run ended with exit 0."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(train_command(out, *flags), stdout=child, stderr=child)
    os.close(child)
    drawn = b""
    while True:
        ready, _, _ = select.select([parent], [], [], 120)
        try:
            chunk = os.read(parent, 65536) if ready else b""
        except OSError:  # the child closed its end
            chunk = b""
        if not chunk:
            break
        drawn += chunk
    assert proc.wait(timeout=60) == 0, drawn[-2000:]
    return drawn


def screen(drawn: bytes) -> list[str]:
    """The lines a terminal shows for `drawn`: a carriage return goes back to the line's start, and what follows
    overwrites what was there."""
    lines = []
    for raw in drawn.decode(errors="replace").split("\n"):
        shown: list[str] = []
        column = 0
        for char in raw:
            if char == "\r":
                column = 0
                continue
            shown[column : column + 1] = [char]
            column += 1
        lines.append("".join(shown).rstrip())
    return lines


@pytest.mark.slow
def test_the_trainers_lines_are_written_above_the_progress_bar_not_onto_it(tmp_path):
    """ "saved checkpoint" (and every other line of the trainer) was printed after the bar, on its line: on the
    terminal each such line starts at its line's start, and each metrics line too."""
    flags = ["train.max_steps=6", "eval.every_steps=2", "logging.log_every=1", "checkpoint.every_steps=2"]
    lines = screen(on_a_terminal(tmp_path, *set_flags(flags)))
    ours = [line for line in lines if "flux-train: " in line or re.search(r"step \d+ (loss|samples) ", line)]
    assert len([line for line in ours if "saved checkpoint" in line]) == 3, lines
    assert [line for line in ours if not re.match(r"flux-train: |step \d+ ", line)] == [], lines


@pytest.mark.slow
def test_the_progress_bar_shows_a_finite_training_loss_through_evals(tmp_path):
    """On a terminal, the bar's loss is the last training loss, also after an eval (whose row has none: the bar
    showed loss=nan from the first eval on, which reads as divergence), and the val loss beside it; its times are
    to the next eval and the step cap (tqdm's own estimate, to the cap without the evals, is not drawn)."""
    flags = set_flags(["train.max_steps=6", "eval.every_steps=2", "logging.log_every=1", "checkpoint.every_steps=0"])
    drawn = on_a_terminal(tmp_path, *flags)
    shown = re.findall(rb"\bloss=([^,\] ]+)", drawn)
    vals = re.findall(rb"val_loss=([^,\] ]+)", drawn)
    assert shown and vals, drawn[-2000:]
    assert all(math.isfinite(float(v)) for v in shown + vals), shown
    assert float(shown[-1]) == pytest.approx(column(tmp_path, "loss")[-1], abs=1e-4)
    assert re.search(rb"next eval in \d\d:\d\d, step cap in \d\d:\d\d", drawn), drawn[-2000:]
    assert not re.search(rb"\d\d:\d\d<\d\d:\d\d", drawn), drawn[-2000:]
