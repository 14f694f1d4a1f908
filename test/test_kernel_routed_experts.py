"""``routed_experts``: the grouped MoE op that reads only the routed experts' weights (dense, FP4, FP8).

* The torch reference against a plain computation (every expert dequantised, a Python loop over the pairs), and
  the op's gradients against autograd through that loop.
* The Triton path, run by Triton's CPU interpreter in a child pytest (as in ``test_kernels_triton``:
  ``TRITON_INTERPRET=1`` must be set before the kernels are decorated and must not leak into other tests), against
  the reference at shapes that pad every tile (D, I not multiples of the blocks, N k not a multiple of BLOCK_M) with
  pairs routed to other ranks' experts.
* Unrouted experts are never read. Poison: their weights and scales set to NaN (FP4: scale byte 0xFF, which e8m0
  reads as 2^128 = inf, so every product with it is inf or NaN) leave the output bit for bit unchanged, on both
  paths. The poison only sees reads whose values reach the output, so the negative control is a kernel that runs
  every held expert over every token and weights the unrouted ones by 0 (0 * NaN = NaN): poison catches it. (The
  old dequantise-everything code is no such control: it read every expert but its grouped matmul gave unrouted
  experts no rows, so their NaN never reached the output.) Under the interpreter every address a kernel loads is
  also recorded: none lies in an unrouted expert's bytes, and the recorder does see the routed experts' bytes.
* The fake (meta) and the traffic declaration; the kernels compile for sm_90 without register spills.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_kernel_ext import traffic
from sgl_kernel_ext.cases import rel_err
from sgl_kernel_ext.routed_experts import dequantize_expert, routed_experts, routed_experts_ref
from sgl_kernel_ext.weight_formats import E8M0_DTYPE, quantize_fp4, quantize_fp8_block

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
FORMATS = ["dense", "fp4", "fp8"]
# per format: (D, I) that pad the 64-wide tiles (fp4 needs multiples of 32; fp8 also pads its 128-blocks)
DIMS = {"dense": (72, 40), "fp4": (96, 160), "fp8": (200, 136)}
LIMIT = 1.0  # small enough that gate and up both hit the clamp


def _stack(fmt: str, n: int, out: int, inp: int, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    mats = [torch.randn(out, inp) * scale for _ in range(n)]
    if fmt == "dense":
        return torch.stack(mats), None
    quant = quantize_fp4 if fmt == "fp4" else quantize_fp8_block
    parts = [quant(m) for m in mats]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def make_case(fmt: str, n: int, k: int, held: int, dim: int, inter: int, dtype=torch.float32,
              routed: tuple[int, ...] | None = None, ranks: int = 3, rank: int = 1) -> dict:
    """The op's arguments: ``held`` local experts of a ``ranks * held``-expert model on rank ``rank``; each token
    routed to k distinct experts, drawn from the other ranks' and the local experts ``routed`` (all if None);
    each of ``routed`` gets at least one pair."""
    first = rank * held
    local = range(held) if routed is None else routed
    allowed = [e for e in range(ranks * held) if not first <= e < first + held] + [first + e for e in local]
    allowed = torch.tensor(allowed)
    idx = torch.stack([allowed[torch.randperm(len(allowed))[:k]] for _ in range(n)])
    for i, e in enumerate(local):
        if i < n and not (idx[i] == first + e).any():
            idx[i, 0] = first + e
    w1, s1 = _stack(fmt, held, inter, dim, 1 / dim**0.5 * 2)
    w3, s3 = _stack(fmt, held, inter, dim, 1 / dim**0.5 * 2)
    w2, s2 = _stack(fmt, held, dim, inter, 1 / inter**0.5)
    return dict(x=torch.randn(n, dim).to(dtype), idx=idx, weights=torch.rand(n, k).to(dtype), first=first, fmt=fmt,
                w1=w1, w3=w3, w2=w2, s1=s1, s3=s3, s2=s2, limit=LIMIT)


def poison(case: dict, routed: tuple[int, ...]) -> dict:
    """The same case with every other local expert's weights and scales made NaN/inf."""
    out = dict(case)
    held = case["w1"].shape[0]
    dead = [e for e in range(held) if e not in routed]
    for name in ("w1", "w3", "w2", "s1", "s3", "s2"):
        t = case[name]
        if t is None:
            continue
        t = t.clone()
        if t.dtype in (torch.uint8, torch.int8) or t.dtype == E8M0_DTYPE:
            if name.startswith("s"):  # fp4 weights have no NaN code; their scales do
                t.view(torch.uint8)[dead] = 0xFF
        else:
            t[dead] = float("nan")
        out[name] = t
    return out


def dense_loop(case: dict) -> torch.Tensor:
    """Every expert dequantised, then the contract evaluated pair by pair in Python."""
    x, idx, wts, first = case["x"], case["idx"], case["weights"], case["first"]
    held = case["w1"].shape[0]
    mats = {n: [dequantize_expert(case["fmt"], case[n], case["s" + n[1]], e).to(x.dtype) for e in range(held)]
            for n in ("w1", "w3", "w2")}
    out = torch.zeros(x.shape, dtype=torch.float32)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[n, j]) - first
            if not 0 <= e < held:
                continue
            g, u = x[n] @ mats["w1"][e].t(), x[n] @ mats["w3"][e].t()
            h = torch.nn.functional.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT)
            out[n] += wts[n, j].float() * (h @ mats["w2"][e].t()).float()
    return out.to(x.dtype)


def every_expert(case: dict) -> torch.Tensor:
    """A correct MoE that reads every held expert: each one over all tokens, weighted by a dense [N, E] routing
    matrix that is 0 where a token does not use the expert (the negative control for the poison test)."""
    x, held = case["x"], case["w1"].shape[0]
    local = case["idx"] - case["first"]
    dense_w = torch.zeros(x.shape[0], held)
    for j in range(local.shape[1]):
        mine = (local[:, j] >= 0) & (local[:, j] < held)
        dense_w[mine, local[mine, j]] = case["weights"][mine, j].float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(held):
        w1, w3, w2 = (dequantize_expert(case["fmt"], case[n], case["s" + n[1]], e).to(x.dtype)
                      for n in ("w1", "w3", "w2"))
        h = torch.nn.functional.silu((x @ w1.t()).clamp(max=LIMIT)) * (x @ w3.t()).clamp(-LIMIT, LIMIT)
        out += dense_w[:, e, None] * (h @ w2.t()).float()
    return out.to(x.dtype)


def _run(case: dict, backend: str) -> torch.Tensor:
    return routed_experts(**case, backend=backend)


@pytest.fixture
def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


# ---- the torch reference ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_matches_dense_loop(fmt, dtype, seed):
    case = make_case(fmt, 9, 3, 4, *DIMS[fmt], dtype=dtype)
    got, want = _run(case, "torch"), dense_loop(case)
    assert got.dtype == dtype and got.shape == case["x"].shape
    assert rel_err(got, want) <= TOLERANCE[dtype], f"rel err {rel_err(got, want):.3g} (seed={seed})"


@pytest.mark.parametrize("fmt", ["dense", "fp4"])
def test_gradients_match_the_dense_loop(fmt, seed):
    """The op's autograd formula (used by full-sequence training): gradients for x, the routing weights and, for
    dense experts, the expert weights equal autograd through the plain loop."""
    case = make_case(fmt, 6, 3, 4, *DIMS[fmt])
    names = ["x", "weights"] + (["w1", "w3", "w2"] if fmt == "dense" else [])
    grads = []
    for fn in (lambda c: routed_experts(**c), dense_loop):
        leaves = {n: case[n].clone().requires_grad_() for n in names}
        out = fn(dict(case, **leaves))
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[1])).sum(), list(leaves.values())))
    for name, got, want in zip(names, *grads, strict=True):
        assert rel_err(got, want) <= 1e-5, f"{name}: rel err {rel_err(got, want):.3g} (seed={seed})"


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_never_reads_unrouted_experts(fmt, seed):
    routed = (0, 2)
    case = make_case(fmt, 8, 3, 5, *DIMS[fmt], dtype=torch.bfloat16, routed=routed)
    clean, dirty = _run(case, "torch"), _run(poison(case, routed), "torch")
    assert not clean.isnan().any() and torch.equal(clean, dirty), f"seed={seed}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_poison_catches_a_kernel_that_reads_every_expert(fmt, seed):
    """Negative control: the every-expert MoE is right on clean weights and NaN on poisoned ones."""
    routed = (0, 2)
    case = make_case(fmt, 6, 2, 4, *DIMS[fmt], routed=routed)
    assert rel_err(every_expert(case), routed_experts_ref(**case)) <= 1e-5, f"seed={seed}"
    assert every_expert(poison(case, routed)).isnan().any()


def test_reference_pairs_on_other_ranks_add_nothing(seed):
    """A rank none of whose experts is routed to returns zeros, and a pair's weight counts only where its expert
    is held here (a NaN weight on another rank's pair changes nothing)."""
    case = make_case("fp4", 5, 2, 4, 64, 32, routed=())
    assert torch.equal(_run(case, "torch"), torch.zeros(5, 64))
    case = make_case("fp4", 5, 2, 4, 64, 32, routed=(1,))
    off = (case["idx"] < case["first"]) | (case["idx"] >= case["first"] + 4)
    nan_w = dict(case, weights=torch.where(off, float("nan"), case["weights"]))
    assert torch.equal(_run(case, "torch"), _run(nan_w, "torch")), f"seed={seed}"


# ---- fake, checks, traffic ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_on_meta(fmt):
    case = make_case(fmt, 4, 2, 3, *DIMS[fmt], dtype=torch.bfloat16)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = routed_experts(**meta)
    assert out.is_meta and out.shape == (4, DIMS[fmt][0]) and out.dtype == torch.bfloat16


def test_argument_checks():
    case = make_case("fp4", 4, 2, 3, 64, 32)
    with pytest.raises(ValueError, match="s1"):
        routed_experts(**dict(case, s1=None))
    with pytest.raises(ValueError, match="w2"):
        routed_experts(**dict(case, w2=case["w2"][:, :, :8]))
    with pytest.raises(ValueError, match="fmt"):
        routed_experts(**dict(case, fmt="fp6"))
    with pytest.raises(ValueError, match="weights"):
        routed_experts(**dict(case, weights=case["weights"][:, :1]))


def test_declared_traffic_by_hand():
    """fp32 x [3, 64], idx int64 [3, 2], FP4 experts (E = 4, I = 32) as meta tensors: 6 pairs, so all 4 experts
    can be routed; with E = 8 and one token only 2 can."""
    case = make_case("fp4", 3, 2, 4, 64, 32)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    got = traffic.declared("sgl_kernel_ext::routed_experts", (), meta)
    x, idx, wts = 3 * 64 * 4, 3 * 2 * 8, 3 * 2 * 4
    expert = 32 * 32 + 32 * 32 + 64 * 16 + 32 * 2 + 32 * 2 + 64 * 1  # w1, w3, w2 packed + e8m0 scales
    counts, order, h, y = 4 * 4, 6 * 4, 6 * 32 * 4, 6 * 64 * 4
    assert got == traffic.Traffic(read=x + idx + wts + 4 * expert, written=x + counts + order + h + y, launches=4)
    assert got.read == 13896 and got.written == 3112

    case = make_case("fp4", 1, 2, 8, 64, 32, ranks=1, rank=0)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    got = traffic.declared("sgl_kernel_ext::routed_experts", (), meta)
    assert got.read == 64 * 4 + 2 * 8 + 2 * 4 + 2 * expert


# ---- the Triton path under the interpreter ------------------------------------------------------------------------
if not INTERPRETED:
    # child runs of a few seconds each: per format, the fp32 and the bf16 comparisons, and the other tests
    CHILD_RUNS = {}
    for fmt in FORMATS:
        CHILD_RUNS[f"{fmt}-fp32"] = f"interpreted and matches and {fmt} and not bf16"
        CHILD_RUNS[f"{fmt}-bf16"] = f"interpreted and matches and {fmt} and bf16"
        CHILD_RUNS[f"{fmt}-reads"] = f"interpreted and {fmt} and not matches"

    # the fast tier keeps one comparison and one read check; the other child runs are the slow tier's
    FAST_RUNS = ("fp4-bf16", "fp8-reads")

    @pytest.mark.parametrize("selection", [s if s in FAST_RUNS else pytest.param(s, marks=pytest.mark.slow)
                                           for s in CHILD_RUNS])
    def test_triton_path_under_interpreter(selection):
        """Re-run part of this file's interpreted tests with TRITON_INTERPRET=1 in a child pytest."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", CHILD_RUNS[selection],
             str(Path(__file__).resolve())],
            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900,
        )
        assert proc.returncode == 0, f"interpreted tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]

    # ---- the kernels compile for sm_90 (H100/H200) without register spills, no GPU needed ----------------------
    import re
    import tempfile

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_kernel_ext import triton_routed_experts as tre

    PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    WEIGHT_TYPE = {"dense": "*bf16", "fp4": "*u8", "fp8": "*fp8e4nv"}
    SCALE_TYPE = {"dense": "*bf16", "fp4": "*u8", "fp8": "*fp32"}

    def _spills(fn, signature: dict, constexprs: dict, num_warps: int) -> tuple[int, int]:
        """Compile for sm_90 with Triton's bundled ptxas; (registers, spill-store bytes) from ``ptxas -v``."""
        if not PTXAS.exists():
            pytest.skip("triton's bundled ptxas is missing")
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "kernel.ptx"
            ptx.write_text(kernel.asm["ptx"])
            report = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                                    capture_output=True, text=True, check=True).stderr
        return (int(re.search(r"Used (\d+) registers", report).group(1)),
                int(re.search(r"(\d+) bytes spill stores", report).group(1)))

    def _signature(fn, types: dict) -> dict:
        out = {}
        for name in fn.arg_names:
            if name.isupper() or name.startswith("BLOCK_"):
                out[name] = "constexpr"
            else:
                out[name] = types.get(name, "*i32" if name.endswith("_ptr") else "i32")
        return out

    # V4-Flash at TP4 (64 experts held, D 4096): a decode-sized verify (96 pairs) and a 512-token one
    LAUNCHES = [pytest.param(96, torch.bfloat16, id="P96-bf16"), pytest.param(3072, torch.bfloat16, id="P3072-bf16"),
                pytest.param(3072, torch.float32, id="P3072-fp32")]

    @pytest.mark.parametrize("kernel", ["_gate_up_kernel", "_down_kernel"])
    @pytest.mark.parametrize("pairs,dtype", LAUNCHES)
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_gemm_kernels_compile_without_spills(fmt, pairs, dtype, kernel):
        cfg = tre.LaunchConfig(pairs, 64, 4096, dtype)
        act = "*bf16" if dtype == torch.bfloat16 else "*fp32"
        fn = getattr(tre, kernel)
        types = {"x_ptr": act, "h_ptr": act, "y_ptr": act, "limit": "fp32"}
        types |= {f"{w}_ptr": WEIGHT_TYPE[fmt] for w in ("w1", "w3", "w2")}
        types |= {f"{s}_ptr": SCALE_TYPE[fmt] for s in ("s1", "s3", "s2")}
        constexprs = dict(FMT=tre.FORMATS[fmt], SCALE_E8M0=fmt == "fp4", KIND=tre._KINDS[dtype],
                          DOT_FP32=dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          BLOCK_K=cfg.block_k, BLOCK_E=cfg.block_e)
        registers, spills = _spills(fn, _signature(fn, types), constexprs, cfg.num_warps)
        assert spills == 0, f"BLOCK_M={cfg.block_m}: {registers} registers, {spills} bytes spilled"

    @pytest.mark.parametrize("held", [64, 256, 512])
    def test_sort_and_combine_kernels_compile_without_spills(held):
        cfg = tre.LaunchConfig(3072, held, 4096)
        sort = tre._sort_pairs_kernel
        registers, spills = _spills(sort, _signature(sort, {"idx_ptr": "*i64"}),
                                    dict(BLOCK_P=cfg.block_p, BLOCK_E=cfg.block_e), cfg.sort_warps)
        assert spills == 0, f"sort, {held} experts: {registers} registers, {spills} bytes spilled"
        comb = tre._combine_kernel
        types = {"idx_ptr": "*i64", "y_ptr": "*bf16", "wt_ptr": "*bf16", "out_ptr": "*bf16"}
        registers, spills = _spills(comb, _signature(comb, types), dict(KIND=1, BLOCK_D=cfg.block_d), 4)
        assert spills == 0, f"combine: {registers} registers, {spills} bytes spilled"

else:
    import numpy as np
    from triton.runtime import interpreter

    SHAPES = [
        # tokens, top-k, held experts
        pytest.param(7, 3, 5, id="N7-k3-E5"),
        pytest.param(19, 4, 6, id="N19-k4-E6"),
    ]

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("n,k,held", SHAPES)
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_interpreted_triton_matches_reference(fmt, n, k, held, dtype, seed):
        case = make_case(fmt, n, k, held, *DIMS[fmt], dtype=dtype)
        got, want = _run(case, "triton"), _run(case, "torch")
        assert got.dtype == dtype and not got.isnan().any(), f"seed={seed}"
        assert rel_err(got, want) <= TOLERANCE[dtype], f"rel err {rel_err(got, want):.3g} (seed={seed})"

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_interpreted_triton_e8m0_scales_and_idle_rank(fmt, seed):
        """The other storage forms of the same values: FP8 scales as float32 (quantize_fp8_block gives e8m0), FP4
        weights and scales as uint8 bytes (as ``FP4Experts`` keeps them); a rank with no routed pair returns 0."""
        case = make_case(fmt, 5, 2, 3, *DIMS[fmt])
        if fmt == "fp8":
            case = dict(case, **{s: case[s].float() for s in ("s1", "s3", "s2")})
        elif fmt == "fp4":
            case = dict(case, **{s: case[s].view(torch.uint8) for s in ("w1", "w3", "w2", "s1", "s3", "s2")})
        assert rel_err(_run(case, "triton"), _run(case, "torch")) <= 1e-5, f"seed={seed}"
        idle = make_case(fmt, 5, 2, 3, *DIMS[fmt], routed=())
        assert torch.equal(_run(idle, "triton"), torch.zeros(5, DIMS[fmt][0]))

    class LoadRecorder:
        """Every address the interpreted kernels load (masked-off lanes excluded)."""

        def __init__(self, monkeypatch):
            self.addresses = []
            original = interpreter.InterpreterBuilder.create_masked_load

            def load(builder, ptrs, mask, other, *args):
                self.addresses.append(np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)].ravel())
                return original(builder, ptrs, mask, other, *args)

            monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", load)

        def touched(self, t: torch.Tensor, e: int) -> bool:
            """Whether any load fell in expert e's bytes of the stacked tensor t."""
            per = t[0].numel() * t.element_size()
            lo = t.data_ptr() + e * t.stride(0) * t.element_size()
            seen = np.concatenate(self.addresses) if self.addresses else np.zeros(0, dtype=np.uint64)
            return bool(((seen >= lo) & (seen < lo + per)).any())

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_interpreted_triton_never_reads_unrouted_experts(fmt, seed, monkeypatch):
        routed = (1, 3)
        case = make_case(fmt, 11, 3, 5, *DIMS[fmt], dtype=torch.bfloat16, routed=routed)
        clean = _run(case, "triton")
        dirty_case = poison(case, routed)
        recorder = LoadRecorder(monkeypatch)
        dirty = _run(dirty_case, "triton")
        assert not clean.isnan().any() and torch.equal(clean, dirty), f"seed={seed}"
        stacks = [dirty_case[n] for n in ("w1", "w3", "w2", "s1", "s3", "s2") if dirty_case[n] is not None]
        for e in range(5):
            used = [recorder.touched(t, e) for t in stacks]
            assert used == [e in routed] * len(stacks), (fmt, e, used)  # the routed ones: the recorder works
