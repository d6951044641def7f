"""ResNet backbone with frozen batch norm, returning multi-scale features and their padding masks.

Module layout follows the original so checkpoints load unchanged: ``backbone.0`` is the ResNet wrapper
(``backbone.0.body.*`` the torchvision ResNet without avgpool/fc), ``backbone.1`` the position encoding.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models._utils import IntermediateLayerGetter

from .frozen_batch_norm import FrozenBatchNorm2d

# Output channels of layer2/3/4 per torchvision ResNet; BasicBlock nets cannot dilate layer4.
RESNET_CHANNELS = {
    "resnet18": (128, 256, 512),
    "resnet34": (128, 256, 512),
    "resnet50": (512, 1024, 2048),
    "resnet101": (512, 1024, 2048),
}
IMAGENET_WEIGHTS = {
    "resnet18": "ResNet18_Weights",
    "resnet34": "ResNet34_Weights",
    "resnet50": "ResNet50_Weights",
    "resnet101": "ResNet101_Weights",
}


def downsample_mask(mask: torch.Tensor, size) -> torch.Tensor:
    """Padding mask (B, H, W) bool -> (B, h, w) bool by nearest interpolation, as the original.

    The images are the batch of one channel (the original interpolates them as the channels of one image:
    the same pixels), so that the batch size stays a batch size to torch.export: as channels, CUDA's
    nearest-upsampling decomposition guarded on it being under 4, and a dynamic batch failed to export."""
    return F.interpolate(mask[:, None].float(), size=size).to(torch.bool)[:, 0]


class PretrainedWeightsUnavailable(OSError):
    """The ImageNet weights model.pretrained asks for could not be read or fetched; the message says from where and
    how to run offline."""


def _imagenet_state_dict(name: str) -> dict:
    """torchvision's IMAGENET1K_V1 weights (those the official models started from), from the hub cache.

    Downloads when the file is missing; without network that fails, and the error says where to put it.
    """
    weights = getattr(torchvision.models, IMAGENET_WEIGHTS[name]).IMAGENET1K_V1
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    try:
        return weights.get_state_dict(progress=False, check_hash=True)
    except Exception as err:  # URLError, socket errors, hash mismatch: all mean "no usable file"
        raise PretrainedWeightsUnavailable(
            f"model.pretrained=imagenet needs torchvision's {IMAGENET_WEIGHTS[name]}.IMAGENET1K_V1 weights, which are "
            f"not in the torch hub cache and could not be downloaded ({type(err).__name__}: {err}). Download "
            f"{weights.url} on a machine with network and put it at {cached} (TORCH_HOME moves the cache), "
            f"or set model.pretrained=none (random init) or model.pretrained=/path/to/resnet.pth"
        ) from err


def _file_state_dict(path: str) -> dict:
    """A ResNet state dict from a file: torchvision's layout, optionally under 'model'/'state_dict', and
    optionally prefixed 'module.' or 'backbone.0.body.' (a DETR checkpoint's backbone)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.pretrained={path!r} is neither 'none', 'imagenet' nor an existing file")
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    out = {}
    for k, v in state.items():
        for prefix in ("module.", "backbone.0.body."):
            if k.startswith(prefix):
                k = k[len(prefix) :]
        out[k] = v
    if not any(k.startswith("layer1.") for k in out):
        raise ValueError(f"{path} holds no ResNet weights (no 'layer1.*' keys after prefix stripping)")
    return out


class Backbone(nn.Module):
    """torchvision ResNet with FrozenBatchNorm2d (eps 1e-5).

    forward(images (B, 3, H, W), mask (B, H, W) bool True on padding) -> list of (features, mask) per
    returned layer: layer2/3/4 (strides 8/16/32; 32 -> 16 with dilation) when return_interm_layers,
    else layer4 only. The stem and layer1 never train; layer2-4 train when train_backbone.
    """

    def __init__(
        self,
        *,
        name: str = "resnet50",
        train_backbone: bool = True,
        return_interm_layers: bool = True,
        dilation: bool = False,
        pretrained: str = "none",
    ):
        super().__init__()
        if name not in RESNET_CHANNELS:
            raise ValueError(f"backbone must be one of {sorted(RESNET_CHANNELS)}, got {name!r}")
        if dilation and name in ("resnet18", "resnet34"):
            raise ValueError(f"dilation=true needs a bottleneck ResNet (resnet50/101), got {name!r}")
        resnet = getattr(torchvision.models, name)(
            weights=None, replace_stride_with_dilation=[False, False, dilation], norm_layer=FrozenBatchNorm2d
        )
        pretrained = str(pretrained)
        if pretrained.lower() == "imagenet":
            resnet.load_state_dict(_imagenet_state_dict(name))
        elif pretrained.lower() not in ("none", "", "null"):
            state = _file_state_dict(pretrained)
            # fc is dropped by IntermediateLayerGetter, so a file without it is complete.
            missing, unexpected = resnet.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.startswith("fc.")]
            unexpected = [k for k in unexpected if not k.startswith("fc.")]
            if missing or unexpected:
                raise ValueError(
                    f"{pretrained} does not match torchvision's {name}: missing {missing[:5]}"
                    f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                    f"{'...' if len(unexpected) > 5 else ''}"
                )

        for pname, param in resnet.named_parameters():
            if not train_backbone or not any(layer in pname for layer in ("layer2", "layer3", "layer4")):
                param.requires_grad_(False)

        channels = RESNET_CHANNELS[name]
        if return_interm_layers:
            return_layers = {"layer2": "0", "layer3": "1", "layer4": "2"}
            self.strides = [8, 16, 32]
            self.num_channels = list(channels)
        else:
            return_layers = {"layer4": "0"}
            self.strides = [32]
            self.num_channels = [channels[-1]]
        if dilation:
            self.strides[-1] //= 2
        self.body = IntermediateLayerGetter(resnet, return_layers=return_layers)
        self.channels_last = False

    def use_channels_last(self) -> None:
        """Weights and input in the channels_last (NHWC) layout: a GPU's half-precision convolutions run in it,
        and NCHW tensors are converted before and after each of them. Values and state_dict keys are unchanged:
        a checkpoint loads into either layout."""
        self.body.to(memory_format=torch.channels_last)
        self.channels_last = True

    def forward(self, images: torch.Tensor, mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        feats = self.body(images)  # {"0": (B, C_l, H_l, W_l), ...}
        # The getter returns the layers in order ("0", "1", ...): no sort, which torch.compile cannot trace.
        return [(x, downsample_mask(mask, x.shape[-2:])) for x in feats.values()]


class Joiner(nn.Sequential):
    """Backbone (index 0) and position encoding (index 1), applied per returned level.

    forward(images, mask) -> (features [(B, C_l, H_l, W_l)], masks [(B, H_l, W_l)], pos [(B, hidden, H_l, W_l)]).
    """

    def __init__(self, backbone: Backbone, position_embedding: nn.Module):
        super().__init__(backbone, position_embedding)
        self.strides = backbone.strides
        self.num_channels = backbone.num_channels

    def forward(self, images: torch.Tensor, mask: torch.Tensor):
        levels = self[0](images, mask)
        features = [x for x, _ in levels]
        masks = [m for _, m in levels]
        pos = [self[1](m).to(x.dtype) for x, m in levels]
        return features, masks, pos


def build_backbone(
    *,
    backbone: str,
    train_backbone: bool,
    num_feature_levels: int,
    dilation: bool,
    pretrained: str,
    position_encoding: nn.Module,
) -> Joiner:
    """Multi-level features (layer2-4) when num_feature_levels > 1, else layer4 only, as the original."""
    body = Backbone(
        name=backbone,
        train_backbone=train_backbone,
        return_interm_layers=num_feature_levels > 1,
        dilation=dilation,
        pretrained=pretrained,
    )
    return Joiner(body, position_encoding)
