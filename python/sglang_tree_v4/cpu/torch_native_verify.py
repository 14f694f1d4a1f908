"""Target verification with a tree mask for SGLang's ``torch_native`` attention backend.

In 0.5.23 the torch_native backend (the one a CPU without AMX gets) has no TARGET_VERIFY path:
its extend code needs ``extend_prefix_lens``, which verification leaves unset. We wrap
``forward_extend``: in TARGET_VERIFY each request's N draft tokens attend the committed prefix
(``seq_lens`` tokens) plus their tree ancestors-or-self, given by ``spec_info.custom_mask`` in
either of SGLang's layouts (per-request [N, N] blocks, or [N, prefix + N] "full" blocks); without a
mask the drafts form a chain. Every other mode goes to the original method.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"


def _tree_masks(spec_info, seq_lens: list[int], n: int) -> list[torch.Tensor]:
    """Per request, the bool [n, n] ancestors-or-self mask of its draft tokens."""
    bs = len(seq_lens)
    mask = getattr(spec_info, "custom_mask", None)
    if mask is None:
        return [torch.ones(n, n, dtype=torch.bool).tril()] * bs
    mask = mask.bool()
    if mask.numel() == bs * n * n:
        return list(mask.view(bs, n, n).unbind(0))
    out, offset = [], 0
    for prefix in seq_lens:
        block = mask[offset : offset + n * (prefix + n)].view(n, prefix + n)
        out.append(block[:, prefix:])
        offset += n * (prefix + n)
    return out


def verify_forward_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND hook body: tree-masked SDPA over the committed prefix plus the draft tokens."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
    spec_info = forward_batch.spec_info
    n = spec_info.draft_token_num
    seq_lens = forward_batch.seq_lens.tolist()
    heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    q_ = q.view(-1, n, heads, layer.qk_head_dim)
    out = q.new_empty(q_.shape[0], n, heads, layer.v_head_dim)
    k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = self.req_to_token_pool.req_to_token
    window = layer.sliding_window_size if (layer.sliding_window_size or -1) > 0 else None
    for b, (row, prefix, tree) in enumerate(zip(forward_batch.req_pool_indices.tolist(), seq_lens,
                                                _tree_masks(spec_info, seq_lens, n), strict=False)):
        slots = req_to_token[row, : prefix + n].long()
        keys = k_cache[slots].to(q.dtype).transpose(0, 1)
        values = v_cache[slots].to(q.dtype).transpose(0, 1)
        mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree], dim=1)
        if window is not None:
            depth = tree.sum(1) - 1
            key_pos = torch.cat([torch.arange(prefix), prefix + depth])
            mask &= key_pos[None, :] > (prefix + depth)[:, None] - window
        o = scaled_dot_product_attention(
            q_[b].transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask, scale=layer.scaling, enable_gqa=heads != kv_heads)
        out[b] = o.squeeze(0).transpose(0, 1)
    return out.view(-1, heads * layer.v_head_dim)
