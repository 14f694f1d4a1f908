"""The Triton kernels compile for sm_90 (H100/H200) without register spills, checked without a GPU.

Why: the interpreter runs the kernels' logic but not Triton's GPU compiler, so a kernel can pass every interpreter
test and still fail to compile, or spill registers at V4-Flash sizes. Triton compiles ahead of time for a named
target with its bundled ptxas and needs no device; `ptxas -v` then reports registers and spills. Each compile is
done with the launch configuration the wrappers really use (`launch_config`).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreter functions in this process"
)

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sgl_kernel_ext import triton_compress, triton_tree_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _registers_and_spills(kernel) -> tuple[int, int]:
    """Run `ptxas -v` on the kernel's PTX; return (registers, spill store bytes)."""
    if not PTXAS.exists():
        pytest.skip("triton's bundled ptxas is missing")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run(
            [str(PTXAS), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
            capture_output=True, text=True, check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spills


def _compile(fn, signature: dict, constexprs: dict, num_warps: int):
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=TARGET, options={"num_warps": num_warps})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [512, 64])
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split"])
def test_tree_attention_kernel_compiles_without_spills(dtype, head_dim, split):
    block_h, block_t, block_d, num_warps = triton_tree_attention.launch_config(head_dim, dtype)
    signature = {}
    for name in triton_tree_attention._tree_sparse_attention_kernel.arg_names:
        if name in ("q_ptr", "kv_a_ptr", "kv_b_ptr", "out_ptr"):
            signature[name] = "*" + TRITON_DTYPE[dtype]
        elif name in ("idx_a_ptr", "idx_b_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        elif name == "scale":
            signature[name] = "fp32"
        elif name.isupper() or name.startswith("BLOCK_"):
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
    constexprs = dict(HAS_B=True, SPLIT=split, DOT_FP32=dtype == torch.float32,
                      BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_D=block_d)
    kernel = _compile(triton_tree_attention._tree_sparse_attention_kernel, signature, constexprs, num_warps)
    registers, spills = _registers_and_spills(kernel)
    assert spills == 0, f"{registers} registers, {spills} bytes spilled"


def test_merge_kernel_compiles_without_spills():
    _, _, block_d, num_warps = triton_tree_attention.launch_config(512, torch.bfloat16)
    signature = {}
    for name in triton_tree_attention._merge_splits_kernel.arg_names:
        if name.startswith("part_"):
            signature[name] = "*fp32"
        elif name == "out_ptr":
            signature[name] = "*bf16"
        elif name.startswith("BLOCK_"):
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
    kernel = _compile(triton_tree_attention._merge_splits_kernel, signature, dict(BLOCK_H=16, BLOCK_D=block_d),
                      num_warps)
    assert _registers_and_spills(kernel)[1] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width,n_slots", [(512, 128), (512, 8), (128, 8)], ids=["hca", "csa", "indexer"])
def test_compress_kernel_compiles_without_spills(dtype, width, n_slots):
    block_r, block_p, num_warps = triton_compress.launch_config(width, n_slots)
    signature = {}
    for name in triton_compress._compress_entries_kernel.arg_names:
        if name in ("kv_ptr", "score_ptr", "out_ptr"):
            signature[name] = "*" + TRITON_DTYPE[dtype]
        elif name == "idx_ptr":
            signature[name] = "*i32"
        elif name == "col_off_ptr":
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        elif name == "eps":
            signature[name] = "fp32"
        elif name.isupper() or name.startswith("BLOCK_"):
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
    kernel = _compile(triton_compress._compress_entries_kernel, signature,
                      dict(HAS_ROPE=True, BLOCK_R=block_r, BLOCK_P=block_p), num_warps)
    assert _registers_and_spills(kernel)[1] == 0
