"""bench/external_ops.py's CPU-side logic: DCNv4's packed layout, the reference check and a graceful load."""

from __future__ import annotations

import torch

from bench import external_ops

LEVELS = ((3, 4), (2, 2), (1, 1))


def test_dcnv4_packing_round_trips_to_our_layout():
    value, loc, logits = external_ops.random_inputs(2, 5, 3, 4, LEVELS, "cpu", P=2)
    op = external_ops.FlashDeformAttn(module=None)
    packed_value, packed = op.leaves(value, loc, logits, torch.float32)
    # Per head: the L*P (x, y) pairs, then the L*P logits.
    assert packed.shape == (2, 5, 3, len(LEVELS) * 2 * 3)
    assert torch.equal(packed[0, 1, 2, :2], loc[0, 1, 2, 0, 0])
    assert torch.equal(packed[0, 1, 2, 2 * len(LEVELS) * 2], logits[0, 1, 2, 0, 0])
    back = op.as_ours([packed_value, packed], len(LEVELS))
    for mine, theirs in zip(back, (value, loc, logits)):
        assert torch.equal(mine, theirs)


class SoftmaxInside(external_ops.Op):
    """Our PyTorch reference behind DCNv4's contract (logits in, the softmax inside): what check compares against."""

    name, takes_logits = "reference-with-logits", True

    def __call__(self, leaves, shapes, start):
        value, loc, logits = leaves
        weights = logits.flatten(-2).softmax(-1).view_as(logits)
        return external_ops.msda.multi_scale_deformable_attention(value, shapes, start, loc, weights, impl="pytorch")


class SwappedXY(SoftmaxInside):
    name = "swapped-xy"

    def __call__(self, leaves, shapes, start):
        return super().__call__([leaves[0], leaves[1].flip(-1), leaves[2]], shapes, start)


def test_check_passes_a_faithful_op_and_refuses_a_layout_mistake():
    ok = external_ops.check(SoftmaxInside(), torch.float32, LEVELS, 2, 7, M=2, D=4, device="cpu")
    assert ok["fwd_ok"] and ok["bwd_ok"] and set(ok["errors"]) == {"output", "grad_value", "grad_loc", "grad_logits"}
    wrong = external_ops.check(SwappedXY(), torch.float32, LEVELS, 2, 7, M=2, D=4, device="cpu")
    assert not wrong["fwd_ok"] and wrong["errors"]["output"][0] > 0.1


def test_load_names_what_is_missing_without_raising(tmp_path):
    ops, notes = external_ops.load(tmp_path)
    assert [op.name for op in ops] == ["ours", "ours_logits"]
    assert set(notes) == {"deformable_detr", "dcnv4"}
    assert all(note.startswith("not built") for note in notes.values())
    (tmp_path / "deformable_detr").mkdir()
    (tmp_path / "deformable_detr" / "MultiScaleDeformableAttention.so").write_bytes(b"")
    (tmp_path / "deformable_detr" / "BUILD_INFO").write_text("torch: 0.0.1 (CUDA 0.0)\nsource: somewhere abc\n")
    _, notes = external_ops.load(tmp_path)
    assert "built under torch 0.0.1" in notes["deformable_detr"] and "rebuild" in notes["deformable_detr"]
