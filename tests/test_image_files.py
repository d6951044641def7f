"""Images as cameras and tools write them (datasets/image_files.py): EXIF orientation applied and the size checked
after it, 16-bit, palette, grayscale and alpha images converted to RGB, pixels with no usable kind refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from datasets.image_files import ImageReadError, read_image


def load(path, size):
    return np.asarray(read_image(path, image_id=7, expected_size=size))


def test_exif_orientation_is_applied_and_the_size_checked_after_it(tmp_path):
    pixels = np.zeros((30, 40, 3), np.uint8)  # stored 40 wide, 30 high
    pixels[:5, :5] = (255, 0, 0)  # a red corner at the stored top left
    path = tmp_path / "turned.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise
    Image.fromarray(pixels).save(path, exif=exif, quality=100)
    shown = load(path, (30, 40))  # the annotation records the size as shown
    assert shown.shape == (40, 30, 3)
    assert shown[:5, -5:, 0].mean() > 200 and shown[:5, :5, 0].mean() < 50  # the corner went to the top right
    with pytest.raises(
        ImageReadError,
        match=r"turned\.jpg \(image id 7\) is 30x40 after its EXIF orientation \(6\) "
        r"turns it; its pixels are stored as 40x30, the size the annotation file "
        r"records: were its boxes drawn on the unturned pixels\?",
    ):
        load(path, (40, 30))


def test_an_image_without_orientation_keeps_its_pixels(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 255, (20, 24, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "plain.png")
    assert np.array_equal(load(tmp_path / "plain.png", (24, 20)), pixels)
    with pytest.raises(ImageReadError, match=r"plain\.png \(image id 7\) is 24x20 but the annotation file says 20x24"):
        load(tmp_path / "plain.png", (20, 24))


@pytest.mark.parametrize("mode", ["I;16", "I"])
def test_sixteen_bit_images_are_scaled_to_eight_bits_not_clipped(tmp_path, mode):
    values = np.array([[0, 256, 32768, 65535]], np.uint16).repeat(3, axis=0)
    image = Image.fromarray(values) if mode == "I;16" else Image.fromarray(values.astype(np.int32), mode="I")
    path = tmp_path / ("deep.png" if mode == "I;16" else "deep.tif")  # PNG has no 32-bit integer mode
    image.save(path)
    rgb = load(path, (4, 3))
    assert rgb.shape == (3, 4, 3) and rgb[0, :, 0].tolist() == [0, 1, 128, 255]
    assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()


def test_palette_grayscale_and_alpha_images_become_rgb(tmp_path):
    colours = np.array([[[10, 20, 30], [200, 100, 50]]], np.uint8)
    Image.fromarray(colours).convert("P", palette=Image.Palette.ADAPTIVE, colors=4).save(tmp_path / "p.png")
    assert np.abs(load(tmp_path / "p.png", (2, 1)).astype(int) - colours).max() <= 2
    Image.fromarray(np.array([[0, 77, 255]], np.uint8), mode="L").save(tmp_path / "l.png")
    assert load(tmp_path / "l.png", (3, 1))[0].tolist() == [[0, 0, 0], [77, 77, 77], [255, 255, 255]]
    rgba = np.array([[[1, 2, 3, 0], [250, 251, 252, 128]]], np.uint8)
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "a.png")
    assert load(tmp_path / "a.png", (2, 1)).tolist() == [[[1, 2, 3], [250, 251, 252]]]  # alpha dropped
    Image.fromarray(np.array([[9, 99]], np.uint8), mode="L").convert("LA").save(tmp_path / "la.png")
    assert load(tmp_path / "la.png", (2, 1))[0, :, 0].tolist() == [9, 99]


def test_float_pixels_are_refused_by_name(tmp_path):
    Image.fromarray(np.ones((3, 3), np.float32) * 0.5, mode="F").save(tmp_path / "float.tif")
    with pytest.raises(ImageReadError, match=r"float\.tif \(image id 7\) has 32-bit floating-point pixels \(mode F\)"):
        load(tmp_path / "float.tif", (3, 3))
