"""The plan's checkpoint disk against a checkpoint the trainer writes here, and pre-flight's disk floor from it (the
rest of the planner: tests/unit/test_plan.py)."""

from __future__ import annotations

import pytest
import torch
from run_outputs import set_flags, train

from flux_train.config import load_config
from flux_train.training import preflight
from flux_train.training.checkpoint_size import checkpoint_bytes

DEBUG_DDP = ["parallel.strategy=ddp", "train.compute_dtype=bfloat16"]  # the debug model in the GPU systems' layout


@pytest.fixture(scope="module")
def debug_checkpoint(tmp_path_factory):
    """Bytes of the data files of a checkpoint the trainer wrote for the debug model (DEBUG_DDP) on this CPU."""
    out = tmp_path_factory.mktemp("ckpt")
    run = ["checkpoint.every_steps=1", "data.source=synthetic", "train.max_steps=1", "eval.enabled=false"]
    proc = train(out, *set_flags(DEBUG_DDP + run + ["logging.progress_bar=false"]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (folder,) = [p for p in (out / "checkpoints").iterdir() if p.is_dir()]  # beside it: the folder's .lock
    return sum(f.stat().st_size for f in folder.glob("*.distcp"))


@pytest.mark.slow  # the fixture trains
def test_checkpoint_size_is_what_the_trainer_writes(debug_checkpoint):
    cfg = load_config("configs/debug.yaml", DEBUG_DDP)
    assert checkpoint_bytes(cfg) == pytest.approx(debug_checkpoint, rel=0.03)  # DCP adds a header per tensor


@pytest.mark.slow  # the fixture trains
def test_preflight_disk_floor_follows_checkpoint_keep(debug_checkpoint, tmp_path, monkeypatch):
    """Unset, the floor is checkpoint.keep + 1 checkpoints: room for 3 passes keep 1 and fails keep 3; an explicit
    floor still rules."""
    written = debug_checkpoint
    usage = preflight.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _: usage._replace(free=3 * written))

    def disk_problems(*overrides):
        cfg = load_config("configs/debug.yaml", [*DEBUG_DDP, f"logging.out_dir={tmp_path}", *overrides])
        return [p for p in preflight.node_problems(cfg, torch.device("cpu"), 1) if "free for the" in p]

    assert disk_problems("checkpoint.keep=1") == []
    assert len(disk_problems("checkpoint.keep=3")) == 2  # the checkpoint and the log folder
    assert disk_problems("checkpoint.keep=3", f"preflight.min_free_disk_gb={2 * written / 1e9}") == []
