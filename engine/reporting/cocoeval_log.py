"""Where COCOeval's printing (CocoEvaluator.cocoeval_output) goes: its 12-line summary table to the console and
train.log, everything else (progress chatter, timings, faster-coco-eval's two extra AR lines) to train.log only,
so that the console shows the same table whichever COCOeval ran.
"""

from __future__ import annotations

import logging
import re

from .log_filter import FILE_ONLY

# A line of the summary table (COCOeval.stats[0..11]): every AP line, and the AR lines over IoU 0.50:0.95.
SUMMARY_LINE = re.compile(r"^\s*Average (Precision\s+\(AP\)|Recall\s+\(AR\) @\[ IoU=0\.50:0\.95) ")


def log_cocoeval_output(text: str, log: logging.Logger) -> None:
    """Each non-empty line of ``text``: INFO on console and file if it is a summary-table line, else file only."""
    for line in text.splitlines():
        if SUMMARY_LINE.match(line):
            log.info("%s", line.rstrip())
        elif line.strip():
            log.info("COCOeval: %s", line.strip(), extra=FILE_ONLY)
