"""What reaches the console, and what only the run's train.log: a record logged with ``extra=FILE_ONLY`` is kept
off the console handlers by the filter ``keep_file_only_off_console`` puts on them.
"""

from __future__ import annotations

import logging

FILE_ONLY = {"file_only": True}


def _not_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


def keep_file_only_off_console(logger: logging.Logger | None = None) -> None:
    """Filter FILE_ONLY records out of ``logger``'s (default: the root logger's) console handlers."""
    for handler in (logger or logging.getLogger()).handlers:
        console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if console and _not_file_only not in handler.filters:
            handler.addFilter(_not_file_only)
