"""What a data source gives the trainer (flux_train/data/sources.py builds one: synthetic, or energon's loaders in
flux_train/data/energon.py; dataprep/format.py owns the on-disk format), and the error for bad data.

Batch contract, per micro-batch: t5 [B,L,4096] bf16, clip [B,768] bf16, mean/logvar [B,16,H,W] bf16; val
batches add timestep [B] int64 and valid [B] bool (False marks padding, so every rank runs the same number of
forwards and each val sample counts exactly once).

A source gives: `train` (an iterator of this rank's micro-batches in order, with state_dict /
load_state_dict), `val()` (a fresh pass over this rank's val batches) and the empty encodings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from flux_train.errors import UserError


@dataclass
class DataSource:
    train: "TrainStream"
    val: Callable[[], Iterator[dict]]
    empty_t5: torch.Tensor  # [1, L, D] bf16
    empty_clip: torch.Tensor  # [1, 768] bf16
    val_size: int


class TrainStream:
    """Iterator of micro-batches with a resumable position."""

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self) -> dict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError


class DataError(UserError, ValueError):
    """A defect in the data on disk; the message names the shard and sample (or file)."""

    label = "data error"
