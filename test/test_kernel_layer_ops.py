"""The decoder layer's small ops as custom ops: hyper-connection pre/post, RMSNorm, RoPE, the indexer's scores, the
HCA folds, a pool's rows read (``gather_rows``), and the tree attention and entry compression kernels registered as
ops.

* each Triton kernel, run by Triton's CPU interpreter in a child pytest (as in ``test_kernel_fp8_linear``), against
  its torch reference at two shapes or more, padded ones included (sizes that are not powers of two, -1 padding in
  index lists);
* declared traffic: rows an index list does not name are NaN in the pool and must not reach the output (the kernel
  reads only what it declares), and each declaration equals a hand count;
* fakes: shapes and dtypes on the meta device; autograd callers get the reference (the ops have no backward).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_kernel_ext import ops, traffic
from sgl_kernel_ext.gather_rows import gather_rows, gather_rows_ref
from sgl_kernel_ext.hca_fold import hca_fold, hca_fold_ref
from sgl_kernel_ext.hyper_connection import hc_post, hc_post_ref, hc_pre, hc_pre_ref
from sgl_kernel_ext.indexer import indexer_scores, indexer_scores_ref
from sgl_kernel_ext.reference import compress_entries_ref, tree_sparse_attention_ref
from sgl_kernel_ext.rms_norm import rms_norm, rms_norm_ref
from sgl_kernel_ext.rope import rope_rotate, rope_rotate_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ULP = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-22}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def hc_case(n: int, hc: int, dim: int, dtype: torch.dtype, seed: int = 0):
    g = _gen(seed)
    rows = (2 + hc) * hc
    return (torch.randn(n, hc, dim, generator=g).to(dtype), torch.randn(rows, hc * dim, generator=g) * 0.05,
            torch.randn(rows, generator=g) * 0.1, torch.rand(3, generator=g) + 0.5)


def indexer_case(n: int, heads: int, dim: int, pool: int, listed: int, dtype: torch.dtype, seed: int = 0):
    """Keys as a column slice of a wider pool; rows with -1 padding anywhere."""
    g = _gen(seed)
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    w = torch.randn(n, heads, generator=g)
    wide = torch.randn(pool, dim + 12, generator=g).to(dtype)
    rows = torch.randint(-1, pool, (n, listed), generator=g)
    return q, w, wide[:, 6:6 + dim], rows


def poisoned(keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of the pool whose rows no list names are NaN."""
    out = keys.clone()
    unread = torch.ones(keys.shape[0], dtype=torch.bool)
    unread[rows[rows >= 0]] = False
    out[unread] = float("nan")
    return out


def assert_close_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float = 2.0):
    """Within ``ulps`` units in the last place of the tensor's largest magnitude: the flipped roundings of another
    summation order (a sum that cancels can lose its relative precision in either path)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().clamp(min=1e-6).item()
    assert err <= ulps * ULP[want.dtype], err


# ---- references, fakes, declarations (this process) ------------------------------------------------------------

def test_hc_pre_reference_is_doubly_stochastic_and_collapses_with_pre():
    streams, fn, base, scale = hc_case(4, 4, 32, torch.float32)
    collapsed, post, comb = hc_pre_ref(streams, fn, base, scale, 30, 1e-6, 1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(4, 4), atol=1e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(4, 4), atol=1e-3)
    assert ((post > 0) & (post < 2)).all()
    assert not torch.allclose(collapsed, streams.mean(1))  # pre weights, not a plain mean


def test_hc_pre_out_weight_is_the_rms_norm_of_the_rounded_collapse():
    """Bit for bit the two references composed (the op's torch path too), in the promoted dtype; post and comb
    unchanged. Negative control: normalising the fp32 collapse before its rounding to bf16 gives other bits."""
    for dtype in (torch.bfloat16, torch.float32):
        streams, fn, base, scale = hc_case(4, 3, 40, dtype, seed=1)
        plain = hc_pre_ref(streams, fn, base, scale, 20, 1e-6, 1e-6)
        unrounded = hc_pre_ref(streams.float(), fn, base, scale, 20, 1e-6, 1e-6)[0]  # the same pre, no rounding
        for wdtype in (torch.bfloat16, torch.float32):
            w = (torch.rand(40, generator=_gen(2)) + 0.5).to(wdtype)
            want = rms_norm_ref(plain[0], w, 1e-5)
            for got in (hc_pre_ref(streams, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-5),
                        hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, out_weight=w, out_eps=1e-5)):
                assert got[0].dtype == torch.promote_types(dtype, wdtype) and torch.equal(got[0], want)
                assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])
            if dtype == torch.bfloat16:
                assert not torch.equal(rms_norm_ref(unrounded, w, 1e-5).to(want.dtype), want)
    with pytest.raises(ValueError, match="out_weight"):
        hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, out_weight=torch.ones(41))


def test_fakes_give_shapes_and_dtypes_on_meta():
    m = dict(device="meta")
    streams = torch.empty(5, 4, 64, dtype=torch.bfloat16, **m)
    col, post, comb = hc_pre(streams, torch.empty(24, 256, **m), torch.empty(24, **m), torch.empty(3, **m), 20,
                             1e-6, 1e-6)
    assert (col.shape, col.dtype, post.shape, post.dtype, comb.shape) == ((5, 64), torch.bfloat16, (5, 4),
                                                                           torch.float32, (5, 4, 4))
    for wdtype in (torch.bfloat16, torch.float32):  # the promoted dtype of streams and the weight
        col, _, _ = hc_pre(streams, torch.empty(24, 256, **m), torch.empty(24, **m), torch.empty(3, **m), 20, 1e-6,
                           1e-6, out_weight=torch.empty(64, dtype=wdtype, **m), out_eps=1e-6)
        assert col.shape == (5, 64) and col.dtype == wdtype
    assert hc_post(torch.empty(5, 64, dtype=torch.bfloat16, **m), streams, post, comb).shape == (5, 4, 64)
    y = rms_norm(torch.empty(3, 7, 64, dtype=torch.bfloat16, **m), torch.empty(64, **m), 1e-6)
    assert y.shape == (3, 7, 64) and y.dtype == torch.float32
    s = indexer_scores(torch.empty(6, 8, 32, dtype=torch.bfloat16, **m), torch.empty(6, 8, **m),
                       torch.empty(100, 32, dtype=torch.bfloat16, **m), torch.empty(6, 40, dtype=torch.long, **m), 0.1)
    assert s.shape == (6, 40) and s.dtype == torch.float32
    o = ops.tree_sparse_attention(torch.empty(6, 4, 64, **m), torch.empty(50, 64, **m),
                                  torch.empty(6, 9, dtype=torch.long, **m), None, None, torch.empty(4, **m), 0.1)
    assert o.shape == (6, 4, 64)
    e = ops.compress_entries(torch.empty(50, 128, **m), torch.empty(50, 128, **m),
                             torch.empty(3, 8, dtype=torch.long, **m), torch.empty(8, dtype=torch.long, **m),
                             torch.empty(8, 64, **m), torch.empty(64, **m), 1e-6, None, None,
                             out_dtype=torch.bfloat16)
    assert e.shape == (3, 64) and e.dtype == torch.bfloat16


def test_declared_traffic_is_the_hand_count():
    n, hc, dim = 8, 4, 4096
    streams = torch.empty(n, hc, dim, dtype=torch.bfloat16, device="meta")
    fn = torch.empty(24, hc * dim, device="meta")
    t = traffic.declared("sgl_kernel_ext::hc_pre", (streams, fn, torch.empty(24), torch.empty(3), 20, 1e-6, 1e-6),
                         {})
    assert t == traffic.Traffic(2 * n * hc * dim * 2 + 24 * hc * dim * 4 + 24 * 4 + 3 * 4,
                                n * dim * 2 + 4 * n * (hc + hc * hc), 1)
    w = torch.empty(dim, device="meta")  # fp32: an fp32 output, written as scratch, read back, written normalised
    t = traffic.declared("sgl_kernel_ext::hc_pre", (streams, fn, torch.empty(24), torch.empty(3), 20, 1e-6, 1e-6, w,
                                                    1e-6), {})
    assert t == traffic.Traffic(2 * n * hc * dim * 2 + 24 * hc * dim * 4 + 24 * 4 + 3 * 4 + dim * 4 + n * dim * 4,
                                2 * n * dim * 4 + 4 * n * (hc + hc * hc), 1)
    rows = torch.empty(8, 2048, dtype=torch.long, device="meta")
    keys = torch.empty(10_000, 128, dtype=torch.bfloat16, device="meta")
    q, w = torch.empty(8, 64, 128, dtype=torch.bfloat16), torch.empty(8, 64)
    t = traffic.declared("sgl_kernel_ext::indexer_scores", (q, w, keys, rows, 0.1), {})
    listed = 8 * 2048 * 128 * 2  # every listed row once per query, not the pool
    assert t == traffic.Traffic(8 * 64 * 128 * 2 + 8 * 64 * 4 + 8 * 2048 * 8 + listed, 8 * 2048 * 4, 1,
                                ((2, listed),))
    idx_a = torch.empty(8, 128, dtype=torch.long)
    t = traffic.declared("sgl_kernel_ext::tree_sparse_attention",
                         (torch.empty(8, 16, 512, dtype=torch.bfloat16), keys.new_empty(10_000, 512), idx_a, None,
                          None, torch.empty(16), 0.1), {})
    assert t.partial == ((1, 8 * 128 * 512 * 2),) and t.written == 8 * 16 * 512 * 2 and t.launches == 1
    x = torch.empty(4, 4096, dtype=torch.bfloat16)
    assert traffic.declared("sgl_kernel_ext::rms_norm", (x, torch.empty(4096, dtype=torch.bfloat16), 1e-6), {}) \
        == traffic.Traffic(4 * 4096 * 2 + 4096 * 2, 4 * 4096 * 2, 1)


def test_rope_reference_rotates_back_and_keeps_the_unrotated_channels():
    g = _gen(2)
    x = torch.randn(4, 3, 40, generator=g, dtype=torch.float64)
    ang = torch.rand(4, 8, generator=g, dtype=torch.float64) * 6
    y = rope_rotate_ref(x, ang.cos(), ang.sin())
    assert torch.equal(y[..., :24], x[..., :24]) and not torch.allclose(y[..., 24:], x[..., 24:])
    torch.testing.assert_close(rope_rotate_ref(y, ang.cos(), ang.sin(), inverse=True), x, rtol=1e-5, atol=1e-5)
    assert traffic.declared("sgl_kernel_ext::rope_rotate", (x, ang.cos(), ang.sin(), False), {}) == \
        traffic.Traffic(x.numel() * 8 + 2 * 32 * 8, x.numel() * 8, 1)
    meta = rope_rotate(x.to("meta"), ang.cos().to("meta"), ang.sin().to("meta"))
    assert meta.shape == x.shape and meta.device.type == "meta"


def fold_case(n: int, d: int, seed: int = 0):
    """Chains of up to 3 queries (predecessor = the previous query), block starts every 5th, the rest from stored
    states."""
    g = _gen(seed)
    start = torch.tensor([i % 5 == 0 for i in range(n)])
    hit = torch.tensor([i % 3 != 0 for i in range(n)])
    query = torch.tensor([max(i - 1, 0) for i in range(n)])
    return (torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), start, hit, query,
            torch.randn(n, 2 * d, generator=g))


def test_hca_fold_sweeps_give_the_one_by_one_folds():
    v, s, start, hit, query, stored = fold_case(11, 6)
    o, lse = [], []
    for i in range(11):  # in order: a predecessor is always folded first
        po, pl = (o[query[i]], lse[query[i]]) if hit[i] else (stored[i, :6], stored[i, 6:])
        nl = torch.logaddexp(pl, s[i])
        no = po * torch.exp(pl - nl) + v[i] * torch.exp(s[i] - nl)
        o.append(v[i] if start[i] else no)
        lse.append(s[i] if start[i] else nl)
    want = torch.cat([torch.stack(o), torch.stack(lse)], 1)
    # chains of 3: 3 sweeps settle (up to the last bit of exp on the CPU's vector and scalar paths); 2 do not
    torch.testing.assert_close(hca_fold_ref(v, s, start, hit, query, stored, 3), want, rtol=1e-6, atol=1e-6)
    assert (hca_fold_ref(v, s, start, hit, query, stored, 2) - want).abs().max() > 1e-2
    t = traffic.declared("sgl_kernel_ext::hca_fold", (v, s, start, hit, query, stored, 3), {})
    state = 11 * 12 * 4
    assert t == traffic.Traffic(2 * 11 * 6 * 4 + 11 + 11 + 11 * 8 + state + 3 * state, state + 3 * state, 1)
    meta = hca_fold(*(x.to("meta") for x in (v, s, start, hit, query, stored)), 3)
    assert meta.shape == (11, 12)


def gather_case(n: int, width: int, dtype: torch.dtype, seed: int = 0):
    """A pool of 40 rows, 3 columns either side of the read range; lists of any shape with -1 anywhere."""
    g = _gen(seed)
    buf = torch.randn(40, width + 6, generator=g).to(dtype)
    return buf, torch.randint(-1, 40, (n, 3), generator=g)


def test_gather_rows_reference_fake_and_traffic():
    buf, rows = gather_case(5, 16, torch.float32)
    got = gather_rows_ref(buf, rows, 3, 16)
    assert torch.equal(got[rows >= 0], buf[rows[rows >= 0], 3:19]) and (got[rows < 0] == 0).all()
    assert torch.equal(gather_rows_ref(poisoned(buf, rows), rows, 3, 16), got)  # unlisted rows are not read
    meta = gather_rows(buf.to("meta"), rows.to("meta"), 3, 16)
    assert meta.shape == (5, 3, 16) and meta.dtype == torch.float32
    t = traffic.declared("sgl_kernel_ext::gather_rows", (buf, rows, 3, 16), {})
    assert t == traffic.Traffic(15 * 8 + 15 * 16 * 4, 15 * 16 * 4, 1, ((0, 15 * 16 * 4),))
    with pytest.raises(ValueError, match="columns"):
        gather_rows(buf, rows, 10, 16)


def test_autograd_runs_the_reference():
    streams, fn, base, scale = hc_case(3, 2, 16, torch.float32)
    fn.requires_grad_(True)
    col, post, comb = hc_pre(streams, fn, base, scale, 5, 1e-6, 1e-6)
    (col.sum() + post.sum() + comb.sum()).backward()
    assert fn.grad is not None and torch.isfinite(fn.grad).all()
    w = torch.ones(16, requires_grad=True)
    rms_norm(torch.randn(3, 16), w, 1e-6).sum().backward()
    assert w.grad is not None


def test_indexer_reference_reads_only_listed_rows():
    q, w, keys, rows = indexer_case(5, 8, 32, 200, 37, torch.float32)
    want = indexer_scores_ref(q, w, keys, rows, 32 ** -0.5)
    assert torch.equal(indexer_scores_ref(q, w, poisoned(keys, rows), rows, 32 ** -0.5), want)
    assert torch.equal(torch.isinf(want), rows < 0)


def test_indexer_reference_matches_the_plain_formula():
    q, w, keys, rows = indexer_case(3, 4, 16, 50, 20, torch.float32, seed=3)
    k = keys[rows.clamp(min=0)]
    plain = (torch.relu(torch.einsum("nhd,ned->nhe", q, k)) * 0.25 * w[..., None]).sum(1)
    plain = plain.masked_fill(rows < 0, float("-inf"))
    assert torch.allclose(indexer_scores_ref(q, w, keys, rows, 0.25), plain, atol=1e-5)


# ---- the Triton kernels under the interpreter -------------------------------------------------------------------

if not INTERPRETED:

    def test_triton_kernels_under_interpreter():
        """Re-run this file's kernel tests with TRITON_INTERPRET=1 in a child pytest."""
        repo_root = Path(__file__).resolve().parent.parent
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve()),
             "-k", "kernel_interpreted"],
            cwd=repo_root, env=env, capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, f"interpreted kernel tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]

else:

    @pytest.mark.parametrize("n,hc,dim,dtype", [(5, 4, 64, torch.bfloat16), (3, 2, 48, torch.float32),
                                                (11, 4, 40, torch.bfloat16), (1, 3, 24, torch.float32)])
    def test_kernel_interpreted_hc_pre(n, hc, dim, dtype):
        streams, fn, base, scale = hc_case(n, hc, dim, dtype, seed=n)
        want = hc_pre_ref(streams, fn, base, scale, 20, 1e-6, 1e-6)
        got = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, backend="triton")
        assert_close_ulps(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("n,hc,dim,dtype,wdtype", [(5, 3, 40, torch.bfloat16, torch.bfloat16),
                                                       (9, 3, 300, torch.bfloat16, torch.float32),
                                                       (3, 4, 48, torch.float32, torch.float32),
                                                       (2, 2, 24, torch.float32, torch.bfloat16)])
    def test_kernel_interpreted_hc_pre_out_weight(n, hc, dim, dtype, wdtype):
        streams, fn, base, scale = hc_case(n, hc, dim, dtype, seed=n)
        w = (torch.rand(dim, generator=_gen(dim)) + 0.5).to(wdtype)
        want = hc_pre_ref(streams, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-5)
        got = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, out_weight=w, out_eps=1e-5, backend="triton")
        assert got[0].dtype == want[0].dtype
        # in the streams' ulps: a flipped rounding of the collapse or of the normalised value (the interpreter
        # truncates fp32 -> bf16 where a GPU rounds to nearest)
        assert_close_ulps(got[0].to(dtype), want[0].to(dtype))
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
        # negative control: the same check fails without the weight
        with pytest.raises(AssertionError):
            assert_close_ulps(rms_norm_ref(hc_pre_ref(streams, fn, base, scale, 20, 1e-6, 1e-6)[0], None, 1e-5),
                              want[0].to(dtype))
        if want[0].dtype != dtype:  # the normalised value is rounded to bf16 before the fp32 weight: got / w is bf16
            assert torch.equal((got[0] / w).to(dtype).float() * w, got[0])
            # negative control: normalising the unrounded fp32 collapse without that rounding fails the same check
            unrounded = rms_norm_ref(hc_pre_ref(streams.float(), fn, base, scale, 20, 1e-6, 1e-6)[0], w, 1e-5)
            assert not torch.equal((unrounded / w).to(dtype).float() * w, unrounded)

    @pytest.mark.parametrize("n,hc,dim,dtype", [(5, 4, 64, torch.bfloat16), (3, 3, 48, torch.float32),
                                                (2, 4, 1500, torch.bfloat16)])
    def test_kernel_interpreted_hc_post(n, hc, dim, dtype):
        streams, fn, base, scale = hc_case(n, hc, dim, dtype, seed=n)
        _, post, comb = hc_pre_ref(streams, fn, base, scale, 20, 1e-6, 1e-6)
        out = torch.randn(n, dim, generator=_gen(9)).to(dtype)
        assert_close_ulps(hc_post(out, streams, post, comb, backend="triton"), hc_post_ref(out, streams, post, comb))

    @pytest.mark.parametrize("shape,dtype,wdtype", [((5, 64), torch.bfloat16, torch.bfloat16),
                                                    ((3, 4, 48), torch.float32, None),
                                                    ((7, 100), torch.bfloat16, torch.float32)])
    def test_kernel_interpreted_rms_norm(shape, dtype, wdtype):
        g = _gen(1)
        x = torch.randn(shape, generator=g).to(dtype)
        weight = None if wdtype is None else torch.randn(shape[-1], generator=g).to(wdtype)
        got, want = rms_norm(x, weight, 1e-6, backend="triton"), rms_norm_ref(x, weight, 1e-6)
        if weight is None or weight.dtype == x.dtype:
            assert_close_ulps(got, want)
        else:  # a flipped bf16 rounding of the normalised value, times the fp32 weight
            assert_close_ulps(got.to(dtype), want.to(dtype))

    @pytest.mark.parametrize("t,h,d,r,dtype,inverse", [(5, 4, 64, 8, torch.bfloat16, False),
                                                       (3, 1, 48, 16, torch.float32, True),
                                                       (7, 20, 100, 32, torch.bfloat16, True)])
    def test_kernel_interpreted_rope(t, h, d, r, dtype, inverse):
        g = _gen(t)
        x = torch.randn(t, h, d + 6, generator=g)[..., 3:3 + d].to(dtype)  # a strided view
        ang = torch.rand(t, r, generator=g) * 6
        got = rope_rotate(x, ang.cos(), ang.sin(), inverse, backend="triton")
        assert_close_ulps(got, rope_rotate_ref(x, ang.cos(), ang.sin(), inverse), ulps=1.0)

    @pytest.mark.parametrize("n,d,sweeps", [(9, 16, 4), (12, 40, 6), (1, 8, 1), (7, 300, 3)])
    def test_kernel_interpreted_hca_fold(n, d, sweeps):
        args = fold_case(n, d, seed=n)
        torch.testing.assert_close(hca_fold(*args, sweeps, backend="triton"), hca_fold_ref(*args, sweeps),
                                   rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("n,heads,dim,listed,dtype,w_scale", [(3, 8, 32, 37, torch.bfloat16, 1.0),
                                                                  (5, 64, 128, 70, torch.bfloat16, 0.125),
                                                                  (2, 5, 24, 9, torch.float32, 3.0)])
    def test_kernel_interpreted_indexer_scores(n, heads, dim, listed, dtype, w_scale):
        q, w, keys, rows = indexer_case(n, heads, dim, 300, listed, dtype, seed=listed)
        w = w.to(dtype)  # the model's weights_proj output, scaled inside the op
        want = indexer_scores_ref(q, w, keys, rows, dim ** -0.5, w_scale)
        if w_scale != 1.0:  # the scale is w's: the reference without it differs
            assert not torch.allclose(want[rows >= 0], indexer_scores_ref(q, w, keys, rows, dim ** -0.5)[rows >= 0])
        got = indexer_scores(q, w, poisoned(keys, rows), rows, dim ** -0.5, w_scale, backend="triton")
        assert torch.equal(torch.isinf(got), rows < 0)
        finite = rows >= 0
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("n,width,dtype,off", [(5, 16, torch.bfloat16, 3), (70, 300, torch.float32, 0),
                                                    (1, 7, torch.bfloat16, 6)])
    def test_kernel_interpreted_gather_rows(n, width, dtype, off):
        buf, rows = gather_case(n, width, dtype, seed=n)
        got = gather_rows(poisoned(buf, rows), rows, off, width, backend="triton")
        assert torch.equal(got, gather_rows_ref(buf, rows, off, width))

    def test_kernel_interpreted_attention_reads_only_listed_rows():
        g = _gen(4)
        q = torch.randn(4, 3, 32, generator=g).to(torch.bfloat16)
        kv_a, kv_b = torch.randn(60, 32, generator=g).to(torch.bfloat16), torch.randn(30, 32, generator=g)
        kv_b = kv_b.to(torch.bfloat16)
        idx_a, idx_b = torch.randint(-1, 60, (4, 10), generator=g), torch.randint(-1, 30, (4, 5), generator=g)
        sink = torch.randn(3, generator=g).to(torch.bfloat16)
        idx_a = torch.stack([torch.where(r >= 0, torch.randperm(60, generator=g)[:10], -1) for r in idx_a])
        idx_b = torch.stack([torch.where(r >= 0, torch.randperm(30, generator=g)[:5], -1) for r in idx_b])
        want = tree_sparse_attention_ref(q, kv_a, idx_a, kv_b, idx_b, sink, 0.2)
        got = ops.tree_sparse_attention(q, poisoned(kv_a, idx_a), idx_a, poisoned(kv_b, idx_b), idx_b, sink, 0.2,
                                        backend="triton")
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

    def test_kernel_interpreted_compress_reads_only_listed_rows():
        g = _gen(5)
        kv, score = torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g)
        idx = torch.randint(-1, 40, (3, 8), generator=g)
        col_off = torch.tensor([0] * 4 + [16] * 4)
        ape, norm_w = torch.randn(8, 16, generator=g), torch.rand(16, generator=g) + 0.5
        want = compress_entries_ref(kv, score, idx, col_off, ape, norm_w, 1e-6, None, None)
        got = ops.compress_entries(poisoned(kv, idx), poisoned(score, idx), idx, col_off, ape, norm_w, 1e-6, None,
                                   None, backend="triton")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
