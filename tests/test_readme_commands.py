"""Documented commands that cannot rot: every command in the code blocks of README.md, bench/README.md and docs/*.md
is checked.

- `python train.py|predict.py|export.py ...` (also under torchrun, after environment variables such as
  `CXX=g++`, over `\\` continuations, before a `# comment`): its overrides are composed with hydra.compose from
  configs/ (train, predict or export) and checked by engine.config.registry.check_config, as the entry point
  would before doing anything; nothing runs.
- `python bench/NAME.py ...`: its arguments are parsed by that bench's own parser (``build_parser()``).

A failure names the file, the line and the command. `...` and `[overrides]` stand for what a reader fills in.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest
from helpers import ROOT

DOCUMENTS = (ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md")))
ENTRY_POINTS = {"train.py": "train", "predict.py": "predict", "export.py": "export"}
PLACEHOLDERS = {"...", "[overrides]"}
OPERATORS = {"&&", "||", ";", "|"}
ENVIRONMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
BENCH = re.compile(r"^bench/(\w+)\.py$")
# Hydra's own command-line flags (not overrides), and those of them that take a value.
HYDRA_FLAGS = {
    "--cfg": True,
    "-c": True,
    "--package": True,
    "-p": True,
    "--info": False,
    "-i": False,
    "--help": False,
    "-h": False,
    "--hydra-help": False,
    "--multirun": False,
    "-m": False,
    "--resolve": False,
}


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every logical line inside a fenced code block; a `\\` continuation is joined to the
    line it continues, which keeps that line's number."""
    found, fenced, pending = [], False, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, pending = not fenced, None
            continue
        if not fenced:
            continue
        if pending is not None:
            found[-1] = (pending, found[-1][1] + " " + line.strip().removesuffix("\\"))
        else:
            found.append((number, line.strip().removesuffix("\\")))
        pending = (pending or number) if line.rstrip().endswith("\\") else None
    return found


def commands(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, script, arguments) of every train.py / predict.py / export.py and bench/*.py command in the blocks."""
    found = []
    for number, line in code_lines(text):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # not shell (a log line, a table): nothing to check
            continue
        segments, current = [], []
        for token in tokens:
            if token in OPERATORS:
                segments.append(current)
                current = []
            else:
                current.append(token)
        for argv in [*segments, current]:
            while argv and ENVIRONMENT.match(argv[0]):
                argv = argv[1:]
            if len(argv) >= 2 and argv[0] in ("python", "python3"):
                script, args = argv[1], argv[2:]
            elif argv and argv[0] == "torchrun":
                scripts = [i for i, token in enumerate(argv) if token.endswith(".py")]
                if not scripts:
                    continue
                script, args = argv[scripts[0]], argv[scripts[0] + 1 :]
            else:
                continue
            if script in ENTRY_POINTS or BENCH.match(script):
                found.append((number, script, args))
    return found


def overrides_of(args: list[str]) -> list[str]:
    """The Hydra overrides of an entry point's arguments: its own flags and the placeholders left out."""
    overrides, skip = [], False
    for token in args:
        if skip:
            skip = False
        elif token.startswith("-"):
            skip = HYDRA_FLAGS.get(token.split("=")[0], False) and "=" not in token
        elif token not in PLACEHOLDERS:
            overrides.append(token)
    return overrides


def entry_point_problem(script: str, args: list[str]) -> str | None:
    """Why the command's config would not compose or check, or None. Needs an initialized Hydra (configs/)."""
    from hydra import compose

    from engine.config.export_schema import ExportConfig
    from engine.config.predict_schema import PredictConfig
    from engine.config.registry import check_config
    from engine.config.train_schema import TrainConfig

    schema = {"train.py": TrainConfig, "predict.py": PredictConfig, "export.py": ExportConfig}[script]
    try:
        check_config(compose(config_name=ENTRY_POINTS[script], overrides=overrides_of(args)), schema)
    except Exception as error:  # Hydra's and OmegaConf's errors, the schemas' ValueErrors
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    return None


_PARSERS: dict[str, object] = {}


def bench_problem(name: str, args: list[str]) -> str | None:
    """Why bench/<name>.py's own parser refuses ``args``, or None."""
    if not (ROOT / "bench" / f"{name}.py").is_file():
        return f"there is no bench/{name}.py"
    if name not in _PARSERS:
        _PARSERS[name] = getattr(importlib.import_module(f"bench.{name}"), "build_parser", None)
    if _PARSERS[name] is None:
        return f"bench/{name}.py has no build_parser()"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            _PARSERS[name]().parse_args([a for a in args if a not in PLACEHOLDERS])
    except SystemExit as stop:
        if stop.code:  # argparse's last line: "PROG: error: WHY"
            return stderr.getvalue().strip().splitlines()[-1].split(": error: ", 1)[-1]
    return None


def problems(text: str, source: str = "README.md") -> list[str]:
    """One message per command of ``text``'s code blocks that would not compose, check or parse."""
    from hydra import initialize_config_dir

    from engine.config.registry import register_configs

    register_configs()
    found = []
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for number, script, args in commands(text):
            bench = BENCH.match(script)
            problem = bench_problem(bench.group(1), args) if bench else entry_point_problem(script, args)
            if problem:
                found.append(f"{source}:{number}: `{' '.join(['python', script, *args])}`: {problem}")
    return found


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if d.exists()], ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_command_of_the_documentation_composes_or_parses(document: Path):
    text = document.read_text()
    assert commands(text), f"no command found in {document}: the extraction is broken"
    found = problems(text, document.relative_to(ROOT).as_posix())
    assert not found, "\n".join(found)


def test_the_extraction_reads_continuations_comments_environment_and_torchrun():
    text = "\n".join(
        [
            "text outside a block: python train.py not=checked",
            "```bash",
            "CXX=g++ python export.py checkpoint=PATH format=aoti   # a comment",
            "python train.py dataset=custom \\",
            "    epochs=2 \\",
            "    max_steps=3",
            "torchrun --nproc_per_node=8 train.py [overrides] epochs=1",
            "pip install -r requirements.txt && python train.py --cfg job seed=1",
            "python bench/parity.py --quick",
            "python -m pytest -q tests",
            "```",
        ]
    )
    assert commands(text) == [
        (3, "export.py", ["checkpoint=PATH", "format=aoti"]),
        (4, "train.py", ["dataset=custom", "epochs=2", "max_steps=3"]),
        (7, "train.py", ["[overrides]", "epochs=1"]),
        (8, "train.py", ["--cfg", "job", "seed=1"]),
        (9, "bench/parity.py", ["--quick"]),
    ]
    assert overrides_of(["--cfg", "job", "...", "seed=1"]) == ["seed=1"]
    assert problems(text, "x.md") == []


@pytest.mark.parametrize("document", ["README.md", "docs/compile.md"])
def test_a_bad_key_and_an_unknown_bench_flag_fail_naming_their_line(document):
    text = (ROOT / document).read_text()
    lines = text.splitlines()
    bad = lines + [
        "",
        "```bash",
        "python train.py optim.lrr=1e-4",
        "python bench/parity.py --no-such-flag",
        "python predict.py checkpoint=PATH images=photos/ score_threshold=2",
        "```",
    ]
    found = problems("\n".join(bad), document)
    first = len(lines) + 3
    assert len(found) == 3, found
    assert found[0].startswith(f"{document}:{first}: `python train.py optim.lrr=1e-4`: ")
    assert "optim.lrr" in found[0].split("`: ")[1]
    assert (
        found[1] == f"{document}:{first + 1}: `python bench/parity.py --no-such-flag`: unrecognized arguments: "
        "--no-such-flag"
    )
    assert found[2].startswith(f"{document}:{first + 2}: ") and "score_threshold must" in found[2].split("`: ")[1]
