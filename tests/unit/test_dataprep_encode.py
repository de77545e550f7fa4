"""`encode`'s resize rules: the crop keeps the centre of the shorter side scaled to 256, rounds the longer side up,
and squash ignores the aspect. `encode` and `empty-encodings` with the tiny encoders end to end:
tests/runs/test_dataprep_encode.py."""

import numpy as np
import pytest
from PIL import Image

from dataprep import images


def stripes(size, horizontal, colors):
    """Three equal stripes of the given colours across the longer side."""
    image = Image.new("RGB", size)
    w, h = size
    for i, color in enumerate(colors):
        box = (i * w // 3, 0, (i + 1) * w // 3, h) if horizontal else (0, i * h // 3, w, (i + 1) * h // 3)
        image.paste(color, box)
    return image


@pytest.mark.parametrize("size,horizontal", [((768, 256), True), ((1536, 512), True), ((300, 900), False)])
def test_crop_rule_keeps_the_centre_of_the_shorter_side_scaled_to_256(size, horizontal):
    red, green, blue = (255, 0, 0), (0, 255, 0), (0, 0, 255)
    out = images.resize_crop(stripes(size, horizontal, [red, green, blue]))
    assert out.size == (256, 256)
    array = np.asarray(out).astype(int)
    assert np.abs(array[2:-2, 2:-2] - np.array(green)).max() <= 2  # only the centre stripe survives


def test_crop_rounds_the_longer_side_up_and_squash_ignores_aspect():
    image = Image.new("RGB", (301, 257), (10, 20, 30))
    assert images.resize_crop(image).size == (256, 256)
    halves = Image.new("RGB", (512, 200), (255, 0, 0))
    halves.paste((0, 0, 255), (256, 0, 512, 200))
    out = np.asarray(images.resize_squash(halves)).astype(int)
    assert out.shape == (256, 256, 3)
    assert (out[:, :120] == [255, 0, 0]).all() and (out[:, 136:] == [0, 0, 255]).all()  # both halves stay
    tensor = images.to_tensor(Image.new("RGB", (4, 4), (255, 0, 255)))
    assert tensor.shape == (3, 4, 4) and tensor[0].eq(1).all() and tensor[1].eq(-1).all()
