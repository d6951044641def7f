"""What reaches the console, and what only the run's train.log.

Hydra gives the root logger two handlers: the console and train.log. A record logged with ``extra=FILE_ONLY``
(a recompilation's reason, COCOeval's chatter) is kept off the console by a filter that
``keep_file_only_off_console`` puts on every console handler, and still reaches the file.
"""

from __future__ import annotations

import logging

FILE_ONLY = {"file_only": True}


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)


_filter = _NotFileOnly()


def keep_file_only_off_console(logger: logging.Logger | None = None) -> None:
    """Filter FILE_ONLY records out of ``logger``'s (default: the root logger's) console handlers."""
    for handler in (logger or logging.getLogger()).handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if _filter not in handler.filters:
                handler.addFilter(_filter)
