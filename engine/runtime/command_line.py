"""What an entry point reads from its overrides before Hydra composes them and writes into the run directory (a
directory in use, an output that cannot be written); the job checks the composed config again.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .output_paths import missing_folders, writable_folder


def override_value(argv: Sequence[str], keys: Sequence[str]) -> tuple[str, str] | None:
    """(key, value) of the last override of one of ``keys`` on the command line (``+``/``++`` prefixes allowed), or
    None when none sets one or the last leaves it unset ("" or null). A value Hydra resolves itself (an
    interpolation) is not read here."""
    found = None
    for argument in argv[1:]:
        key, equals, value = argument.lstrip("+~").partition("=")
        if equals and key in keys:
            found = None if value in ("", "null") or "${" in value else (key, value)
    return found


def is_multirun(argv: Sequence[str]) -> bool:
    """Whether Hydra runs the command as a multirun (``-m``, ``--multirun`` or ``hydra.mode=MULTIRUN``)."""
    mode = override_value(argv, ("hydra.mode",))
    return any(a in ("-m", "--multirun") for a in argv[1:]) or (mode is not None and mode[1].upper() == "MULTIRUN")


def is_sweep(key: str, value: str) -> bool:
    """Whether ``key=value`` sweeps several values (``a,b``, ``range(3)``, ``glob(*)``...), as Hydra parses it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(f"{key}={value}").is_sweep_override()
    except Exception:  # not an override Hydra takes: Hydra says so itself when it composes
        return False


def check_named_files_folder(argv: Sequence[str], key: str) -> list[Path]:
    """The folder of the file ``key=`` names on the command line, if any, can be created and written (the file
    itself is the job's to check); the folders this made (output_paths.remove_empty_folders removes them unused)."""
    named = override_value(argv, (key,))
    if named is None:
        return []
    folder = Path(named[1]).expanduser().parent
    made = missing_folders(folder)
    writable_folder(folder, setting=f"{key}={named[1]}")
    return made


# Settings that moved, and where: a command line with the old one is told, rather than Hydra's "not in ModelConfig".
MOVED = {
    "model.hybrid_matching": "one-to-many supervision is model.one_to_many=hybrid (or mixed, or none for off)",
}


def refuse_moved_settings(argv: Sequence[str]) -> None:
    """A SettingsError naming the first override of a setting that moved (MOVED) and its new place."""
    from engine.errors import SettingsError

    for argument in argv[1:]:
        key = argument.lstrip("+~").partition("=")[0]
        if key in MOVED:
            raise SettingsError(f"{argument}: {key} has moved: {MOVED[key]}")
