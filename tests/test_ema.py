"""Model EMA (engine/train/hooks/ema.py): the average and its warm-up, its place in checkpoints and resumes, and the
weights evaluation, predict.py and export.py take from a checkpoint that holds one."""

from __future__ import annotations

import json
import math
import signal

import pytest
import torch
from helpers import ROOT, compose_run, signal_at_call, tiny_cfg, write_checkpoint

import train as trainer
from engine.checkpoint.io import load_checkpoint
from engine.checkpoint.trained_model import checkpoint_model, load_trained_model
from engine.runtime.stop_request import TrainingStopped
from engine.train.hooks.ema import ModelEma
from models import build_model

STEPS_PER_EPOCH = 3  # helpers.tiny_overrides


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.register_buffer("fixed", torch.arange(4.0))
        self.register_buffer("count", torch.tensor(7))  # not floating: never averaged


def _step(net: _Net, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=gen))


def test_the_average_follows_the_warmed_up_decay_exactly():
    gen = torch.Generator().manual_seed(0)
    net = _Net()
    ema = ModelEma(net, decay=0.9, warmup_steps=3)
    expected = {name: t.detach().clone().double() for name, t in net.state_dict().items() if t.is_floating_point()}
    for n in range(1, 8):
        _step(net, gen)
        ema.after_step(None, None)
        d = 0.9 * (1 - math.exp(-n / 3))
        for name, t in net.state_dict().items():
            if name in expected:
                expected[name] = d * expected[name] + (1 - d) * t.double()
    assert ema.updates == 7 and sorted(ema.names) == ["fixed", "linear.bias", "linear.weight"]
    averages = dict(zip(ema.names, ema.average))
    for name, average in averages.items():
        torch.testing.assert_close(average.double(), expected[name], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(averages["fixed"], torch.arange(4.0))  # a buffer that never changes stays itself


def test_the_average_is_in_the_model_inside_applied_only_and_round_trips_through_its_state():
    gen = torch.Generator().manual_seed(1)
    net = _Net()
    ema = ModelEma(net, decay=0.5, warmup_steps=1)
    for _ in range(3):
        _step(net, gen)
        ema.after_step(None, None)
    raw = {k: v.clone() for k, v in net.state_dict().items()}
    weight = net.linear.weight
    with ema.applied():
        assert net.linear.weight is weight  # in place: graphs that read the tensors see the average
        torch.testing.assert_close(net.linear.weight, dict(zip(ema.names, ema.average))["linear.weight"])
        assert not torch.equal(net.linear.weight, raw["linear.weight"])
    for name, value in net.state_dict().items():
        assert torch.equal(value, raw[name]), name
    again = ModelEma(_Net(), decay=0.5, warmup_steps=1)
    again.load_state_dict(ema.state_dict())
    assert again.updates == 3 and all(torch.equal(a, b) for a, b in zip(again.average, ema.average))


@pytest.mark.parametrize(
    "decay, warmup, message",
    [(1.0, 10, "ema.decay must be in"), (0.0, 10, "ema.decay"), (0.9, 0, "ema.warmup_steps must be")],
)
def test_bad_settings_are_refused_naming_the_key(decay, warmup, message):
    with pytest.raises(ValueError, match=message):
        ModelEma(_Net(), decay=decay, warmup_steps=warmup)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


EMA = ["ema.decay=0.8", "ema.warmup_steps=2", "eval_images=0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_root):
    run_dir = tmp_path_factory.mktemp("ema_run")
    result = trainer.train(compose_run(data_root, run_dir, *EMA))
    return {**result, "ckpt": load_checkpoint(run_dir / "checkpoint.pth"), "dir": run_dir}


@pytest.mark.slow
def test_a_resumed_runs_average_is_the_uninterrupted_runs(uninterrupted, data_root, tmp_path, monkeypatch):
    signal_at_call(monkeypatch, signal.SIGTERM, STEPS_PER_EPOCH + 1)
    with pytest.raises(TrainingStopped):
        trainer.train(compose_run(data_root, tmp_path, *EMA))
    assert load_checkpoint(tmp_path / "checkpoint.pth")["ema"]["updates"] == STEPS_PER_EPOCH + 1
    trainer.train(compose_run(data_root, tmp_path, *EMA, "resume=auto"))
    resumed, expected = load_checkpoint(tmp_path / "checkpoint.pth")["ema"], uninterrupted["ckpt"]["ema"]
    assert resumed["updates"] == expected["updates"] == 2 * STEPS_PER_EPOCH
    assert resumed["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        torch.testing.assert_close(resumed["model"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_evaluation_reports_the_averages_ap_with_the_raw_weights_beside_it(uninterrupted, data_root, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(uninterrupted["dir"] / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert {"eval/AP", "eval_raw/AP"} <= set(events.Tags()["scalars"])
    average = trainer.evaluate_checkpoint(
        compose_run(data_root, tmp_path / "ema", *EMA, "eval_only=true", f"checkpoint={uninterrupted['dir']}")
    )
    raw = trainer.evaluate_checkpoint(
        compose_run(
            data_root,
            tmp_path / "raw",
            *EMA,
            "eval_only=true",
            f"checkpoint={uninterrupted['dir']}",
            "checkpoint_weights=raw",
        )
    )
    assert average["eval"] == pytest.approx(uninterrupted["eval"], abs=1e-4)
    last_raw = events.Scalars("eval_raw/AP")[-1].value
    assert raw["eval"]["AP"] == pytest.approx(last_raw, abs=1e-4)

    # Each file names whose weights it scored; training's keep the raw weights' figures beside the average's.
    final = json.loads((uninterrupted["dir"] / "eval_epoch0002.json").read_text())
    assert final["weights"] == "ema" and final["AP"] == pytest.approx(uninterrupted["eval"]["AP"], abs=1e-6)
    assert final["raw"]["AP"] == pytest.approx(last_raw, abs=1e-6) and set(final["raw"]) == set(average["eval"])
    for folder, weights in ((tmp_path / "ema", "ema"), (tmp_path / "raw", "raw")):
        assert json.loads((folder / "eval.json").read_text())["weights"] == weights


def test_predict_and_export_load_the_average_unless_asked_for_the_raw_weights(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_cfg("base")
    model, _, _ = build_model(cfg)
    state = model.state_dict()
    average = {name: t + 1.0 for name, t in state.items() if t.is_floating_point()}
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": state, "ema": {"model": average, "updates": 5}}, path)
    cpu = torch.device("cpu")
    for weights, expected in (("ema", average), ("raw", state)):
        loaded = load_trained_model(path, cfg, device=cpu, weights=weights).model.state_dict()
        for name, value in expected.items():
            assert torch.equal(loaded[name], value), (weights, name)
    assert checkpoint_model(path, cfg).uses_ema and not checkpoint_model(path, cfg, weights="raw").uses_ema
    torch.save({"model": state}, path)  # no EMA in it: its weights, whatever is asked
    assert not checkpoint_model(path, cfg).uses_ema


def test_a_checkpoint_trained_with_hybrid_matching_and_ema_evaluates_predicts_and_exports_its_average(tmp_path):
    """The average of a hybrid model's weights loads into the model without the option (its one-to-many queries left
    out), for predict.py and export.py alike; the ONNX export of it passes its parity check."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from hydra import compose, initialize_config_dir

    import export as exporter

    path = write_checkpoint(
        tmp_path / "checkpoint.pth",
        extra=("model.dec_layers=1", "model.one_to_many=hybrid", "model.num_queries_one2many=24"),
    )
    ckpt = torch.load(path, weights_only=False)
    gen = torch.Generator().manual_seed(3)
    average = {
        name: t + 0.01 * torch.randn(t.shape, generator=gen)
        for name, t in ckpt["model"].items()
        if t.is_floating_point()
    }
    torch.save({**ckpt, "ema": {"model": average, "updates": 10}}, path)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="export", overrides=["device=cpu", f"checkpoint={path}", "dynamic=false"])
    trained = load_trained_model(path, cfg.model, device=torch.device("cpu"), msda="pytorch")
    state = trained.model.state_dict()
    assert not [name for name in state if trained.model.is_training_only(name)]
    for name, value in state.items():
        if name in average:
            assert torch.equal(value, average[name]), name
    exporter.export(cfg)  # raises ExportParityError when the file's outputs are not the loaded model's
