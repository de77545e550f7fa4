"""Image decoding and the resize rules of the reference (docs/data-format.md)."""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from PIL import Image

from dataprep.format import IMAGE_SIZE


def decode(data: bytes) -> Image.Image:
    """RGB image from encoded bytes; raises ValueError naming the problem."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad files
        raise ValueError(f"undecodable image ({type(exc).__name__}: {exc})") from None
    return image.convert("RGB")


def resize_crop(image: Image.Image, size: int = IMAGE_SIZE) -> Image.Image:
    """CC12M: shorter side to `size` (bicubic, longer side rounded up), then the centred size x size crop."""
    width, height = image.size
    scale = size / min(width, height)
    new_w, new_h = max(size, math.ceil(width * scale)), max(size, math.ceil(height * scale))
    image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return image.crop((left, top, left + size, top + size))


def resize_squash(image: Image.Image, size: int = IMAGE_SIZE) -> Image.Image:
    """COCO: straight to size x size (bicubic), aspect ratio not kept."""
    return image.resize((size, size), Image.Resampling.BICUBIC)


RESIZE = {"crop": resize_crop, "squash": resize_squash}


def to_tensor(image: Image.Image) -> torch.Tensor:
    """[3, H, W] float in [-1, 1], as the reference feeds the VAE."""
    array = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
    return torch.from_numpy(array.copy()).float() / 127.5 - 1.0
