"""What checkpoints take on disk, from the config alone: the planner and the pre-flight's disk floor ask it without
loading torch's distributed checkpointing (which the cluster commands never need)."""

from __future__ import annotations

import torch

from flux_train.model.flux import param_count


def checkpoint_bytes(cfg) -> float:
    """One checkpoint's size: the weights (ddp: in the compute dtype, written once; fsdp: fp32) and the fp32 AdamW
    moments (and ddp's fp32 master weights)."""
    weights = getattr(torch, cfg.train.compute_dtype).itemsize + 4 if cfg.parallel.strategy == "ddp" else 4
    return param_count(cfg.model) * (weights + 8)


def checkpoint_disk_gb(cfg) -> float:
    """Disk the checkpoint folder needs: checkpoint.keep complete checkpoints and the one being written."""
    return checkpoint_bytes(cfg) * (cfg.checkpoint.keep + 1) / 1e9
