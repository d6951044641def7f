"""CI (.ci/run) tests what a new machine gets: a fresh virtual environment, the README's install into it, ruff's
lint and format checks, then the README's test command with that environment's python; the test tools pinned to the
versions the suite passes with.

The script runs for real, with a stand-in for python that records each call instead of installing anything."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

# A python that records how it was called (its own path, then its arguments) and, asked for a virtual environment,
# makes one whose python is this same recorder. $FAIL, when set, is a command it fails (with $FAIL_STATUS, default 1),
# as ruff fails on a violation.
RECORDER = """#!/usr/bin/env bash
echo "$0 $*" >> "$CALLS"
if [ "$1" = "--version" ]; then echo "Python (recorder)"; fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
if [ -n "${FAIL:-}" ] && [ "$*" = "$FAIL" ]; then exit "${FAIL_STATUS:-1}"; fi
"""


def run_ci(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, list[list[str]], Path]:
    """.ci/run with the recorder as python: (the run, the calls it made, the recorder)."""
    recorder, calls = tmp_path / "python", tmp_path / "calls.txt"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    env = {**os.environ, "PYTHON": str(recorder), "CALLS": str(calls), "CI": "true", **env}
    run = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    return run, [shlex.split(line) for line in calls.read_text().splitlines()], recorder


def readme_test_command() -> list[str]:
    """The arguments after `python` of the README's test command (its first `python -m pytest ...`)."""
    found = re.search(r"^.*&& python (-m pytest[^\n`]*)$", (ROOT / "README.md").read_text(), flags=re.MULTILINE)
    assert found, "README.md has no `... && python -m pytest ...` command"
    return shlex.split(found.group(1))


def test_ci_installs_into_a_fresh_virtual_environment_checks_the_style_and_runs_the_readmes_test_command(tmp_path):
    run, lines, recorder = run_ci(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines[0] == [str(recorder), "--version"]
    assert lines[1][:3] == [str(recorder), "-m", "venv"]
    venv = Path(lines[1][3])
    assert not venv.exists()  # made for this run, removed after it
    assert not venv.is_relative_to(ROOT)
    python = str(venv / "bin" / "python")
    assert lines[2:] == [
        [python, "-m", "pip", "install", "-q", "-r", "requirements.txt"],
        [python, "-m", "pip", "install", "-q", "-r", "requirements-export.txt"],
        [python, "-m", "ruff", "check", "."],
        [python, "-m", "ruff", "format", "--check", "."],
        [python, *readme_test_command()],
    ]


@pytest.mark.parametrize("check", ["-m ruff check .", "-m ruff format --check ."])
def test_a_style_violation_fails_ci_before_the_tests_run(tmp_path, check):
    run, lines, _ = run_ci(tmp_path, FAIL=check)
    assert run.returncode != 0
    assert lines[-1][1:] == shlex.split(check)  # nothing ran after the failing check


@pytest.mark.parametrize("status", [1, 5])
def test_a_failing_or_empty_test_run_fails_ci(tmp_path, status):
    """pytest's own exit status is CI's: 1 (a test failed) and 5 (no tests collected) both fail it."""
    run, lines, _ = run_ci(tmp_path, FAIL=" ".join(readme_test_command()), FAIL_STATUS=str(status))
    assert run.returncode == status
    assert lines[-1][1:] == readme_test_command()


@pytest.mark.parametrize(
    ("planted", "check"),
    [
        ("import os\n", ["check"]),  # an unused import
        ("x = [1,2]\n", ["format", "--check"]),  # spacing the formatter would change
    ],
)
def test_ruff_with_the_projects_settings_finds_a_planted_violation(tmp_path, planted, check):
    """What CI runs, on a copy of the project's settings beside one planted file: the check fails on it, and passes
    once the file is clean. Where ruff is not installed (a lent GPU machine has the suite's packages, not the style
    tools) there is nothing to run; CI installs it from requirements.txt and must have it."""
    if importlib.util.find_spec("ruff") is None:
        assert os.environ.get("CI") != "true", "CI's environment has no ruff: requirements.txt should install it"
        pytest.skip("ruff is not installed here")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    planted_file = tmp_path / "planted.py"
    planted_file.write_text(planted)
    ruff = [sys.executable, "-m", "ruff", *check, "."]
    assert subprocess.run(ruff, cwd=tmp_path, capture_output=True, timeout=60).returncode != 0
    planted_file.write_text("x = [1, 2]\n")
    assert subprocess.run(ruff, cwd=tmp_path, capture_output=True, timeout=60).returncode == 0


def test_the_test_tools_are_pinned_to_the_versions_the_suite_runs_with():
    """In CI, whose fresh environment installs requirements.txt (.ci/run sets CI=true), the suite runs with the pinned
    versions; elsewhere (a machine with its own pytest) only the pins themselves are checked."""
    pins = dict(re.findall(r"^(pytest[\w-]*)==([\w.]+)", (ROOT / "requirements.txt").read_text(), flags=re.MULTILINE))
    assert "pytest" in pins, "requirements.txt does not pin pytest"
    if os.environ.get("CI") == "true":
        for name, version in pins.items():
            installed = importlib.metadata.version(name)
            assert installed == version, f"{name} {installed} runs the suite"
