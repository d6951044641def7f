"""Position encodings of a feature map given its padding mask: sine (normalized) and learned.

Both map a padding mask (B, H, W) bool, True on padding, to an encoding (B, 2*F, H, W) with F =
num_pos_feats (hidden_dim // 2); sine puts the y half first, learned the x half first, as in the original.
"""

from __future__ import annotations

import math

import torch
from torch import nn

POSITION_EMBEDDINGS = ("sine", "learned")


class PositionEmbeddingSine(nn.Module):
    """Sine/cosine encoding of the cumulative valid-pixel count along y and x.

    With ``normalize`` the counts are mapped to (0, scale] of the valid extent, so a padded image gets the
    same encoding over its valid region as the image alone. Deformable DETR shifts by -0.5 (pixel centres)
    and adds eps 1e-6 to the denominator; both change numbers, so both are kept.
    """

    def __init__(
        self,
        *,
        num_pos_feats: int = 128,
        temperature: float = 10000.0,
        normalize: bool = True,
        scale: float | None = None,
    ):
        super().__init__()
        if scale is not None and not normalize:
            raise ValueError("PositionEmbeddingSine: scale is only used with normalize=True")
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        self.scale = 2 * math.pi if scale is None else scale

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        """mask (B, H, W) bool, True on padding -> (B, 2*num_pos_feats, H, W) float32."""
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)  # (B, H, W)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)  # (B, H, W)
        if self.normalize:
            eps = 1e-6
            y_embed = (y_embed - 0.5) / (y_embed[:, -1:, :] + eps) * self.scale
            x_embed = (x_embed - 0.5) / (x_embed[:, :, -1:] + eps) * self.scale

        F = self.num_pos_feats
        dim_t = torch.arange(F, dtype=torch.float32, device=mask.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / F)  # (F,)

        pos_x = x_embed[:, :, :, None] / dim_t  # (B, H, W, F)
        pos_y = y_embed[:, :, :, None] / dim_t  # (B, H, W, F)
        # Interleave sin of even and cos of odd frequencies, as the original does.
        pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)  # (B, 2F, H, W)


class PositionEmbeddingLearned(nn.Module):
    """Absolute learned encoding: a row and a column table of ``max_size`` (50) entries each.

    It ignores the mask (as the original); feature maps larger than max_size in either side are refused.
    """

    def __init__(self, *, num_pos_feats: int = 128, max_size: int = 50):
        super().__init__()
        self.max_size = max_size
        self.row_embed = nn.Embedding(max_size, num_pos_feats)
        self.col_embed = nn.Embedding(max_size, num_pos_feats)
        nn.init.uniform_(self.row_embed.weight)
        nn.init.uniform_(self.col_embed.weight)

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        """mask (B, H, W) bool -> (B, 2*num_pos_feats, H, W)."""
        B, H, W = mask.shape
        if self.max_size < H or self.max_size < W:
            raise ValueError(
                f"learned position embedding supports feature maps up to {self.max_size}x{self.max_size}, "
                f"got {H}x{W}; use position_embedding=sine for larger inputs"
            )
        x_emb = self.col_embed(torch.arange(W, device=mask.device))  # (W, F)
        y_emb = self.row_embed(torch.arange(H, device=mask.device))  # (H, F)
        pos = torch.cat([x_emb.unsqueeze(0).expand(H, W, -1), y_emb.unsqueeze(1).expand(H, W, -1)], dim=-1)
        return pos.permute(2, 0, 1).unsqueeze(0).expand(B, -1, -1, -1)  # (B, 2F, H, W)


def build_position_encoding(*, hidden_dim: int, position_embedding: str) -> nn.Module:
    """hidden_dim channels of encoding: hidden_dim // 2 for y and as many for x."""
    num_pos_feats = hidden_dim // 2
    if position_embedding in ("sine", "v2"):
        return PositionEmbeddingSine(num_pos_feats=num_pos_feats, normalize=True)
    if position_embedding in ("learned", "v3"):
        return PositionEmbeddingLearned(num_pos_feats=num_pos_feats)
    raise ValueError(f"position_embedding must be one of {POSITION_EMBEDDINGS}, got {position_embedding!r}")
