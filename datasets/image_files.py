"""Reading image files as cameras and tools write them, and checking a whole set before training starts.

An image is shown as its EXIF orientation says (as PIL's ``ImageOps.exif_transpose`` turns it, and as viewers
and annotation tools show it), and its size is checked after that turn. Grayscale, palette, CMYK and images
with an alpha channel become RGB (alpha dropped, as the original does); 16-bit ones are scaled to 8 bits
rather than clipped (a 16-bit PNG would otherwise be all white); 32-bit float pixels are refused by name.
Every failure names the file: one that is missing, cannot be decoded (corrupt, truncated, not an image), has
pixels of no usable kind, or whose size is not the one its annotation entry records (the boxes would then be
misplaced).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

EXAMPLES = 5  # files named in a message about many


class ImageReadError(OSError):
    """An image that cannot be used; the message names the file (and, during training, the last checkpoint)."""


EXIF_ORIENTATION = 0x0112
TURNED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")


def read_image(
    path: Path, *, image_id: int, expected_size: tuple[int | None, int | None], draft: bool = False
) -> Image.Image:
    """The RGB image at ``path`` as its EXIF orientation shows it, decoded in full (a truncated file fails
    here, not later).

    ``expected_size`` is (width, height) from the annotation file, either possibly None (not recorded).
    ``draft`` lets JPEG decode at 1/8 scale: every byte is still read and entropy-decoded, so damage is
    still found, in a fraction of the time (used to check a set, never to train).
    """
    try:
        with Image.open(path) as pil:
            stored = pil.size  # (w, h) of the pixels as stored
            orientation = pil.getexif().get(EXIF_ORIENTATION, 1)
            if draft:
                pil.draft("RGB", (max(1, stored[0] // 8), max(1, stored[1] // 8)))
            pil = _to_rgb(ImageOps.exif_transpose(pil), path=path, image_id=image_id)
    except FileNotFoundError as error:
        raise ImageReadError(f"image {path} (image id {image_id}) does not exist") from error
    except ImageReadError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise ImageReadError(f"cannot read image {path} (image id {image_id}): {error}") from error
    width, height = (stored[1], stored[0]) if orientation in TURNED else stored
    expected = (expected_size[0] or width, expected_size[1] or height)
    if (width, height) != expected:
        turned = ""
        if orientation in TURNED:
            turned = (
                f" after its EXIF orientation ({orientation}) turns it; its pixels are stored as "
                f"{stored[0]}x{stored[1]}"
                + (
                    ", the size the annotation file records: were its boxes drawn on the unturned pixels?"
                    if stored == expected
                    else ""
                )
            )
        raise ImageReadError(
            f"image {path} (image id {image_id}) is {width}x{height}{turned} but the annotation file "
            f"says {expected[0]}x{expected[1]}: its boxes would be misplaced"
        )
    return pil


def _to_rgb(pil: Image.Image, *, path: Path, image_id: int) -> Image.Image:
    """8-bit RGB of any of PIL's image modes that has one; an ImageReadError naming the file otherwise."""
    if pil.mode in SIXTEEN_BIT or pil.mode == "I":
        pixels = np.asarray(pil)
        if pixels.size and (pixels.min() < 0 or pixels.max() > 65535):
            raise ImageReadError(
                f"image {path} (image id {image_id}) has 32-bit integer pixels beyond 16 bits "
                f"(mode {pil.mode}); save it as 8- or 16-bit"
            )
        # 16-bit values to 8 bits; a 32-bit integer image whose values fit 8 bits is kept as it is.
        shift = 8 if pil.mode in SIXTEEN_BIT or (pixels.size and pixels.max() > 255) else 0
        return Image.fromarray((pixels.astype(np.uint32) >> shift).astype(np.uint8), mode="L").convert("RGB")
    if pil.mode == "F":
        raise ImageReadError(
            f"image {path} (image id {image_id}) has 32-bit floating-point pixels (mode F), which "
            "have no standard range; save it as an 8- or 16-bit image"
        )
    return pil.convert("RGB")


def check_files_exist(image_dir: Path, images: list[dict], *, annotation_file: Path) -> None:
    """Every image the annotation file lists is a file in ``image_dir``; one error listing what is missing."""
    missing = [image["file_name"] for image in images if not (image_dir / image["file_name"]).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} of the {len(images)} images listed in {annotation_file} are not in {image_dir} "
            f"(e.g. {', '.join(missing[:EXAMPLES])}); check that the image directory and the annotation file "
            "belong together"
        )


def check_images_open(image_dir: Path, images: list[dict], *, annotation_file: Path) -> None:
    """Decode every image once (threads: Pillow's decoders release the GIL); one error listing the bad ones."""

    def problem(image: dict) -> str | None:
        try:
            read_image(
                image_dir / image["file_name"],
                image_id=image["id"],
                expected_size=(image.get("width"), image.get("height")),
                draft=True,
            )
        except ImageReadError as error:
            return str(error)
        return None

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        problems = [p for p in pool.map(problem, images) if p]
    if problems:
        raise ImageReadError(
            f"{len(problems)} of the {len(images)} images of {annotation_file} cannot be used: "
            + "; ".join(problems[:EXAMPLES])
            + ("; ..." if len(problems) > EXAMPLES else "")
        )
