"""The external multi-scale deformable attention ops that ``bench/msda.py --external`` times beside ours.

bench/build_external_ops.sh builds them into external/build/ (ignored, never committed; see bench/README.md):

- deformable_detr: the original Deformable DETR CUDA op, MultiScaleDeformableAttention, through upstream's own
  MSDeformAttnFunction (fp32 and fp64);
- dcnv4: DCNv4's FlashDeformAttn kernels (fp16, bf16, fp32). They take the sampling locations and the attention
  *logits* packed together, (N, Lq, M, L*P*2 + L*P): per head the L*P (x, y) pairs, then the L*P logits, over which
  the kernel applies the softmax itself (and its backward returns the logits' gradient). Upstream's Python wrapper
  chooses the launch (d_stride, threads) with findspec/findspec_bwd, a Python loop over the divisors of N*Lq on
  every call (milliseconds of host time at the encoder's shape); the adapter calls the same two functions once per
  shape and launches the extension as the wrapper does, so the timings are the kernels'.

Each op is adapted to our op's contract (value (N, S, M, D), locations (N, Lq, M, L, P, 2) as (x, y) in [0, 1],
weights (N, Lq, M, L, P) -> (N, Lq, M*D)), and ``check`` compares its output and gradients with our PyTorch
reference in float64 on the very inputs the op was given (rounded to its dtype), so the error is the kernel's own.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

import msda

IM2COL_STEP = 64  # what both upstream modules pass: a batch of up to 64 images per launch
# Largest relative L2 error (||op - ref|| / ||ref||) of the output and of each gradient that passes, per dtype:
# about ten units of rounding of the dtype (fp32: loose enough for atomics' summation order, tight enough for any
# layout mistake, which gives errors of order 1).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def describe(error: Exception) -> str:
    """An exception on one line that a markdown table can hold: its type and its message's first line."""
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:300]}".replace("|", "/")


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over each head's L*P samples: (N, Lq, M, L, P) -> the same shape."""
    return logits.flatten(-2).softmax(-1).view_as(logits)


class Op:
    """One implementation behind our op's contract. ``leaves`` are its inputs in its own layout and dtypes (from
    ours: value, locations and weights, or logits where ``takes_logits``); ``as_ours`` maps its leaves, or their
    gradients, back to (value, locations, weights or logits) in our layout; calling it runs the forward."""

    name = ""
    dtypes: tuple[torch.dtype, ...] = ()
    takes_logits = False

    def leaves(self, value, loc, weights, dtype) -> list[torch.Tensor]:
        return [t.to(dtype).contiguous() for t in (value, loc, weights)]

    def as_ours(self, tensors, L: int) -> tuple[torch.Tensor, ...]:
        return tuple(tensors)

    def __call__(self, leaves, shapes, start) -> torch.Tensor:
        raise NotImplementedError


class Ours(Op):
    """msda.multi_scale_deformable_attention(impl="triton") with fp32 locations and weights, as the model passes
    them: softmaxed weights ("ours"), or with ``logits`` their logits, softmaxed inside the kernels
    (weights_are_logits=True, "ours_logits": the model's call on CUDA, and DCNv4's contract)."""

    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def __init__(self, logits: bool = False):
        self.takes_logits = logits
        self.name = "ours_logits" if logits else "ours"

    def leaves(self, value, loc, weights, dtype):
        return [value.to(dtype).contiguous(), loc.float().contiguous(), weights.float().contiguous()]

    def __call__(self, leaves, shapes, start):
        return msda.multi_scale_deformable_attention(
            leaves[0], shapes, start, leaves[1], leaves[2], impl="triton", weights_are_logits=self.takes_logits
        )


class DeformableDetr(Op):
    """Upstream's MSDeformAttnFunction.apply(value, shapes, level_start_index, locations, weights, im2col_step)."""

    name = "deformable_detr"
    dtypes = (torch.float32, torch.float64)

    def __init__(self, function):
        self.function = function

    def __call__(self, leaves, shapes, start):
        return self.function.apply(leaves[0], shapes, start, leaves[1], leaves[2], IM2COL_STEP)


class _FlashDeformAttnFunction(torch.autograd.Function):
    """DCNv4's extension calls as upstream's FlashDeformAttnFunction makes them, with the launch spec given."""

    @staticmethod
    def forward(ctx, value, shapes, start, packed, ext, spec, points):
        ctx.save_for_backward(value, shapes, start, packed)
        ctx.ext, ctx.spec, ctx.points = ext, spec, points
        return ext.flash_deform_attn_forward(value, shapes, start, packed, IM2COL_STEP, points, spec[0], spec[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        value, shapes, start, packed = ctx.saved_tensors
        grad_value, grad_packed = ctx.ext.flash_deform_attn_backward(
            value, shapes, start, packed, grad_output.contiguous(), IM2COL_STEP, ctx.points, ctx.spec[2], ctx.spec[3]
        )
        return grad_value, None, None, grad_packed, None, None, None


class FlashDeformAttn(Op):
    """DCNv4's flash_deform_attn kernels: value and the packed (locations, logits) in one dtype."""

    name = "dcnv4"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    takes_logits = True

    def __init__(self, module):
        self.module = module  # upstream's flash_deform_attn_func: its ext and findspec, findspec_bwd
        self.specs: dict = {}

    def spec(self, value, packed) -> tuple[int, int, int, int]:
        """(d_stride, threads) of the forward, then of the backward, as upstream's wrapper picks them."""
        key = (value.shape[0], packed.shape[1], value.shape[2], value.shape[3])
        if key not in self.specs:
            self.specs[key] = (*self.module.findspec(*key), *self.module.findspec_bwd(*key))
        return self.specs[key]

    def leaves(self, value, loc, logits, dtype):
        packed = torch.cat([loc.flatten(3), logits.flatten(3)], dim=-1)
        return [value.to(dtype).contiguous(), packed.to(dtype).contiguous()]

    def as_ours(self, tensors, L):
        value, packed = tensors
        N, Lq, M, width = packed.shape
        P = width // (3 * L)
        return value, packed[..., : 2 * L * P].view(N, Lq, M, L, P, 2), packed[..., 2 * L * P :].view(N, Lq, M, L, P)

    def __call__(self, leaves, shapes, start):
        value, packed = leaves
        points = packed.shape[-1] // (3 * shapes.shape[0])
        return _FlashDeformAttnFunction.apply(
            value, shapes, start, packed, self.module.ext, self.spec(value, packed), points
        )


def _import_file(name: str, path: Path, search: Path):
    """Upstream's Python file at ``path`` as module ``name``, with ``search`` first on sys.path for its imports."""
    if str(search) not in sys.path:
        sys.path.insert(0, str(search))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_info(folder: Path) -> dict[str, str]:
    """BUILD_INFO's "key: value" lines (torch, arch, nvcc, source, built), as the build script writes them."""
    info = folder / "BUILD_INFO"
    lines = info.read_text().splitlines() if info.exists() else []
    return dict(line.split(": ", 1) for line in lines if ": " in line)


# name -> (the file whose presence says it was built, the loader from its folder)
_EXTERNAL = {
    "deformable_detr": (
        "MultiScaleDeformableAttention.so",
        lambda d: DeformableDetr(
            _import_file("deformable_detr_ms_deform_attn_func", d / "ms_deform_attn_func.py", d).MSDeformAttnFunction
        ),
    ),
    "dcnv4": (
        "DCNv4/ext.so",
        lambda d: FlashDeformAttn(_import_file("dcnv4_flash_deform_attn_func", d / "flash_deform_attn_func.py", d)),
    ),
}


def load(build: Path | None) -> tuple[list[Op], dict[str, str]]:
    """Ours (on weights, then on logits), then each external op that imports from ``build`` (external/build), and a
    line per external op saying what was loaded or why it was not (not built, built under another torch, no CUDA
    device, an import error): never an exception."""
    ops: list[Op] = [Ours(), Ours(logits=True)]
    notes = {}
    for name, (marker, loader) in _EXTERNAL.items():
        folder = (build / name) if build is not None else None
        if folder is None:
            notes[name] = "not run: no --external folder given"
            continue
        if not (folder / marker).exists():
            notes[name] = f"not built: {folder / marker} is missing (bash bench/build_external_ops.sh builds it)"
            continue
        info = _build_info(folder)
        built = f"built under torch {info.get('torch', '?')} from {info.get('source', '?')}"
        if info.get("torch", "").split(" ")[0] != torch.__version__:
            notes[name] = f"not run: {built}, this is torch {torch.__version__} (rebuild it here)"
        elif not torch.cuda.is_available():
            notes[name] = f"not run: {built}, but there is no CUDA device here"
        else:
            try:
                ops.append(loader(folder))
                notes[name] = f"loaded: {built}"
            except Exception as error:  # a missing symbol, no CUDA capability it knows, ...
                notes[name] = f"failed to import from {folder}: {describe(error)} ({built})"
    return ops, notes


def random_inputs(N, Lq, M, D, levels, device, seed=0, P=4):
    """value, locations (a tenth of them just outside [0, 1], to exercise the zero padding) and logits, fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    L, S = len(levels), sum(h * w for h, w in levels)
    value = torch.randn(N, S, M, D, device=device, generator=gen)
    loc = torch.rand(N, Lq, M, L, P, 2, device=device, generator=gen) * 1.2 - 0.1
    logits = torch.randn(N, Lq, M, L, P, device=device, generator=gen)
    return value, loc, logits


def _errors(mine, ref) -> tuple[float, float]:
    """(relative L2 error, largest absolute error over the reference's largest magnitude)."""
    mine, ref = mine.double(), ref.double()
    scale = ref.norm().clamp_min(1e-30)
    return ((mine - ref).norm() / scale).item(), ((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check(op: Op, dtype, levels, N, Lq, M=8, D=32, device="cuda", seed=0) -> dict:
    """The op's output and gradients against our PyTorch reference in float64, on fresh random inputs. Returns the
    errors per tensor, and fwd_ok / bwd_ok: within TOLERANCE[dtype] (and no exception)."""
    value, loc, logits = random_inputs(N, Lq, M, D, levels, device, seed)
    weights = logits if op.takes_logits else _softmax(logits)
    shapes = torch.tensor(levels, device=device)
    start = msda.level_start_index_from_shapes(shapes)
    tolerance = TOLERANCE[dtype]
    result = {"op": op.name, "dtype": DTYPE_NAMES[dtype], "N": N, "Lq": Lq, "levels": [list(l) for l in levels]}
    result.update(tolerance=tolerance, fwd_ok=False, bwd_ok=False, errors={})
    leaves = [t.detach().requires_grad_() for t in op.leaves(value, loc, weights, dtype)]
    try:
        out = op(leaves, shapes, start)
    except Exception as error:
        result["error"] = f"forward: {describe(error)}"
        return result
    grad_out = torch.randn(out.shape, device=device, generator=torch.Generator(device).manual_seed(seed + 1))
    grad_out = grad_out.to(out.dtype)

    ref_leaves = [t.detach().double().requires_grad_() for t in op.as_ours(leaves, len(levels))]
    ref_weights = _softmax(ref_leaves[2]) if op.takes_logits else ref_leaves[2]
    ref_out = msda.multi_scale_deformable_attention(
        ref_leaves[0], levels, None, ref_leaves[1], ref_weights, impl="pytorch"
    )
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, grad_out.double())
    result["errors"]["output"] = _errors(out, ref_out)
    result["fwd_ok"] = result["errors"]["output"][0] <= tolerance
    try:
        grads = op.as_ours(torch.autograd.grad(out, leaves, grad_out), len(levels))
    except Exception as error:
        result["error"] = f"backward: {describe(error)}"
        return result
    names = ("grad_value", "grad_loc", "grad_logits" if op.takes_logits else "grad_weights")
    for name, mine, ref in zip(names, grads, ref_grads):
        result["errors"][name] = _errors(mine, ref)
    result["bwd_ok"] = all(result["errors"][name][0] <= tolerance for name in names)
    return result
