"""Deformable DETR model tests (CPU, tiny configs): shapes, official layout, reload, gradients, padding, config.

Tiny config: hidden_dim 64, 2 heads, 1 encoder and 2 decoder layers, 8 queries, ResNet-50 without
pretrained weights, 64x64 images (levels 8x8, 4x4, 2x2, 1x1).
"""

from __future__ import annotations

import copy
import math
import random
import urllib.error

import pytest
import torch
from helpers import ROOT, VARIANTS, image_batch, model_cfg, tiny_cfg, two_box_targets
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

import msda
from models import build_model
from models.backbone import Backbone, PretrainedWeightsUnavailable
from models.deformable_attention import MSDeformAttn
from models.deformable_detr import build_deformable_detr
from models.deformable_transformer import inverse_sigmoid

# A copy of shared/reference/official_state_dict.tsv, kept in the repo so the check never depends on a
# folder beside the checkout.
OFFICIAL_TSV = ROOT / "tests" / "data" / "official_state_dict.tsv"


@pytest.fixture
def seeded():
    torch.manual_seed(0)


# ----------------------------------------------------------------------------------------------------
# outputs
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_output_shapes_and_keys(seeded, variant):
    model = build_deformable_detr(tiny_cfg(variant)).eval()
    images, mask = image_batch(pad_w=16)
    with torch.no_grad():
        out = model(images, mask)
    B, Q, K, S = 2, 10, 5, 8 * 8 + 4 * 4 + 2 * 2  # 64-pixel images, three levels
    expected = {"pred_logits", "pred_boxes", "aux_outputs"} | ({"enc_outputs"} if variant == "two_stage" else set())
    assert set(out) == expected
    assert out["pred_logits"].shape == (B, Q, K)
    assert out["pred_boxes"].shape == (B, Q, 4)
    assert ((out["pred_boxes"] >= 0) & (out["pred_boxes"] <= 1)).all()
    assert len(out["aux_outputs"]) == 1  # dec_layers - 1
    for aux in out["aux_outputs"]:
        assert aux["pred_logits"].shape == (B, Q, K) and aux["pred_boxes"].shape == (B, Q, 4)
    if variant == "two_stage":
        assert out["enc_outputs"]["pred_logits"].shape == (B, S, K)
        assert out["enc_outputs"]["pred_boxes"].shape == (B, S, 4)
    assert all(torch.isfinite(t).all() for t in (out["pred_logits"], out["pred_boxes"]))


def test_no_aux_outputs_without_aux_loss(seeded):
    model = build_deformable_detr(tiny_cfg(aux_loss=False)).eval()
    with torch.no_grad():
        out = model(*image_batch(B=1))
    assert set(out) == {"pred_logits", "pred_boxes"}


def test_single_level_and_dilation(seeded):
    """num_feature_levels=1 uses layer4 only; dilation keeps layer4 at stride 16."""
    model = build_deformable_detr(tiny_cfg(num_feature_levels=1, dilation=True, backbone="resnet50")).eval()
    assert model.backbone.strides == [16]
    srcs, masks, pos = model.features(*image_batch(B=1))
    assert [tuple(s.shape) for s in srcs] == [(1, 32, 4, 4)]
    assert masks[0].shape == (1, 4, 4) and pos[0].shape == (1, 32, 4, 4)


# ----------------------------------------------------------------------------------------------------
# official layout
# ----------------------------------------------------------------------------------------------------
def _official(variant):
    rows = [line.rstrip("\n").split("\t") for line in OFFICIAL_TSV.read_text().splitlines() if not line.startswith("#")]
    return {name: shape for var, name, shape in rows if var == variant}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_state_dict_matches_official(variant):
    """Default config: every official tensor name and shape, nothing more (no num_batches_tracked)."""
    model = build_deformable_detr(model_cfg(**VARIANTS[variant]))
    got = {name: "x".join(map(str, t.shape)) for name, t in model.state_dict().items()}
    official = _official(variant)
    assert sorted(set(official) - set(got)) == [], "missing"
    assert sorted(set(got) - set(official)) == [], "unexpected"
    assert {n: got[n] for n in official if got[n] != official[n]} == {}
    # A state dict in the official layout loads strictly.
    model.load_state_dict({n: torch.zeros_like(t) for n, t in model.state_dict().items()}, strict=True)


def test_head_sharing_as_official():
    base = build_deformable_detr(tiny_cfg("base"))
    assert base.class_embed[0] is base.class_embed[1] and base.bbox_embed[0] is base.bbox_embed[1]
    assert base.transformer.decoder.bbox_embed is None
    assert (base.bbox_embed[0].layers[-1].bias[2:] == -2).all()
    assert torch.allclose(base.class_embed[0].bias, torch.full((5,), -math.log(99)))
    refine = build_deformable_detr(tiny_cfg("box_refine"))
    assert refine.class_embed[0] is not refine.class_embed[1]
    assert refine.transformer.decoder.bbox_embed is refine.bbox_embed
    two = build_deformable_detr(tiny_cfg("two_stage"))
    assert len(two.class_embed) == 3 and two.transformer.decoder.class_embed is two.class_embed
    assert not hasattr(two, "query_embed") and not hasattr(two.transformer, "reference_points")


def test_msdeformattn_init_and_fp32_locations_under_autocast(monkeypatch, seeded):
    attn = MSDeformAttn(d_model=32, n_levels=2, nheads=4, n_points=2, msda="pytorch")
    bias = attn.sampling_offsets.bias.view(4, 2, 2, 2)  # (M, L, P, xy)
    assert torch.allclose(bias[0, :, 0], torch.tensor([1.0, 0.0]))  # head 0 looks right, 1 pixel
    assert torch.allclose(bias[1, :, 1], torch.tensor([0.0, 2.0]), atol=1e-6)  # head 1 down, 2 pixels
    seen = {}
    original = msda.multi_scale_deformable_attention

    def spy(value, shapes, start, loc, weights, impl):
        seen.update(value=value.dtype, loc=loc.dtype, impl=impl)
        return original(value, shapes, start, loc, weights, impl="pytorch")

    monkeypatch.setattr(msda, "multi_scale_deformable_attention", spy)
    shapes = torch.tensor([[4, 4], [2, 2]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(
            torch.randn(1, 3, 32),
            torch.rand(1, 3, 2, 2),
            torch.randn(1, 20, 32),
            shapes,
            torch.tensor([0, 16]),
            torch.zeros(1, 20, dtype=torch.bool),
        )
    assert seen == {"value": torch.bfloat16, "loc": torch.float32, "impl": "pytorch"}
    assert out.shape == (1, 3, 32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_autocast_keeps_locations_and_boxes_fp32(monkeypatch, seeded, variant):
    """Under autocast every msda call gets float32 locations and the boxes come out float32."""
    model, criterion, _ = build_model(tiny_cfg(variant))
    original, loc_dtypes = msda.multi_scale_deformable_attention, set()

    def spy(value, shapes, start, loc, weights, impl):
        loc_dtypes.add((value.dtype, loc.dtype))
        return original(value, shapes, start, loc, weights, impl=impl)

    monkeypatch.setattr(msda, "multi_scale_deformable_attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*image_batch(pad_w=16))
        losses = criterion(out, two_box_targets())
    loss = sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses)
    loss.backward()
    assert loc_dtypes == {(torch.bfloat16, torch.float32)}
    assert out["pred_boxes"].dtype == torch.float32 and torch.isfinite(loss)


def test_inverse_sigmoid_clamps():
    x = torch.tensor([-0.5, 0.0, 0.5, 1.0, 2.0])
    expected = torch.tensor([math.log(1e-5), math.log(1e-5), 0.0, -math.log(1e-5), -math.log(1e-5)])
    assert torch.allclose(inverse_sigmoid(x), expected)


# ----------------------------------------------------------------------------------------------------
# reload, loss, gradients
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_and_reload_gives_identical_outputs(tmp_path, seeded, variant):
    model = build_deformable_detr(tiny_cfg(variant)).eval()
    torch.save({"model": model.state_dict()}, tmp_path / "ckpt.pth")
    torch.manual_seed(123)  # a differently initialized model, then overwritten by the file
    reloaded = build_deformable_detr(tiny_cfg(variant)).eval()
    reloaded.load_state_dict(torch.load(tmp_path / "ckpt.pth", weights_only=True)["model"], strict=True)
    images, mask = image_batch(pad_w=16)
    with torch.no_grad():
        a, b = model(images, mask), reloaded(images, mask)
    assert torch.equal(a["pred_logits"], b["pred_logits"]) and torch.equal(a["pred_boxes"], b["pred_boxes"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_finite_and_every_trainable_parameter_gets_a_gradient(seeded, variant):
    model, criterion, postprocess = build_model(tiny_cfg(variant))
    model.train()
    out = model(*image_batch(pad_w=16))
    losses = criterion(out, two_box_targets())
    loss = sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses)
    assert torch.isfinite(loss)
    loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert [n for n, p in trainable.items() if p.grad is None] == []
    assert [n for n, p in trainable.items() if not torch.isfinite(p.grad).all()] == []
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(
        n.startswith("backbone.0.body.") and "layer2" not in n and "layer3" not in n and "layer4" not in n
        for n in frozen
    )
    with torch.no_grad():
        results = postprocess(out, torch.tensor([[64, 64], [64, 48]]))
    assert len(results) == 2 and results[0]["boxes"].shape[-1] == 4


def test_train_backbone_false_freezes_the_whole_backbone():
    model = build_deformable_detr(tiny_cfg(train_backbone=False))
    assert not any(p.requires_grad for p in model.backbone.parameters())


# ----------------------------------------------------------------------------------------------------
# padding
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["base", "box_refine"])
def test_padded_image_gives_the_same_detections_as_alone(seeded, variant):
    """Transformer and heads are exactly padding-invariant (tolerance 1e-5): padding is masked out of the
    values, reference points and offsets are scaled by valid ratios, the sine encoding is normalized by the
    valid extent, and boxes are relative to the valid region.

    The full model, like the original, is NOT invariant, so it is not compared end to end: input_proj's
    GroupNorm takes its statistics over the whole padded map, and a trained backbone's receptive fields
    see the padded pixels. We check instead that the projected levels of an image and of its padded copy
    differ only through those, by feeding the transformer the alone image's levels padded with garbage.
    Two-stage is not invariant either (padded positions get a constant, finite class-0 logit and can
    enter the top-k proposals), so it is left out.
    """
    model = build_deformable_detr(tiny_cfg(variant)).eval()
    images, _ = image_batch(B=1, H=64, W=128)
    with torch.no_grad():
        srcs, masks, pos = model.features(images)
        alone = model.predict(srcs, masks, pos)
        # The same image inside a 128x192 batch canvas: every level gets padding right and below.
        padded_srcs, padded_masks = [], []
        for src in srcs:
            h, w = src.shape[-2:]
            canvas = torch.randn(2, src.shape[1], 2 * h, w + w // 2 + 1) * 5  # garbage where padded
            canvas[0, :, :h, :w] = src[0]
            mask = torch.ones(2, 2 * h, w + w // 2 + 1, dtype=torch.bool)
            mask[0, :h, :w] = False
            mask[1] = False
            padded_srcs.append(canvas)
            padded_masks.append(mask)
        padded_pos = [model.backbone[1](m) for m in padded_masks]
        padded = model.predict(padded_srcs, padded_masks, padded_pos)
    torch.testing.assert_close(padded["pred_logits"][0], alone["pred_logits"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded["pred_boxes"][0], alone["pred_boxes"][0], atol=1e-5, rtol=1e-5)


def test_backbone_masks_follow_the_padding():
    model = build_deformable_detr(tiny_cfg())
    images, mask = image_batch(B=2, H=128, W=128, pad_w=64)
    _, masks, _ = model.features(images, mask)
    for m in masks:  # 16, 8, 4, 2 wide: the right half is padding at every level
        w = m.shape[-1]
        assert not m[0].any() and m[1, :, w // 2 :].all() and not m[1, :, : w // 2].any()


# ----------------------------------------------------------------------------------------------------
# config and weights errors
# ----------------------------------------------------------------------------------------------------
BAD_CONFIGS = [
    ({"hidden_dim": 48, "nheads": 5}, "divisible by model.nheads"),
    ({"hidden_dim": 40, "nheads": 2}, "multiple of 32"),
    ({"num_feature_levels": 2}, "num_feature_levels"),
    ({"two_stage": True, "with_box_refine": False}, "with_box_refine"),
    ({"backbone": "vgg16"}, "model.backbone"),
    ({"position_embedding": "rope"}, "position_embedding"),
    ({"msda": "cuda"}, "model.msda"),
    ({"dropout": 1.5}, "dropout"),
    ({"enc_layers": 0}, "enc_layers"),
    ({"aux_loss": "maybe"}, r"'maybe' is not a valid bool \(type str\)\s+full_key: model\.aux_loss"),
    ({"pretrained": "/nonexistent/resnet.pth"}, "neither 'none', 'imagenet' nor an existing file"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS)
def test_bad_config_values_raise_clear_errors(overrides, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        build_deformable_detr(tiny_cfg(**overrides))


def test_missing_key_is_named():
    cfg = OmegaConf.to_container(tiny_cfg())
    del cfg["nheads"]
    with pytest.raises(MissingMandatoryValue, match=r"missing mandatory value: nheads\s+full_key: model\.nheads"):
        build_deformable_detr(cfg)


def test_imagenet_weights_unavailable_offline(monkeypatch, tmp_path):
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(self, *args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(type(torchvision.models.ResNet18_Weights.IMAGENET1K_V1), "get_state_dict", offline)
    # An OSError, which the console reports as one message: what it tried to fetch, and how to go without.
    with pytest.raises(
        PretrainedWeightsUnavailable,
        match=r"model\.pretrained=imagenet needs torchvision's .*could "
        r"not be downloaded \(URLError.*resnet18-f37072fd\.pth.*"
        r"model\.pretrained=none",
    ) as error:
        Backbone(name="resnet18", pretrained="imagenet")
    assert isinstance(error.value, OSError)


def test_pretrained_from_a_file(tmp_path, seeded):
    source = Backbone(name="resnet18")
    state = {k: torch.randn_like(v) for k, v in source.body.state_dict().items()}
    torch.save({"model": {"backbone.0.body." + k: v for k, v in state.items()}}, tmp_path / "r18.pth")
    loaded = Backbone(name="resnet18", pretrained=str(tmp_path / "r18.pth"))
    assert all(torch.equal(loaded.body.state_dict()[k], v) for k, v in state.items())
    bad = copy.deepcopy(state)
    bad.pop("conv1.weight")
    torch.save(bad, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match=r"missing.*conv1\.weight"):
        Backbone(name="resnet18", pretrained=str(tmp_path / "bad.pth"))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
            ),
        ),
    ],
)
def test_masks_are_downsampled_as_the_original_and_export_with_any_batch_size(device):
    """The original interpolates the batch as the channels of one image; ours as a batch of one channel: the
    same masks, and torch.export keeps the batch dynamic (CUDA's decomposition guarded on the channel count)."""
    import torch.nn.functional as F

    from models.backbone import downsample_mask

    torch.manual_seed(0)
    masks = torch.rand(3, 37, 53, device=device) > 0.5
    for size in ((5, 7), (19, 27), (37, 53), (74, 106)):
        original = F.interpolate(masks[None].float(), size=size).to(torch.bool)[0]
        assert torch.equal(downsample_mask(masks, size), original), size

    class Downsample(torch.nn.Module):
        def forward(self, mask):
            return downsample_mask(mask, (mask.shape[-2] // 8, mask.shape[-1] // 8))

    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(Downsample(), (masks[:2, :32, :48].contiguous(),), dynamic_shapes=({0: batch},))
    assert torch.equal(program.module()(masks[:, :32, :48].contiguous()), Downsample()(masks[:, :32, :48]))


def test_channels_last_backbone_computes_the_same_with_the_same_state_dict(seeded):
    """A GPU run puts the ResNet in channels_last (engine/train/build.py): the same function, gradients and
    checkpoint keys, and a checkpoint of either layout loads into the other."""
    # float64: in float32 the convolutions' other order of sums moves some gradients by a percent (sampling
    # locations that cross a pixel), which would hide a real difference.
    model = build_deformable_detr(tiny_cfg(backbone="resnet18", train_backbone=True)).train().double()
    other = copy.deepcopy(model)
    other.use_channels_last()
    conv = other.backbone[0].body.conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    images, mask = image_batch(pad_w=16)
    outputs = [m(images.double(), mask) for m in (model, other)]
    torch.testing.assert_close(outputs[0]["pred_boxes"], outputs[1]["pred_boxes"], rtol=1e-10, atol=1e-12)
    for out in outputs:
        (out["pred_logits"].square().sum() + out["pred_boxes"].sum()).backward()
    grads = dict(model.named_parameters())
    for name, p in other.named_parameters():
        if p.grad is not None:
            if name.startswith("backbone.0."):
                assert p.grad.stride() == p.stride(), name
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-8, atol=1e-10, msg=name)
    state = other.state_dict()
    assert list(state) == list(model.state_dict())
    fresh = build_deformable_detr(tiny_cfg(backbone="resnet18", train_backbone=True)).double()
    fresh.load_state_dict(state)
    assert fresh.backbone[0].body.conv1.weight.is_contiguous()
    torch.testing.assert_close(fresh.backbone[0].body.conv1.weight, conv, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# input pixels: the loaders give uint8, the model normalizes
# ----------------------------------------------------------------------------------------------------
def _host_normalized(pixels: torch.Tensor) -> torch.Tensor:
    """What the loaders gave before they handed over uint8: torchvision's normalization on the host."""
    from torchvision.transforms.v2 import functional as F

    from models.input_pixels import IMAGENET_MEAN, IMAGENET_STD

    return F.normalize(F.to_dtype(pixels, torch.float32, scale=True), mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD))


def _pixel_batch(generator, B=2, H=64, W=96, pad=(0, 24)):
    """uint8 images, zero padded as collate_fn pads them (the last image's bottom/right ``pad`` rows/columns), and
    their masks; and the same batch as the loaders gave it before: normalized on the host, padded with 0."""
    pixels = torch.randint(0, 256, (B, 3, H, W), dtype=torch.uint8, generator=generator)
    mask = torch.zeros(B, H, W, dtype=torch.bool)
    mask[-1, H - pad[0] :] = True
    mask[-1, :, W - pad[1] :] = True
    pixels[mask[:, None].expand_as(pixels)] = 0
    normalized = torch.stack([_host_normalized(p) for p in pixels])
    normalized[mask[:, None].expand_as(normalized)] = 0
    return pixels, mask, normalized


def test_pixels_are_normalized_as_torchvision_normalizes_them_and_padding_is_zero():
    from models.input_pixels import InputPixels

    normalizer = InputPixels()
    seed = random.randrange(2**31)  # fresh pixels each run, named when they fail
    pixels, mask, expected = _pixel_batch(torch.Generator().manual_seed(seed), B=3, H=37, W=53, pad=(5, 11))
    assert torch.equal(normalizer(pixels, mask), expected), f"seed {seed}"
    assert torch.equal(normalizer(pixels[0]), _host_normalized(pixels[0]))  # one image, no mask
    unmasked = normalizer(pixels)
    assert unmasked.dtype == torch.float32 and (unmasked[mask[:, None].expand_as(unmasked)] != 0).all()
    assert normalizer(expected, mask) is expected  # float: already normalized
    with pytest.raises(ValueError, match=r"pixels must be uint8.*float32"):
        normalizer.normalize(expected, mask)
    assert list(normalizer.state_dict()) == []  # constants: no key the official checkpoints lack


def test_normalizing_makes_no_tensor_and_copies_nothing_from_the_host():
    """Its constants are already where the pixels are: a CUDA graph records the step, and a tensor made from
    Python numbers during it (a copy from the host) would stop the recording. Every op it dispatches works on the
    pixels, the mask and the buffers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.input_pixels import InputPixels

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((func.overloadpacket.__name__, kwargs or {}))
            return func(*args, **(kwargs or {}))

    normalizer = InputPixels()
    pixels, mask, _ = _pixel_batch(torch.Generator().manual_seed(3), H=16, W=24, pad=(4, 8))
    with Ops() as ops:
        out = normalizer(pixels, mask)
    assert out.shape == pixels.shape and out.dtype == torch.float32
    assert ops.calls, "the mode saw no op"
    for name, kwargs in ops.calls:
        assert "device" not in kwargs, (name, kwargs)
        assert not name.startswith(("lift_fresh", "scalar_tensor", "empty", "full", "zeros", "ones", "arange")), name
    with pytest.raises(ValueError, match="pixels are on cpu and the model on meta"):
        normalizer.to("meta")(pixels, mask)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_model_on_uint8_pixels_computes_what_it_did_on_host_normalized_images(variant):
    """The same outputs and gradients, to the bit (fp32, CPU), as when the loaders normalized on the host."""
    seed = random.randrange(2**31)  # fresh weights and pixels each run, named when they fail
    torch.manual_seed(seed)
    model = build_deformable_detr(tiny_cfg(variant, backbone="resnet18", train_backbone=True)).train()
    pixels, mask, normalized = _pixel_batch(torch.Generator().manual_seed(seed), pad=(16, 32))
    runs = []
    for images in (pixels, normalized):
        model.zero_grad()
        out = model(images, mask)
        (out["pred_logits"].square().sum() + out["pred_boxes"].sum()).backward()
        runs.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (a, grads_a), (b, grads_b) = runs
    assert torch.equal(a["pred_logits"], b["pred_logits"]) and torch.equal(a["pred_boxes"], b["pred_boxes"]), seed
    assert grads_a.keys() == grads_b.keys() and "backbone.0.body.layer2.0.conv1.weight" in grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), f"{name}, seed {seed}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_pixels_normalized_on_the_gpu_match_the_host():
    """Eager CUDA kernels round as the CPU's; a compiled graph (as the backbone's) may differ by an ulp."""
    from models.input_pixels import InputPixels

    normalizer = InputPixels().cuda()
    pixels, mask, expected = _pixel_batch(torch.Generator().manual_seed(2), B=4, H=120, W=200, pad=(40, 56))
    assert torch.equal(normalizer(pixels.cuda(), mask.cuda()).cpu(), expected)
    compiled = torch.compile(normalizer, fullgraph=True)(pixels.cuda(), mask.cuda()).cpu()
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)
    assert (compiled[mask[:, None].expand_as(compiled)] == 0).all()
