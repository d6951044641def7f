"""Each recompilation's reason in train.log as one line, and torch's multi-line account of it off the console."""

from __future__ import annotations

import logging

import torch

from engine.reporting.log_filter import FILE_ONLY

log = logging.getLogger(__name__)


class _OneLine(logging.Handler):
    """Re-logs a record of torch's recompile log as one line of ours, to train.log only."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = " ".join(line.strip() for line in record.getMessage().splitlines() if line.strip())
            log.info("recompile: %s", text, extra=FILE_ONLY)
        except Exception:  # a logging handler must never raise into the compile
            self.handleError(record)


_recompile_handler = _OneLine()


def log_recompiles_to_file() -> bool:
    """Turn on torch's recompile log and route it through ``_OneLine``; False where this torch lacks the
    artifact loggers it needs (recompilations then go unlogged rather than to the console)."""
    from torch._logging import _internal

    registry = getattr(_internal, "log_registry", None)
    if registry is None or not hasattr(registry, "get_artifact_log_qnames"):
        return False
    torch._logging.set_logs(recompiles=True)
    names = [name for name in registry.get_artifact_log_qnames() if name.endswith("__recompiles")]
    for name in names:
        logger = logging.getLogger(name)
        logger.propagate = False  # not through torch's console handler
        if _recompile_handler not in logger.handlers:
            logger.addHandler(_recompile_handler)
    return bool(names)
