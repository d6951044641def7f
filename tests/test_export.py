"""export.py: ONNX files and AOTInductor packages of a checkpoint, their parity checks, the TensorRT node (CPU).

One export per kind, shared by the tests of that kind (each costs tens of seconds on a 2-core CPU): an ONNX
file with dynamic batch and sides (export(cfg), in this process), and, as `python export.py` commands started
first so that they run on the other core meanwhile, an AOTInductor package (static, with post-processing,
quick_compile) and a static ONNX file with TensorRT's attention node. The sample images come from a small
validation folder that the checkpoint's config names, as a trained run's would.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY_MODEL, child_env, write_checkpoint
from hydra import compose, initialize_config_dir
from PIL import Image

import export as exporter
from engine.checkpoint.trained_model import load_trained_model
from engine.config.export_schema import MAX_OPSET, MIN_OPSET, default_output
from engine.errors import ExportParityError
from engine.export.aoti import has_shared_libstdcxx
from engine.export.exportable import ExportableDetector, SampleShape, trace
from engine.export.parity import Tolerance, check_parity, compare_outputs, tolerance_for
from engine.export.samples import random_batch, recorded_validation_folder, sample_batch
from models.postprocess import PostProcess

CPU = torch.device("cpu")
CXX = shutil.which(os.environ.get("CXX", "g++"))
# A compiler without a shared libstdc++ is refused by export.py (its own test below): no package to test then.
HAS_COMPILER = CXX is not None and has_shared_libstdcxx(CXX) is not False
HAS_ONNX = all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxruntime", "onnxscript"))


def compose_export(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="export", overrides=["device=cpu", *overrides])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny model's checkpoint (one encoder and one decoder layer, three levels, 96 x 128 evaluation size)
    whose run config names a validation folder of two pictures."""
    root = tmp_path_factory.mktemp("export")
    (root / "data" / "val2017").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for index, (width, height) in enumerate(((120, 90), (70, 100))):
        pixels = torch.randint(0, 255, (height, width, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(root / "data" / "val2017" / f"{index}.png")
    return write_checkpoint(root / "checkpoint.pth", extra=("model.dec_layers=1", f"dataset.root={root / 'data'}"))


class ExportCommand:
    """``python export.py checkpoint=... OVERRIDES`` running in the background, its console output going to a file
    (a pipe that nobody reads until it ends would stall the command once full); ``finished()`` waits for it."""

    def __init__(self, checkpoint: Path, name: str, *overrides: str):
        self.console = checkpoint.with_name(f"{name}.console.txt")
        with open(self.console, "w") as console:
            self.process = subprocess.Popen(
                [sys.executable, str(ROOT / "export.py"), f"checkpoint={checkpoint}", "device=cpu", *overrides],
                cwd=ROOT,
                env=child_env(),
                stdout=console,
                stderr=subprocess.STDOUT,
            )

    def finished(self) -> str:
        """The command's console output, once it has exited with code 0 (else the test fails showing it)."""
        self.process.wait(timeout=600)
        output = self.console.read_text()
        assert self.process.returncode == 0, output
        return output


@pytest.fixture(scope="module")
def background_exports(checkpoint) -> dict[str, ExportCommand]:
    """The AOTInductor and TensorRT-node exports, started at once (the first ONNX test asks for them)."""
    commands = {}
    if HAS_COMPILER:
        commands["aoti"] = ExportCommand(
            checkpoint,
            "aoti",
            "format=aoti",
            "dynamic=false",
            "postprocess=true",
            "max_detections=10",
            "quick_compile=true",
        )
    if HAS_ONNX:
        commands["tensorrt"] = ExportCommand(checkpoint, "tensorrt", "msda_node=tensorrt", "dynamic=false")
        commands["opset17"] = ExportCommand(
            checkpoint, "opset17", "opset=17", f"output={checkpoint.with_name('opset17.onnx')}"
        )
    yield commands
    for command in commands.values():
        if command.process.poll() is None:
            command.process.kill()
            command.process.wait()


def pytorch_detector(checkpoint: Path, *, max_detections: int | None = None) -> ExportableDetector:
    """The PyTorch side, built as export.py builds it (reference attention, fp32, on the CPU)."""
    trained = load_trained_model(checkpoint, compose_export("checkpoint=x").model, device=CPU, msda="pytorch")
    postprocess = PostProcess(num_select=max_detections) if max_detections else None
    return ExportableDetector(trained.model, postprocess).eval()


def inputs_of(shape: SampleShape, *, seed: int, postprocess: bool = False) -> tuple[torch.Tensor, ...]:
    return random_batch(shape, seed=seed).inputs(postprocess=postprocess, dtype=torch.float32, device=CPU)


# ----------------------------------------------------------------------------------------------------
# ONNX
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def onnx_export(checkpoint, background_exports) -> dict:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    return exporter.export(compose_export(f"checkpoint={checkpoint}"))


def test_onnx_file_takes_other_batch_and_image_sizes(checkpoint, onnx_export):
    import onnx

    from engine.export.onnx import OnnxRunner

    path = onnx_export["output"]
    assert path == checkpoint.with_name("checkpoint.onnx") and path.is_file()
    assert onnx_export["sample"] == f"2 validation image(s) of {checkpoint.parent / 'data' / 'val2017'}"
    assert [r.images for r in onnx_export["parity"]] == [2, 1]  # the sample's shape, then a second one
    model = onnx.load(str(path), load_external_data=False)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [18]
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    assert list(inputs) == ["images", "mask"] and [o.name for o in model.graph.output] == ["pred_logits", "pred_boxes"]
    assert inputs["mask"].elem_type == onnx.TensorProto.BOOL
    assert all(d.dim_param for d in inputs["images"].shape.dim[:1] + inputs["images"].shape.dim[2:])  # B, H, W
    assert any(n.op_type == "GridSample" for n in model.graph.node)  # the reference attention

    runner, detector = OnnxRunner(path, device=CPU), pytorch_detector(checkpoint)
    for shape, seed in (
        (SampleShape(batch=1, height=64, width=160), 1),
        (SampleShape(batch=3, height=128, width=96), 2),
    ):
        inputs = inputs_of(shape, seed=seed)
        got = runner(*inputs)
        with torch.no_grad():
            expected = detector(*inputs)
        queries = TINY_MODEL["num_queries"]
        assert got[0].shape == (shape.batch, queries, 4) and got[1].shape == (shape.batch, queries, 4)
        report = compare_outputs(got, expected, tolerance=tolerance_for("fp32"))
        assert not report.failures, report.describe()


def test_onnx_parity_check_fails_for_a_changed_model(checkpoint, onnx_export):
    from engine.export.onnx import OnnxRunner

    runner, detector = OnnxRunner(onnx_export["output"], device=CPU), pytorch_detector(checkpoint)
    inputs = inputs_of(SampleShape(batch=2, height=96, width=128), seed=3)
    assert (
        check_parity(runner, detector, inputs, tolerance=tolerance_for("fp32"), what="x").differences["logits"] < 1e-4
    )
    with torch.no_grad():
        detector.model.class_embed[0].bias.add_(0.05)
    with pytest.raises(ExportParityError, match=r"^model\.onnx does not match .* logits differ by up to 0\.05"):
        check_parity(runner, detector, inputs, tolerance=tolerance_for("fp32"), what="model.onnx")
    with torch.no_grad():
        detector.model.class_embed[0].bias.sub_(0.05)
        detector.model.bbox_embed[0].layers[-1].bias.add_(0.01)  # the boxes alone move
    with pytest.raises(ExportParityError, match=r"boxes differ") as error:
        check_parity(runner, detector, inputs, tolerance=tolerance_for("fp32"), what="model.onnx")
    assert "logits differ" not in str(error.value)


@pytest.fixture(scope="module")
def traced_program(checkpoint, onnx_export):
    """The tiny detector traced with dynamic batch and sides, as export.py traces it, and that detector."""
    detector = pytorch_detector(checkpoint)
    return trace(detector, inputs_of(SampleShape(batch=2, height=96, width=128), seed=0), dynamic=True), detector


@pytest.mark.parametrize("opset", range(MIN_OPSET, MAX_OPSET + 1))
def test_every_allowed_opset_writes_a_file_that_is_valid_at_it_and_matches(traced_program, tmp_path, opset):
    import onnx

    from engine.export.onnx import OnnxRunner, write_onnx

    program, detector = traced_program
    path = write_onnx(
        program,
        tmp_path / "model.onnx",
        input_names=detector.input_names,
        output_names=detector.output_names,
        opset=opset,
    )
    model = onnx.load(str(path))
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [opset]
    onnx.checker.check_model(model, full_check=True)
    inputs = inputs_of(SampleShape(batch=3, height=64, width=160), seed=4)
    with torch.no_grad():
        expected = detector(*inputs)
    report = compare_outputs(OnnxRunner(path, device=CPU)(*inputs), expected, tolerance=tolerance_for("fp32"))
    assert not report.failures, report.describe()


def test_export_py_with_opset_17_writes_a_file_that_onnxruntime_loads_and_checks(checkpoint, background_exports):
    """The command as a user runs it: the opset-17 file is written, loaded by onnxruntime, and its parity checked."""
    import onnx

    output = background_exports["opset17"].finished()
    assert "parity at batch 2, 96 x 128" in output and "Traceback" not in output
    model = onnx.load(str(checkpoint.with_name("opset17.onnx")))
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    onnx.checker.check_model(model)


def test_a_float32_file_onnxruntime_cannot_load_is_not_told_to_export_fp32(tmp_path):
    """The advice after a failed load fits the file: fp32 only for a float16 file."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from engine.export.onnx import OnnxRunner

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    halves = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2]) for name in ("a", "b")]
    split = helper.make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=2)  # opset 18's form, at opset 17
    model = helper.make_model(helper.make_graph([split], "g", [x], halves), opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match=r"cannot load .*m\.onnx") as error:
        OnnxRunner(tmp_path / "m.onnx", device=CPU)
    assert "dtype=fp32" not in str(error.value) and "older than its opset (17)" in str(error.value)


# ----------------------------------------------------------------------------------------------------
# AOTInductor
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def aoti_export(checkpoint, background_exports) -> Path:
    """The package's path, once its `python export.py` command succeeded (its parity check included)."""
    if not HAS_COMPILER:
        pytest.skip("AOTInductor needs a C++ compiler with a shared libstdc++ (g++, or CXX) to build the package")
    output = background_exports["aoti"].finished()
    assert "parity at batch 2, 96 x 128: 2 images: scores max |diff|" in output
    return checkpoint.with_name("checkpoint.postprocess.static.pt2")


def test_aoti_package_runs_without_the_project_and_matches(checkpoint, aoti_export, tmp_path):
    path = aoti_export
    assert path.is_file() and "parity at" in (path.parent / "export.log").read_text()
    inputs = inputs_of(SampleShape(batch=2, height=96, width=128), seed=4, postprocess=True)
    torch.save(inputs, tmp_path / "inputs.pt")
    # A process that has not this repository on its path: torch alone runs the package.
    child = (
        "import sys, torch\n"
        f"package = torch._inductor.aoti_load_package({str(path)!r})\n"
        "outputs = package(*torch.load('inputs.pt'))\n"
        "torch.save(tuple(outputs), 'outputs.pt')\n"
        "assert not {'models', 'msda', 'engine'} & set(sys.modules), 'project code was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, check=True, timeout=120)
    got = torch.load(tmp_path / "outputs.pt")
    with torch.no_grad():
        expected = pytorch_detector(checkpoint, max_detections=10)(*inputs)
    assert [t.shape for t in got] == [(2, 10), (2, 10), (2, 10, 4)] and got[1].dtype == torch.int64
    report = compare_outputs(got, expected, tolerance=tolerance_for("fp32"), target_sizes=inputs[2])
    assert not report.failures and report.ranks_compared > 0, report.describe()


def test_aoti_parity_check_fails_for_a_changed_model(checkpoint, aoti_export):
    from engine.export.aoti import AotiRunner

    runner, detector = AotiRunner(aoti_export), pytorch_detector(checkpoint, max_detections=10)
    inputs = inputs_of(SampleShape(batch=2, height=96, width=128), seed=5, postprocess=True)
    check_parity(runner, detector, inputs, tolerance=tolerance_for("fp32"), what="x")
    with torch.no_grad():
        detector.model.class_embed[0].bias.add_(0.05)
    with pytest.raises(ExportParityError, match=r"scores differ"):
        check_parity(runner, detector, inputs, tolerance=tolerance_for("fp32"), what="model.pt2")


def fake_compiler(folder: Path, libstdcxx: str) -> str:
    """A C++ compiler stand-in that answers ``-print-file-name=libstdc++.so`` with ``libstdcxx``."""
    path = folder / "fake-g++"
    path.write_text(f"#!/bin/sh\necho '{libstdcxx}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the libstdc++ check runs on Linux")
def test_compiler_without_shared_libstdcxx_is_refused_before_anything_is_traced(checkpoint, tmp_path, monkeypatch):
    import engine.export.run
    from engine.errors import AotiCompilerError
    from engine.export import aoti as export_aoti

    static_only = fake_compiler(tmp_path, "libstdc++.so")  # what a compiler with no libstdc++.so prints
    refused = (
        rf"^format=aoti: the C\+\+ compiler {re.escape(static_only)} has no shared libstdc\+\+.* "
        r"Run the export with CXX="
    )
    with pytest.raises(AotiCompilerError, match=refused):
        export_aoti.check_cxx_compiler(static_only)
    monkeypatch.setattr(export_aoti, "inductor_cxx", lambda: static_only)
    monkeypatch.setattr(engine.export.run, "load_trained_model", lambda *a, **k: pytest.fail("loaded the checkpoint"))
    with pytest.raises(AotiCompilerError):
        exporter.export(compose_export(f"checkpoint={checkpoint}", "format=aoti"))
    with pytest.raises(AotiCompilerError):  # callers other than export.py (the bench) are covered
        export_aoti.write_aoti(None, tmp_path / "never.pt2")
    assert not (tmp_path / "never.pt2").exists()


def test_compiler_with_shared_libstdcxx_or_unknown_is_let_through(tmp_path):
    from engine.export.aoti import check_cxx_compiler, has_shared_libstdcxx

    shared = fake_compiler(tmp_path, "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so")
    assert has_shared_libstdcxx(shared) is True
    check_cxx_compiler(shared)
    missing = str(tmp_path / "no-such-compiler")
    assert has_shared_libstdcxx(missing) is None  # Inductor names a missing compiler itself
    check_cxx_compiler(missing)


# ----------------------------------------------------------------------------------------------------
# TensorRT's node
# ----------------------------------------------------------------------------------------------------
def test_tensorrt_variant_has_the_plugin_node_with_its_inputs(checkpoint, background_exports):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    import numpy as np
    from onnx import numpy_helper

    from engine.export.tensorrt import PLUGIN_DOMAIN, PLUGIN_NAME

    output = background_exports["tensorrt"].finished()
    assert "NOT checked against the PyTorch model" in output and "parity at" not in output
    model = onnx.load(str(checkpoint.with_name("checkpoint.tensorrt.static.onnx")))
    metadata = {p.key: p.value for p in model.metadata_props}
    assert metadata["deformable_detr.parity"].startswith("not checked")
    assert metadata["deformable_detr.weights"] == "raw"  # the checkpoint holds no EMA: its trained weights
    assert not any(n.op_type == "GridSample" for n in model.graph.node)
    nodes = [n for n in model.graph.node if n.op_type == PLUGIN_NAME]
    assert len(nodes) == 2 and {n.domain for n in nodes} == {PLUGIN_DOMAIN}  # one encoder, one decoder layer
    assert {a.name: a.s for a in nodes[0].attribute} == {"plugin_version": b"1", "plugin_namespace": b""}
    types = {v.name: v.type.tensor_type for v in [*model.graph.value_info, *model.graph.input]}
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            value = onnx.helper.get_attribute_value(node.attribute[0])
            constants[node.output[0]] = (
                numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.array(value)
            )

    def shape(name):
        return [d.dim_value for d in types[name].shape.dim]

    float32, int32 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT32
    # The encoder's queries are its 252 positions, the decoder's the model's.
    for node, queries in zip(nodes, (12 * 16 + 6 * 8 + 3 * 4, TINY_MODEL["num_queries"])):
        value, spatial_shapes, level_start_index, locations, weights = node.input
        assert shape(value) == [2, 252, 2, 16] and types[value].elem_type == float32  # (N, S, M, D)
        assert types[spatial_shapes].elem_type == types[level_start_index].elem_type == int32
        assert constants[spatial_shapes].tolist() == [[12, 16], [6, 8], [3, 4]]  # (H, W) of 96 x 128 / 8, 16, 32
        assert constants[level_start_index].tolist() == [0, 192, 240]
        assert shape(locations) == [2, queries, 2, 3, 4, 2] and types[locations].elem_type == float32
        assert shape(weights) == [2, queries, 2, 3, 4] and types[weights].elem_type == float32
        assert shape(node.output[0]) == [2, queries, 2, 16]  # (N, Lq, M, D), as the plugin returns


# ----------------------------------------------------------------------------------------------------
# the parity check itself, and the settings
# ----------------------------------------------------------------------------------------------------
def test_detection_parity_lets_tied_ranks_swap_but_not_labels_change():
    scores = torch.tensor([[0.9, 0.5, 0.5 - 1e-6, 0.2, 0.1]])
    labels = torch.tensor([[1, 2, 3, 1, 0]])
    boxes = torch.rand(1, 5, 4) * 50
    sizes = torch.tensor([[50, 50]])
    tolerance = Tolerance(logits=1e-3, boxes=1e-4)
    swapped = (scores[:, [0, 2, 1, 3, 4]], labels[:, [0, 2, 1, 3, 4]], boxes[:, [0, 2, 1, 3, 4]])
    report = compare_outputs(swapped, (scores, labels, boxes), tolerance=tolerance, target_sizes=sizes)
    assert not report.failures and report.ranks_compared == 2  # ranks 0 and 3; the tie and the last are not clear
    relabelled = (scores, torch.tensor([[1, 2, 3, 2, 0]]), boxes)
    report = compare_outputs(relabelled, (scores, labels, boxes), tolerance=tolerance, target_sizes=sizes)
    assert report.label_mismatches == 1 and report.failures
    nan = (scores, labels, boxes.clone().index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"))))
    assert compare_outputs(nan, (scores, labels, boxes), tolerance=tolerance, target_sizes=sizes).failures


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["format=aoti", "msda_node=tensorrt"], "msda_node=tensorrt is for format=onnx"),
        (["msda_node=triton"], "msda_node=triton is for format=aoti"),
        (["format=aoti", "msda_node=triton"], "msda_node=triton puts the Triton kernels' op in the package"),
        (["image_size=[100,128]"], "image_size must be null"),
        (["image_size=[32,32]"], "image_size must be at least 64 x 64"),
        (["opset=16"], "opset must be from 17 to 23"),
        (["opset=24"], "opset must be from 17 to 23"),
        (["dtype=bf16"], "dtype=bf16 is for format=aoti"),
        (["batch_size=1"], "batch_size must be >= 2 with dynamic=true"),
        (["tolerance.boxes=0"], "tolerance.boxes must be null"),
    ],
)
def test_settings_that_cannot_work_are_refused(checkpoint, overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        exporter.export(compose_export(f"checkpoint={checkpoint}", *overrides))


def test_sample_batch_is_the_recorded_validation_images_fitted_else_noise(checkpoint, tmp_path):
    folder = checkpoint.parent / "data" / "val2017"
    assert recorded_validation_folder({"dataset": {"name": "synthetic", "root": str(folder.parent)}}) == folder
    assert recorded_validation_folder({"dataset": {"name": "custom", "val_images": str(folder)}}) == folder
    assert recorded_validation_folder({"dataset": {"name": "coco", "root": str(tmp_path / "absent")}}) is None
    sample = sample_batch(SampleShape(batch=3, height=96, width=128), folder=folder)
    # 120 x 90 fills 128 x 96; 70 x 100 becomes 67 x 96; the third image is the first again (two in the folder).
    assert sample.target_sizes.tolist() == [[90, 120], [100, 70], [90, 120]]
    assert not sample.mask[0].any() and not sample.mask[1, :, :67].any() and sample.mask[1, :, 67:].all()
    assert (sample.images[1, :, :, 67:] == 0).all() and sample.images[0].std() > 0.5
    noise = sample_batch(SampleShape(batch=2, height=64, width=64), folder=None)
    assert noise.source.startswith("random images") and noise.mask[1].any() and not noise.mask[0].any()


def test_default_output_names_tell_variants_apart():
    base = Path("runs/a/checkpoint_epoch0024.pth")
    assert default_output(checkpoint=base, format="onnx") == Path("runs/a/checkpoint_epoch0024.onnx")
    assert default_output(checkpoint=base, format="aoti", dtype="bf16") == Path("runs/a/checkpoint_epoch0024.bf16.pt2")
    assert default_output(
        checkpoint=base, format="onnx", dtype="fp16", msda_node="tensorrt", postprocess=True, dynamic=False
    ) == Path("runs/a/checkpoint_epoch0024.fp16.tensorrt.postprocess.static.onnx")
    # The trained weights rather than the EMA, and another opset, are variants of their own too.
    assert default_output(checkpoint=base, format="onnx", weights="raw") == Path("runs/a/checkpoint_epoch0024.raw.onnx")
    assert default_output(checkpoint=base, format="onnx", opset=17) == Path("runs/a/checkpoint_epoch0024.opset17.onnx")
    assert default_output(checkpoint=base, format="aoti", opset=17) == Path("runs/a/checkpoint_epoch0024.pt2")


def test_a_run_directory_given_as_the_checkpoint_exports_beside_its_checkpoint(checkpoint):
    from engine.config.export_schema import default_output, export_directory

    assert default_output(checkpoint=checkpoint.parent, format="onnx") == checkpoint.with_suffix(".onnx")
    assert export_directory(None, str(checkpoint.parent)) == str(checkpoint.parent.resolve())


def test_a_model_trained_on_images_too_small_to_export_at_exports_at_the_least_size_that_works(tmp_path):
    """Four feature levels need 96-pixel sides; the checkpoint's run evaluated at 64: export picks 96 itself."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import onnx

    small = write_checkpoint(
        tmp_path / "checkpoint.pth", extra=("model.num_feature_levels=4", "dataset.val_size=64", "dataset.max_size=64")
    )
    result = exporter.export(compose_export(f"checkpoint={small}", "dynamic=false", "batch_size=1"))
    dims = [d.dim_value for d in onnx.load(str(result["output"])).graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 96, 96] and result["parity"]
