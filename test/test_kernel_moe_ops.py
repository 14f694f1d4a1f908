"""The MoE's small ops: the router (``sgl_kernel_ext.moe_route``) and the shared expert's clamped SwiGLU
(``sgl_kernel_ext.swiglu``): references against the formulas the model used, fakes and declared traffic, and the
Triton kernels under the interpreter (a child pytest, as in ``test_kernel_layer_ops``) at padded shapes: for the
router every scoring, a bias of either dtype and a hash layer's table; for the SwiGLU values past the limit."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from sgl_kernel_ext import traffic
from sgl_kernel_ext.moe_route import moe_route, moe_route_ref, score
from sgl_kernel_ext.swiglu import swiglu_op, swiglu_ref
from support.interpreted import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def case(n: int, c: int, e: int, dtype: torch.dtype, bias_dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g).to(dtype)
    w = (torch.randn(e, c, generator=g) * c ** -0.5).to(dtype)
    bias = None if bias_dtype is None else (torch.randn(e, generator=g) * 0.1).to(bias_dtype)
    return x, w, bias


def test_reference_is_the_gates_formula_and_the_bias_only_steers():
    x, w, bias = case(9, 32, 16, torch.float32)
    idx, wt = moe_route_ref(x, w, bias, 4, 2.5, "sqrtsoftplus")
    s = F.softplus(x @ w.t()).sqrt()
    assert torch.equal(idx, torch.topk(s + bias, 4).indices)
    torch.testing.assert_close(wt, s.gather(1, idx) / s.gather(1, idx).sum(-1, keepdim=True) * 2.5)
    torch.testing.assert_close(wt.sum(-1), torch.full((9,), 2.5))
    unbiased, _ = moe_route_ref(x, w, None, 4, 2.5, "sqrtsoftplus")
    assert not torch.equal(unbiased, idx)  # the bias changed some choice (this seed) ...
    chosen = torch.randint(0, 16, (9, 4), generator=torch.Generator().manual_seed(1))
    hashed, hw = moe_route_ref(x, w, bias, 4, 1.0, "sqrtsoftplus", chosen)
    assert torch.equal(hashed, chosen)  # ... a hash layer's table decides alone
    torch.testing.assert_close(hw, s.gather(1, chosen) / s.gather(1, chosen).sum(-1, keepdim=True))


def test_fake_and_declared_traffic():
    m = dict(device="meta")
    x, w, b = torch.empty(7, 4096, dtype=torch.bfloat16, **m), torch.empty(256, 4096, dtype=torch.bfloat16, **m), \
        torch.empty(256, **m)
    idx, wt = moe_route(x, w, b, 6, 2.5)
    assert (idx.shape, idx.dtype, wt.shape, wt.dtype) == ((7, 6), torch.long, (7, 6), torch.bfloat16)
    t = traffic.declared("sgl_kernel_ext::moe_route", (x, w, b, 6, 2.5, "sqrtsoftplus"), {})
    assert t == traffic.Traffic(7 * 4096 * 2 + 256 * 4096 * 2 + 256 * 4, 7 * 6 * (8 + 2), 1)
    with pytest.raises(ValueError, match="scoring"):
        moe_route(x, w, b, 6, 2.5, "relu")
    with pytest.raises(ValueError, match="chosen"):
        moe_route(x, w, b, 6, 2.5, chosen=torch.empty(7, 5, dtype=torch.long, **m))


def test_swiglu_reference_fake_and_traffic():
    g = torch.linspace(-12, 12, 9)
    want = F.silu(g.clamp(max=10.0)) * g.clamp(-10.0, 10.0)
    assert torch.equal(swiglu_ref(g, g, 10.0), want) and torch.equal(swiglu_op(g, g, 10.0), want)
    m = torch.empty(4, 2048, dtype=torch.bfloat16, device="meta")
    y = swiglu_op(m, m, 10.0)
    assert y.shape == (4, 2048) and y.dtype == torch.bfloat16
    assert traffic.declared("sgl_kernel_ext::swiglu", (m, m, 10.0), {}) == traffic.Traffic(2 * 4 * 2048 * 2,
                                                                                         4 * 2048 * 2, 1)
    with pytest.raises(ValueError, match="must match"):
        swiglu_op(m, m.float(), 10.0)
    # the halves of a fused gate-up projection: column slices, read in place (no copy charged) ...
    gate, up = torch.empty(4, 4096, dtype=torch.bfloat16, device="meta").split(2048, -1)
    assert traffic.declared("sgl_kernel_ext::swiglu", (gate, up, 10.0), {}) == traffic.Traffic(2 * 4 * 2048 * 2,
                                                                                             4 * 2048 * 2, 1)
    # ... a transposed input is not: its copy is charged
    t = torch.empty(2048, 4, dtype=torch.bfloat16, device="meta").t()
    assert traffic.declared("sgl_kernel_ext::swiglu", (t, m, 10.0), {}).launches == 2


def assert_same_routes(got, want, x, w, bias, scoring, dtype):
    """The same choice up to ties: the chosen experts' steering scores (``s + bias``, the reference's) and the
    weights, each sorted, agree within a rounding of x's dtype (the interpreter's casts truncate, and two experts a
    rounding apart may trade places)."""
    (gi, gw), (wi, ww) = got, want
    assert gi.dtype == torch.long and gw.dtype == ww.dtype == dtype
    s = score(x @ w.t(), scoring).float()
    sel = s if bias is None else s + bias.float()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    for a, b in ((sel.gather(1, gi), sel.gather(1, wi)), (gw.float(), ww.float())):
        torch.testing.assert_close(a.sort(-1).values, b.sort(-1).values, rtol=3 * ulp, atol=3 * ulp)


if not INTERPRETED:

    def test_triton_kernel_under_interpreter():
        """Re-run this file's kernel tests with TRITON_INTERPRET=1 in a child pytest."""
        run_interpreted(__file__)

else:

    @pytest.mark.parametrize("n,c,e,k,dtype,bias_dtype,scoring", [
        (5, 64, 16, 4, torch.bfloat16, torch.float32, "sqrtsoftplus"),
        (37, 100, 24, 6, torch.float32, torch.float32, "sqrtsoftplus"),
        (18, 48, 20, 2, torch.bfloat16, torch.bfloat16, "sqrtsoftplus"),
        (3, 40, 16, 3, torch.bfloat16, None, "sigmoid"),
        (20, 72, 30, 4, torch.float32, None, "softmax"),
    ])
    def test_kernel_interpreted(n, c, e, k, dtype, bias_dtype, scoring):
        x, w, bias = case(n, c, e, dtype, bias_dtype, seed=n)
        got = moe_route(x, w, bias, k, 2.5, scoring, backend="triton")
        assert_same_routes(got, moe_route_ref(x, w, bias, k, 2.5, scoring), x, w, bias, scoring, dtype)

    def test_kernel_interpreted_hash_layer():
        x, w, bias = case(21, 64, 16, torch.bfloat16, seed=4)
        chosen = torch.randint(0, 16, (21, 6), generator=torch.Generator().manual_seed(5))
        got = moe_route(x, w, bias, 6, 1.5, "sqrtsoftplus", chosen, backend="triton")
        assert torch.equal(got[0], chosen)
        assert_same_routes(got, moe_route_ref(x, w, bias, 6, 1.5, "sqrtsoftplus", chosen), x, w, bias,
                           "sqrtsoftplus", torch.bfloat16)

    def test_kernel_interpreted_small_logits_keep_softplus_exact():
        """Logits far below 0: softplus is exp(l) there, which log(1 + exp(l)) in fp32 would flush to 0."""
        x, w, _ = case(4, 32, 16, torch.float32, seed=7)
        x[:, 0], w[:, 0] = 1.0, -25.0  # logits about -25 +- 3: exp(l) < 1e-9, where 1 + exp(l) == 1 in fp32
        got = moe_route(x, w, None, 3, 1.0, "sqrtsoftplus", backend="triton")
        assert_same_routes(got, moe_route_ref(x, w, None, 3, 1.0, "sqrtsoftplus"), x, w, None, "sqrtsoftplus",
                           torch.float32)

    @pytest.mark.parametrize("shape,dtype,fused", [((5, 100), torch.bfloat16, False),
                                                   ((3, 7, 64), torch.float32, False),
                                                   ((1, 1500), torch.bfloat16, False),
                                                   ((6, 100), torch.bfloat16, True)])
    def test_kernel_interpreted_swiglu(shape, dtype, fused):
        """Values to 3x the limit on both inputs: each clamp matters (without the up clamp this fails). ``fused``:
        gate and up as the column halves of one projection's output (rows strided, read in place)."""
        g = torch.Generator().manual_seed(shape[-1])
        if fused:
            gate, up = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 12).to(dtype).split(shape[-1], -1)
        else:
            gate = (torch.randn(shape, generator=g) * 12).to(dtype)
            up = (torch.randn(shape, generator=g) * 12).to(dtype)
        got, want = swiglu_op(gate, up, 10.0, backend="triton"), swiglu_ref(gate, up, 10.0)
        assert got.dtype == dtype and got.shape == want.shape
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=2 * ulp)
