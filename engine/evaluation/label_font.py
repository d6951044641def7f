"""The font detection labels are drawn in: one with wide coverage found on the system (PIL's default has no glyph
for "â" or "猫"), and the category id instead of a class name the font cannot draw (never a row of empty boxes)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from PIL import ImageFont

# In order of preference: the widest coverage first (CJK included), then fonts most systems have.
FONT_FILES = (
    "NotoSansCJK-Regular.ttc",
    "NotoSansCJKsc-Regular.otf",
    "NotoSans-Regular.ttf",
    "DejaVuSans.ttf",
    "LiberationSans-Regular.ttf",
    "Arial Unicode.ttf",
    "ArialUnicode.ttf",
    "arial.ttf",
    "Arial.ttf",
)
FONT_DIRS = (
    "/usr/share/fonts",
    "/usr/local/share/fonts",
    "~/.local/share/fonts",
    "~/.fonts",
    "/Library/Fonts",
    "/System/Library/Fonts",
    "C:/Windows/Fonts",
)
SIZE = 11


@dataclass(frozen=True)
class LabelFont:
    """path: the font file, None for PIL's default font (torchvision's when given no font)."""

    path: str | None
    font: ImageFont.FreeTypeFont | ImageFont.ImageFont

    def draws(self, text: str) -> bool:
        """Whether every character of ``text`` has a glyph of its own (not the font's missing-glyph box)."""
        missing = _mask(self.font, "\uffff")  # a non-character: every font draws its missing-glyph shape for it
        return all(ch.isspace() or _mask(self.font, ch) != missing for ch in text)

    def label(self, name: str, category_id: int) -> str:
        """``name``, or the category id where the font cannot draw it."""
        return name if self.draws(name) else str(category_id)


def _mask(font, text: str) -> tuple:
    mask = font.getmask(text)
    return mask.size, bytes(mask)


@functools.cache
def label_font(font_dirs: tuple[str, ...] = FONT_DIRS, font_files: tuple[str, ...] = FONT_FILES) -> LabelFont:
    """The first of ``font_files`` found under ``font_dirs`` (searched recursively), else PIL's default font."""
    for name in font_files:
        for folder in font_dirs:
            root = Path(folder).expanduser()
            found = next(root.rglob(name), None) if root.is_dir() else None
            if found is not None:
                try:
                    return LabelFont(path=str(found), font=ImageFont.truetype(str(found), SIZE))
                except OSError:  # unreadable: the next candidate
                    continue
    return LabelFont(path=None, font=ImageFont.load_default())
