"""What a training run wrote, read one way for every test: metrics.jsonl rows and MLLOG events of an out_dir."""

from __future__ import annotations

import json
from pathlib import Path

from flux_train import results


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
