"""The energon side of the data: the cooker (crude sample -> batch contract), this rank's resumable train
stream, and the val pass that covers the val split exactly once across ranks (flux_train.data.contract has the
batch contract, dataprep.format the on-disk format)."""

from __future__ import annotations

import math
import pickle
import random
import re
import tarfile
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
from megatron.energon import (
    Cooker,
    CrudeSample,
    DefaultTaskEncoder,
    WorkerConfig,
    basic_sample_keys,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
    stateless,
)
from megatron.energon.errors import reraise_exception

from dataprep import digests
from dataprep.format import (
    METADATA,
    PARTS,
    DatasetInfo,
    FormatError,
    decode_bf16,
    load_empty_encodings,
    read_info,
    sample_meta,
    sample_where,
)
from flux_train.config import Config, DataConfig, ModelConfig
from flux_train.data.contract import DataError, DataSource, TrainStream
from flux_train.private_apis import energon_shard_end, quiet_energon_sample_errors, split_samples_to_workers

# energon's loaders always ask for page-locked memory; on a host without a GPU torch warns that there is none
warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator is found")
quiet_energon_sample_errors()  # a bad sample is named once, by reading(), not first by energon on stdout


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


# what energon's loader raises for a shard it cannot read (a cut or garbled tar, an I/O error) or a sample our
# cooker refuses (DataError); a loader worker's arrives with the worker's whole traceback as its message
READ_ERRORS = (ValueError, tarfile.TarError, OSError)
TYPE_PREFIX = re.compile(r"^(\w+\.)*\w*(Error|Exception): ")


def read_error(path: Path, split: str, exc: Exception) -> DataError:
    """The loader's error in one line: the worker traceback's last line; a shard it could not read is named with
    the dataset, and the command that checks every shard."""
    lines = str(exc).strip().splitlines()
    last = lines[-1] if lines else ""
    if isinstance(exc, DataError):  # ours: it names the shard and sample
        return DataError(TYPE_PREFIX.sub("", last))
    said = last if TYPE_PREFIX.match(last) else f"{type(exc).__name__}: {last}"
    return DataError(
        f"{path}: reading the {split} split failed ({said}); `python -m dataprep verify {path}` names every bad shard"
    )


def reading(batches: Iterable, path: Path, split: str) -> Iterator:
    """The loader's batches, its errors as one line each (read_error)."""
    try:
        yield from batches
    except READ_ERRORS as exc:
        raise read_error(path, split, exc) from None


def check_shards(path: Path) -> None:
    """A shard cut short (a copy or a conversion that did not finish) is named before the run reads any, from the
    end of its last sample in energon's index; the loader would fail on it mid-run without naming it."""
    for tar in sorted(path.rglob("*.tar")):
        end = energon_shard_end(tar)
        size = tar.stat().st_size
        if end is not None and size < end:
            raise DataError(
                f"{tar}: cut short ({size} bytes, its samples end at byte {end} by energon's index); copy or "
                f"convert it again, then check the dataset with `python -m dataprep verify {path}`"
            )


class FluxTaskEncoder(DefaultTaskEncoder):
    decoder = None  # parts stay bytes; the cooker decodes them (as NVIDIA's recipe does)
    # energon's Cooker bounds the cook's result to Sample, yet runs one that gives a CrudeSample (a dict: what batch()
    # collates) as well
    cookers = [Cooker(cook)]  # pyright: ignore[reportArgumentType] - the Sample bound, above

    def batch(self, samples: list[dict]) -> dict:
        return collate(samples, PARTS)


def _worker_config(rank: int, world: int, num_workers: int, seed: int) -> WorkerConfig:
    # a bad sample stops the run: energon's default handler logs and skips it, which silently changes the data
    return WorkerConfig(
        rank=rank, world_size=world, num_workers=num_workers, seed_offset=seed, global_error_handler=reraise_exception
    )


class EnergonTrainStream(TrainStream):
    """This rank's shuffled, infinite micro-batches from energon's savable loader. The order depends on the
    seed, world size and num_workers; the state restores exactly only under the same world size and
    num_workers (energon's "reproducible scaling"), so both are stored with it and checked."""

    def __init__(self, path: Path, rank: int, world: int, micro_batch: int, d: DataConfig, seed: int):
        self.rank, self.world, self.num_workers = rank, world, d.num_workers
        dataset = get_train_dataset(
            path,
            split_part="train",
            worker_config=_worker_config(rank, world, d.num_workers, seed),
            batch_size=micro_batch,
            shuffle_buffer_size=d.shuffle_buffer_size or None,
            max_samples_per_sequence=d.max_samples_per_sequence or None,
            task_encoder=FluxTaskEncoder(),
        )
        self.loader = get_savable_loader(dataset)
        self.path = path
        self._iter = None  # started by the first batch, i.e. after run_start: no data is read before it

    def __next__(self) -> dict:
        if self._iter is None:
            self._iter = reading(self.loader, self.path, "train")
        return next(self._iter)

    def state_dict(self) -> dict:
        # energon's state is a pickled dataclass; kept as bytes so the checkpoint loads with weights_only=True
        return {
            "rank": self.rank,
            "world_size": self.world,
            "num_workers": self.num_workers,
            "energon": pickle.dumps(self.loader.save_state_rank()),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        for key, mine in (("world_size", self.world), ("num_workers", self.num_workers), ("rank", self.rank)):
            if state_dict[key] != mine:
                raise ValueError(
                    f"data loader state was saved with {key}={state_dict[key]}, this run has {key}={mine}: energon "
                    f"resumes the exact sample order only with the same world size, num_workers and rank; "
                    f"resume with the original layout (data.num_workers, number of GPUs) or start the data fresh"
                )
        if self._iter is not None:
            raise RuntimeError("load_state_dict must be called before the first batch")
        self.loader.restore_state_rank(pickle.loads(state_dict["energon"]))


def val_counts(total: int, world: int, num_workers: int) -> list[int]:
    """Val samples per rank as energon splits them: contiguous slices over world x max(1, num_workers)
    global workers. One rank holding all the global workers yields every rank's boundaries at once."""
    workers = max(1, num_workers)
    offsets = split_samples_to_workers(total, world * workers)
    return [offsets[(r + 1) * workers] - offsets[r * workers] for r in range(world)]


class EnergonVal:
    """One call = one pass over this rank's part of the val split. Over all ranks every val sample is counted
    exactly once, and every rank yields the same number of batches (FSDP all-gathers in every forward):
    short batches are padded with copies of a real val sample marked valid=False."""

    def __init__(
        self,
        path: Path,
        rank: int,
        world: int,
        batch: int,
        num_workers: int,
        check_sample: Callable[[dict], None] = lambda sample: None,
    ):
        self.path, self.rank, self.world, self.num_workers, self.batch = path, rank, world, num_workers, batch
        self.size = len(self._dataset(0, 1, 0))  # from the index: no sample is read here
        if self.size == 0:
            raise DataError(f"{path}: the val split is empty")
        counts = val_counts(self.size, world, num_workers)
        mine = len(self._dataset(rank, world, num_workers))
        if mine != counts[rank]:
            raise RuntimeError(
                f"energon gives rank {rank} {mine} val samples, val_counts() predicts "
                f"{counts[rank]}: energon's split changed, update val_counts"
            )
        self.mine = counts[rank]
        self.num_batches = math.ceil(max(counts) / batch)
        self._template = None  # read at the first pass: nothing reads a sample before run_start
        self._check_sample = check_sample

    def _dataset(self, rank: int, world: int, workers: int):
        return get_val_dataset(
            self.path,
            split_part="val",
            worker_config=_worker_config(rank, world, workers, 0),
            batch_size=None,  # pyright: ignore[reportArgumentType] - typed int; build_batch takes None: no batching
            task_encoder=FluxTaskEncoder(),
        )

    def template(self) -> dict:
        """The split's first sample: the padding of short batches, and the sample the dims are checked on."""
        if self._template is None:
            self._template = self._checked(next(reading(get_loader(self._dataset(0, 1, 0)), self.path, "val")))
            self._check_sample(self._template)
        return self._template

    @staticmethod
    def _checked(sample: dict) -> dict:
        if "timestep" not in sample:
            raise DataError(f"{sample_where(sample)}: val sample without a timestep in its json")
        return sample

    def _collate(self, real: list[dict]) -> dict:
        out = collate(real + [self.template()] * (self.batch - len(real)), PARTS + ("timestep",))
        out["valid"] = torch.arange(self.batch) < len(real)
        return out

    def __call__(self) -> Iterator[dict]:
        # a fresh dataset and loader per pass: energon resumes a re-iterated one where an abandoned pass stopped
        self.template()  # the dims check runs before the first forward
        pending, batches, seen = [], 0, 0
        loader = get_loader(self._dataset(self.rank, self.world, self.num_workers))
        for sample in reading(loader, self.path, "val"):
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


class DimsCheck:
    """The data's dims against the model and the empty encodings, each mismatch named in one line: from the dataset's
    own description (format.METADATA) before anything is built, and on the first val sample, which must be what
    the description says (a dataset without one, as NVIDIA's tools prepare it, is checked on that sample alone)."""

    def __init__(
        self,
        path: Path,
        info: DatasetInfo | None,
        empty_t5: torch.Tensor,
        empty_clip: torch.Tensor,
        m: ModelConfig,
        empty_dir: Path,
    ):
        self.path, self.info, self.m, self.empty_dir = path, info, m, empty_dir
        self.empty = {"t5": list(empty_t5.shape[1:]), "clip": list(empty_clip.shape[1:])}
        if info is not None:
            self.check({part: list(info.shape.of(part)) for part in PARTS}, f"{path / METADATA}: the dataset's samples")

    def check(self, dims: dict[str, list[int]], what: str) -> None:
        m = self.m
        for part, key in (("t5", "joint_attention_dim"), ("clip", "pooled_projection_dim")):
            if dims[part][-1] != getattr(m, key):
                raise DataError(
                    f"{what} have {part} {dims[part]}, the model takes {part} of width model.{key} "
                    f"{getattr(m, key)}; use a model config with flux-schnell's input dims"
                )
        channels, height, width = dims["mean"]
        if 4 * channels != m.in_channels or height % 2 or width % 2:
            raise DataError(
                f"{what} have latents {dims['mean']}, the model takes {m.in_channels // 4} channels "
                f"(model.in_channels {m.in_channels}) of even height and width (2x2 patches)"
            )
        for part in ("t5", "clip"):
            if self.empty[part] != dims[part]:
                raise DataError(
                    f"{what} have {part} {dims[part]}, the empty encodings in {self.empty_dir} "
                    f"{self.empty[part]}; point data.empty_encodings at the ones made for this data"
                )

    def __call__(self, sample: dict) -> None:
        dims = {part: list(sample[part].shape) for part in PARTS}
        if self.info is not None and any(dims[p] != list(self.info.shape.of(p)) for p in PARTS):
            raise DataError(
                f"{sample_where(sample)}: t5 {dims['t5']}, mean {dims['mean']}, but "
                f"{self.path / METADATA} says L,H,W {self.info.shape}; check the dataset with "
                f"`python -m dataprep verify {self.path}`"
            )
        self.check(dims, f"{sample_where(sample)}: the samples")


def _fixture(cfg: Config) -> Path:
    from dataprep.fixture import ensure_fixture  # only debug runs write data

    d = cfg.data
    root = Path(d.fixture_dir) if d.fixture_dir else Path(cfg.logging.out_dir) / "fixture"
    return ensure_fixture(
        root,
        train=d.synthetic_train_samples,
        val=d.synthetic_val_samples,
        text_len=d.synthetic_text_len,
        height=d.synthetic_latent_size,
        width=d.synthetic_latent_size,
        seed=cfg.train.seed,
    )


def check_digests(path: Path, seed: int) -> list[str]:
    """Each split's shards against the digests dataprep wrote as it made them (digests.check: the start of every
    shard and a few pieces of the split, drawn from `seed`: the same on every rank, read once per node); returns the
    splits that have none (made by another tool)."""
    without = []
    for split in ("train", "val"):
        folder = path / split
        try:
            entries = digests.read(folder)
        except ValueError as exc:
            raise DataError(f"{exc}; convert the dataset again") from None
        if entries is None:
            without.append(split)
            continue
        problems = digests.check(folder, sorted(p.name for p in folder.glob("*.tar")), entries, random.Random(seed))
        if problems:
            raise DataError(
                f"{problems[0]}; copy or convert it again, then check the dataset with `python -m dataprep verify {path}`"
            )
    return without


class DatasetFiles(NamedTuple):
    """What a run reads of the dataset before its first sample, checked against the config."""

    path: Path
    empty_t5: torch.Tensor
    empty_clip: torch.Tensor
    dims: DimsCheck
    undigested: list[str]  # splits without shard digests (data made by other tools): said once, not an error


def dataset_files(cfg: Config) -> DatasetFiles:
    """The dataset (data.path, or the fixture, written on first use), its shards' ends, its empty encodings and its
    description of itself, each checked against the model: preflight.check_inputs runs it before init_start."""
    d = cfg.data
    path = Path(d.path) if d.path else _fixture(cfg)
    if not (path / ".nv-meta" / "dataset.yaml").is_file():
        raise DataError(
            f"{path}: not a prepared energon dataset (no .nv-meta/dataset.yaml); run "
            f"`python -m dataprep prepare {path}`"
        )
    check_shards(path)
    undigested = check_digests(path, cfg.train.seed)
    empty_dir = Path(d.empty_encodings) if d.empty_encodings else path / "empty_encodings"
    try:
        empty_t5, empty_clip = load_empty_encodings(empty_dir)
        info = read_info(path)
    except FormatError as exc:
        raise DataError(str(exc)) from None
    dims = DimsCheck(path, info, empty_t5, empty_clip, cfg.model, empty_dir)
    return DatasetFiles(path, empty_t5, empty_clip, dims, undigested)


def build_energon(cfg: Config, rank: int, world: int, files: DatasetFiles | None = None) -> DataSource:
    """The loaders over `files` (dataset_files(cfg) if not given: it scans every shard)."""
    d = cfg.data
    path, empty_t5, empty_clip, dims, undigested = files if files is not None else dataset_files(cfg)
    if not d.path and rank == 0:
        print(
            f"flux-train: data.path is unset, training on the fixture dataset {path} (a debug set: "
            f"{d.synthetic_train_samples} train, {d.synthetic_val_samples} val samples)",
            flush=True,
        )
    if undigested and rank == 0:
        print(
            f"flux-train: note: {path} has no shard digests in {' and '.join(undigested)} (made by another tool than "
            f"python -m dataprep): their contents are not checked",
            flush=True,
        )
    try:
        val = EnergonVal(path, rank, world, cfg.eval.batch_size, d.num_workers, check_sample=dims)
        train = EnergonTrainStream(path, rank, world, cfg.train.micro_batch_size, d, cfg.train.seed)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - energon reports garbled metadata (.nv-meta) with many exception types
        said = " ".join(str(exc).split())[:300]
        raise DataError(
            f"{path}: energon cannot open it ({type(exc).__name__}: {said}); rewrite its metadata with "
            f"`python -m dataprep prepare {path}`"
        ) from None
    return DataSource(train, val, empty_t5, empty_clip, val.size)
