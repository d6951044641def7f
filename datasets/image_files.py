"""Reading image files, and checking a whole set of them before training starts.

Every failure names the file: one that is missing, cannot be decoded (corrupt, truncated, not an image),
or whose size is not the one its annotation entry records (the boxes would then be misplaced).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

EXAMPLES = 5  # files named in a message about many


class ImageReadError(OSError):
    """An image that cannot be used; the message names the file (and, during training, the last checkpoint)."""


def read_image(path: Path, *, image_id: int, expected_size: tuple[int | None, int | None],
               draft: bool = False) -> Image.Image:
    """The RGB image at ``path``, decoded in full (a truncated file fails here, not later).

    ``expected_size`` is (width, height) from the annotation file, either possibly None (not recorded).
    ``draft`` lets JPEG decode at 1/8 scale: every byte is still read and entropy-decoded, so damage is
    still found, in a fraction of the time (used to check a set, never to train).
    """
    try:
        with Image.open(path) as pil:
            width, height = pil.size
            if draft:
                pil.draft("RGB", (max(1, width // 8), max(1, height // 8)))
            pil = pil.convert("RGB")
    except FileNotFoundError as error:
        raise ImageReadError(f"image {path} (image id {image_id}) does not exist") from error
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise ImageReadError(f"cannot read image {path} (image id {image_id}): {error}") from error
    expected = (expected_size[0] or width, expected_size[1] or height)
    if (width, height) != expected:
        raise ImageReadError(f"image {path} (image id {image_id}) is {width}x{height} but the annotation file says "
                             f"{expected[0]}x{expected[1]}: its boxes would be misplaced")
    return pil


def check_files_exist(image_dir: Path, images: list[dict], *, annotation_file: Path) -> None:
    """Every image the annotation file lists is a file in ``image_dir``; one error listing what is missing."""
    missing = [image["file_name"] for image in images if not (image_dir / image["file_name"]).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} of the {len(images)} images listed in {annotation_file} are not in {image_dir} "
            f"(e.g. {', '.join(missing[:EXAMPLES])}); check that the image directory and the annotation file "
            "belong together")


def check_images_open(image_dir: Path, images: list[dict], *, annotation_file: Path) -> None:
    """Decode every image once (threads: Pillow's decoders release the GIL); one error listing the bad ones."""

    def problem(image: dict) -> str | None:
        try:
            read_image(image_dir / image["file_name"], image_id=image["id"],
                       expected_size=(image.get("width"), image.get("height")), draft=True)
        except ImageReadError as error:
            return str(error)
        return None

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        problems = [p for p in pool.map(problem, images) if p]
    if problems:
        raise ImageReadError(f"{len(problems)} of the {len(images)} images of {annotation_file} cannot be used: "
                             + "; ".join(problems[:EXAMPLES]) + ("; ..." if len(problems) > EXAMPLES else ""))
