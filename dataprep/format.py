"""The on-disk sample format, its one owner: flux_train reads it through this module and dataprep writes and
checks it through it. It imports nothing from either package.

A dataset root holds `train/` and `val/` (energon CrudeWebdataset shards with `index.txt`), `empty_encodings/`
and `.nv-meta/` (energon's index, plus `flux_dataset.yaml`: the sample shape and counts, written by
`python -m dataprep prepare`). A sample is KEY.json ({"key": source key, "timestep": k} - timestep for val
only, k in 0..7) and KEY.t5.bytes [L, 4096], KEY.clip.bytes [768], KEY.mean.bytes and KEY.logvar.bytes
[16, H, W], each the np.save bytes of a bf16 array viewed as uint16. KEY is a zero-padded integer, unique
across train and val (val continues after train), with no dot. The empty encodings t5_empty.npy [1, L, 4096]
and clip_empty.npy [1, 768] are float16 values, as the reference's save_empty_encodings.py writes them.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import yaml

if TYPE_CHECKING:  # the functions that make tensors import torch: the command lines read Shape and the errors first
    import torch

PARTS = ("t5", "clip", "mean", "logvar")
T5_DIM, CLIP_DIM, LATENT_CHANNELS = 4096, 768, 16
IMAGE_SIZE = 256  # the task's images: 256x256 (32x32 latents)
EVAL_TIMESTEP_BINS = 8  # a val sample's timestep k is in 0..7; the eval noises it at t = k/8
EMPTY_T5, EMPTY_CLIP = "t5_empty.npy", "clip_empty.npy"
METADATA = Path(".nv-meta") / "flux_dataset.yaml"  # relative to the dataset root
BF16_EXPONENT = 0x7F80  # all exponent bits set: Inf or NaN


class FormatError(ValueError):
    """The data on disk breaks the format; the message names the file and the fix (the trainer reports it as its
    data error)."""


class DataprepError(Exception):
    """Bad input or an unfinished/incompatible output; the message names the file and sample and the fix."""

    exit_code = 2  # bad input, as flux_train.errors.EXIT_BAD_INPUT


class DataprepStorageError(DataprepError):
    """A file dataprep must write could not be written (a full disk, a quota): not a bad input, the same command
    resumes once there is room."""

    exit_code = 74  # as flux_train.errors.EXIT_STORAGE


@dataclass(frozen=True)
class Shape:
    """Sample sizes: T5 text length L and latent height H, width W (the real data: 256, 32, 32)."""

    text_len: int = 256
    height: int = 32
    width: int = 32

    @classmethod
    def parse(cls, text: str) -> "Shape":
        try:
            values = [int(v) for v in str(text).split(",")]
            shape = cls(*values)
        except (TypeError, ValueError):
            raise DataprepError(f"shape {text!r}: expected L,H,W (e.g. 256,32,32)") from None
        if min(values) <= 0 or len(values) != 3:
            raise DataprepError(f"shape {text!r}: expected three positive integers L,H,W")
        return shape

    def of(self, part: str) -> tuple[int, ...]:
        return {
            "t5": (self.text_len, T5_DIM),
            "clip": (CLIP_DIM,),
            "mean": (LATENT_CHANNELS, self.height, self.width),
            "logvar": (LATENT_CHANNELS, self.height, self.width),
        }[part]

    def __str__(self) -> str:
        return f"{self.text_len},{self.height},{self.width}"


# ---------------------------------------------------------------------------------------------- samples


def key_name(index: int) -> str:
    return f"{index:08d}"


def encode_bf16(tensor: torch.Tensor) -> bytes:
    """bf16 tensor -> np.save bytes of its uint16 view (the MLCommons encoding)."""
    import torch

    buf = io.BytesIO()
    np.save(buf, tensor.detach().cpu().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16))
    return buf.getvalue()


def decode_bf16(raw: bytes) -> torch.Tensor:
    """np.save bytes of a bf16 array viewed as uint16 -> the bf16 tensor (bits unchanged)."""
    array = np.load(io.BytesIO(raw), allow_pickle=False)
    if array.dtype != np.uint16:
        raise ValueError(f"dtype {array.dtype}, expected uint16 (bf16 bits)")
    import torch

    return torch.from_numpy(array).view(torch.bfloat16)


def tar_sample(index: int, source_key: str, parts: dict[str, bytes], timestep: Optional[int]) -> dict:
    """The members of one sample for webdataset's TarWriter; json bytes as NVIDIA's writer makes them."""
    meta: dict[str, str | int] = {"key": source_key}
    if timestep is not None:
        meta["timestep"] = timestep
    sample = {"__key__": key_name(index), "json": json.dumps(meta).encode()}
    sample.update({f"{part}.bytes": parts[part] for part in PARTS})
    return sample


def sample_meta(sample: dict) -> dict:
    """The json part: bytes with energon's decoder off (ours and NVIDIA's), a dict with its default decoder."""
    meta = sample.get("json")
    if meta is None:
        return {}
    return json.loads(meta) if isinstance(meta, (bytes, str)) else dict(meta)


def sample_where(sample: dict) -> str:
    """`shard: sample KEY` of a crude sample (`__shard__`) or a cooked one (energon's `__sources__`)."""
    sources = sample.get("__sources__") or ()
    shard = sample.get("__shard__") or (getattr(sources[0], "shard_name", None) if sources else None)
    return f"{shard or '?'}: sample {sample.get('__key__', '?')}"


# ---------------------------------------------------------------------------------------------- checks


def check_part(part: str, raw, shape: Optional[Shape]) -> Optional[str]:
    """What is wrong with one part's bytes, or None; shape None checks everything but the shape."""
    if not isinstance(raw, (bytes, bytearray)) or not raw:
        return f"{part}: missing or empty"
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not npy bytes"
        return f"{part}: not np.save bytes ({exc})"
    if array.dtype != np.uint16:
        return f"{part}: dtype {array.dtype}, expected uint16 (bf16 bits)"
    if shape is not None and array.shape != shape.of(part):
        return f"{part}: shape {list(array.shape)}, expected {list(shape.of(part))}"
    if ((array & BF16_EXPONENT) == BF16_EXPONENT).any():
        return f"{part}: contains NaN or Inf"
    return None


def check_timestep(value, val: bool) -> Optional[str]:
    if not val:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return f"timestep: {value!r}, expected an integer 0..{EVAL_TIMESTEP_BINS - 1} (val samples need one)"
    if not 0 <= value < EVAL_TIMESTEP_BINS:
        return f"timestep: {value}, expected 0..{EVAL_TIMESTEP_BINS - 1}"
    return None


def check_sample(source_key, parts: dict, timestep, val: bool, shape: Optional[Shape]) -> list[str]:
    """Every problem of one input sample (empty list = good)."""
    good_key = isinstance(source_key, str) and source_key
    problems = [] if good_key else [f"key: {source_key!r}, expected a non-empty string"]
    problems += [p for p in (check_part(part, parts.get(part), shape) for part in PARTS) if p]
    problem = check_timestep(timestep, val)
    return problems + ([problem] if problem else [])


def shape_of(parts: dict[str, bytes]) -> Shape:
    """L,H,W of a sample from its t5 and mean bytes."""
    (text_len, _), (_, height, width) = (
        np.load(io.BytesIO(parts[p]), allow_pickle=False).shape for p in ("t5", "mean")
    )
    return Shape(text_len, height, width)


# ---------------------------------------------------------------------------------------------- the dataset


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset says about itself (METADATA): the sample shape and the samples and shards per split."""

    shape: Shape
    splits: dict  # split -> {"samples": n, "shards": n}


def write_info(root: Path, info: DatasetInfo) -> Path:
    path = Path(root) / METADATA
    described = {
        "shape": str(info.shape),
        "parts": {part: list(info.shape.of(part)) for part in PARTS},
        "splits": info.splits,
    }
    path.write_text(
        "# written by `python -m dataprep prepare`; `verify` and the trainer check the data against it\n"
        + yaml.safe_dump(described, sort_keys=False, default_flow_style=None)
    )
    return path


def read_info(root: Path) -> Optional[DatasetInfo]:
    """The dataset's METADATA, or None if it has none (a dataset prepared by energon's own tool)."""
    path = Path(root) / METADATA
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
        return DatasetInfo(Shape.parse(raw["shape"]), {s: dict(c) for s, c in raw["splits"].items()})
    except (yaml.YAMLError, DataprepError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise FormatError(
            f"{path}: unreadable ({type(exc).__name__}: {exc}); rewrite it with `python -m dataprep prepare {root}`"
        ) from None


def write_empty_encodings(folder: Path, t5: torch.Tensor, clip: torch.Tensor) -> None:
    """t5_empty.npy [1,L,4096] and clip_empty.npy [1,768] as float16 values (unlike the dataset's bf16 bits)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensor in ((EMPTY_T5, t5), (EMPTY_CLIP, clip)):
        np.save(folder / name, tensor.detach().cpu().float().numpy().astype(np.float16))


def load_empty_encodings(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """t5_empty.npy [1,L,4096] and clip_empty.npy [1,768] -> bf16. They hold float16 values (not bf16 bits like
    the dataset), so they are converted by value: never .view() them."""
    import torch

    out = []
    for name, ndim in ((EMPTY_T5, 3), (EMPTY_CLIP, 2)):
        file = folder / name
        if not file.is_file():
            raise FormatError(
                f"{file}: missing; write it with `python -m dataprep empty-encodings` or point "
                f"data.empty_encodings at the folder holding {EMPTY_T5} and {EMPTY_CLIP}"
            )
        try:
            array = np.load(file, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:  # cut short, or not npy at all
            raise FormatError(f"{file}: not a readable .npy file ({exc}); write it again") from None
        if array.dtype not in (np.float16, np.float32):
            raise FormatError(
                f"{file}: dtype {array.dtype}, expected float16 values (as save_empty_encodings.py writes them)"
            )
        if array.ndim != ndim or array.shape[0] != 1:
            raise FormatError(f"{file}: shape {list(array.shape)}, expected {ndim} dims with a leading 1")
        out.append(torch.from_numpy(array).to(torch.bfloat16))
    return out[0], out[1]
