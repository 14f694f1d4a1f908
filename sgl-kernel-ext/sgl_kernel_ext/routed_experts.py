"""The routed experts of a DeepSeek-V4 MoE layer as one op that reads only the experts some pair is routed to.

Contract
--------
routed_experts(x[N, D], idx[N, k], weights[N, k], first, fmt, w1, w3, w2, s1, s3, s2, limit) -> [N, D], x's dtype.

The rank holds experts ``first .. first + E - 1`` (local e = global id - first). For each token n, with X = x's
dtype (fp32, bf16 or fp16) and ``round`` = round to nearest even in X:

* ``W1_e, W3_e [I, D]`` and ``W2_e [D, I]`` are the dequantised weights (exact float values) cast to X;
* ``g = round(x_n W1_e^T)``, ``u = round(x_n W3_e^T)``, ``y = round(h W2_e^T)``: dot products accumulated in fp32;
* ``h = round(round(silu(min(g, limit))) * clamp(u, -limit, limit))`` (swiglu evaluated in X, as torch does);
* ``out[n] = round(sum_j weights[n, j] y_{n,j})`` over the j whose expert is local (weights and y as fp32, the sum in
  fp32, order unspecified: the Triton path adds in j order); pairs routed to other ranks' experts contribute 0.

For fp32 every ``round`` is the identity. Two paths agree up to fp32 summation order (and the GPU's exp); a
difference can flip one bf16 rounding of g/u/h/y.

Layouts (E local experts, I intermediate, D hidden):

* ``"dense"``: w1, w3 float ``[E, I, D]``, w2 ``[E, D, I]``; s1, s3, s2 None.
* ``"fp4"``: w1, w3 uint8/int8 ``[E, I, D/2]`` (two e2m1 per byte, low nibble = even element), s1, s3 e8m0
  (uint8 bytes or float8_e8m0fnu) ``[E, I, D/32]``; w2 ``[E, D, I/2]``, s2 ``[E, D, I/32]``. D, I multiples of 32.
* ``"fp8"``: w1, w3 float8_e4m3fn ``[E, I, D]`` with s1, s3 ``[E, ceil(I/128), ceil(D/128)]`` (float or e8m0);
  w2 ``[E, D, I]`` with s2 ``[E, ceil(D/128), ceil(I/128)]``.

Paths: the torch reference (CPU, and the oracle) dequantises one routed expert at a time, never an unrouted one (it
reads the routing on the host, so it is not capturable); the Triton path (``triton_routed_experts``) sorts the
pairs by expert on the device and dequantises weight tiles in registers, with fixed shapes. The op is the custom op
``sgl_kernel_ext::routed_experts``; its fake gives ``empty_like(x)``, so model code runs on the meta device, and its
autograd formula (gradients for x, the routing weights and dense expert weights) runs the reference again under
autograd, for full-sequence training.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import traffic
from .ops import _backend
from .weight_formats import E8M0_DTYPE, FP4_GROUP, FP8_BLOCK, FP8_DTYPE, dequantize_fp4, dequantize_fp8, e8m0_to_float

FORMATS = ("dense", "fp4", "fp8")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCALE_DTYPES = tuple(d for d in (torch.uint8, E8M0_DTYPE, torch.float32, torch.bfloat16, torch.float16) if d)
LAUNCHES = 4  # of the Triton path: sort, gate/up, down, combine (no other op runs on the device)


def intermediate_shapes(n_pairs: int, n_experts: int, dim: int, inter: int) -> dict[str, tuple[int, ...]]:
    """What the Triton path writes to memory besides the output: per-expert pair counts (int32), the pair ids
    sorted by expert (int32), the SwiGLU activation h and the unweighted down projection y (both in x's dtype)."""
    return {"counts": (n_experts,), "order": (n_pairs,), "h": (n_pairs, inter), "y": (n_pairs, dim)}


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU (gate <= limit, |up| <= limit): the routed experts' and the shared expert's."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def dequantize_expert(fmt: str, w: torch.Tensor, s: torch.Tensor | None, e: int) -> torch.Tensor:
    """Local expert ``e``'s matrix ``[out, in]`` as float values (only that expert's bytes are read)."""
    if fmt == "dense":
        return w[e]
    if fmt == "fp4":
        return dequantize_fp4(w[e], s[e])
    return dequantize_fp8(w[e], e8m0_to_float(s[e]))


def routed_experts_ref(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, first: int, fmt: str,
                       w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor | None,
                       s3: torch.Tensor | None, s2: torch.Tensor | None, limit: float) -> torch.Tensor:
    """The torch reference: a loop over the experts that have routed pairs (read on the host), each dequantised
    alone, so temporaries are bounded by one expert and unrouted experts are never touched."""
    n_experts = w1.shape[0]
    local = idx.long() - first
    mine = (local >= 0) & (local < n_experts)
    wf = torch.where(mine, weights.float(), 0.0)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(local[mine]).tolist():
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        gate_w, up_w, down_w = (dequantize_expert(fmt, w, s, e).to(x.dtype) for w, s in ((w1, s1), (w3, s3), (w2, s2)))
        rows = x[tok]
        h = swiglu(rows @ gate_w.t(), rows @ up_w.t(), limit)
        y = (h @ down_w.t()).float()
        out.index_add_(0, tok, wf[tok, slot, None] * y)
    return out.to(x.dtype)


def _check(x, idx, weights, fmt, w1, w3, w2, s1, s3, s2) -> None:
    """Shape and dtype checks only (no values), so they run on meta tensors too."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be [N, D] float, got {tuple(x.shape)} {x.dtype}")
    n, dim = x.shape
    if idx.dim() != 2 or idx.shape[0] != n or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be [{n}, k] int32/int64, got {tuple(idx.shape)} {idx.dtype}")
    if weights.shape != idx.shape or not weights.is_floating_point():
        raise ValueError(f"weights must be float {tuple(idx.shape)}, got {tuple(weights.shape)} {weights.dtype}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if w1.dim() != 3:
        raise ValueError(f"w1 must be [E, I, in], got {tuple(w1.shape)}")
    n_experts, inter = w1.shape[:2]
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if fmt == "dense":
        want = {"w1": (inter, dim), "w3": (inter, dim), "w2": (dim, inter)}
        scales = {}
    elif fmt == "fp4":
        if dim % FP4_GROUP or inter % FP4_GROUP:
            raise ValueError(f"fp4 needs D and I multiples of {FP4_GROUP}, got D={dim}, I={inter}")
        want = {"w1": (inter, dim // 2), "w3": (inter, dim // 2), "w2": (dim, inter // 2)}
        scales = {"s1": (inter, dim // FP4_GROUP), "s3": (inter, dim // FP4_GROUP), "s2": (dim, inter // FP4_GROUP)}
    else:
        want = {"w1": (inter, dim), "w3": (inter, dim), "w2": (dim, inter)}
        blocks = (cdiv(inter, FP8_BLOCK), cdiv(dim, FP8_BLOCK))
        scales = {"s1": blocks, "s3": blocks, "s2": blocks[::-1]}
    tensors = {"w1": w1, "w3": w3, "w2": w2, "s1": s1, "s3": s3, "s2": s2}
    for name, shape in want.items():
        t = tensors[name]
        if tuple(t.shape) != (n_experts, *shape):
            raise ValueError(f"{fmt}: {name} must be {(n_experts, *shape)}, got {tuple(t.shape)}")
        ok = {"dense": t.is_floating_point() and t.dtype != FP8_DTYPE, "fp4": t.dtype in (torch.uint8, torch.int8),
              "fp8": t.dtype == FP8_DTYPE}[fmt]
        if not ok:
            raise ValueError(f"{fmt}: {name} has the wrong dtype {t.dtype}")
    for name in ("s1", "s3", "s2"):
        t = tensors[name]
        if name not in scales:
            if t is not None:
                raise ValueError(f"dense experts take no scales ({name})")
            continue
        if t is None or tuple(t.shape) != (n_experts, *scales[name]) or t.dtype not in _SCALE_DTYPES:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"{fmt}: {name} must be {(n_experts, *scales[name])} e8m0/float, got {got}")


@torch.library.custom_op("sgl_kernel_ext::routed_experts", mutates_args=())
def _routed_experts_op(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, first: int, fmt: str,
                       w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, s1: Optional[torch.Tensor],
                       s3: Optional[torch.Tensor], s2: Optional[torch.Tensor], limit: float,
                       backend: str) -> torch.Tensor:
    if backend == "torch":
        return routed_experts_ref(x, idx, weights, first, fmt, w1, w3, w2, s1, s3, s2, limit)
    from .triton_routed_experts import routed_experts_triton

    return routed_experts_triton(x, idx, weights, first, fmt, w1, w3, w2, s1, s3, s2, limit)


@_routed_experts_op.register_fake
def _(x, idx, weights, first, fmt, w1, w3, w2, s1, s3, s2, limit, backend):
    return torch.empty_like(x)


_DIFFERENTIABLE = {0: "x", 2: "weights", 5: "w1", 6: "w3", 7: "w2"}  # op input position -> name


def _setup_context(ctx, inputs, output):
    x, idx, weights, first, fmt, w1, w3, w2, s1, s3, s2, limit, _ = inputs
    ctx.save_for_backward(x, idx, weights, w1, w3, w2, s1, s3, s2)
    ctx.first, ctx.fmt, ctx.limit = first, fmt, limit


def _backward(ctx, grad):
    """Gradients for x, the routing weights and dense expert weights, by running the torch reference again under
    autograd (the reference is the contract's definition, written in differentiable torch ops)."""
    x, idx, weights, w1, w3, w2, s1, s3, s2 = ctx.saved_tensors
    args = {"x": x, "weights": weights, "w1": w1, "w3": w3, "w2": w2}
    wanted = [name for pos, name in _DIFFERENTIABLE.items()
              if ctx.needs_input_grad[pos] and (name in ("x", "weights") or ctx.fmt == "dense")]
    with torch.enable_grad():
        leaves = {name: args[name].detach().requires_grad_() for name in wanted}
        args |= leaves
        out = routed_experts_ref(args["x"], idx, args["weights"], ctx.first, ctx.fmt, args["w1"], args["w3"],
                                 args["w2"], s1, s3, s2, ctx.limit)
        grads = torch.autograd.grad(out, list(leaves.values()), grad, allow_unused=True) if leaves else ()
    by_name = dict(zip(leaves, grads, strict=True))
    return tuple(by_name.get(_DIFFERENTIABLE.get(pos)) for pos in range(13))


_routed_experts_op.register_autograd(_backward, setup_context=_setup_context)


@traffic.declare("sgl_kernel_ext::routed_experts")
def routed_experts_traffic(x, idx, weights, first, fmt, w1, w3, w2, s1, s3, s2, limit, backend="auto"):
    """Bytes and launches of the Triton path, from shapes only (values unknown, e.g. on meta). Read: the op's
    inputs x, idx and weights once each, plus the routed experts' weights and scales at the busiest rank's worst
    case, min(E, N k) experts. Written: the output and the intermediates the kernels pass through memory (counts
    [E] and order [N k] int32, h [N k, I] and y [N k, D] in x's dtype). The intermediates' re-reads by the next
    kernel (about the same bytes again) are not in ``read``: the step-cost counter charges a declared read beyond
    the op's inputs to weights."""
    n, dim = x.shape
    pairs = n * idx.shape[1]
    if pairs == 0:
        return traffic.Traffic(0, 0, 0)
    n_experts, inter = w1.shape[:2]
    per_expert = sum(traffic.nbytes(t) for t in (w1, w3, w2, s1, s3, s2)) // n_experts
    sizes = {"counts": 4, "order": 4, "h": x.element_size(), "y": x.element_size()}
    inner = sum(sizes[name] * torch.Size(shape).numel()
                for name, shape in intermediate_shapes(pairs, n_experts, dim, inter).items())
    read = traffic.nbytes(x) + traffic.nbytes(idx) + traffic.nbytes(weights) + min(n_experts, pairs) * per_expert
    return traffic.Traffic(read, traffic.nbytes(x) + inner, LAUNCHES)


def routed_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, first: int, fmt: str,
                   w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor | None,
                   s3: torch.Tensor | None, s2: torch.Tensor | None, limit: float, *,
                   backend: str | None = None) -> torch.Tensor:
    """The routed experts' share of each token (see the module doc). Backend: as in ``ops`` ("auto": Triton on CUDA
    tensors, the torch reference elsewhere; "triton" also on CPU tensors under ``TRITON_INTERPRET=1``)."""
    _check(x, idx, weights, fmt, w1, w3, w2, s1, s3, s2)
    choice = "torch" if _backend(backend, x) == "torch" else "triton"
    if choice == "torch" and x.device.type == "cpu":  # the op's dispatch would cost more than a small call's work
        return routed_experts_ref(x, idx, weights, first, fmt, w1, w3, w2, s1, s3, s2, limit)
    return torch.ops.sgl_kernel_ext.routed_experts(x, idx, weights, int(first), fmt, w1, w3, w2, s1, s3, s2,
                                                   float(limit), choice)
