"""Deformable DETR: backbone, input projections, deformable transformer and prediction heads; build_model.

Dimensions, named once: B batch, Q queries, K decoder layers, L feature levels, C hidden_dim. Boxes are
normalized (cx, cy, w, h) in [0, 1] of each image's valid (unpadded) region.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.backbone import Joiner, build_backbone, downsample_mask
from models.compiled_regions import CompiledRegions, Region
from models.deformable_transformer import DeformableTransformer, inverse_sigmoid
from models.input_pixels import InputPixels
from models.model_config import ModelConfig, read_model_config, resolved_num_classes
from models.one_to_many import OneToMany, is_training_only
from models.position_encoding import build_position_encoding


def encoder_tokens(height: int, width: int, *, num_feature_levels: int, dilation: bool = False) -> int:
    """S, the encoder's tokens for images of ``height`` x ``width``: the cells of every feature level (each of the
    ResNet's stride-2 convolutions, and each extra level's, halves a side rounding up). Two-stage selects its
    queries among them."""
    strides = [8, 16, 32] if num_feature_levels > 1 else [32]
    if dilation:
        strides[-1] //= 2
    sides = [(-(-height // stride), -(-width // stride)) for stride in strides]
    for _ in range(num_feature_levels - len(sides)):
        h, w = sides[-1]
        sides.append((-(-h // 2), -(-w // 2)))
    return sum(h * w for h, w in sides)


class MLP(nn.Module):
    """num_layers Linear layers with ReLU between them (``layers.K`` names as the original)."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return x


class DeformableDETR(CompiledRegions, nn.Module):
    """forward(images (B, 3, H, W), mask (B, H, W) bool True on padding) -> dict. images: uint8 pixels (as the
    loaders give them: the model normalizes them, ``input_pixels``) or float, already normalized.

    pred_logits (B, Q, num_classes) logits of the last decoder layer (sigmoid per class, no background),
    pred_boxes  (B, Q, 4) normalized cxcywh (sigmoid),
    aux_outputs [{pred_logits, pred_boxes}] for decoder layers 0..K-2 (when aux_loss),
    enc_outputs {pred_logits (B, S, num_classes), pred_boxes (B, S, 4)} of the encoder proposals (two_stage),
    one2many_outputs {pred_logits, pred_boxes, aux_outputs} for one-to-many supervision (models/one_to_many.py):
                of the Q2 = num_queries_one2many queries of hybrid matching (when Q2 > 0), or of the Q queries
                themselves with mixed supervision (``mixed_supervision``).

    Hybrid matching (H-DETR): the Q2 one-to-many queries are decoded beside the Q one-to-one queries, by the same
    layers and heads (two-stage: the top Q + Q2 proposals, the best Q the one-to-one queries), and neither group
    attends to the other, so the one-to-one outputs are those of the model without them. Their own embeddings
    (``query_embed_one2many``; two-stage only with mixed_selection) are parameters of their own, so that the other
    parameters keep the official names and shapes.

    Mixed supervision (MS-DETR): with the decoder's cross-attention first, each layer's training-only FFN on its
    cross-attention's output, read by the layer's own heads; else training-only class heads (``class_embed_one2many``)
    on each layer's output, the boxes being the one-to-one ones.

    mixed_selection (two-stage): the queries' content is ``query_embed`` (Q, C), a learned embedding per proposal rank.

    ``detect`` is the computation for inference (evaluation, predict and export call it): the Q one-to-one queries
    alone, as the model without one-to-many supervision; ``compile_regions`` says which parts engine/compile/plan.py
    may compile. ``is_training_only`` names the parameters inference never uses.
    """

    is_training_only = staticmethod(is_training_only)

    def __init__(
        self,
        *,
        backbone: Joiner,
        transformer: DeformableTransformer,
        num_classes: int,
        num_queries: int,
        num_feature_levels: int,
        aux_loss: bool = True,
        with_box_refine: bool = False,
        two_stage: bool = False,
        num_queries_one2many: int = 0,
        mixed_supervision: bool = False,
        mixed_selection: bool = False,
    ):
        super().__init__()
        if num_queries_one2many < 0:
            raise ValueError(f"num_queries_one2many must be >= 0 (0: no hybrid matching), got {num_queries_one2many}")
        if num_queries_one2many and mixed_supervision:
            raise ValueError("one-to-many supervision is hybrid (num_queries_one2many) or mixed, not both")
        if mixed_selection and not two_stage:
            raise ValueError("mixed_selection takes the queries' positions from two-stage proposals: two_stage=True")
        self.input_pixels = InputPixels()  # uint8 images normalized on the model's device
        self.num_queries = num_queries
        self.num_queries_one2many = num_queries_one2many
        self.transformer = transformer
        C = transformer.d_model
        self.class_embed = nn.Linear(C, num_classes)
        self.bbox_embed = MLP(C, C, 4, 3)
        self.num_feature_levels = num_feature_levels
        if not two_stage:
            self.query_embed = nn.Embedding(num_queries, C * 2)  # (Q, 2C): query_pos then tgt

        num_backbone_outs = len(backbone.strides)
        if num_feature_levels > 1:
            if num_feature_levels < num_backbone_outs:
                raise ValueError(f"num_feature_levels must be 1 or >= {num_backbone_outs}, got {num_feature_levels}")
            proj = [nn.Sequential(nn.Conv2d(ch, C, kernel_size=1), nn.GroupNorm(32, C)) for ch in backbone.num_channels]
            in_channels = backbone.num_channels[-1]
            for _ in range(num_feature_levels - num_backbone_outs):
                # Extra coarser levels: stride-2 3x3 convs, the first on the last backbone map.
                proj.append(
                    nn.Sequential(nn.Conv2d(in_channels, C, kernel_size=3, stride=2, padding=1), nn.GroupNorm(32, C))
                )
                in_channels = C
            self.input_proj = nn.ModuleList(proj)
        else:
            self.input_proj = nn.ModuleList(
                [nn.Sequential(nn.Conv2d(backbone.num_channels[0], C, kernel_size=1), nn.GroupNorm(32, C))]
            )
        self.backbone = backbone
        self.aux_loss = aux_loss
        self.with_box_refine = with_box_refine
        self.two_stage = two_stage

        # Focal-loss prior: every class starts at probability 0.01.
        prior_prob = 0.01
        nn.init.constant_(self.class_embed.bias, -math.log((1 - prior_prob) / prior_prob))
        nn.init.constant_(self.bbox_embed.layers[-1].weight, 0)
        nn.init.constant_(self.bbox_embed.layers[-1].bias, 0)
        for proj in self.input_proj:
            nn.init.xavier_uniform_(proj[0].weight, gain=1)
            nn.init.constant_(proj[0].bias, 0)

        K = transformer.decoder.num_layers
        num_pred = K + 1 if two_stage else K  # two-stage: one more head for the encoder proposals
        if with_box_refine:
            self.class_embed = nn.ModuleList([copy.deepcopy(self.class_embed) for _ in range(num_pred)])
            self.bbox_embed = nn.ModuleList([copy.deepcopy(self.bbox_embed) for _ in range(num_pred)])
            # As the original: only the first layer's head starts with small boxes (sigmoid(-2) ~ 0.12).
            nn.init.constant_(self.bbox_embed[0].layers[-1].bias[2:], -2.0)
            # The decoder refines its reference points with these same heads.
            self.transformer.decoder.bbox_embed = self.bbox_embed
        else:
            nn.init.constant_(self.bbox_embed.layers[-1].bias[2:], -2.0)
            # One head shared by all layers; listing it per layer keeps the official state_dict names.
            self.class_embed = nn.ModuleList([self.class_embed for _ in range(num_pred)])
            self.bbox_embed = nn.ModuleList([self.bbox_embed for _ in range(num_pred)])
            self.transformer.decoder.bbox_embed = None
        if two_stage:
            self.transformer.decoder.class_embed = self.class_embed
            for box_embed in self.bbox_embed:
                nn.init.constant_(box_embed.layers[-1].bias[2:], 0.0)
        # Made last, so that every other parameter starts as in the model without them (same seed).
        self.mixed_selection = mixed_selection
        if mixed_selection:
            self.query_embed = nn.Embedding(num_queries, C)  # (Q, C): the content of the top Q proposals
        if num_queries_one2many and (mixed_selection or not two_stage):
            self.query_embed_one2many = nn.Embedding(num_queries_one2many, C if two_stage else 2 * C)  # (Q2, C or 2C)
        # Mixed supervision in the original decoder order: class heads of its own, copies of the one-to-one ones.
        with_aux_ffn = any(layer.aux_ffn is not None for layer in transformer.decoder.layers)
        self.class_embed_one2many = None
        if mixed_supervision and not with_aux_ffn:
            self.class_embed_one2many = copy.deepcopy(self.class_embed[:K])  # shared across layers where theirs are
        self.mixed_supervision = mixed_supervision

    def forward(self, images: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
        """images (B, 3, H, W) uint8 pixels or normalized float, mask (B, H, W) bool True on padding (None: no
        padding) -> output dict, with the one-to-many queries' outputs when the model has them (training)."""
        return self.predict(*self.features(images, mask), one2many=True)

    def detect(self, images: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
        """forward for inference, the one-to-one queries alone, through the plain methods: a compiled evaluation
        graph of its own (one per image size, all the model in one graph) rather than the training regions under
        no_grad, which would each compile again."""
        return DeformableDETR.predict(self, *DeformableDETR.features(self, images, mask))

    def compile_regions(
        self, *, regions: str = "transformer", backbone: str = "dynamic", evaluation: bool = False, graphs: bool = False
    ) -> list[Region]:
        """What engine/compile/plan.py compiles (models/compiled_regions.py).

        graphs: what engine/compile/cuda_graphs.py records instead, nothing compiled: ``forward`` (the whole model,
        forward and backward, in training) and, with ``evaluation``, ``detect``; each one recording per input size.

        regions "transformer": ``predict`` (the encoder, the decoder, the glue between their layers and the
        heads) as one graph, and the position encoding; "layers": each encoder and decoder layer (layers of
        one kind share a graph) and ``heads``. ``backbone``: ``features`` (the ResNet, the input projections,
        the masks and the position encoding), "dynamic" as one graph of symbolic sizes, "static" as one graph
        per image size, "eager" not compiled. ``evaluation``: ``detect``, one graph per image size.
        """
        if graphs:
            return [Region("forward", training=True)] + ([Region("detect")] if evaluation else [])
        if regions == "layers":
            layers = [*self.transformer.encoder.layers, *self.transformer.decoder.layers]
            names = {id(m): n for n, m in self.named_modules()}
            found = [Region(names[id(layer)], method=False) for layer in layers] + [Region("heads")]
        elif regions == "transformer":
            found = [Region("predict", whole=True), Region("backbone.1", method=False)]
        else:
            raise ValueError(f"regions must be 'transformer' or 'layers', got {regions!r}")
        if backbone not in ("dynamic", "static", "eager"):
            raise ValueError(f"backbone must be 'dynamic', 'static' or 'eager', got {backbone!r}")
        if backbone != "eager":
            found.append(Region("features", static_sizes=backbone == "static"))
        if evaluation:
            found.append(Region("detect", static_sizes=True, whole=True, starts_step=True))
        return found

    def use_channels_last(self) -> None:
        """The ResNet in the channels_last layout (Backbone.use_channels_last), as a GPU runs it fastest."""
        self.backbone[0].use_channels_last()

    def features(self, images: torch.Tensor, mask: torch.Tensor | None = None):
        """Projected feature levels: (srcs [(B, C, H_l, W_l)], masks [(B, H_l, W_l)], pos [(B, C, H_l, W_l)])."""
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
        if mask is None:
            mask = torch.zeros(images.shape[0], *images.shape[-2:], dtype=torch.bool, device=images.device)
        if tuple(mask.shape) != (images.shape[0], *images.shape[-2:]) or mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be (B, H, W) bool matching images {tuple(images.shape)}, "
                f"got {tuple(mask.shape)} {mask.dtype}"
            )
        features, masks, pos = self.backbone(self.input_pixels(images, mask), mask)
        srcs = [proj(feat) for proj, feat in zip(self.input_proj, features)]  # [(B, C, H_l, W_l)]
        masks, pos = list(masks), list(pos)
        for lvl in range(len(srcs), self.num_feature_levels):
            src = self.input_proj[lvl](features[-1] if lvl == len(features) else srcs[-1])
            # Extra levels' masks come from the image mask directly, as the original.
            lvl_mask = downsample_mask(mask, src.shape[-2:])
            srcs.append(src)
            masks.append(lvl_mask)
            pos.append(self.backbone[1](lvl_mask).to(src.dtype))
        return srcs, masks, pos

    def heads(self, hs: torch.Tensor, init_reference: torch.Tensor, inter_references: torch.Tensor):
        """Class logits and boxes of every decoder layer (engine.compile compiles this as one region).

        hs (K, B, Q, C), init_reference (B, Q, 2 or 4), inter_references (K, B, Q, 2 or 4) in [0, 1]
        -> (logits (K, B, Q, num_classes), boxes (K, B, Q, 4) normalized cxcywh)
        """
        outputs_classes, outputs_coords = [], []
        for lvl in range(hs.shape[0]):
            reference = inverse_sigmoid(init_reference if lvl == 0 else inter_references[lvl - 1])
            outputs_class = self.class_embed[lvl](hs[lvl])  # (B, Q, num_classes)
            tmp = self.bbox_embed[lvl](hs[lvl])  # (B, Q, 4)
            if reference.shape[-1] == 4:
                tmp = tmp + reference
            else:
                tmp = torch.cat([tmp[..., :2] + reference, tmp[..., 2:]], -1)
            outputs_classes.append(outputs_class)
            outputs_coords.append(tmp.sigmoid())
        return torch.stack(outputs_classes), torch.stack(outputs_coords)

    def predict(self, srcs, masks, pos, *, one2many: bool = False) -> dict:
        """Transformer and heads on projected levels (as returned by ``features``) -> output dict.

        one2many: decode the one-to-many queries too, when the model has them (``forward``; inference never does).
        """
        Q, Q2 = self.num_queries, (self.num_queries_one2many if one2many else 0)
        mixed = one2many and self.mixed_supervision
        if self.two_stage and not self.mixed_selection:
            query_embed = None
        elif Q2:
            query_embed = torch.cat([self.query_embed.weight, self.query_embed_one2many.weight])  # (Q + Q2, 2C or C)
        else:
            query_embed = self.query_embed.weight
        hs, init_reference, inter_references, hs_one2many, enc_outputs_class, enc_outputs_coord_unact = (
            self.transformer(srcs, masks, pos, query_embed, (Q, Q2) if Q2 else None, one2many=mixed)
        )  # hs (K, B, Q + Q2, C)
        outputs_class, outputs_coord = self.heads(hs, init_reference, inter_references)
        if Q2:
            outputs_class, classes_one2many = outputs_class.split([Q, Q2], dim=2)  # (K, B, Q, n), (K, B, Q2, n)
            outputs_coord, coords_one2many = outputs_coord.split([Q, Q2], dim=2)  # (K, B, Q, 4), (K, B, Q2, 4)
        elif mixed and hs_one2many is not None:  # the layers' auxiliary FFNs, read by their own heads
            classes_one2many, coords_one2many = self.heads(hs_one2many, init_reference, inter_references)
        elif mixed:  # each layer's output, through the one-to-many class heads; the boxes are the one-to-one ones
            classes_one2many = torch.stack([head(h) for head, h in zip(self.class_embed_one2many, hs)])  # (K, B, Q, n)
            coords_one2many = outputs_coord

        out = self._layer_outputs(outputs_class, outputs_coord)
        if self.two_stage:
            out["enc_outputs"] = {"pred_logits": enc_outputs_class, "pred_boxes": enc_outputs_coord_unact.sigmoid()}
        if Q2 or mixed:
            out["one2many_outputs"] = self._layer_outputs(classes_one2many, coords_one2many)
        return out

    def _layer_outputs(self, outputs_class: torch.Tensor, outputs_coord: torch.Tensor) -> dict:
        """Every decoder layer's (K, B, Q, num_classes) logits and (K, B, Q, 4) boxes -> the last layer's
        pred_logits and pred_boxes, and the others' as aux_outputs (when aux_loss)."""
        out = {"pred_logits": outputs_class[-1], "pred_boxes": outputs_coord[-1]}
        if self.aux_loss:
            out["aux_outputs"] = [
                {"pred_logits": a, "pred_boxes": b} for a, b in zip(outputs_class[:-1], outputs_coord[:-1])
            ]
        return out


# ----------------------------------------------------------------------------------------------------
# config adapter
# ----------------------------------------------------------------------------------------------------
def _check_config(cfg) -> ModelConfig:
    """The model config, typed and checked (models/model_config.py holds every rule), ready to build from."""
    c = read_model_config(cfg)
    resolved_num_classes(c)
    return c


def build_deformable_detr(cfg) -> DeformableDETR:
    """The model alone from the model config (keys as in configs/model/deformable_detr.yaml)."""
    c = _check_config(cfg)
    position_encoding = build_position_encoding(hidden_dim=c.hidden_dim, position_embedding=c.position_embedding.value)
    backbone = build_backbone(
        backbone=c.backbone.value,
        train_backbone=c.train_backbone,
        num_feature_levels=c.num_feature_levels,
        dilation=c.dilation,
        pretrained=str(c.pretrained),
        position_encoding=position_encoding,
    )
    transformer = DeformableTransformer(
        d_model=c.hidden_dim,
        nheads=c.nheads,
        num_encoder_layers=c.enc_layers,
        num_decoder_layers=c.dec_layers,
        dim_feedforward=c.dim_feedforward,
        dropout=c.dropout,
        num_feature_levels=c.num_feature_levels,
        dec_n_points=c.dec_n_points,
        enc_n_points=c.enc_n_points,
        two_stage=c.two_stage,
        two_stage_num_proposals=c.num_queries,
        msda=c.msda.value,
        mixed_selection=c.mixed_selection,
        look_forward_twice=c.look_forward_twice,
        cross_attention_first=c.cross_attention_first,
        aux_ffn=c.one_to_many == OneToMany.mixed and c.cross_attention_first,
    )
    return DeformableDETR(
        backbone=backbone,
        transformer=transformer,
        num_classes=c.num_classes,
        num_queries=c.num_queries,
        num_feature_levels=c.num_feature_levels,
        aux_loss=c.aux_loss,
        with_box_refine=c.with_box_refine,
        two_stage=c.two_stage,
        num_queries_one2many=c.num_queries_one2many if c.one_to_many == OneToMany.hybrid else 0,
        mixed_supervision=c.one_to_many == OneToMany.mixed,
        mixed_selection=c.mixed_selection,
    )


def build_model(cfg):
    """cfg.model -> (model, criterion, postprocess). The criterion reads the loss keys of the same config."""
    from models.criterion import build_criterion  # the loss side lives in its own files

    model = build_deformable_detr(cfg)
    criterion, postprocess = build_criterion(cfg)
    return model, criterion, postprocess
