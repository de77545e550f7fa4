"""The pinned loss curve: the first 20 training losses of configs/debug.yaml (fp32, on the CPU), checked in at
tests/assets/losses/debug_fp32_cpu.json and held to 1e-5. A change that moves the model's numerics, the data's
order, the optimizer or the schedule moves them; one meant to: FLUX_LOSSES_REGENERATE=1 rewrites the file, and its
diff goes with the change. Runs of one machine agree to about 1e-7 whatever the thread count."""

import json
import os
from pathlib import Path

from run_outputs import losses, train

PINNED = Path(__file__).resolve().parents[1] / "assets" / "losses" / "debug_fp32_cpu.json"
STEPS = 20
TOLERANCE = 1e-5
FLAGS = {
    "train.device": "cpu",
    "train.max_steps": STEPS,
    "logging.log_every": 1,
    "eval.every_steps": 1000,  # no eval: the curve is the training losses alone
}


def first_losses(out: Path, **changed) -> list[float]:
    flags = [arg for key, value in {**FLAGS, **changed}.items() for arg in ("--set", f"{key}={value}")]
    proc = train(out, *flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_step = losses(out)
    assert sorted(by_step) == list(range(1, STEPS + 1)), sorted(by_step)
    return [by_step[step] for step in range(1, STEPS + 1)]


def test_the_debug_runs_first_losses_are_the_pinned_ones(tmp_path):
    got = first_losses(tmp_path / "run")
    if os.environ.get("FLUX_LOSSES_REGENERATE"):
        PINNED.write_text(json.dumps({"config": "configs/debug.yaml", "set": FLAGS, "losses": got}, indent=1) + "\n")
    pinned = json.loads(PINNED.read_text())
    assert pinned["set"] == FLAGS, f"{PINNED} was written with other flags (FLUX_LOSSES_REGENERATE=1 rewrites it)"
    moved = [
        f"step {step}: {was:.8f} now {now:.8f}"
        for step, (was, now) in enumerate(zip(pinned["losses"], got, strict=True), 1)
        if abs(was - now) > TOLERANCE
    ]
    assert not moved, f"losses moved from {PINNED.name} (FLUX_LOSSES_REGENERATE=1 rewrites it):\n" + "\n".join(moved)


def test_a_learning_rate_two_percent_off_moves_the_curve_past_the_tolerance(tmp_path):
    """The tolerance catches a small change: lr 3.06e-3 for 3e-3 moves some loss by more than it."""
    pinned = json.loads(PINNED.read_text())["losses"]
    got = first_losses(tmp_path / "run", **{"train.lr": 3.06e-3})
    assert max(abs(a - b) for a, b in zip(pinned, got, strict=True)) > TOLERANCE
