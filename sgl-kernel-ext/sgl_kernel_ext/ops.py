"""The model-facing ops: argument checks, then the Triton/FlashInfer kernel on CUDA tensors, the torch reference
otherwise.

Backend choice, in order: the `backend` argument; the environment variable `SGL_KERNEL_EXT_BACKEND`; "auto".
Values: "auto" (kernels on CUDA, reference elsewhere), "torch", "triton" (also on CPU tensors, which works under
`TRITON_INTERPRET=1`, how the tests run the kernels), "flashinfer" (tree_window_attention only; the other ops treat
it as "triton").

Contracts
---------
tree_sparse_attention(q[N,H,D], kv_a[Sa,D], idx_a[N,Ta], kv_b[Sb,D] | None, idx_b[N,Tb] | None, sink[H], scale)
    -> [N,H,D] in q's dtype. MQA with K = V: every head of node n attends the rows kv_a[idx_a[n, t]] and
    kv_b[idx_b[n, t]] in ONE softmax whose denominator also holds exp(sink[h]) (the sink carries no value).
    idx entries < 0 are padding and may sit anywhere; a list must not repeat a row (each listed row counts once per
    listing). Empty lists are fine; a node with no rows in either source outputs 0. kv_* may be strided views
    (any row stride, any column stride); q/kv in bf16, fp16 or fp32 (q and the kv sources share one dtype); the
    kernel accumulates in fp32. scale multiplies q.k (RoPE and its de-rotation are the caller's).
compress_entries(kv_store[S,*], score_store[S,*], idx[E,R], col_off[R], ape[R,C], norm_w[C], eps,
                 cos[E,rd/2] | None, sin[E,rd/2] | None, out_dtype=None) -> [E,C]
    For each entry e and channel c: softmax over slots j of (score_store[idx[e,j], col_off[j]+c] + ape[j,c]),
    weighted sum of kv_store[idx[e,j], col_off[j]+c]; slots with idx < 0 get weight 0 (an entry with no slot gives
    0). Then y = pooled * rsqrt(mean(pooled^2) + eps) * norm_w, then RoPE on the last rd channels as interleaved
    pairs (2i, 2i+1) with cos/sin of the entry's position (rd = 0 / None: no RoPE). fp32 math; output dtype
    out_dtype or kv_store's. C must be even. HCA: R = r slots, col_off all equal; CSA: R = 8, col_off =
    [0]*4 + [C]*4 over rows laid out [Ca | Cb], ape rows 0..3 = Ca bias, 4..7 = Cb bias. The indexer's compressor
    is the same op at its smaller C.
tree_window_attention(q[N,H,D], kv[S,D], qo_indptr[B+1], kv_indptr[B+1], kv_indices[nnz], mask[sum q_b*k_b],
                      sink[H], scale) -> [N,H,D]
    The MTP draft layer's sliding-window attention in FlashInfer's custom-mask layout: request b's queries
    q[qo_indptr[b]:qo_indptr[b+1]] attend rows kv[kv_indices[kv_indptr[b]:kv_indptr[b+1]]] where the row-major
    [q_b, k_b] block of mask (concatenated request after request) is True; softmax with sink as above.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from . import reference, traffic

_BACKENDS = ("auto", "torch", "triton", "flashinfer")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _backend(requested: str | None, tensor: torch.Tensor, gpu_default: str = "triton") -> str:
    choice = requested or os.environ.get("SGL_KERNEL_EXT_BACKEND", "auto")
    if choice not in _BACKENDS:
        raise ValueError(f"unknown backend {choice!r}; expected one of {_BACKENDS}")
    if choice == "auto":
        return gpu_default if tensor.is_cuda else "torch"
    return choice


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd runs the references (training); the custom ops have no backward and are for inference."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def plain_reference(backend: str | None, tensor: torch.Tensor, *grad_tensors: torch.Tensor | None) -> bool:
    """Whether a call runs its torch reference directly, not through the custom op: under autograd, and on the CPU
    with the torch backend (where the op's dispatch costs more than a small op's work). The custom ops remain for
    CUDA (kernels, capture) and the meta device (their fakes and traffic declarations)."""
    return needs_grad(tensor, *grad_tensors) or (tensor.device.type == "cpu" and _backend(backend, tensor) == "torch")


def _check_index(name: str, idx: torch.Tensor, n_rows: int) -> None:
    if idx.dim() != 2 or idx.shape[0] != n_rows:
        raise ValueError(f"{name} must be [{n_rows}, T], got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {idx.dtype}")


def tree_sparse_attention(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    idx_a: torch.Tensor,
    kv_b: torch.Tensor | None,
    idx_b: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Tree sparse attention over raw-KV rows and compressed entries in one softmax with a sink (see module doc).

    num_splits (Triton only): programs sharing one node's lists, merged afterwards; None picks it from the GPU.
    """
    if q.dim() != 3 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be [N, H, D] float, got {tuple(q.shape)} {q.dtype}")
    n_nodes, num_heads, head_dim = q.shape
    _check_index("idx_a", idx_a, n_nodes)
    if kv_a.dim() != 2 or kv_a.shape[1] != head_dim or kv_a.dtype != q.dtype:
        raise ValueError(f"kv_a must be [S, {head_dim}] {q.dtype}, got {tuple(kv_a.shape)} {kv_a.dtype}")
    if (kv_b is None) != (idx_b is None):
        raise ValueError("kv_b and idx_b come together")
    if kv_b is not None:
        _check_index("idx_b", idx_b, n_nodes)
        if kv_b.dim() != 2 or kv_b.shape[1] != head_dim or kv_b.dtype != q.dtype:
            raise ValueError(f"kv_b must be [S, {head_dim}] {q.dtype}, got {tuple(kv_b.shape)} {kv_b.dtype}")
    if sink.shape != (num_heads,):
        raise ValueError(f"sink must be [{num_heads}], got {tuple(sink.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError("out must match q in shape and dtype")

    if plain_reference(backend, q, kv_a, kv_b, sink):
        return reference.tree_sparse_attention_ref(q, kv_a, idx_a, kv_b, idx_b, sink, scale, out=out)
    result = torch.ops.sgl_kernel_ext.tree_sparse_attention(q, kv_a, idx_a, kv_b, idx_b, sink, float(scale),
                                                            backend, num_splits)
    return result if out is None else out.copy_(result)


@torch.library.custom_op("sgl_kernel_ext::tree_sparse_attention", mutates_args=())
def _tree_sparse_attention_op(q: torch.Tensor, kv_a: torch.Tensor, idx_a: torch.Tensor, kv_b: Optional[torch.Tensor],
                              idx_b: Optional[torch.Tensor], sink: torch.Tensor, scale: float,
                              backend: Optional[str] = None, num_splits: Optional[int] = None) -> torch.Tensor:
    if _backend(backend, q) == "torch":
        return reference.tree_sparse_attention_ref(q, kv_a, idx_a, kv_b, idx_b, sink, scale)
    from .triton_tree_attention import tree_sparse_attention_triton

    return tree_sparse_attention_triton(q, kv_a, idx_a, kv_b, idx_b, sink, scale, num_splits=num_splits)


@_tree_sparse_attention_op.register_fake
def _(q, kv_a, idx_a, kv_b, idx_b, sink, scale, backend=None, num_splits=None):
    return torch.empty_like(q)


@traffic.declare("sgl_kernel_ext::tree_sparse_attention")
def tree_sparse_attention_traffic(q, kv_a, idx_a, kv_b, idx_b, sink, scale, backend=None, num_splits=None):
    """The Triton path: q, the index lists and the sink read once, every listed row once per node that lists it
    (padding included: the bound of a list's reads), the output written once; one launch (a split run adds its
    partial results' round trip and the merge launch, which a fixed-shape decode on a GPU does not need at B = 1
    only when the SMs are already full: counted as one launch here, as the default tiling at the step's sizes)."""
    partial = [(1, idx_a.numel() * kv_a.shape[1] * kv_a.element_size())]
    if kv_b is not None and idx_b is not None:
        partial.append((3, idx_b.numel() * kv_b.shape[1] * kv_b.element_size()))
    read = traffic.nbytes(q) + traffic.nbytes(idx_a) + traffic.nbytes(idx_b) + traffic.nbytes(sink)
    return traffic.Traffic(read + sum(b for _, b in partial), traffic.nbytes(q), 1, tuple(partial))


def compress_entries(
    kv_store: torch.Tensor,
    score_store: torch.Tensor,
    idx: torch.Tensor,
    col_off: torch.Tensor,
    ape: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Per-branch compression: gated pooling of indexed rows + RMSNorm + interleaved RoPE (see module doc)."""
    if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be [E, R] int32/int64, got {tuple(idx.shape)} {idx.dtype}")
    n_entries, n_slots = idx.shape
    if ape.dim() != 2 or ape.shape[0] != n_slots or ape.shape[1] % 2:
        raise ValueError(f"ape must be [{n_slots}, C] with C even, got {tuple(ape.shape)}")
    width = ape.shape[1]
    if col_off.shape != (n_slots,):
        raise ValueError(f"col_off must be [{n_slots}], got {tuple(col_off.shape)}")
    if norm_w.shape != (width,):
        raise ValueError(f"norm_w must be [{width}], got {tuple(norm_w.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin come together")
    if cos is not None and (cos.shape != sin.shape or cos.shape[0] != n_entries or 2 * cos.shape[1] > width):
        raise ValueError(f"cos/sin must be [{n_entries}, rd/2] with rd <= {width}, got {tuple(cos.shape)}")
    if kv_store.dim() != 2 or score_store.dim() != 2:
        raise ValueError("kv_store and score_store must be 2-D [S, row]")
    if out is not None and (out.shape != (n_entries, width) or out.dtype != (out_dtype or kv_store.dtype)):
        raise ValueError("out has the wrong shape or dtype")

    if plain_reference(backend, kv_store, score_store, ape, norm_w):
        return reference.compress_entries_ref(kv_store, score_store, idx, col_off, ape, norm_w, eps, cos, sin,
                                              out_dtype=out_dtype, out=out)
    result = torch.ops.sgl_kernel_ext.compress_entries(kv_store, score_store, idx, col_off, ape, norm_w, float(eps),
                                                       cos, sin, out_dtype or kv_store.dtype, backend)
    return result if out is None else out.copy_(result)


@torch.library.custom_op("sgl_kernel_ext::compress_entries", mutates_args=())
def _compress_entries_op(kv_store: torch.Tensor, score_store: torch.Tensor, idx: torch.Tensor, col_off: torch.Tensor,
                         ape: torch.Tensor, norm_w: torch.Tensor, eps: float, cos: Optional[torch.Tensor],
                         sin: Optional[torch.Tensor], out_dtype: torch.dtype,
                         backend: Optional[str] = None) -> torch.Tensor:
    if _backend(backend, kv_store) == "torch":
        return reference.compress_entries_ref(kv_store, score_store, idx, col_off, ape, norm_w, eps, cos, sin,
                                              out_dtype=out_dtype)
    from .triton_compress import compress_entries_triton

    return compress_entries_triton(kv_store, score_store, idx, col_off, ape, norm_w, eps, cos, sin,
                                   out_dtype=out_dtype)


@_compress_entries_op.register_fake
def _(kv_store, score_store, idx, col_off, ape, norm_w, eps, cos, sin, out_dtype, backend=None):
    return kv_store.new_empty(idx.shape[0], ape.shape[1], dtype=out_dtype)


@traffic.declare("sgl_kernel_ext::compress_entries")
def compress_entries_traffic(kv_store, score_store, idx, col_off, ape, norm_w, eps, cos, sin, out_dtype,
                             backend=None):
    """The Triton path: for each entry and slot one kv and one score row of C channels, the index, the biases,
    the norm weight and the entry's cos/sin read once; the entries written once; one launch."""
    n_entries, width = idx.shape[0], ape.shape[1]
    slots = idx.numel() * width
    partial = ((0, slots * kv_store.element_size()), (1, slots * score_store.element_size()))
    small = sum(traffic.nbytes(t) for t in (idx, col_off, ape, norm_w, cos, sin))
    out_bytes = n_entries * width * torch.empty((), dtype=out_dtype, device="meta").element_size()
    return traffic.Traffic(small + sum(b for _, b in partial), out_bytes, 1, partial)


def tree_mask_to_index_lists(
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """FlashInfer's per-request mask layout -> one -1-padded slot list per query `[N, max k_b]` (vectorised)."""
    device = kv_indices.device
    qo_indptr, kv_indptr = qo_indptr.to(device).long(), kv_indptr.to(device).long()
    q_lens, k_lens = qo_indptr.diff(), kv_indptr.diff()
    n_tokens = int(qo_indptr[-1])
    width = int(k_lens.max()) if k_lens.numel() else 0
    req = torch.repeat_interleave(torch.arange(q_lens.numel(), device=device), q_lens)  # request of each query
    row_in_req = torch.arange(n_tokens, device=device) - qo_indptr[req]
    mask_start = torch.cumsum(q_lens * k_lens, 0) - q_lens * k_lens  # start of each request's mask block
    col = torch.arange(width, device=device)
    in_range = col[None, :] < k_lens[req][:, None]
    flat = mask_start[req][:, None] + row_in_req[:, None] * k_lens[req][:, None] + col[None, :]
    allowed = in_range & mask.to(device).bool()[flat.clamp_max(max(mask.numel() - 1, 0))]
    slots = kv_indices.long()[(kv_indptr[req][:, None] + col[None, :]).clamp_max(max(kv_indices.numel() - 1, 0))]
    return torch.where(allowed, slots, torch.full_like(slots, -1))


def tree_window_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    mask: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """MTP draft layer's sliding-window tree attention in FlashInfer's custom-mask layout (see module doc)."""
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"q must be [N, H, D] and kv [S, D], got {tuple(q.shape)} and {tuple(kv.shape)}")
    if qo_indptr.shape != kv_indptr.shape or int(qo_indptr[-1]) != q.shape[0]:
        raise ValueError("qo_indptr/kv_indptr must be [B+1] with qo_indptr[-1] == N")
    q_lens, k_lens = qo_indptr.long().diff(), kv_indptr.long().diff()
    if mask.numel() != int((q_lens * k_lens).sum()):
        raise ValueError("mask must hold sum(q_b * k_b) booleans")

    choice = _backend(backend, q, gpu_default="flashinfer")
    if choice == "torch":
        return reference.tree_window_attention_ref(
            q, kv, qo_indptr, kv_indptr, kv_indices, mask, sink, scale, out=out
        )
    if choice == "flashinfer" and q.is_cuda:
        from .flashinfer_tree import (
            flashinfer_available,
            tree_window_attention_flashinfer,
        )

        if flashinfer_available():
            try:
                return tree_window_attention_flashinfer(
                    q, kv, qo_indptr, kv_indptr, kv_indices, mask, sink, scale, out=out
                )
            except Exception as exc:  # noqa: BLE001 - e.g. a head dim FlashInfer was not built for
                warnings.warn(f"FlashInfer tree mask path failed ({exc!r}); using the Triton tree kernel", stacklevel=2)
    idx = tree_mask_to_index_lists(qo_indptr, kv_indptr, kv_indices, mask)
    return tree_sparse_attention(q, kv, idx, None, None, sink, scale, out=out, backend="triton")
