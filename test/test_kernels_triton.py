"""The Triton kernels, run by Triton's CPU interpreter, against the torch references.

Why a child process: `TRITON_INTERPRET=1` must be set before `triton.jit` decorates the kernels and must not leak
into other tests of the same pytest run (they import torch/triton too). So when this file is collected without the
variable, it holds a single test that re-runs this same file in a fresh pytest process with the variable set; inside
that process the real kernel tests below are defined and run. Running the whole suite with TRITON_INTERPRET=1
already set runs them directly.

Each check: fresh random inputs (seed in the failure message), the output buffer poisoned with NaN so an element
the kernel never writes fails, relative error (max |out - ref| / max |ref|) <= 1e-5 for fp32 and <= 1e-2 for bf16
against the reference computed in fp32.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


if not INTERPRETED:

    def test_triton_kernels_under_interpreter():
        """Re-run this file with TRITON_INTERPRET=1 in a child pytest; it fails if any kernel check fails."""
        repo_root = Path(__file__).resolve().parent.parent
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
            cwd=repo_root, env=env, capture_output=True, text=True, timeout=900,
        )
        assert proc.returncode == 0, f"interpreted kernel tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]

else:
    from sgl_kernel_ext import ops
    from sgl_kernel_ext.cases import attention_case, compress_case, rel_err, window_case
    from sgl_kernel_ext.reference import (
        compress_entries_ref,
        tree_sparse_attention_ref,
        tree_window_attention_ref,
    )

    @pytest.fixture
    def seed() -> int:
        value = int.from_bytes(os.urandom(4), "little")
        torch.manual_seed(value)
        return value

    def _fp32_copy(case: dict) -> dict:
        """The same inputs upcast to fp32 (index tensors and None untouched): the oracle's view of a bf16 case."""
        return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in case.items()}

    ATTENTION = [
        # n_nodes, heads, dim, t_a, t_b, empty_nodes, ragged
        pytest.param(1, 4, 64, 16, 0, (), True, id="single-node-one-source"),
        pytest.param(6, 4, 64, 20, 9, (), True, id="tiny-ragged"),
        pytest.param(5, 4, 64, 17, 33, (1, 4), True, id="tiny-empty-nodes"),
        pytest.param(3, 4, 64, 0, 12, (), True, id="empty-raw-source"),
        pytest.param(4, 8, 32, 16, 16, (), False, id="full-lists"),
        pytest.param(1, 64, 512, 128, 512, (), False, id="v4flash-n1"),
        pytest.param(2, 64, 512, 128, 512, (), True, id="v4flash-n2-ragged"),
    ]

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("n_nodes,heads,dim,t_a,t_b,empty,ragged", ATTENTION)
    def test_tree_sparse_attention_kernel(n_nodes, heads, dim, t_a, t_b, empty, ragged, dtype, seed):
        case = attention_case(n_nodes, heads, dim, t_a, t_b, dtype=dtype, ragged=ragged, empty_nodes=empty)
        out = torch.full(case["q"].shape, float("nan"), dtype=dtype)
        got = ops.tree_sparse_attention(**case, out=out, backend="triton")
        assert got.data_ptr() == out.data_ptr()
        want = tree_sparse_attention_ref(**_fp32_copy(case))
        assert not torch.isnan(got).any(), f"unwritten output (seed={seed})"
        assert rel_err(got, want) <= TOLERANCE[dtype], f"rel err {rel_err(got, want):.3g} (seed={seed})"
        for n in empty:
            assert torch.all(got[n] == 0), f"seed={seed}"

    SPLITS = [
        # n_nodes, heads, dim, t_a, t_b, empty_nodes, num_splits
        pytest.param(4, 4, 64, 40, 70, (1,), 3, id="tiny-3-splits"),
        pytest.param(3, 4, 64, 10, 0, (), 4, id="more-splits-than-tiles"),
        pytest.param(2, 4, 64, 0, 0, (), 2, id="all-empty"),
        pytest.param(2, 64, 512, 128, 512, (), 5, id="v4flash-5-splits"),
    ]

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("n_nodes,heads,dim,t_a,t_b,empty,num_splits", SPLITS)
    def test_tree_sparse_attention_kernel_split_lists(n_nodes, heads, dim, t_a, t_b, empty, num_splits, dtype, seed):
        """Flash-decoding mode (several programs per node, merged by a second kernel), forced on the CPU."""
        case = attention_case(n_nodes, heads, dim, t_a, t_b, dtype=dtype, empty_nodes=empty)
        out = torch.full(case["q"].shape, float("nan"), dtype=dtype)
        ops.tree_sparse_attention(**case, out=out, backend="triton", num_splits=num_splits)
        want = tree_sparse_attention_ref(**_fp32_copy(case))
        assert not torch.isnan(out).any(), f"unwritten output (seed={seed})"
        assert rel_err(out, want) <= TOLERANCE[dtype], f"rel err {rel_err(out, want):.3g} (seed={seed})"
        for n in empty:
            assert torch.all(out[n] == 0), f"seed={seed}"

    def test_tree_sparse_attention_kernel_strided_query_and_output(seed):
        """q and out as views with non-unit strides (heads interleaved with other data) are honoured."""
        case = attention_case(3, 4, 64, 10, 6)
        case["q"] = torch.randn(3, 8, 64)[:, ::2]
        out = torch.full((3, 4, 128), float("nan"))[:, :, 32:96]
        ops.tree_sparse_attention(**case, out=out, backend="triton")
        assert rel_err(out, tree_sparse_attention_ref(**case)) <= 1e-5, f"seed={seed}"

    COMPRESS = [
        # n_entries, kind, width, ratio, rope_dims, empty_prev_window, empty_entries
        pytest.param(1, "hca", 64, 8, 16, (), (), id="hca-single-entry"),
        pytest.param(5, "hca", 64, 8, 16, (), (2,), id="hca-empty-entry"),
        pytest.param(6, "csa", 64, 4, 16, (0, 3), (), id="csa-first-window"),
        pytest.param(7, "csa", 32, 4, 8, (1,), (), id="indexer-compressor"),
        pytest.param(3, "hca", 48, 6, 0, (), (), id="no-rope-odd-ratio"),
        pytest.param(2, "hca", 512, 128, 64, (), (), id="v4flash-hca"),
        pytest.param(2, "csa", 512, 4, 64, (0,), (), id="v4flash-csa"),
        pytest.param(2, "csa", 128, 4, 64, (), (), id="v4flash-indexer"),
    ]

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("n_entries,kind,width,ratio,rope_dims,prev_empty,all_empty", COMPRESS)
    def test_compress_entries_kernel(n_entries, kind, width, ratio, rope_dims, prev_empty, all_empty, dtype, seed):
        case = compress_case(n_entries, kind, width, ratio, rope_dims, dtype=dtype, empty_prev_window=prev_empty,
                             empty_entries=all_empty)
        out = torch.full((n_entries, width), float("nan"), dtype=dtype)
        ops.compress_entries(**case, out=out, backend="triton")
        want = compress_entries_ref(**_fp32_copy(case))
        assert not torch.isnan(out).any(), f"unwritten output (seed={seed})"
        assert rel_err(out, want) <= TOLERANCE[dtype], f"rel err {rel_err(out, want):.3g} (seed={seed})"
        for e in all_empty:
            assert torch.all(out[e] == 0), f"seed={seed}"

    def test_compress_entries_kernel_fp32_output_from_bf16_store(seed):
        case = compress_case(3, "csa", 64, 4, 16, dtype=torch.bfloat16)
        out = torch.full((3, 64), float("nan"))
        ops.compress_entries(**case, out_dtype=torch.float32, out=out, backend="triton")
        assert rel_err(out, compress_entries_ref(**_fp32_copy(case))) <= 1e-5, f"seed={seed}"

    WINDOW = [(1, 1, 4, 64, 8), (3, 6, 4, 64, 16), (2, 8, 64, 512, 128)]

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("batch,nodes,heads,dim,window", WINDOW)
    def test_tree_window_attention_triton_path(batch, nodes, heads, dim, window, dtype, seed):
        """The CPU-testable GPU fallback of the MTP op: tree mask -> slot lists -> the tree attention kernel."""
        case = window_case(batch, nodes, heads, dim, window, dtype=dtype)
        out = torch.full(case["q"].shape, float("nan"), dtype=dtype)
        ops.tree_window_attention(**case, out=out, backend="triton")
        want = tree_window_attention_ref(**_fp32_copy(case))
        assert not torch.isnan(out).any(), f"unwritten output (seed={seed})"
        assert rel_err(out, want) <= TOLERANCE[dtype], f"rel err {rel_err(out, want):.3g} (seed={seed})"
