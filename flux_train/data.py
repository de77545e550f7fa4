"""Data for the trainer: the batch contract, the energon loaders, the synthetic source.

Batch contract (DESIGN.md §4), per micro-batch: t5 [B,L,4096] bf16, clip [B,768] bf16, mean/logvar
[B,16,H,W] bf16; val batches add timestep [B] int64 and valid [B] bool (False marks padding, so every
rank runs the same number of forwards and each val sample counts exactly once).

A source gives: `train` (an iterator of this rank's micro-batches in order, with state_dict /
load_state_dict), `val()` (a fresh pass over this rank's val batches) and the empty encodings.

On disk (energon CrudeWebdataset, DESIGN.md §4) a sample is KEY.json ({"key": ..., "timestep": k} for val)
and KEY.{t5,clip,mean,logvar}.bytes, each the np.save bytes of a bf16 array viewed as uint16.
"""
from __future__ import annotations

import io
import json
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from megatron.energon import (Cooker, CrudeSample, DefaultTaskEncoder, WorkerConfig, basic_sample_keys,
                              get_loader, get_savable_loader, get_train_dataset, get_val_dataset, stateless)
from megatron.energon.errors import reraise_exception
from megatron.energon.flavors.webdataset.sharder import Sharder

from flux_train.config import Config, ConfigError, DataConfig, ModelConfig

LATENT_CHANNELS = 16


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

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


def synthetic_samples(n: int, text_len: int, height: int, width: int, t5_dim: int, clip_dim: int,
                      seed: int) -> dict:
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
    number of ranks (the 1-vs-N parity test relies on it)."""

    def __init__(self, samples: dict, gbs: int, mbs: int, rank: int, world: int, seed: int):
        self.samples, self.gbs, self.mbs, self.seed = samples, gbs, mbs, seed
        self.n = samples["t5"].shape[0]
        self.per_rank = gbs // world
        self.rank = rank
        self.consumed = 0  # micro-batches this rank has yielded

    def _position(self, offset: int) -> int:
        micro_per_rank = self.per_rank // self.mbs
        step, within = divmod(self.consumed, micro_per_rank)
        return step * self.gbs + self.rank * self.per_rank + within * self.mbs + offset

    def __next__(self) -> dict:
        idx = []
        for j in range(self.mbs):
            epoch, pos = divmod(self._position(j), self.n)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
            idx.append(int(perm[pos]))
        self.consumed += 1
        return {k: v[idx] for k, v in self.samples.items()}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def shard_val_indices(n: int, rank: int, world: int, batch: int) -> list[list[int]]:
    """Round-robin split of n val samples; every rank gets the same number of batches (-1 = padding)."""
    mine = list(range(rank, n, world))
    batches = math.ceil(math.ceil(n / world) / batch)
    mine += [-1] * (batches * batch - len(mine))
    return [mine[i * batch:(i + 1) * batch] for i in range(batches)]


def _synthetic_val(samples: dict, rank: int, world: int, batch: int) -> Callable[[], Iterator[dict]]:
    n = samples["t5"].shape[0]
    timesteps = torch.arange(n) % 8

    def passes() -> Iterator[dict]:
        for idx in shard_val_indices(n, rank, world, batch):
            valid = torch.tensor([i >= 0 for i in idx])
            safe = [max(i, 0) for i in idx]
            out = {k: v[safe] for k, v in samples.items()}
            out["timestep"] = timesteps[safe]
            out["valid"] = valid
            yield out

    return passes


def build_synthetic(cfg: Config, rank: int, world: int) -> DataSource:
    d, m = cfg.data, cfg.model
    train = synthetic_samples(d.synthetic_train_samples, d.synthetic_text_len, d.synthetic_latent_size,
                              d.synthetic_latent_size, m.joint_attention_dim, m.pooled_projection_dim, cfg.train.seed)
    if d.synthetic_val_samples > d.synthetic_train_samples:
        raise ValueError("data.synthetic_val_samples must be <= data.synthetic_train_samples")
    # val is a subset of train: the synthetic set exists to show the trainer can overfit it
    val = {k: v[:d.synthetic_val_samples] for k, v in train.items()}
    empty = synthetic_samples(1, d.synthetic_text_len, 2, 2, m.joint_attention_dim, m.pooled_projection_dim,
                               cfg.train.seed + 2)
    stream = SyntheticTrainStream(train, cfg.train.global_batch_size, cfg.train.micro_batch_size, rank, world,
                                  cfg.train.seed)
    return DataSource(stream, _synthetic_val(val, rank, world, cfg.eval.batch_size), empty["t5"],
                      empty["clip"], d.synthetic_val_samples)


# ---------------------------------------------------------------------------------------------
# energon: the on-disk format (read side), the cooker, the train stream and the val pass

PARTS = ("t5", "clip", "mean", "logvar")
EMPTY_T5, EMPTY_CLIP = "t5_empty.npy", "clip_empty.npy"


class DataError(ValueError):
    """A defect in the data on disk; the message names the shard and sample (or file)."""


def decode_bf16(raw: bytes) -> torch.Tensor:
    """np.save bytes of a bf16 array viewed as uint16 -> the bf16 tensor (bits unchanged)."""
    array = np.load(io.BytesIO(raw), allow_pickle=False)
    if array.dtype != np.uint16:
        raise ValueError(f"dtype {array.dtype}, expected uint16 (bf16 bits)")
    return torch.from_numpy(array).view(torch.bfloat16)


def sample_meta(sample: dict) -> dict:
    """The json part: bytes with energon's decoder off (ours and NVIDIA's), a dict with its default decoder."""
    meta = sample.get("json")
    if meta is None:
        return {}
    return json.loads(meta) if isinstance(meta, (bytes, str)) else dict(meta)


def sample_where(sample: dict) -> str:
    return f"{sample.get('__shard__', '?')}: sample {sample.get('__key__', '?')}"


@stateless
def cook(sample: dict) -> CrudeSample:
    """Crude sample -> bf16 tensors t5, clip, mean, logvar (+ int64 timestep when the json has one)."""
    out = {}
    for part in PARTS:
        raw = sample.get(f"{part}.bytes")
        if raw is None:
            raise DataError(f"{sample_where(sample)}: missing member {sample.get('__key__')}.{part}.bytes")
        try:
            out[part] = decode_bf16(raw)
        except ValueError as exc:
            raise DataError(f"{sample_where(sample)}: {part}.bytes: {exc}") from None
    try:
        meta = sample_meta(sample)
    except ValueError as exc:
        raise DataError(f"{sample_where(sample)}: json: {exc}") from None
    if "timestep" in meta:
        out["timestep"] = torch.tensor(int(meta["timestep"]), dtype=torch.int64)
    return CrudeSample(**basic_sample_keys(sample), **out)


def collate(samples: list[dict], keys: tuple[str, ...]) -> dict:
    try:
        return {k: torch.stack([s[k] for s in samples]) for k in keys}
    except RuntimeError:
        shapes = {s["__key__"]: tuple(s["t5"].shape) + tuple(s["mean"].shape) for s in samples}
        raise DataError(f"samples of one batch differ in shape (t5 + mean shapes per key): {shapes}") from None


class FluxTaskEncoder(DefaultTaskEncoder):
    decoder = None  # parts stay bytes; the cooker decodes them (as NVIDIA's recipe does)
    cookers = [Cooker(cook)]

    def batch(self, samples: list[dict]) -> dict:
        return collate(samples, PARTS)


def _worker_config(rank: int, world: int, num_workers: int, seed: int) -> WorkerConfig:
    # a bad sample stops the run: energon's default handler logs and skips it, which silently changes the data
    return WorkerConfig(rank=rank, world_size=world, num_workers=num_workers, seed_offset=seed,
                        global_error_handler=reraise_exception)


class EnergonTrainStream(TrainStream):
    """This rank's shuffled, infinite micro-batches from energon's savable loader. The order depends on the
    seed, world size and num_workers; the state restores exactly only under the same world size and
    num_workers (energon's "reproducible scaling"), so both are stored with it and checked."""

    def __init__(self, path: Path, rank: int, world: int, micro_batch: int, d: DataConfig, seed: int):
        self.rank, self.world, self.num_workers = rank, world, d.num_workers
        dataset = get_train_dataset(
            path, split_part="train", worker_config=_worker_config(rank, world, d.num_workers, seed),
            batch_size=micro_batch, shuffle_buffer_size=d.shuffle_buffer_size or None,
            max_samples_per_sequence=d.max_samples_per_sequence or None, task_encoder=FluxTaskEncoder())
        self.loader = get_savable_loader(dataset)
        self._iter = None  # started by the first batch, i.e. after run_start: no data is read before it

    def __next__(self) -> dict:
        if self._iter is None:
            self._iter = iter(self.loader)
        return next(self._iter)

    def state_dict(self) -> dict:
        # energon's state is a pickled dataclass; kept as bytes so the checkpoint loads with weights_only=True
        return {"rank": self.rank, "world_size": self.world, "num_workers": self.num_workers,
                "energon": pickle.dumps(self.loader.save_state_rank())}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("world_size", self.world), ("num_workers", self.num_workers), ("rank", self.rank)):
            if state[key] != mine:
                raise ValueError(
                    f"data loader state was saved with {key}={state[key]}, this run has {key}={mine}: energon "
                    f"resumes the exact sample order only with the same world size, num_workers and rank; "
                    f"resume with the original layout (data.num_workers, number of GPUs) or start the data fresh")
        if self._iter is not None:
            raise RuntimeError("load_state_dict must be called before the first batch")
        self.loader.restore_state_rank(pickle.loads(state["energon"]))


def val_counts(total: int, world: int, num_workers: int) -> list[int]:
    """Val samples per rank as energon splits them: contiguous slices over world x max(1, num_workers)
    global workers. One rank holding all the global workers yields every rank's boundaries at once."""
    workers = max(1, num_workers)
    offsets = Sharder.split_samples_to_workers(0, total, WorkerConfig(rank=0, world_size=1,
                                                                      num_workers=world * workers))
    return [int(offsets[(r + 1) * workers] - offsets[r * workers]) for r in range(world)]


class EnergonVal:
    """One call = one pass over this rank's part of the val split. Over all ranks every val sample is counted
    exactly once, and every rank yields the same number of batches (FSDP all-gathers in every forward):
    short batches are padded with copies of a real val sample marked valid=False."""

    def __init__(self, path: Path, rank: int, world: int, batch: int, num_workers: int):
        self.path, self.rank, self.world, self.num_workers, self.batch = path, rank, world, num_workers, batch
        whole = self._dataset(0, 1, 0)
        self.size = len(whole)
        if self.size == 0:
            raise DataError(f"{path}: the val split is empty")
        counts = val_counts(self.size, world, num_workers)
        mine = len(self._dataset(rank, world, num_workers))
        if mine != counts[rank]:
            raise RuntimeError(f"energon gives rank {rank} {mine} val samples, val_counts() predicts "
                               f"{counts[rank]}: energon's split changed, update val_counts")
        self.mine = counts[rank]
        self.num_batches = math.ceil(max(counts) / batch)
        self.template = self._checked(next(iter(get_loader(whole))))

    def _dataset(self, rank: int, world: int, workers: int):
        return get_val_dataset(self.path, split_part="val", worker_config=_worker_config(rank, world, workers, 0),
                               batch_size=None, task_encoder=FluxTaskEncoder())

    @staticmethod
    def _checked(sample: dict) -> dict:
        if "timestep" not in sample:
            raise DataError(f"{sample_where(sample)}: val sample without a timestep in its json")
        return sample

    def _collate(self, real: list[dict]) -> dict:
        out = collate(real + [self.template] * (self.batch - len(real)), PARTS + ("timestep",))
        out["valid"] = torch.arange(self.batch) < len(real)
        return out

    def __call__(self) -> Iterator[dict]:
        # a fresh dataset and loader per pass: energon resumes a re-iterated one where an abandoned pass stopped
        pending, batches, seen = [], 0, 0
        for sample in get_loader(self._dataset(self.rank, self.world, self.num_workers)):
            pending.append(self._checked(sample))
            seen += 1
            if len(pending) == self.batch:
                yield self._collate(pending)
                pending, batches = [], batches + 1
        if seen != self.mine:
            raise RuntimeError(f"val pass read {seen} samples on this rank, expected {self.mine}")
        while batches < self.num_batches:
            yield self._collate(pending)
            pending, batches = [], batches + 1


def load_empty_encodings(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """t5_empty.npy [1,L,4096] and clip_empty.npy [1,768] -> bf16. The reference writes them as float16
    values (not bf16 bits like the dataset), so they are converted by value: never .view() them."""
    out = []
    for name, ndim in ((EMPTY_T5, 3), (EMPTY_CLIP, 2)):
        file = folder / name
        if not file.is_file():
            raise DataError(f"{file}: missing; write it with `python -m dataprep empty-encodings` or point "
                            f"data.empty_encodings at the folder holding {EMPTY_T5} and {EMPTY_CLIP}")
        array = np.load(file, allow_pickle=False)
        if array.dtype not in (np.float16, np.float32):
            raise DataError(f"{file}: dtype {array.dtype}, expected float16 values (as save_empty_encodings.py "
                            f"writes them)")
        if array.ndim != ndim or array.shape[0] != 1:
            raise DataError(f"{file}: shape {list(array.shape)}, expected {ndim} dims with a leading 1")
        out.append(torch.from_numpy(array).to(torch.bfloat16))
    return out[0], out[1]


def _check_dims(val_sample: dict, empty_t5: torch.Tensor, empty_clip: torch.Tensor, m: ModelConfig,
                empty_dir: Path) -> None:
    t5, clip = val_sample["t5"], val_sample["clip"]
    if t5.shape[-1] != m.joint_attention_dim or clip.shape[-1] != m.pooled_projection_dim:
        raise DataError(f"{sample_where(val_sample)}: t5 {list(t5.shape)} / clip {list(clip.shape)} do not fit "
                        f"model.joint_attention_dim {m.joint_attention_dim} / pooled_projection_dim "
                        f"{m.pooled_projection_dim}")
    if tuple(empty_t5.shape[1:]) != tuple(t5.shape) or tuple(empty_clip.shape[1:]) != tuple(clip.shape):
        raise DataError(f"{empty_dir}: empty encodings {list(empty_t5.shape)} / {list(empty_clip.shape)} do not "
                        f"match the data's t5 {list(t5.shape)} / clip {list(clip.shape)}")


def _fixture(cfg: Config) -> Path:
    from dataprep.fixture import ensure_fixture  # only debug runs write data

    d = cfg.data
    root = Path(d.fixture_dir) if d.fixture_dir else Path(cfg.logging.out_dir) / "fixture"
    return ensure_fixture(root, train=d.synthetic_train_samples, val=d.synthetic_val_samples,
                          text_len=d.synthetic_text_len, height=d.synthetic_latent_size,
                          width=d.synthetic_latent_size, seed=cfg.train.seed)


def build_energon(cfg: Config, rank: int, world: int) -> DataSource:
    d = cfg.data
    for key in ("num_workers", "shuffle_buffer_size", "max_samples_per_sequence"):
        if getattr(d, key) < 0:
            raise ConfigError(f"data.{key}: must be >= 0, got {getattr(d, key)}")
    path = Path(d.path) if d.path else _fixture(cfg)
    if not (path / ".nv-meta" / "dataset.yaml").is_file():
        raise DataError(f"{path}: not a prepared energon dataset (no .nv-meta/dataset.yaml); run "
                        f"`python -m dataprep prepare {path}`")
    val = EnergonVal(path, rank, world, cfg.eval.batch_size, d.num_workers)
    empty_dir = Path(d.empty_encodings) if d.empty_encodings else path / "empty_encodings"
    empty_t5, empty_clip = load_empty_encodings(empty_dir)
    _check_dims(val.template, empty_t5, empty_clip, cfg.model, empty_dir)
    train = EnergonTrainStream(path, rank, world, cfg.train.micro_batch_size, d, cfg.train.seed)
    return DataSource(train, val, empty_t5, empty_clip, val.size)


def build_data(cfg: Config, rank: int, world: int) -> DataSource:
    """rank/world are the data-parallel rank and size."""
    if cfg.data.source == "synthetic":
        return build_synthetic(cfg, rank, world)
    return build_energon(cfg, rank, world)
