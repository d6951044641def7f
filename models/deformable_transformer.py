"""Deformable transformer: multi-scale deformable encoder, decoder with reference points, two-stage proposals.

Dimensions, named once: N batch, C d_model, L levels, S = sum(H_l * W_l) flattened positions, Q queries,
K decoder layers. Reference points are normalized to each image's valid (unpadded) region: (x, y) or
boxes (cx, cy, w, h); valid_ratios (N, L, 2) as (w, h) map them onto each padded level.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.deformable_attention import MSDeformAttn
from models.fused import linear_relu, residual_norm
from models.one_to_many import AuxiliaryFFN


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """log(x / (1 - x)) with x clamped to [0, 1] and both terms to >= eps, as the original."""
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def _clones(module: nn.Module, n: int) -> nn.ModuleList:
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


class DeformableTransformerEncoderLayer(nn.Module):
    """Post-norm: deformable self-attention, residual, norm1; FFN (linear1, relu, linear2), residual, norm2.

    On CUDA (models/fused/policy.py) each residual and its norm run as one Triton kernel where the residual's dropout
    does nothing (dropout 0, as the tiny model's, or evaluation; with the paper's 0.1 a training step keeps the
    unfused ops), and linear1 with its ReLU as one matmul; elsewhere the plain ops, unchanged.
    """

    def __init__(
        self, *, d_model: int, d_ffn: int, dropout: float, n_levels: int, nheads: int, n_points: int, msda: str
    ):
        super().__init__()
        self.self_attn = MSDeformAttn(d_model=d_model, n_levels=n_levels, nheads=nheads, n_points=n_points, msda=msda)
        self.dropout1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, d_ffn)
        self.dropout2 = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ffn, d_model)
        self.dropout3 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, src, pos, reference_points, spatial_shapes, padding_mask):
        """src, pos (N, S, C); reference_points (N, S, L, 2); spatial_shapes ((H, W), ...) -> (N, S, C)."""
        src2 = self.self_attn(src + pos, reference_points, src, spatial_shapes, None, padding_mask)
        src = residual_norm(self.norm1, self.dropout1, src, src2)  # norm1(src + dropout1(src2))
        src2 = self.linear2(self.dropout2(linear_relu(self.linear1, src)))  # linear2(dropout2(relu(linear1(src))))
        return residual_norm(self.norm2, self.dropout3, src, src2)  # norm2(src + dropout3(src2))


class DeformableTransformerEncoder(nn.Module):
    def __init__(self, layer: DeformableTransformerEncoderLayer, num_layers: int):
        super().__init__()
        self.layers = _clones(layer, num_layers)
        self.num_layers = num_layers

    @staticmethod
    def get_reference_points(spatial_shapes, valid_ratios: torch.Tensor, device) -> torch.Tensor:
        """Pixel centres of every level, normalized by the level's valid size, then projected onto every
        level with that level's valid ratio: (N, S, L, 2) as (x, y)."""
        reference_points_list = []
        for lvl, (H, W) in enumerate(spatial_shapes):
            # Pixel centres 0.5, 1.5, ...: arange rather than linspace, whose step count torch.compile
            # would fix to the traced size (a recompilation per feature-map size).
            ref_y, ref_x = torch.meshgrid(
                torch.arange(H, dtype=torch.float32, device=device) + 0.5,
                torch.arange(W, dtype=torch.float32, device=device) + 0.5,
                indexing="ij",
            )
            ref_y = ref_y.reshape(-1)[None] / (valid_ratios[:, None, lvl, 1] * H)  # (N, H*W)
            ref_x = ref_x.reshape(-1)[None] / (valid_ratios[:, None, lvl, 0] * W)  # (N, H*W)
            reference_points_list.append(torch.stack((ref_x, ref_y), -1))  # (N, H*W, 2)
        reference_points = torch.cat(reference_points_list, 1)  # (N, S, 2)
        return reference_points[:, :, None] * valid_ratios[:, None]  # (N, S, L, 2)

    def forward(self, src, spatial_shapes, valid_ratios, pos, padding_mask):
        """src, pos (N, S, C); spatial_shapes ((H, W), ...); padding_mask (N, S) bool -> memory (N, S, C)."""
        reference_points = self.get_reference_points(spatial_shapes, valid_ratios, device=src.device)
        output = src
        for layer in self.layers:
            output = layer(output, pos, reference_points, spatial_shapes, padding_mask)
        return output


class DeformableTransformerDecoderLayer(nn.Module):
    """Post-norm: self-attention -> norm2, deformable cross-attention -> norm1, FFN -> norm3 (official names).

    cross_attention_first: cross-attention -> norm1, then self-attention -> norm2 and the FFN (MS-DETR's order; the
    same modules). aux_ffn: mixed supervision's training-only FFN on the cross-attention's output
    (models/one_to_many.py), whose result the layer returns beside its own when asked for it.
    """

    def __init__(
        self,
        *,
        d_model: int,
        d_ffn: int,
        dropout: float,
        n_levels: int,
        nheads: int,
        n_points: int,
        msda: str,
        cross_attention_first: bool = False,
        aux_ffn: bool = False,
    ):
        super().__init__()
        if aux_ffn and not cross_attention_first:
            raise ValueError("aux_ffn reads the cross-attention's output before self-attention: cross_attention_first")
        self.cross_attn = MSDeformAttn(d_model=d_model, n_levels=n_levels, nheads=nheads, n_points=n_points, msda=msda)
        self.dropout1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = nn.MultiheadAttention(d_model, nheads, dropout=dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, d_ffn)
        self.dropout3 = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ffn, d_model)
        self.dropout4 = nn.Dropout(dropout)
        self.norm3 = nn.LayerNorm(d_model)
        self.cross_attention_first = cross_attention_first
        # Made last, so that every other parameter starts as in the layer without it (same seed).
        self.aux_ffn = AuxiliaryFFN(d_model=d_model, d_ffn=d_ffn, dropout=dropout) if aux_ffn else None

    def forward(
        self,
        tgt,
        query_pos,
        reference_points,
        src,
        spatial_shapes,
        padding_mask,
        query_groups=None,
        one2many: bool = False,
    ):
        """tgt, query_pos (N, Q, C); reference_points (N, Q, L, 2 or 4); src (N, S, C) -> ((N, Q, C), the aux FFN's
        (N, Q, C) output with ``one2many`` and an aux FFN, else None).

        query_groups: None, or the sizes of consecutive groups of the Q queries (summing to Q) whose
        self-attention stays within their group (hybrid matching's one-to-one and one-to-many queries).
        """
        one2many_out = None
        if self.cross_attention_first:
            tgt = self._cross_attention(tgt, query_pos, reference_points, src, spatial_shapes, padding_mask)
            if one2many and self.aux_ffn is not None:
                one2many_out = self.aux_ffn(tgt)
            tgt = self._self_attention_block(tgt, query_pos, query_groups)
        else:
            tgt = self._self_attention_block(tgt, query_pos, query_groups)
            tgt = self._cross_attention(tgt, query_pos, reference_points, src, spatial_shapes, padding_mask)
        tgt2 = self.linear2(self.dropout3(F.relu(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout4(tgt2)), one2many_out

    def _cross_attention(self, tgt, query_pos, reference_points, src, spatial_shapes, padding_mask):
        tgt2 = self.cross_attn(tgt + query_pos, reference_points, src, spatial_shapes, None, padding_mask)
        return self.norm1(tgt + self.dropout1(tgt2))

    def _self_attention_block(self, tgt, query_pos, query_groups):
        q = tgt + query_pos
        if query_groups is None:
            tgt2 = self._self_attention(q, tgt)
        else:
            # H-DETR's block-diagonal self-attention mask, as one attention per group: the same result without
            # the masked blocks' work, and the first group computes what a model of that group alone computes.
            tgt2 = torch.cat(
                [
                    self._self_attention(q_g, tgt_g)
                    for q_g, tgt_g in zip(q.split(query_groups, 1), tgt.split(query_groups, 1))
                ],
                1,
            )  # (N, Q, C)
        return self.norm2(tgt + self.dropout2(tgt2))

    def _self_attention(self, q: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """(N, Q, C) queries and keys q, values tgt -> (N, Q, C)."""
        # nn.MultiheadAttention is sequence-first here, as in the original.
        return self.self_attn(q.transpose(0, 1), q.transpose(0, 1), tgt.transpose(0, 1))[0].transpose(0, 1)


class DeformableTransformerDecoder(nn.Module):
    """Returns every layer's output and reference points.

    ``bbox_embed`` (one head per layer) is set by the detector for iterative box refinement: each layer's
    box delta refines the reference points, detached before the next layer. ``class_embed`` is set for
    two-stage; the transformer uses its extra (last) head on the encoder output.

    look_forward_twice (Deformable-DETR++, from DINO): the references returned are the refined ones before the
    detach, so that a layer's box prediction, made on the reference the previous layer refined, passes its loss's
    gradient back to that layer's box head too; the layers still sample at detached references. Values are the same.
    """

    def __init__(self, layer: DeformableTransformerDecoderLayer, num_layers: int, *, look_forward_twice: bool = False):
        super().__init__()
        self.layers = _clones(layer, num_layers)
        self.num_layers = num_layers
        self.look_forward_twice = look_forward_twice
        self.bbox_embed: nn.ModuleList | None = None
        self.class_embed: nn.ModuleList | None = None

    def forward(
        self,
        tgt,
        reference_points,
        src,
        spatial_shapes,
        valid_ratios,
        query_pos,
        padding_mask,
        query_groups=None,
        one2many: bool = False,
    ):
        """tgt, query_pos (N, Q, C); reference_points (N, Q, 2 or 4) in [0, 1] of the valid region; query_groups
        and one2many as the layers take them -> hs (K, N, Q, C), references (K, N, Q, 2 or 4) after each layer, and
        the layers' one-to-many outputs (K, N, Q, C) (mixed supervision, with one2many) or None."""
        # Contiguous like every later layer's output, so that a compiled layer (compile=true) sees one layout.
        output = tgt.contiguous()
        intermediate, intermediate_reference_points, intermediate_one2many = [], [], []
        for lid, layer in enumerate(self.layers):
            if reference_points.shape[-1] == 4:
                ratios = torch.cat([valid_ratios, valid_ratios], -1)[:, None]  # (N, 1, L, 4)
            else:
                ratios = valid_ratios[:, None]  # (N, 1, L, 2)
            reference_points_input = reference_points[:, :, None] * ratios  # (N, Q, L, 2 or 4)
            output, one2many_output = layer(
                output, query_pos, reference_points_input, src, spatial_shapes, padding_mask, query_groups, one2many
            )
            refined = reference_points
            if self.bbox_embed is not None:
                tmp = self.bbox_embed[lid](output)  # (N, Q, 4) unnormalized delta
                if reference_points.shape[-1] == 4:
                    new_reference_points = (tmp + inverse_sigmoid(reference_points)).sigmoid()
                else:
                    new_reference_points = torch.cat(
                        [tmp[..., :2] + inverse_sigmoid(reference_points), tmp[..., 2:]], -1
                    ).sigmoid()
                reference_points = new_reference_points.detach()
                refined = new_reference_points if self.look_forward_twice else reference_points
            intermediate.append(output)
            intermediate_reference_points.append(refined)
            if one2many_output is not None:
                intermediate_one2many.append(one2many_output)
        one2many_hs = torch.stack(intermediate_one2many) if intermediate_one2many else None
        return torch.stack(intermediate), torch.stack(intermediate_reference_points), one2many_hs


class DeformableTransformer(nn.Module):
    """Flattens the levels, encodes them, and decodes Q queries.

    forward(srcs [(N, C, H_l, W_l)], masks [(N, H_l, W_l) bool], pos_embeds [(N, C, H_l, W_l)], query_embed
    (Q, 2C), or for two-stage None (or, with mixed_selection, the queries' content (Q, C)), query_groups, one2many)
    -> (hs (K, N, Q, C), init_reference (N, Q, 2 or 4), inter_references (K, N, Q, 2 or 4), hs_one2many
    (K, N, Q, C) | None (the decoder's), enc_outputs_class (N, S, num_classes) | None, enc_outputs_coord_unact
    (N, S, 4) | None).

    mixed_selection (two-stage; Deformable-DETR++, from DINO): the queries' positions (reference points and position
    embeddings) come from the top proposals as without it, their content from ``query_embed``, a learned embedding
    row per proposal rank, in place of the proposals' own.

    query_groups: None, or the sizes of consecutive groups of the queries whose decoder self-attention stays within
    their group (hybrid matching: (num_queries, num_queries_one2many)). They number the queries: query_embed's rows,
    or, two-stage, the top-scoring encoder proposals (else ``two_stage_num_proposals``); as the proposals are taken
    best first, the first group's are those a model of that group alone takes.
    """

    def __init__(
        self,
        *,
        d_model: int = 256,
        nheads: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 1024,
        dropout: float = 0.1,
        num_feature_levels: int = 4,
        dec_n_points: int = 4,
        enc_n_points: int = 4,
        two_stage: bool = False,
        two_stage_num_proposals: int = 300,
        msda: str = "auto",
        mixed_selection: bool = False,
        look_forward_twice: bool = False,
        cross_attention_first: bool = False,
        aux_ffn: bool = False,
    ):
        super().__init__()
        if mixed_selection and not two_stage:
            raise ValueError("mixed_selection takes the queries' positions from two-stage proposals: two_stage=True")
        self.d_model = d_model
        self.nheads = nheads
        self.two_stage = two_stage
        self.two_stage_num_proposals = two_stage_num_proposals
        self.mixed_selection = mixed_selection

        encoder_layer = DeformableTransformerEncoderLayer(
            d_model=d_model,
            d_ffn=dim_feedforward,
            dropout=dropout,
            n_levels=num_feature_levels,
            nheads=nheads,
            n_points=enc_n_points,
            msda=msda,
        )
        self.encoder = DeformableTransformerEncoder(encoder_layer, num_encoder_layers)
        decoder_layer = DeformableTransformerDecoderLayer(
            d_model=d_model,
            d_ffn=dim_feedforward,
            dropout=dropout,
            n_levels=num_feature_levels,
            nheads=nheads,
            n_points=dec_n_points,
            msda=msda,
            cross_attention_first=cross_attention_first,
            aux_ffn=aux_ffn,
        )
        self.decoder = DeformableTransformerDecoder(
            decoder_layer, num_decoder_layers, look_forward_twice=look_forward_twice
        )

        self.level_embed = nn.Parameter(torch.empty(num_feature_levels, d_model))
        if two_stage:
            self.enc_output = nn.Linear(d_model, d_model)
            self.enc_output_norm = nn.LayerNorm(d_model)
            self.pos_trans = nn.Linear(d_model * 2, d_model * 2)
            self.pos_trans_norm = nn.LayerNorm(d_model * 2)
        else:
            self.reference_points = nn.Linear(d_model, 2)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for m in self.modules():
            if isinstance(m, MSDeformAttn):
                m._reset_parameters()  # undo the blanket xavier on the zero-initialized offsets/weights
        if not self.two_stage:
            nn.init.xavier_uniform_(self.reference_points.weight, gain=1.0)
            nn.init.constant_(self.reference_points.bias, 0.0)
        nn.init.normal_(self.level_embed)

    def get_proposal_pos_embed(self, proposals: torch.Tensor) -> torch.Tensor:
        """(N, Q, 4) unnormalized boxes -> (N, Q, 2C) sine embedding of their sigmoid, C/2 feats per coordinate.

        The original hard-codes 128 feats (C = 256); C // 2 is the same there and lets smaller models run.
        """
        num_pos_feats, temperature, scale = self.d_model // 2, 10000, 2 * math.pi
        dim_t = torch.arange(num_pos_feats, dtype=torch.float32, device=proposals.device)
        dim_t = temperature ** (2 * (dim_t // 2) / num_pos_feats)  # (C/2,)
        proposals = proposals.sigmoid() * scale
        pos = proposals[:, :, :, None] / dim_t  # (N, Q, 4, C/2)
        return torch.stack((pos[:, :, :, 0::2].sin(), pos[:, :, :, 1::2].cos()), dim=4).flatten(2)  # (N, Q, 2C)

    def gen_encoder_output_proposals(self, memory, memory_padding_mask, spatial_shapes):
        """One proposal per encoder position: its pixel centre in the valid region, size 0.05 * 2**lvl.

        memory (N, S, C), memory_padding_mask (N, S) -> (output_memory (N, S, C), output_proposals (N, S, 4)
        as inverse-sigmoid cxcywh, +inf on padding and on proposals not within (0.01, 0.99)).
        """
        N, _S, _C = memory.shape
        proposals = []
        cur = 0
        for lvl, (H, W) in enumerate(spatial_shapes):
            mask_flatten = memory_padding_mask[:, cur : cur + H * W].view(N, H, W, 1)
            valid_H = torch.sum(~mask_flatten[:, :, 0, 0], 1)  # (N,)
            valid_W = torch.sum(~mask_flatten[:, 0, :, 0], 1)  # (N,)
            grid_y, grid_x = torch.meshgrid(
                torch.arange(H, dtype=torch.float32, device=memory.device),
                torch.arange(W, dtype=torch.float32, device=memory.device),
                indexing="ij",
            )
            grid = torch.cat([grid_x.unsqueeze(-1), grid_y.unsqueeze(-1)], -1)  # (H, W, 2)
            scale = torch.cat([valid_W.unsqueeze(-1), valid_H.unsqueeze(-1)], 1).view(N, 1, 1, 2)
            grid = (grid.unsqueeze(0).expand(N, -1, -1, -1) + 0.5) / scale  # (N, H, W, 2)
            wh = torch.ones_like(grid) * 0.05 * (2.0**lvl)
            proposals.append(torch.cat((grid, wh), -1).view(N, -1, 4))  # (N, H*W, 4)
            cur += H * W
        output_proposals = torch.cat(proposals, 1)  # (N, S, 4)
        output_proposals_valid = ((output_proposals > 0.01) & (output_proposals < 0.99)).all(-1, keepdim=True)
        output_proposals = torch.log(output_proposals / (1 - output_proposals))
        output_proposals = output_proposals.masked_fill(memory_padding_mask.unsqueeze(-1), float("inf"))
        output_proposals = output_proposals.masked_fill(~output_proposals_valid, float("inf"))

        output_memory = memory.masked_fill(memory_padding_mask.unsqueeze(-1), 0.0)
        output_memory = output_memory.masked_fill(~output_proposals_valid, 0.0)
        output_memory = self.enc_output_norm(self.enc_output(output_memory))
        return output_memory, output_proposals

    @staticmethod
    def get_valid_ratio(mask: torch.Tensor) -> torch.Tensor:
        """(N, H, W) padding mask -> (N, 2) valid fraction as (w, h), read from the first row and column."""
        _, H, W = mask.shape
        valid_H = torch.sum(~mask[:, :, 0], 1)
        valid_W = torch.sum(~mask[:, 0, :], 1)
        return torch.stack([valid_W.float() / W, valid_H.float() / H], -1)

    def forward(self, srcs, masks, pos_embeds, query_embed=None, query_groups=None, one2many: bool = False):
        if (not self.two_stage or self.mixed_selection) and query_embed is None:
            raise ValueError(
                "DeformableTransformer needs query_embed: (Q, 2*d_model) unless two_stage, (Q, d_model) with "
                "mixed_selection"
            )
        if query_groups is not None:
            query_groups = tuple(query_groups)
            if not query_groups or min(query_groups) < 1:
                raise ValueError(f"query_groups must be None or sizes >= 1, got {query_groups}")
            if query_embed is not None and sum(query_groups) != query_embed.shape[0]:
                raise ValueError(f"query_groups {query_groups} must sum to query_embed's {query_embed.shape[0]} rows")
        src_flatten, mask_flatten, lvl_pos_embed_flatten = [], [], []
        # The level layout as host ints from the maps' shapes: no tensor of it, nothing read back from the GPU.
        spatial_shapes = tuple((src.shape[-2], src.shape[-1]) for src in srcs)  # ((H_l, W_l), ...)
        for lvl, (src, mask, pos_embed) in enumerate(zip(srcs, masks, pos_embeds)):
            src_flatten.append(src.flatten(2).transpose(1, 2))  # (N, H*W, C)
            mask_flatten.append(mask.flatten(1))  # (N, H*W)
            lvl_pos_embed_flatten.append(pos_embed.flatten(2).transpose(1, 2) + self.level_embed[lvl].view(1, 1, -1))
        src_flatten = torch.cat(src_flatten, 1)  # (N, S, C)
        mask_flatten = torch.cat(mask_flatten, 1)  # (N, S)
        lvl_pos_embed_flatten = torch.cat(lvl_pos_embed_flatten, 1)  # (N, S, C)
        valid_ratios = torch.stack([self.get_valid_ratio(m) for m in masks], 1)  # (N, L, 2)

        memory = self.encoder(
            src_flatten, spatial_shapes, valid_ratios, lvl_pos_embed_flatten, mask_flatten
        )  # (N, S, C)

        N, _, C = memory.shape
        enc_outputs_class = enc_outputs_coord_unact = None
        if self.two_stage:
            output_memory, output_proposals = self.gen_encoder_output_proposals(memory, mask_flatten, spatial_shapes)
            K = self.decoder.num_layers
            num_proposals = self.two_stage_num_proposals if query_groups is None else sum(query_groups)
            if num_proposals > memory.shape[1]:
                raise ValueError(
                    f"two-stage selects {num_proposals} proposals (num_queries"
                    f"{'' if query_groups is None else ' + num_queries_one2many'}) but the feature maps "
                    f"have only {memory.shape[1]} positions; use larger images or fewer queries"
                )
            enc_outputs_class = self.decoder.class_embed[K](output_memory)  # (N, S, num_classes)
            enc_outputs_coord_unact = self.decoder.bbox_embed[K](output_memory) + output_proposals  # (N, S, 4)
            # The original ranks proposals by the logit of class 0 only; kept for checkpoint parity.
            topk_proposals = torch.topk(enc_outputs_class[..., 0], num_proposals, dim=1)[1]  # (N, Q)
            topk_coords_unact = torch.gather(
                enc_outputs_coord_unact, 1, topk_proposals.unsqueeze(-1).repeat(1, 1, 4)
            ).detach()  # (N, Q, 4)
            reference_points = topk_coords_unact.sigmoid()
            init_reference_out = reference_points
            pos_trans_out = self.pos_trans_norm(self.pos_trans(self.get_proposal_pos_embed(topk_coords_unact)))
            query_pos, tgt = torch.split(pos_trans_out, C, dim=2)  # (N, Q, C) each
            if self.mixed_selection:
                tgt = query_embed.unsqueeze(0).expand(N, -1, -1)  # (N, Q, C): content by proposal rank
        else:
            query_pos, tgt = torch.split(query_embed, C, dim=1)  # (Q, C) each
            query_pos = query_pos.unsqueeze(0).expand(N, -1, -1)  # (N, Q, C)
            tgt = tgt.unsqueeze(0).expand(N, -1, -1)  # (N, Q, C)
            with torch.autocast(device_type=query_pos.device.type, enabled=False):
                # float32 under autocast: a bf16 reference point is off by up to a pixel on a large level.
                dtype = torch.promote_types(query_pos.dtype, torch.float32)
                lin = self.reference_points
                reference_points = F.linear(query_pos.to(dtype), lin.weight.to(dtype), lin.bias.to(dtype))
                reference_points = reference_points.sigmoid()  # (N, Q, 2)
            init_reference_out = reference_points

        hs, inter_references, hs_one2many = self.decoder(
            tgt, reference_points, memory, spatial_shapes, valid_ratios, query_pos, mask_flatten, query_groups, one2many
        )
        return hs, init_reference_out, inter_references, hs_one2many, enc_outputs_class, enc_outputs_coord_unact
