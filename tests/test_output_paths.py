"""Outputs that cannot be written, as a user meets them: a folder under /proc, a path through a file, an export
named after a folder. Each command stops before any work with one message naming the setting, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, child_env, tiny_overrides, write_checkpoint
from PIL import Image

UNDER_PROC = "/proc/deformable_detr_no_such_folder/run"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint, a folder of one image, and a regular file to put in the way."""
    root = tmp_path_factory.mktemp("outputs")
    (root / "photos").mkdir()
    Image.fromarray(torch.randint(0, 255, (40, 60, 3), dtype=torch.uint8).numpy()).save(root / "photos" / "a.png")
    (root / "notes.txt").write_text("a file, not a folder\n")
    return {
        "checkpoint": write_checkpoint(root / "checkpoint.pth"),
        "photos": root / "photos",
        "file": root / "notes.txt",
        "root": root,
    }


def run(script: str, *overrides: str, cwd: Path) -> tuple[int, str]:
    child = subprocess.run(
        [sys.executable, str(ROOT / script), *overrides],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return child.returncode, child.stdout + child.stderr


def assert_one_message(code: int, out: str, *expected: str) -> None:
    assert code == 1 and "Traceback" not in out, out
    for text in expected:
        assert out.count(text) == 1, out


@pytest.mark.parametrize(
    "where, reason",
    [
        ("under_proc", "No such file or directory"),
        ("under_a_file", "is a file, not a folder"),
        ("a_file", "is a file, not a folder"),
    ],
)
def test_train_refuses_an_output_dir_it_cannot_write_before_anything_runs(files, tmp_path, where, reason):
    output_dir = {"under_proc": UNDER_PROC, "under_a_file": f"{files['file']}/run", "a_file": str(files["file"])}[where]
    code, out = run(
        "train.py", *tiny_overrides(tmp_path / "data"), "epochs=1", f"output_dir={output_dir}", cwd=tmp_path
    )
    assert_one_message(code, out, f"output_dir={output_dir}: cannot create or write into the folder", reason)
    assert not (tmp_path / "data").exists() and not (tmp_path / "outputs").exists()  # nothing ran
    assert files["file"].read_text() == "a file, not a folder\n"


@pytest.mark.parametrize("where", ["under_proc", "under_a_file"])
def test_predict_refuses_an_output_dir_it_cannot_write(files, tmp_path, where):
    output_dir = {"under_proc": UNDER_PROC, "under_a_file": f"{files['file']}/predictions"}[where]
    code, out = run(
        "predict.py",
        f"checkpoint={files['checkpoint']}",
        f"images={files['photos']}",
        "device=cpu",
        f"output_dir={output_dir}",
        cwd=tmp_path,
    )
    assert_one_message(code, out, f"output_dir={output_dir}: cannot create or write into the folder")


def test_export_refuses_an_output_it_cannot_write(files, tmp_path):
    output = f"{UNDER_PROC}/model.onnx"
    code, out = run("export.py", f"checkpoint={files['checkpoint']}", "device=cpu", f"output={output}", cwd=tmp_path)
    assert_one_message(code, out, f"output={output}: cannot create or write into the folder {Path(output).parent}")


def test_export_refuses_an_output_that_is_a_folder_before_it_traces(files, tmp_path):
    folder = files["root"] / "exports"
    folder.mkdir()
    code, out = run("export.py", f"checkpoint={files['checkpoint']}", "device=cpu", f"output={folder}", cwd=tmp_path)
    assert_one_message(
        code, out, f"output={folder}: {folder} is a folder; name the file to write, e.g. {folder / 'checkpoint.onnx'}"
    )
    assert "exporting" not in out and list(folder.iterdir()) == []  # refused before the model was loaded


def test_the_in_process_commands_check_their_outputs_too(files, tmp_path):
    """predict(cfg) and export(cfg), as the tests and bench call them, refuse the same outputs."""
    from hydra import compose, initialize_config_dir

    import export as exporter
    import predict as predictor
    from engine.errors import OutputPathError

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        predicting = compose(
            config_name="predict",
            overrides=[
                f"checkpoint={files['checkpoint']}",
                f"images={files['photos']}",
                "device=cpu",
                f"output_dir={files['file']}/predictions",
            ],
        )
        exporting = compose(
            config_name="export",
            overrides=[f"checkpoint={files['checkpoint']}", "device=cpu", f"output={files['root']}"],
        )
    with pytest.raises(OutputPathError, match=r"notes\.txt is a file, not a folder"):
        predictor.predict(predicting)
    with pytest.raises(OutputPathError, match=r"is a folder; name the file to write"):
        exporter.export(exporting)


# A GPU this machine lacks: the GPU experiment's device=cuda on a machine without one, else one GPU past the last.
NO_SUCH_GPU = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


@pytest.mark.parametrize("script", ["train.py", "predict.py", "export.py"])
def test_a_gpu_the_machine_lacks_is_one_message_naming_device_and_leaves_no_folder(files, tmp_path, script):
    device = "experiment=coco_gpu" if NO_SUCH_GPU == "cuda" and script == "train.py" else f"device={NO_SUCH_GPU}"
    args = {
        "train.py": [device, f"dataset.root={tmp_path / 'coco'}"],
        "predict.py": [f"checkpoint={files['checkpoint']}", f"images={files['photos']}", device],
        "export.py": [f"checkpoint={files['checkpoint']}", device, f"output={tmp_path / 'exported' / 'model.onnx'}"],
    }[script]
    code, out = run(script, *args, cwd=tmp_path)
    assert_one_message(code, out, f"device={NO_SUCH_GPU} (from the command line", "Set device=cpu, or device=auto")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], out  # no run directory, no export's folder


@pytest.mark.parametrize(
    "script, rejected",
    [
        ("train.py", "optim.lr=fast"),  # a wrong type
        ("train.py", "experiment=two_stag"),  # a misspelt choice
        ("train.py", "+model.no_such_key=1"),  # an unknown key
        ("predict.py", "batch_size=many"),
        ("export.py", "opset=latest"),
    ],
)
def test_an_override_hydra_rejects_leaves_no_folder_of_the_ones_named(files, tmp_path, script, rejected):
    named = {
        "train.py": f"output_dir={tmp_path / 'new' / 'run'}",
        "predict.py": f"output_dir={tmp_path / 'new' / 'run'}",
        "export.py": f"output={tmp_path / 'new' / 'run' / 'model.onnx'}",
    }[script]
    inputs = {
        "train.py": [*tiny_overrides(tmp_path / "data")],
        "predict.py": [f"checkpoint={files['checkpoint']}", f"images={files['photos']}"],
        "export.py": [f"checkpoint={files['checkpoint']}"],
    }[script]
    code, out = run(script, *inputs, named, rejected, cwd=tmp_path)
    assert code == 1, out
    assert not (tmp_path / "new").exists(), out


def test_an_output_in_a_folder_nothing_can_be_written_into_says_so(files, tmp_path):
    code, out = run("export.py", f"checkpoint={files['checkpoint']}", "device=cpu", "output=/proc/x.onnx", cwd=tmp_path)
    assert_one_message(
        code, out, "output=/proc/x.onnx: cannot create or write into the folder /proc: the folder exists"
    )
