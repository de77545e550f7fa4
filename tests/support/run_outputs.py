"""Training runs for the tests: one way to start `python -m flux_train.train`, and one way to read what a run
wrote (metrics.jsonl rows and MLLOG events of an out_dir)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from flux_train.outputs import results


def set_flags(overrides) -> list[str]:
    """SECTION.KEY=VALUE overrides (strings, or a {key: value} dict) as `--set` flags."""
    items = [f"{k}={v}" for k, v in overrides.items()] if isinstance(overrides, dict) else overrides
    return [arg for o in items for arg in ("--set", o)]


def train_command(out: Path, *args: str, config: str = "configs/debug.yaml", nproc: int = 1) -> list[str]:
    """`python -m flux_train.train --config CONFIG --set logging.out_dir=OUT ARGS...`; under torchrun on this
    machine with `nproc` ranks when nproc > 1."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, "-m", "flux_train.train", "--config", config, "--set", f"logging.out_dir={out}", *args]


def train(out: Path, *args: str, config: str = "configs/debug.yaml", nproc: int = 1, timeout: float = 600):
    """`train_command`, run to its end, its output captured. A run still going after `timeout` seconds fails the
    test with its last lines and every process's Python stacks (each is sent SIGABRT, which faulthandler turns
    into a dump of its threads), not with a bare timeout."""
    proc = subprocess.Popen(
        train_command(out, *args, config=config, nproc=nproc),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the workers under torchrun too
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        raise AssertionError(
            f"the run in {out} had not ended after {timeout:g} s; its last output, then the stacks:\n"
            + "\n".join(stdout.splitlines()[-20:] + stderr.splitlines()[-150:])
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def metrics(out: Path) -> list[dict]:
    """metrics.jsonl's rows ([] before the first is written)."""
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def column(out: Path, key: str) -> list:
    """One metric over the run, in order: "loss", "grad_norm", "val_loss", ..."""
    return [row[key] for row in metrics(out) if key in row]


def losses(out: Path) -> dict[int, float]:
    """Training loss by step."""
    return {row["step"]: row["loss"] for row in metrics(out) if "loss" in row}


def events(out: Path) -> list[dict]:
    """The MLLOG events of <out>/mllog.log ([] before it holds one)."""
    try:
        return results.read_events(Path(out) / "mllog.log")
    except results.UnreadableLog:
        return []
