"""Put a launch table measured by bench/msda.py (its msda_launch_table.py) into msda/launch.py.

    python bench/apply_launch_table.py OUT/msda_launch_table.py

Replaces the ``TUNED: dict = {...}`` block (with the comment lines bench/msda.py writes above it) in place.
"""

import re
import sys
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[1] / "msda" / "launch.py"
BLOCK = re.compile(r"(?:# Measured on .*\n# .*\n)?TUNED: dict = \{\n(?:    .*\n)*\}\n")


def main(table_file: str) -> None:
    table = Path(table_file).read_text()
    if not BLOCK.fullmatch(table):
        raise SystemExit(f"{table_file}: expected the TUNED block bench/msda.py writes")
    source = LAUNCH.read_text()
    if len(BLOCK.findall(source)) != 1:
        raise SystemExit(f"{LAUNCH}: expected exactly one TUNED block")
    LAUNCH.write_text(BLOCK.sub(lambda _: table, source))
    print(f"{LAUNCH}: TUNED replaced with {table_file}")


if __name__ == "__main__":
    main(*sys.argv[1:])
