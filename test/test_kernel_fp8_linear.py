"""The FP8 block-scaled linear op (``sgl_kernel_ext.fp8_block_linear``): reference, Triton kernel, custom op.

* the torch reference against dequantising the whole matrix and one fp32 matmul (every scale dtype, shards at
  block offsets, padding, leading batch dimensions), and its bitwise fp8 decode against torch's on all 256 codes;
* the Triton kernel, run by Triton's CPU interpreter in a child pytest (as in ``test_kernels_triton``), against
  the reference: fp32 x to fp32 rounding, bf16 / fp16 x to one unit in the last place of the output, unwritten
  outputs poisoned with NaN;
* the traffic declaration: scale blocks (and x columns) the shard does not touch are NaN and must not reach the
  output, and the declared bytes equal a hand count;
* the fake: output shape and dtype on the meta device; the kernel compiles for sm_90 without register spills.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from sgl_kernel_ext import fp8_block_linear, traffic
from sgl_kernel_ext.weight_formats import (
    E8M0_DTYPE,
    FP8_BLOCK,
    FP8_DTYPE,
    _e4m3_as_half,
    dequantize_fp8,
    e8m0_to_float,
    fp8_block_matmul,
    quantize_fp8_block,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SCALE_KINDS = ["e8m0", "e8m0-bytes", "fp32", "bf16", "fp32-any"]  # fp32-any: not powers of two
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def make_case(lead: tuple[int, ...], n: int, k: int, offsets: tuple[int, int], scale_kind: str,
              x_dtype: torch.dtype = torch.float32, poison: bool = False, seed: int = 0) -> dict:
    """A shard ``[n, k]`` of a larger FP8 matrix starting one block in, at ``offsets`` inside its first block, with
    its scale as a view of the full scale tensor. ``poison``: every scale block the shard does not touch is NaN
    (0xFF for e8m0) and the scale handed over runs to the end of the full tensor (more rows and columns than the
    shard needs); x is a column slice of a wider tensor whose other columns are NaN."""
    g = torch.Generator().manual_seed(seed)
    r0, c0 = FP8_BLOCK + offsets[0], FP8_BLOCK + offsets[1]
    full = torch.randn(r0 + n + 150, c0 + k + 150, generator=g) * 0.05
    full_w, full_s = quantize_fp8_block(full)
    scale = e8m0_to_float(full_s)
    if scale_kind == "fp32-any":
        scale = scale * (0.5 + torch.rand(scale.shape, generator=g))
    (r_lo, r_hi), (c_lo, c_hi) = (1, (r0 + n - 1) // FP8_BLOCK + 1), (1, (c0 + k - 1) // FP8_BLOCK + 1)
    if poison:
        keep = torch.zeros_like(scale, dtype=torch.bool)
        keep[r_lo:r_hi, c_lo:c_hi] = True
        scale = scale.masked_fill(~keep, float("nan"))
    stored = {"e8m0": lambda s: s.to(E8M0_DTYPE), "e8m0-bytes": lambda s: s.to(E8M0_DTYPE).view(torch.uint8),
              "bf16": lambda s: s.to(torch.bfloat16)}.get(scale_kind, lambda s: s)(scale)
    if poison and scale_kind.startswith("e8m0"):
        stored.view(torch.uint8)[~keep] = 0xFF
    stored = stored[r_lo:, c_lo:] if poison else stored[r_lo:r_hi, c_lo:c_hi]
    wide = torch.randn(*lead, k + 24, generator=g).to(x_dtype)
    if poison:
        wide[..., :8] = float("nan")
        wide[..., 8 + k:] = float("nan")
    x = wide[..., 8:8 + k]
    weight = full_w[r0:r0 + n, c0:c0 + k]  # a strided view: reading past K would pick up the neighbours' values
    dense = dequantize_fp8(full_w, scale)[r0:r0 + n, c0:c0 + k]
    return dict(x=x, weight=weight, scale=stored, offsets=offsets, dense=dense)


def dense_product(case: dict) -> torch.Tensor:
    """The contract computed the plain way: the whole matrix dequantised, one fp32 matmul."""
    return case["x"].float() @ case["dense"].t()


def assert_close(got: torch.Tensor, ref32: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """fp32: max error <= 1e-5 of max |ref| (fp32 rounding of a K-term sum); half precision: within one unit in
    the last place of each element (a rounding boundary may go either way), plus the fp32 slack near 0."""
    assert got.dtype == dtype and got.shape == ref32.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    slack = 1e-5 * ref32.abs().max().item()
    err = (got.double() - ref32.double()).abs()
    bound = slack + (ULP[dtype] * ref32.double().abs() if dtype in ULP else 0.0)
    assert (err <= bound).all(), f"{what}: worst error {(err - bound).max().item():.3g} over the bound"


# ---- the reference ---------------------------------------------------------------------------------------------

def test_e4m3_decode_matches_torch_on_every_code():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    got, want = _e4m3_as_half(codes).float() * 256.0, codes.float()
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().sum() == 2
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])
    assert torch.equal(torch.signbit(got[~want.isnan()]), torch.signbit(want[~want.isnan()]))  # -0 stays -0


SHAPES = [
    # lead dims of x, N, K, offsets
    pytest.param((1,), 200, 300, (0, 0), id="m1-padded"),
    pytest.param((37,), 130, 260, (0, 0), id="m37-padded"),
    pytest.param((2, 3, 5), 256, 384, (0, 0), id="batched-aligned"),
    pytest.param((37,), 300, 260, (50, 72), id="m37-tp-shard"),
    pytest.param((1,), 77, 129, (127, 1), id="m1-tp-shard-edges"),
]


@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
@pytest.mark.parametrize("lead,n,k,offsets", SHAPES)
def test_reference_matches_dequantise_whole(lead, n, k, offsets, scale_kind):
    case = make_case(lead, n, k, offsets, scale_kind)
    ref32 = dense_product(case)
    got = fp8_block_matmul(case["x"], case["weight"], case["scale"], offsets)
    assert got.shape == (*lead, n)
    assert_close(got, ref32, torch.float32, "reference vs dequantise-whole")
    for dtype in (torch.bfloat16, torch.float16):  # the op's torch path: the fp32 result rounded once
        x = case["x"].to(dtype)
        want = fp8_block_matmul(x.float(), case["weight"], case["scale"], offsets).to(dtype)
        assert torch.equal(fp8_block_linear(x, case["weight"], case["scale"], offsets, backend="torch"), want)


@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
def test_reference_reads_only_the_touched_blocks(scale_kind):
    clean = make_case((37,), 300, 260, (50, 72), scale_kind)
    dirty = make_case((37,), 300, 260, (50, 72), scale_kind, poison=True)
    assert dirty["scale"].shape[0] > clean["scale"].shape[0] and dirty["scale"].shape[1] > clean["scale"].shape[1]
    want = fp8_block_linear(clean["x"], clean["weight"], clean["scale"], (50, 72), backend="torch")
    got = fp8_block_linear(dirty["x"], dirty["weight"], dirty["scale"], (50, 72), backend="torch")
    assert torch.equal(got, want)


def test_empty_inputs():
    w = torch.zeros(5, 20, dtype=FP8_DTYPE)
    s = torch.ones(1, 1)
    assert fp8_block_linear(torch.randn(0, 20), w, s).shape == (0, 5)
    assert fp8_block_linear(torch.randn(3, 20), w[:0], s).shape == (3, 0)


def test_argument_checks():
    w, s = torch.zeros(200, 300, dtype=FP8_DTYPE), torch.ones(2, 3)
    fp8_block_linear(torch.randn(2, 300), w, s)
    with pytest.raises(ValueError, match="scale"):
        fp8_block_linear(torch.randn(2, 300), w, torch.ones(2, 2))
    with pytest.raises(ValueError, match="scale"):
        fp8_block_linear(torch.randn(2, 300), w, s, (100, 0))  # 300 rows from offset 100 touch 3 blocks
    with pytest.raises(ValueError, match="offsets"):
        fp8_block_linear(torch.randn(2, 300), w, torch.ones(4, 4), (128, 0))
    with pytest.raises(ValueError, match="weight"):
        fp8_block_linear(torch.randn(2, 300), w.float(), s)
    with pytest.raises(ValueError, match="x must"):
        fp8_block_linear(torch.randn(2, 301), w, s)


# ---- custom op: fake, traffic ----------------------------------------------------------------------------------

def test_fake_gives_shape_and_dtype_on_meta():
    w = torch.empty(7168, 4096, dtype=FP8_DTYPE, device="meta")
    for scale in (torch.empty(56, 32, device="meta"), torch.empty(56, 32, dtype=torch.uint8, device="meta")):
        for x in (torch.empty(4, 37, 4096, dtype=torch.bfloat16, device="meta"),
                  torch.empty(5, 4096, dtype=torch.float32, device="meta")):
            y = fp8_block_linear(x, w, scale)
            assert y.is_meta and y.shape == (*x.shape[:-1], 7168) and y.dtype == x.dtype


def test_fp8_block_linear_module_on_meta_and_cpu():
    from sglang_tree_v4.checkpoint.quantized_modules import FP8BlockLinear

    meta = FP8BlockLinear(300, 200, device="meta")
    y = meta(torch.empty(2, 3, 300, dtype=torch.bfloat16, device="meta"))
    assert y.is_meta and y.shape == (2, 3, 200) and y.dtype == torch.bfloat16
    lin = FP8BlockLinear(300, 200)
    case = make_case((3,), 200, 300, (0, 0), "fp32")
    lin.weight.copy_(case["weight"])
    lin.scale.copy_(case["scale"])
    assert_close(lin(case["x"]), dense_product(case), torch.float32, "FP8BlockLinear")


def test_declared_traffic_is_the_hand_count():
    case = make_case((2, 37), 300, 260, (50, 72), "fp32", x_dtype=torch.bfloat16, poison=True)
    x, w, s = case["x"], case["weight"], case["scale"]
    args = (x, w, s, 50, 72, None)
    # x 74 x 260 bf16 + weight 300 x 260 fp8 + the 3 x 3 fp32 scale blocks rows [50, 350) x cols [72, 332) touch
    # (the handed-over scale is larger); output 74 x 300 bf16; one launch
    want = traffic.Traffic(74 * 260 * 2 + 300 * 260 + 3 * 3 * 4, 74 * 300 * 2, 1)
    assert traffic.declared("sgl_kernel_ext::fp8_block_linear", args, {}) == want
    # leading dimensions that cannot be flattened into a view cost one copy of x
    xt = torch.randn(37, 2, 260, dtype=torch.bfloat16).transpose(0, 1)
    copy = traffic.Traffic(74 * 260 * 2, 74 * 260 * 2, 1)
    assert traffic.declared("sgl_kernel_ext::fp8_block_linear", (xt, w, s, 50, 72, None), {}) == want + copy


def test_op_is_registered_with_its_schema():
    schema = str(torch.ops.sgl_kernel_ext.fp8_block_linear.default._schema)
    assert schema.startswith("sgl_kernel_ext::fp8_block_linear(Tensor x, Tensor weight, Tensor scale")


# ---- the kernel compiles for sm_90 -----------------------------------------------------------------------------

def _launch_variants() -> list:
    """Every (tile config, x dtype, STRADDLE) the wrapper can pick for an H100 / H200 (132 SMs) at V4-like shapes.
    Per row tile, x dtype and STRADDLE the widest BLOCK_N (the most registers) is in the fast tier, the rest slow."""
    from sgl_kernel_ext.triton_fp8_linear import launch_config

    seen = {}
    for dtype in (torch.bfloat16, torch.float32):
        for m in (1, 16, 17, 32, 33, 64, 65, 4096):
            for n in (512, 4096, 32768):
                for off_c in (0, 64, 50):
                    cfg = launch_config(m, n, dtype, sms=132, off_c=off_c)
                    key = (cfg, dtype, off_c % cfg[2] != 0)
                    seen.setdefault(key, f"m{m}-n{n}-offc{off_c}-{str(dtype)[6:]}")
    widest = {}
    for cfg, dtype, straddle in seen:
        group = (cfg[0], dtype, straddle)
        widest[group] = max(widest.get(group, 0), cfg[1])
    return [pytest.param(*key, id=name, marks=() if key[0][1] == widest[(key[0][0], key[1], key[2])]
                         else pytest.mark.slow) for key, name in seen.items()]


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreter functions in this process")
@pytest.mark.parametrize("cfg,dtype,straddle", _launch_variants())
def test_kernel_compiles_for_sm90_pipelined_without_spills(cfg, dtype, straddle):
    """Compiled as a launch specialises it (unit strides constant, pointers and leading strides 16-aligned): the
    loads must be pipelined (cp.async) and nothing spilled."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_kernel_ext import triton_fp8_linear as kern

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton's bundled ptxas is missing")
    block_m, block_n, block_k, num_warps, num_stages = cfg
    names = kern._fp8_block_linear_kernel.arg_names
    constexprs = dict(SCALE_E8M0=straddle, DOT_FP32=dtype == torch.float32, STRADDLE=straddle,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                      x_stride_k=1, w_stride_k=1, s_stride_c=1, out_stride_n=1)
    x_type = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    pointers = {"x_ptr": x_type, "out_ptr": x_type, "w_ptr": "*fp8e4nv", "s_ptr": "*u8" if straddle else "*fp32"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in names}
    aligned = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "x_stride_m", "w_stride_n", "out_stride_m", "N", "K")
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=kern._fp8_block_linear_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert "async_copy_global_to_local" in compiled.asm["ttgir"], "the K loop's loads are not pipelined"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    assert spills == 0, report


# ---- the Triton kernel under the interpreter -------------------------------------------------------------------

if not INTERPRETED:

    @pytest.mark.parametrize("group", ["shapes", "not shapes"])
    def test_triton_kernel_under_interpreter(group):
        """Re-run this file's kernel tests (one group) with TRITON_INTERPRET=1 in a child pytest."""
        repo_root = Path(__file__).resolve().parent.parent
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve()),
             "-k", f"kernel_interpreted and ({group})"],
            cwd=repo_root, env=env, capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, f"interpreted kernel tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]

else:
    from sgl_kernel_ext.triton_fp8_linear import fp8_block_linear_triton

    def run_kernel(case: dict) -> torch.Tensor:
        """The kernel into a NaN-filled output (an element it never writes stays NaN and fails the check)."""
        x = case["x"]
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.full((x2.shape[0], case["weight"].shape[0]), float("nan"), dtype=x.dtype)
        fp8_block_linear_triton(x2, case["weight"], case["scale"], *case["offsets"], out=out)
        return out.view(*x.shape[:-1], -1)

    def reference32(case: dict) -> torch.Tensor:
        return fp8_block_matmul(case["x"].float(), case["weight"], case["scale"], case["offsets"])

    def test_kernel_interpreted_through_the_op():
        """backend="triton" reaches the kernel through the custom op (leading dims kept, x's dtype out)."""
        case = make_case((2, 3), 130, 200, (5, 100), "e8m0", x_dtype=torch.bfloat16)
        got = fp8_block_linear(case["x"], case["weight"], case["scale"], case["offsets"], backend="triton")
        assert got.shape == (2, 3, 130) and got.dtype == torch.bfloat16
        assert torch.equal(got, run_kernel(case))

    @pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("lead,n,k,offsets", SHAPES)
    def test_kernel_interpreted_shapes(lead, n, k, offsets, x_dtype):
        case = make_case(lead, n, k, offsets, "e8m0", x_dtype=x_dtype)
        assert_close(run_kernel(case), reference32(case), x_dtype, f"kernel {lead} {n}x{k} at {offsets}")

    @pytest.mark.parametrize("scale_kind,x_dtype", [(kind, torch.bfloat16) for kind in SCALE_KINDS]
                             + [("fp32-any", torch.float32), ("e8m0-bytes", torch.float32)],
                             ids=[f"{kind}-bf16" for kind in SCALE_KINDS] + ["fp32-any-fp32", "e8m0-bytes-fp32"])
    def test_kernel_interpreted_scales(scale_kind, x_dtype):
        case = make_case((37,), 300, 260, (50, 72), scale_kind, x_dtype=x_dtype)
        assert_close(run_kernel(case), reference32(case), x_dtype, f"kernel, {scale_kind} scales")

    @pytest.mark.parametrize("scale_kind", ["e8m0", "fp32"])
    def test_kernel_interpreted_poison(scale_kind):
        """Untouched scale blocks NaN, the scale larger than needed, x a slice between NaN columns: the output is
        the clean one, bit for bit."""
        clean = make_case((37,), 300, 260, (50, 72), scale_kind, x_dtype=torch.bfloat16)
        dirty = make_case((37,), 300, 260, (50, 72), scale_kind, x_dtype=torch.bfloat16, poison=True)
        assert torch.equal(run_kernel(dirty), run_kernel(clean))

    def test_kernel_interpreted_halves():
        case = make_case((3, 4), 140, 200, (5, 100), "bf16", x_dtype=torch.float16)
        assert_close(run_kernel(case), reference32(case), torch.float16, "kernel, fp16 x")

    def test_kernel_interpreted_large_m():
        """M spanning several M tiles of the prefill tile table, N and K ragged, a shard inside its blocks."""
        case = make_case((130,), 140, 200, (3, 9), "e8m0", x_dtype=torch.bfloat16)
        assert_close(run_kernel(case), reference32(case), torch.bfloat16, "kernel, M = 130")
