"""Training runs for the tests: one way to start `python -m flux_train.train`, and one way to read what a run
wrote (metrics.jsonl rows and MLLOG events of an out_dir)."""

from __future__ import annotations

import json
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
    return [*launcher, "-m", "flux_train.training.train", "--config", config, "--set", f"logging.out_dir={out}", *args]


def train(out: Path, *args: str, config: str = "configs/debug.yaml", nproc: int = 1, timeout: float = 600):
    """`train_command`, run to its end, its output captured."""
    return subprocess.run(
        train_command(out, *args, config=config, nproc=nproc), capture_output=True, text=True, timeout=timeout
    )


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
