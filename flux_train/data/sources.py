"""The synthetic source (`data.source: synthetic`, a fixed random set; its samples also feed the warm-up and the
bench) and `build_data`, which builds the source `data.source` names: that one, or the energon loaders of the
real dataset (flux_train/data/energon.py). Both give the batch contract of flux_train/data/contract.py."""

from __future__ import annotations

import collections
import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from dataprep.format import LATENT_CHANNELS
from flux_train.config import Config
from flux_train.data.contract import DataSource, TrainStream

if TYPE_CHECKING:  # energon is imported only for real data
    from flux_train.data.energon import DatasetFiles


def synthetic_samples(n: int, text_len: int, height: int, width: int, t5_dim: int, clip_dim: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "t5": torch.randn(n, text_len, t5_dim, generator=g).to(torch.bfloat16),
        "clip": torch.randn(n, clip_dim, generator=g).to(torch.bfloat16),
        "mean": torch.randn(n, LATENT_CHANNELS, height, width, generator=g).to(torch.bfloat16),
        "logvar": (torch.randn(n, LATENT_CHANNELS, height, width, generator=g) - 4.0).to(torch.bfloat16),
    }


class SyntheticTrainStream(TrainStream):
    """A fixed random set, reshuffled each epoch; global batch `step` is positions [step*GBS, (step+1)*GBS)
    of the epoch-wise permutation and rank r takes its contiguous slice, so data do not depend on the
    number of ranks (the 1-vs-N parity test relies on it). The micro-batches of one step are made ahead by a
    thread (`made_ahead`), as energon's loader workers make real ones."""

    def __init__(self, samples: dict, gbs: int, mbs: int, rank: int, world: int, seed: int):
        self.samples, self.gbs, self.mbs, self.seed = samples, gbs, mbs, seed
        self.n = samples["t5"].shape[0]
        self.per_rank = gbs // world
        self.micro_per_rank = self.per_rank // mbs  # micro-batches a rank takes a step
        self.rank = rank
        self.consumed = 0  # micro-batches this rank has yielded
        self._ahead: Iterator[dict] | None = None  # started by the first batch, from `consumed`
        self._epoch_order: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        # read once: a thread still making batches for an old position may replace it meanwhile
        order = self._epoch_order
        if order is None or order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = self._epoch_order = (epoch, torch.randperm(self.n, generator=generator))
        return order[1]

    def _batch(self, micro_batch: int) -> dict:
        """This rank's `micro_batch`-th micro-batch (counted from the run's start)."""
        step, within = divmod(micro_batch, self.micro_per_rank)
        first = step * self.gbs + self.rank * self.per_rank + within * self.mbs
        idx = torch.stack(
            [self._order(epoch)[pos] for epoch, pos in (divmod(first + j, self.n) for j in range(self.mbs))]
        )
        return gathered(self.samples, idx)

    def __next__(self) -> dict:
        if self._ahead is None:
            self._ahead = made_ahead(map(self._batch, itertools.count(self.consumed)), self.micro_per_rank)
        self.consumed += 1
        return next(self._ahead)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state_dict: dict) -> None:
        self.consumed = int(state_dict["consumed"])
        self._ahead = None  # what was made ahead was for the old position


def gathered(samples: dict, idx: torch.Tensor) -> dict:
    """The rows `idx` of every tensor, gathered in one pass into host tensors (`host_tensor`)."""
    return {
        k: torch.index_select(v, 0, idx, out=host_tensor((len(idx), *v.shape[1:]), v.dtype)) for k, v in samples.items()
    }


def host_tensor(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory on GPU hosts, as energon's loader gives: the trainer's non-blocking copies then do
    not wait for the GPU, so the host runs ahead (a copy from pageable memory synchronises)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def made_ahead(batches: Iterator[dict], depth: int) -> Iterator[dict]:
    """`batches`, each made by a thread of its own while the `depth` before it are used. Gathering a synthetic
    micro-batch of 32 at 256 + 256 tokens (68 MB) on the training thread took 82 ms under torchrun (one OpenMP
    thread a rank), with the GPU idle: four of them 328 ms of a 1867 ms step of flux-schnell's width at 6 + 12
    blocks."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="flux-synthetic-data")
    pending = collections.deque(pool.submit(next, batches, None) for _ in range(max(depth, 1)))
    try:
        while (batch := pending.popleft().result()) is not None:
            pending.append(pool.submit(next, batches, None))
            yield batch
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def shard_val_indices(n: int, rank: int, world: int, batch: int) -> list[list[int]]:
    """Round-robin split of n val samples; every rank gets the same number of batches (-1 = padding)."""
    mine = list(range(rank, n, world))
    batches = math.ceil(math.ceil(n / world) / batch)
    mine += [-1] * (batches * batch - len(mine))
    return [mine[i * batch : (i + 1) * batch] for i in range(batches)]


def _synthetic_val(samples: dict, rank: int, world: int, batch: int) -> Callable[[], Iterator[dict]]:
    n = samples["t5"].shape[0]
    timesteps = torch.arange(n) % 8

    def passes() -> Iterator[dict]:
        for idx in shard_val_indices(n, rank, world, batch):
            out = gathered(samples | {"timestep": timesteps}, torch.tensor([max(i, 0) for i in idx]))
            out["valid"] = host_tensor((len(idx),), torch.bool).copy_(torch.tensor([i >= 0 for i in idx]))
            yield out

    return lambda: made_ahead(passes(), 2)


def build_synthetic(cfg: Config, rank: int, world: int) -> DataSource:
    d, m = cfg.data, cfg.model
    train = synthetic_samples(
        d.synthetic_train_samples,
        d.synthetic_text_len,
        d.synthetic_latent_size,
        d.synthetic_latent_size,
        m.joint_attention_dim,
        m.pooled_projection_dim,
        cfg.train.seed,
    )
    # val is a subset of train: the synthetic set exists to show the trainer can overfit it
    val = {k: v[: d.synthetic_val_samples] for k, v in train.items()}
    empty = synthetic_samples(
        1, d.synthetic_text_len, 2, 2, m.joint_attention_dim, m.pooled_projection_dim, cfg.train.seed + 2
    )
    stream = SyntheticTrainStream(
        train, cfg.train.global_batch_size, cfg.train.micro_batch_size, rank, world, cfg.train.seed
    )
    return DataSource(
        stream,
        _synthetic_val(val, rank, world, cfg.eval.batch_size),
        empty["t5"],
        empty["clip"],
        d.synthetic_val_samples,
    )


def build_data(cfg: Config, rank: int, world: int, files: DatasetFiles | None = None) -> DataSource:
    """rank/world are the data-parallel rank and size; `files`: the energon dataset's, if already checked
    (preflight.check_inputs)."""
    if cfg.data.source == "synthetic":
        return build_synthetic(cfg, rank, world)
    from flux_train.data.energon import build_energon  # energon is needed only for real data

    return build_energon(cfg, rank, world, files)
