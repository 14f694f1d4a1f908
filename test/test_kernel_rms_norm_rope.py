"""The fused RMSNorm + RoPE op (``sgl_kernel_ext.rms_norm_rope``) computes what the model computed with the two ops.

* the reference is the composition of ``rms_norm_ref`` and ``rope_rotate_ref`` bit for bit, through every CPU entry
  (the public function, the custom op), equals the model's own ``rms`` / ``RMSNorm`` then ``Rope.rotate``, and
  equals the module doc's formula written out step by step (so the doc's roundings are the ones computed);
* fakes give the promoted dtype on meta, the declared traffic is a hand count, bad arguments raise a ValueError
  naming the problem;
* the Triton kernel, run by Triton's CPU interpreter in a child pytest (as in ``test_kernel_moe_ops``), against
  the reference at padded shapes (D and R not powers of two, an odd unrotated width, no unrotated channels, odd T
  and H, strided views), with and without a weight, bf16 and fp32: within a few ulps, and with x in bf16 bit for
  bit (bar rare flips of the fp32 sum order) with the step-by-step formula rounded as the interpreter rounds;
* negative controls: a variant that skips the rounding to x's dtype before the rotation differs from the reference
  (and fails the kernel's bitwise check), and a variant that rotates before normalising fails the ulp comparison,
  so both comparisons are shown able to fail.
"""
from __future__ import annotations

import os

import pytest
import torch

from sgl_kernel_ext import traffic
from sgl_kernel_ext.rms_norm import rms_norm, rms_norm_ref
from sgl_kernel_ext.rms_norm_rope import rms_norm_rope, rms_norm_rope_ref
from sgl_kernel_ext.rope import rope_rotate, rope_rotate_ref
from support.interpreted import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6
# a unit in the last place relative to a tensor's largest magnitude (as in test_kernel_layer_ops)
ULP = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-22}
BF16, FP32 = torch.bfloat16, torch.float32
DTYPES = [(BF16, None), (BF16, BF16), (BF16, FP32), (FP32, None), (FP32, FP32)]  # (x, weight)
DTYPE_IDS = ["bf16", "bf16-w-bf16", "bf16-w-fp32", "fp32", "fp32-w-fp32"]


def case(t: int, h: int, d: int, r: int, dtype: torch.dtype, wdtype: torch.dtype | None, layout: str = "contiguous",
         seed: int = 0):
    """x [t, h, d], a weight (or None) and cos/sin [t, r] of angles up to 6 rad. Layouts: ``contiguous``;
    ``sliced`` (x and cos/sin as column slices of wider rows); ``strided`` (x and the weight at every other
    element); ``heads_first`` (x a transpose of [h, t, d])."""
    g = torch.Generator().manual_seed(seed)
    if layout == "sliced":
        x = (torch.randn(t, h, d + 6, generator=g) * 2).to(dtype)[..., 3:3 + d]
    elif layout == "strided":
        x = (torch.randn(t, h, 2 * d, generator=g) * 2).to(dtype)[..., ::2]
    elif layout == "heads_first":
        x = (torch.randn(h, t, d, generator=g) * 2).to(dtype).transpose(0, 1)
    else:
        x = (torch.randn(t, h, d, generator=g) * 2).to(dtype)
    weight = None
    if wdtype is not None:
        weight = (torch.rand(2 * d if layout == "strided" else d, generator=g) + 0.5).to(wdtype)
        weight = weight[::2] if layout == "strided" else weight
    ang = torch.rand(t, r + 4, generator=g) * 6
    ang = ang[:, 2:2 + r] if layout == "sliced" else ang[:, :r].contiguous()
    return x, weight, ang.cos(), ang.sin()


def stepwise(x, weight, eps, cos, sin, to=torch.Tensor.to, round_before_rotation: bool = True) -> torch.Tensor:
    """The module doc's formula written out: ``to(v, dtype)`` is each rounding (torch's, or the interpreter's);
    ``round_before_rotation=False`` is the negative control that rotates the unrounded fp32 normalised values."""
    out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if round_before_rotation:
        y = to(y, x.dtype).float()
    if weight is not None:
        y = y * weight.float()
        if round_before_rotation:
            y = to(y, out_dtype).float()
    rd = 2 * cos.shape[1]
    c, s = cos[:, None].float(), sin[:, None].float()
    even, odd = y[..., -rd:][..., 0::2], y[..., -rd:][..., 1::2]
    rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)
    return torch.cat([to(y[..., :-rd], out_dtype), to(rotated, out_dtype)], dim=-1)


def assert_close_ulps(got: torch.Tensor, want: torch.Tensor, unit: torch.dtype, ulps: float):
    """Within ``ulps`` units in the last place of ``unit`` (x's dtype: the coarsest rounding on the way, also when
    a fp32 weight makes the output fp32) relative to the largest magnitude of ``want``."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().clamp(min=1e-6).item()
    assert err <= ulps * ULP[unit], f"{err / ULP[unit]:.2f} ulps"


# ---- the reference, fakes, declarations, arguments (this process) ----------------------------------------------

@pytest.mark.parametrize("dtype,wdtype", DTYPES, ids=DTYPE_IDS)
def test_reference_is_the_composition_bit_for_bit(dtype, wdtype):
    x, weight, cos, sin = case(5, 3, 100, 18, dtype, wdtype, "sliced")
    want = rope_rotate_ref(rms_norm_ref(x, weight, EPS), cos, sin)
    assert want.dtype == (dtype if wdtype is None else torch.promote_types(dtype, wdtype))
    assert torch.equal(rms_norm_rope_ref(x, weight, EPS, cos, sin), want)
    assert torch.equal(rms_norm_rope(x, weight, EPS, cos, sin), want)  # the CPU path: the reference directly
    assert torch.equal(rope_rotate(rms_norm(x, weight, EPS), cos, sin), want)  # the two public ops
    assert torch.equal(torch.ops.sgl_kernel_ext.rms_norm_rope(x, weight, EPS, cos, sin, "torch"), want)
    assert torch.equal(stepwise(x, weight, EPS, cos, sin), want)  # the module doc's roundings


def test_cpu_path_is_what_the_model_computed():
    """The model's q (per-head norm without a weight, then RoPE of every head) and k (the weighted kv norm, then
    RoPE) with its own modules, at V4's widths (D = 512 and 128, R = 32)."""
    from sglang_tree_v4.dsv4.norm import RMSNorm, rms
    from sglang_tree_v4.dsv4.rope import Rope

    g = torch.Generator().manual_seed(3)
    rope = Rope(64, 10000.0)
    cos, sin = rope.cos_sin(torch.tensor([0, 5, 77, 4093, 65000]))
    for d in (512, 128):
        q = torch.randn(5, 4, d, generator=g).to(BF16)
        assert torch.equal(rms_norm_rope(q, None, EPS, cos, sin), rope.rotate(rms(q, EPS), cos[:, None], sin[:, None]))
        norm = RMSNorm(d, EPS)
        kv = torch.randn(5, d, generator=g).to(BF16)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=g)
            want = rope.rotate(norm(kv), cos, sin)
            assert want.dtype == FP32  # the fp32 weight promotes
            assert torch.equal(rms_norm_rope(kv[:, None], norm.weight, EPS, cos, sin)[:, 0], want)


def test_skipping_the_rounding_before_the_rotation_changes_bits():
    """Negative control of the bitwise comparisons: rotating the unrounded normalised values differs from the
    reference wherever x's dtype is coarser than fp32 (by an ulp: only a bitwise check sees it), and nowhere with
    fp32 throughout (there the rounding is none)."""
    for dtype, wdtype in DTYPES:
        x, weight, cos, sin = case(5, 3, 100, 18, dtype, wdtype)
        skipped = stepwise(x, weight, EPS, cos, sin, round_before_rotation=False)
        want = rms_norm_rope_ref(x, weight, EPS, cos, sin)
        assert torch.equal(skipped, want) == (dtype == FP32), (dtype, wdtype)
        assert_close_ulps(skipped, want, dtype, 2.0)


def test_rotating_before_normalising_is_another_op():
    """The norm of a row does not see a rotation of its pairs, so without a weight the order matters only to the
    roundings; with a weight it multiplies other channels and is far off."""
    x, _, cos, sin = case(5, 3, 100, 18, FP32, None)
    weight = 1.0 + 0.5 * (-1.0) ** torch.arange(100)  # the two channels of a pair weighted apart
    assert_close_ulps(rms_norm_ref(rope_rotate_ref(x, cos, sin), None, EPS), rms_norm_rope_ref(x, None, EPS, cos, sin),
                      FP32, 4.0)
    swapped = rms_norm_ref(rope_rotate_ref(x, cos, sin), weight, EPS)
    with pytest.raises(AssertionError):
        assert_close_ulps(swapped, rms_norm_rope_ref(x, weight, EPS, cos, sin), BF16, 3.0)


def test_fake_shapes_and_dtypes_on_meta():
    m = dict(device="meta")
    cos = torch.empty(7, 32, **m)
    for dtype, wdtype, out in [(BF16, None, BF16), (BF16, BF16, BF16), (BF16, FP32, FP32), (FP32, BF16, FP32)]:
        x = torch.empty(7, 64, 512, dtype=dtype, **m)
        weight = None if wdtype is None else torch.empty(512, dtype=wdtype, **m)
        y = rms_norm_rope(x, weight, EPS, cos, cos)
        assert (y.shape, y.dtype, y.device.type) == ((7, 64, 512), out, "meta")
        y = torch.ops.sgl_kernel_ext.rms_norm_rope(x, weight, EPS, cos, cos, "triton")
        assert (y.shape, y.dtype) == ((7, 64, 512), out)


def test_declared_traffic_is_the_hand_count():
    m = dict(device="meta")
    t, h, d, r = 7, 64, 512, 32
    x, cos = torch.empty(t, h, d, dtype=BF16, **m), torch.empty(t, r, **m)
    declared = traffic.declared("sgl_kernel_ext::rms_norm_rope", (x, torch.empty(d, **m), EPS, cos, cos), {})
    # x, the fp32 weight, fp32 cos and sin read once; the promoted (fp32) output written once; one launch
    assert declared == traffic.Traffic(t * h * d * 2 + d * 4 + 2 * t * r * 4, t * h * d * 4, 1)
    strided = torch.empty(t, h, 2 * d, dtype=BF16, **m)[..., ::2]  # no copy: the kernel takes any strides
    declared = traffic.declared("sgl_kernel_ext::rms_norm_rope", (strided, None, EPS, cos, cos), {})
    assert declared == traffic.Traffic(t * h * d * 2 + 2 * t * r * 4, t * h * d * 2, 1)


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.randn(5, 64)), r"x must be \[T, H, D\]"),
    (dict(cos=torch.randn(5, 8)), "cos and sin must both be"),
    (dict(cos=torch.randn(4, 16), sin=torch.randn(4, 16)), r"T = 5 \(x's tokens\)"),
    (dict(cos=torch.randn(5, 16, 1), sin=torch.randn(5, 16, 1)), "cos and sin must both be"),
    (dict(cos=torch.randn(5, 33), sin=torch.randn(5, 33)), "2R = 66 must be in"),
    (dict(cos=torch.randn(5, 0), sin=torch.randn(5, 0)), "2R = 0 must be in"),
    (dict(weight=torch.randn(63)), r"weight must be \[64\]"),
    (dict(x=torch.ones(5, 2, 64, dtype=torch.int32)), "x must be a floating-point"),
    (dict(sin=torch.ones(5, 16, dtype=torch.long)), "sin must be a floating-point"),
])
def test_bad_arguments_raise(change, match):
    args = dict(x=torch.randn(5, 2, 64), weight=torch.ones(64), cos=torch.randn(5, 16), sin=torch.randn(5, 16))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        rms_norm_rope(args["x"], args["weight"], EPS, args["cos"], args["sin"])


def test_autograd_runs_the_reference():
    x, _, cos, sin = case(3, 2, 48, 12, FP32, None)
    weight = torch.ones(48, requires_grad=True)
    rms_norm_rope(x, weight, EPS, cos, sin, backend="triton").sum().backward()  # no backward on the op: the ref
    assert weight.grad is not None and torch.isfinite(weight.grad).all()


# ---- the Triton kernel under the interpreter -------------------------------------------------------------------

if not INTERPRETED:

    def test_triton_kernel_under_interpreter():
        """Re-run this file's kernel tests with TRITON_INTERPRET=1 in a child pytest."""
        run_interpreted(__file__)

else:
    import triton
    import triton.language as tl

    @triton.jit
    def _cast_probe(x_ptr, y_ptr):
        tl.store(y_ptr, tl.load(x_ptr).to(tl.bfloat16))

    def _interpreter_rounding():
        """The interpreter's fp32 -> bf16 cast as a torch function: it truncates (Triton 3.6 to 3.8 at least;
        torch and the GPU round to nearest), found by casting a value whose nearest bf16 is the larger one."""
        y = torch.empty(1, dtype=BF16)
        _cast_probe[(1,)](torch.tensor([1 + 2**-8 + 2**-10]), y)
        if y.item() != 1.0:
            return torch.Tensor.to

        def truncate(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            if dtype == BF16 and v.dtype == FP32:
                return (v.view(torch.int32) & -65536).view(FP32).to(BF16)
            return v.to(dtype)

        return truncate

    INTERPRETER_TO = _interpreter_rounding()

    def assert_rounds_as_interpreted(got, x, weight, cos, sin, **variant):
        """With x in bf16, the rotated channels bit for bit the step-by-step formula rounded as the interpreter
        rounds, but for rare flips of a rounding by the fp32 order of the sum of squares (an ulp of x's dtype
        apart, in two outputs per flip: 3% or 4 values allowed); with x in fp32 the sum order alone moves last
        bits everywhere and the ulp comparison is the check."""
        if x.dtype == FP32:
            return
        want = stepwise(x, weight, EPS, cos, sin, INTERPRETER_TO, **variant)
        rd = 2 * cos.shape[1]
        differ = (got[..., -rd:] != want[..., -rd:]).sum().item()
        n = got[..., -rd:].numel()
        assert differ <= max(4, 0.03 * n), f"only {n - differ} of {n} rotated channels bit-equal"
        differ, n = (got != want).sum().item(), got.numel()
        assert differ <= max(4, 0.03 * n), f"only {n - differ} of {n} channels bit-equal"
        assert_close_ulps(got, want, x.dtype, 1.0)

    SHAPES = [(5, 3, 48, 12, "contiguous"), (7, 5, 100, 18, "sliced"), (3, 4, 37, 7, "strided"),
              (1, 3, 12, 6, "heads_first"), (3, 4, 512, 32, "contiguous"), (5, 3, 128, 32, "sliced")]

    @pytest.mark.parametrize("dtype,wdtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("t,h,d,r,layout", SHAPES, ids=[f"{t}x{h}x{d}-r{r}-{lay}" for t, h, d, r, lay in SHAPES])
    def test_kernel_interpreted(t, h, d, r, layout, dtype, wdtype):
        """Three bf16 roundings at most on the way (the norm, the weight's product, the rotation), each of which
        the interpreter truncates where the reference rounds to nearest: within 3 ulps of bf16; 2 of fp32."""
        x, weight, cos, sin = case(t, h, d, r, dtype, wdtype, layout, seed=t * d + r)
        got = rms_norm_rope(x, weight, EPS, cos, sin, backend="triton")
        want = rms_norm_rope_ref(x, weight, EPS, cos, sin)
        assert_close_ulps(got, want, dtype, 3.0 if dtype == BF16 else 2.0)
        assert_rounds_as_interpreted(got, x, weight, cos, sin)

    def test_kernel_interpreted_empty():
        x, weight, cos, sin = case(0, 3, 48, 12, BF16, FP32)
        got = rms_norm_rope(x, weight, EPS, cos, sin, backend="triton")
        assert got.shape == (0, 3, 48) and got.dtype == FP32

    @pytest.mark.parametrize("dtype,wdtype", [(BF16, None), (BF16, BF16), (BF16, FP32)],
                             ids=["bf16", "bf16-w-bf16", "bf16-w-fp32"])
    def test_kernel_interpreted_negative_controls(dtype, wdtype):
        """The kernel's checks fail against the wrong ops: the bitwise check against the formula that skips the
        rounding before the rotation, the ulp comparison against rotating before normalising (with a weight that
        differs across channels)."""
        x, weight, cos, sin = case(5, 3, 128, 32, dtype, wdtype, seed=11)
        got = rms_norm_rope(x, weight, EPS, cos, sin, backend="triton")
        assert_rounds_as_interpreted(got, x, weight, cos, sin)  # the right formula passes ...
        with pytest.raises(AssertionError, match="bit-equal"):  # ... the one without the rounding does not
            assert_rounds_as_interpreted(got, x, weight, cos, sin, round_before_rotation=False)
        zigzag = (1.0 + 0.5 * (-1.0) ** torch.arange(128)).to(wdtype or dtype)  # the two channels of a pair apart
        got = rms_norm_rope(x, zigzag, EPS, cos, sin, backend="triton")
        assert_close_ulps(got, rms_norm_rope_ref(x, zigzag, EPS, cos, sin), dtype, 3.0)
        with pytest.raises(AssertionError, match="ulps"):
            assert_close_ulps(got, rms_norm_ref(rope_rotate_ref(x, cos, sin), zigzag, EPS), dtype, 3.0)
