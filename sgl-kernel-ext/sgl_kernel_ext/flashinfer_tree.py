"""GPU path of the MTP draft layer's tree attention: FlashInfer's batch prefill with a custom (tree) mask.

Why FlashInfer here: the MTP layer is sliding-window only, so each request's attention is a small dense block
(its committed window rows plus its tree nodes) under an ancestors-or-self mask, exactly what FlashInfer's
custom-mask prefill computes. Pool rows are addressed through a paged KV view with page size 1, so
`kv_indices` are plain slot numbers and nothing is copied. K = V: the same pool tensor is passed as both caches.

The sink is applied after the kernel from the returned log-sum-exp (natural base): with a sink logit s_h,
softmax-with-sink output = o * exp(lse) / (exp(lse) + exp(s_h)) = o * sigmoid(lse - s_h). This needs no sink
support from the kernel variant that serves custom masks.

Only used on CUDA tensors and only when `flashinfer` imports; `ops.tree_window_attention` falls back to the
Triton tree kernel when this path is unavailable or raises.
"""
from __future__ import annotations

import torch

_WORKSPACE_BYTES = 128 * 1024 * 1024
_wrappers: dict[torch.device, object] = {}


def flashinfer_available() -> bool:
    """True when flashinfer imports and a CUDA device exists."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _wrapper(device: torch.device):
    import flashinfer

    if device not in _wrappers:
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _wrappers[device] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    return _wrappers[device]


def tree_window_attention_flashinfer(
    q: torch.Tensor,
    kv: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    mask: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `reference.tree_window_attention_ref`; `kv` is `[S, D]` with unit column stride."""
    if kv.stride(1) != 1:
        raise ValueError("FlashInfer reads pool rows with unit column stride")
    num_heads, head_dim = q.shape[1], q.shape[2]
    batch = qo_indptr.numel() - 1
    device = q.device
    wrapper = _wrapper(device)
    # page size 1: one pool row per page, so every page is full and the last page length is 1
    pages = kv.unsqueeze(1).unsqueeze(1)  # [S, page_size=1, kv_heads=1, D], keeps the pool's row stride
    wrapper.plan(
        qo_indptr.to(device=device, dtype=torch.int32),
        kv_indptr.to(device=device, dtype=torch.int32),
        kv_indices.to(device=device, dtype=torch.int32),
        torch.ones(batch, dtype=torch.int32, device=device),
        num_heads,
        1,
        head_dim,
        1,
        custom_mask=mask.to(device=device, dtype=torch.bool),
        sm_scale=float(scale),
        q_data_type=q.dtype,
        kv_data_type=kv.dtype,
    )
    o, lse = wrapper.run(q, (pages, pages), return_lse=True, lse_base="ln")
    gate = torch.sigmoid(lse.float() - sink.float().view(1, -1))
    result = (o.float() * gate[..., None]).to(q.dtype)
    if out is None:
        return result
    return out.copy_(result)
