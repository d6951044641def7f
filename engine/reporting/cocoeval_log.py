"""Where COCOeval's printing goes: its summary table to the console and train.log, the rest to train.log only.

pycocotools prints about 20 lines per evaluation ("Loading and preparing results...", "index created!",
"Running per image evaluation...", timings) and faster-coco-eval a few more; only the 12 lines of the summary
table ("Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ] = 0.243") tell the user
anything. CocoEvaluator keeps the printed text (``cocoeval_output``); this logs it line by line, the table at
INFO and the rest marked FILE_ONLY (engine/runtime/console.py), so that train.log holds everything COCOeval said.
faster-coco-eval's table has two more lines (AR at IoU 0.50 and 0.75): they go to the file only, so that the
console shows the same 12 lines whichever COCOeval ran.
"""

from __future__ import annotations

import logging
import re

from .log_filter import FILE_ONLY

# A line of the 12-line summary table (COCOeval.stats[0..11]): every AP line, and the AR lines over IoU
# 0.50:0.95 (" Average Recall     (AR) @[ IoU=0.50:0.95 | area=   all | maxDets=  1 ] = 0.345").
SUMMARY_LINE = re.compile(r"^\s*Average (Precision\s+\(AP\)|Recall\s+\(AR\) @\[ IoU=0\.50:0\.95) ")


def log_cocoeval_output(text: str, log: logging.Logger) -> None:
    """Each non-empty line of ``text``: INFO on console and file if it is a summary-table line, else file only."""
    for line in text.splitlines():
        if not line.strip():
            continue
        if SUMMARY_LINE.match(line):
            log.info("%s", line.rstrip())
        else:
            log.info("COCOeval: %s", line.strip(), extra=FILE_ONLY)
