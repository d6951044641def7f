"""A multirun (``python train.py -m ...``) as a user runs it: each job in a run directory of its own under
output_dir, with its own log, .hydra/, checkpoint, evaluation and timing counted from its own start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, child_env, tiny_overrides

from engine.checkpoint.io import load_checkpoint

pytestmark = pytest.mark.slow


def test_each_job_of_a_multirun_gets_its_own_run_directory_and_its_own_clock(tmp_path):
    runs = tmp_path / "seeds"
    child = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "seed=1,2",
            f"output_dir={runs}",
            *tiny_overrides(tmp_path / "data"),
            "epochs=1",
            "eval_images=0",
        ],
        cwd=tmp_path,
        env=child_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = child.stdout + child.stderr
    assert child.returncode == 0, out
    assert (runs / "multirun.yaml").is_file() and not (runs / "checkpoint.pth").exists()
    assert not (runs / ".run.lock").exists()  # the multirun held its folder while its jobs ran
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()
    for job, seed in ((0, 1), (1, 2)):
        run_dir = runs / str(job)
        assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())[0] == f"seed={seed}"
        assert load_checkpoint(run_dir / "checkpoint.pth")["config"]["seed"] == seed
        assert (run_dir / "eval_epoch0001.json").is_file() and (run_dir / "timing.json").is_file()
        assert f"run directory {run_dir}" in (run_dir / "train.log").read_text()
        assert not (run_dir / ".run.lock").exists()
    assert out.count("done: ") == 2
    # The second job's clock starts with it (Hydra writes its .hydra/ just before), not with the process.
    second = runs / "1"
    lived = (second / "timing.json").stat().st_mtime - (second / ".hydra" / "config.yaml").stat().st_mtime
    assert json.loads((second / "timing.json").read_text())["total_s"] <= lived + 0.5


def test_a_multirun_that_sweeps_output_dir_is_refused_before_anything_runs(tmp_path):
    child = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "output_dir=a,b",
            *tiny_overrides(tmp_path / "data"),
            "epochs=1",
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = child.stdout + child.stderr
    assert child.returncode == 1 and "Traceback" not in out, out
    assert out.count("output_dir=a,b: a multirun (-m) takes one output_dir") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []
