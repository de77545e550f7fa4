"""The dataset format, write side and checks (DESIGN.md §4); flux_train.data reads it.

A sample is KEY.json ({"key": source key, "timestep": k} - timestep for val only) and KEY.t5.bytes,
KEY.clip.bytes, KEY.mean.bytes, KEY.logvar.bytes, each the np.save bytes of a bf16 array viewed as uint16.
KEY is a zero-padded integer, unique across train and val (val continues after train), with no dot.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from flux_train.data import EMPTY_CLIP, EMPTY_T5, LATENT_CHANNELS, PARTS
from flux_train.flow import EVAL_TIMESTEP_BINS

T5_DIM, CLIP_DIM = 4096, 768
BF16_EXPONENT = 0x7F80  # all exponent bits set: Inf or NaN


class DataprepError(Exception):
    """Bad input or an unfinished/incompatible output; the message names the file and sample and the fix."""


@dataclass(frozen=True)
class Shape:
    """Sample sizes: T5 text length L and latent height H, width W (the real data: 256, 32, 32)."""
    text_len: int = 256
    height: int = 32
    width: int = 32

    @classmethod
    def parse(cls, text: str) -> "Shape":
        try:
            values = [int(v) for v in text.split(",")]
            shape = cls(*values)
        except (TypeError, ValueError):
            raise DataprepError(f"--shape {text!r}: expected L,H,W (e.g. 256,32,32)") from None
        if min(values) <= 0 or len(values) != 3:
            raise DataprepError(f"--shape {text!r}: expected three positive integers L,H,W")
        return shape

    def of(self, part: str) -> tuple[int, ...]:
        return {"t5": (self.text_len, T5_DIM), "clip": (CLIP_DIM,),
                "mean": (LATENT_CHANNELS, self.height, self.width),
                "logvar": (LATENT_CHANNELS, self.height, self.width)}[part]

    def __str__(self) -> str:
        return f"{self.text_len},{self.height},{self.width}"


def key_name(index: int) -> str:
    return f"{index:08d}"


def encode_bf16(tensor: torch.Tensor) -> bytes:
    """bf16 tensor -> np.save bytes of its uint16 view (the MLCommons encoding)."""
    buf = io.BytesIO()
    np.save(buf, tensor.detach().cpu().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16))
    return buf.getvalue()


def write_empty_encodings(folder: Path, t5: torch.Tensor, clip: torch.Tensor) -> None:
    """t5_empty.npy [1,L,4096] and clip_empty.npy [1,768] as float16 values, as the reference's
    save_empty_encodings.py writes them (unlike the dataset's bf16 bits)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensor in ((EMPTY_T5, t5), (EMPTY_CLIP, clip)):
        np.save(folder / name, tensor.detach().cpu().float().numpy().astype(np.float16))


def tar_sample(index: int, source_key: str, parts: dict[str, bytes], timestep: Optional[int]) -> dict:
    """The members of one sample for webdataset's TarWriter; json bytes as NVIDIA's writer makes them."""
    meta = {"key": source_key}
    if timestep is not None:
        meta["timestep"] = timestep
    sample = {"__key__": key_name(index), "json": json.dumps(meta).encode()}
    sample.update({f"{part}.bytes": parts[part] for part in PARTS})
    return sample


def check_part(part: str, raw, shape: Shape) -> Optional[str]:
    """What is wrong with one part's bytes, or None."""
    if not isinstance(raw, (bytes, bytearray)) or not raw:
        return f"{part}: missing or empty"
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not npy bytes"
        return f"{part}: not np.save bytes ({exc})"
    if array.dtype != np.uint16:
        return f"{part}: dtype {array.dtype}, expected uint16 (bf16 bits)"
    if array.shape != shape.of(part):
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


def check_sample(source_key, parts: dict, timestep, val: bool, shape: Shape) -> list[str]:
    """Every problem of one input sample (empty list = good)."""
    good_key = isinstance(source_key, str) and source_key
    problems = [] if good_key else [f"key: {source_key!r}, expected a non-empty string"]
    problems += [p for p in (check_part(part, parts.get(part), shape) for part in PARTS) if p]
    problem = check_timestep(timestep, val)
    return problems + ([problem] if problem else [])
