"""The errors a user can fix. Each derives from ``UserError`` so that the console (engine/runtime/console.py) prints
it as one message without importing the modules that raise it. This module imports nothing."""

from __future__ import annotations


class UserError(Exception):
    """A fault the user can fix: its message names the culprit and the fix."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read or does not fit the model; the message names the file."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint that could not be written (a full disk, say); the message names the file and what is kept."""


class CollectiveError(UserError, RuntimeError):
    """A collective failed or timed out; the message names this rank and the collective."""


class SettingsError(UserError, ValueError):
    """Settings that cannot work together, refused before anything runs; the message names them and the fix."""


class OutputPathError(UserError, OSError):
    """A folder or file a command was told to write that cannot be written; the message names the setting."""


class RunDirectoryInUse(UserError, RuntimeError):
    """Another process is running in this run directory; the message names it."""


class LoaderWorkerDied(UserError, RuntimeError):
    """A data loader worker process died (killed, out of memory); the message says where to resume from."""


class NonFiniteLossError(UserError, RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the run stops without saving that state."""


class AotiCompilerError(UserError, ValueError):
    """The C++ compiler would build an AOTInductor package that crashes when loaded (engine/export/aoti.py says why)."""


class ExportParityError(UserError, ValueError):
    """The exported model's outputs differ from the PyTorch model's by more than the tolerance; the message says how."""


# What the console reports as one message: ours, and the built-in errors raised for bad settings and files.
USER_FAULTS: tuple[type[BaseException], ...] = (UserError, ValueError, OSError)
