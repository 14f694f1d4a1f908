"""The ops on CUDA tensors (the kernels the model really uses there) against the torch references.

Why: the interpreter tests cannot run the half-precision tensor-core dots, the flash-decoding split heuristic or
FlashInfer; these checks do, on whatever GPU the suite lands on. Skipped without CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch

from sgl_kernel_ext import ops
from sgl_kernel_ext.cases import attention_case, compress_case, rel_err, window_case
from sgl_kernel_ext.reference import (
    compress_entries_ref,
    tree_sparse_attention_ref,
    tree_window_attention_ref,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a CUDA device"
)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture
def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


def _fp32_copy(case: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in case.items()}


GPU_ATTENTION = [(6, 4, 64, 20, 9), (8, 64, 512, 128, 512), (320, 64, 512, 128, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_nodes,heads,dim,t_a,t_b", GPU_ATTENTION)
def test_tree_sparse_attention_on_gpu(n_nodes, heads, dim, t_a, t_b, dtype, seed):
    case = attention_case(n_nodes, heads, dim, t_a, t_b, dtype=dtype, device="cuda", empty_nodes=(1,))
    out = torch.full(case["q"].shape, float("nan"), dtype=dtype, device="cuda")
    ops.tree_sparse_attention(**case, out=out)
    want = tree_sparse_attention_ref(**_fp32_copy(case))
    assert rel_err(out, want) <= TOLERANCE[dtype], f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,width,ratio", [("csa", 512, 4), ("csa", 128, 4), ("hca", 512, 128)])
def test_compress_entries_on_gpu(kind, width, ratio, dtype, seed):
    case = compress_case(40, kind, width, ratio, 64, dtype=dtype, device="cuda", empty_prev_window=(0,))
    out = torch.full((40, width), float("nan"), dtype=dtype, device="cuda")
    ops.compress_entries(**case, out=out)
    assert rel_err(out, compress_entries_ref(**_fp32_copy(case))) <= TOLERANCE[dtype], f"seed={seed}"


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
@pytest.mark.parametrize("heads,dim,window", [(4, 64, 16), (64, 512, 128)])
def test_tree_window_attention_on_gpu(backend, heads, dim, window, seed):
    case = window_case(4, 8, heads, dim, window, dtype=torch.bfloat16, device="cuda")
    if backend == "flashinfer":
        from sgl_kernel_ext.flashinfer_tree import tree_window_attention_flashinfer

        got = tree_window_attention_flashinfer(**case)
    else:
        got = ops.tree_window_attention(**case, backend="triton")
    assert rel_err(got, tree_window_attention_ref(**_fp32_copy(case))) <= 1e-2, f"seed={seed}"
