"""Pure-torch versions of the ``torch.ops.sgl_kernel.*_cpu`` ops SGLang's speculative path calls.

PyPI's sgl_kernel is a CUDA build: its Python wrappers exist, but the CPU ops behind them are only
in a source-built CPU wheel. On a plain CPU, KV-pool warm-up and every speculative round (NGRAM,
TREE_V4) call the ops below. Each one is registered only if the op is absent, so a real CPU build
of sgl_kernel always wins. Semantics follow SGLang's Triton kernels of the same name.
"""

from __future__ import annotations

import ctypes

import torch

_LIBRARY: torch.library.Library | None = None


def copy_all_layer_kv_cache(data_ptrs: torch.Tensor, strides: torch.Tensor,
                            tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every buffer (base pointer, bytes per slot): slot rows ``tgt`` become rows ``src``.

    All sources are read before any target is written, so overlapping moves are safe.
    """
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=False):
        raw = (ctypes.c_uint8 * (rows * row_bytes)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, row_bytes)
        buf[tgt] = buf[src].clone()


def _ragged_positions(req_pool_indices, start, end):
    """(row of req_to_token, column) for every token of every request's [start, end) span."""
    lens = (end - start).long()
    rows = torch.repeat_interleave(req_pool_indices.long(), lens)
    first = torch.repeat_interleave(start.long(), lens)
    offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    return rows, first + offsets


def assign_extend_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset,
                             out_cache_loc, pool_len: int) -> None:
    """out_cache_loc = concatenation of req_to_token[r, start:end] over the requests."""
    rows, cols = _ragged_positions(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset,
                             out_cache_loc, pool_len: int) -> None:
    """The inverse of ``assign_extend_cache_locs``: scatter slots into the request rows."""
    rows, cols = _ragged_positions(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def fill_accept_out_cache_loc(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Slots of the accepted nodes (accept_index != -1), packed to the front in order."""
    flat = accept_index.flatten().long()
    picked = out_cache_loc[flat[flat != -1]]
    accept_out_cache_loc[: picked.numel()] = picked.to(accept_out_cache_loc.dtype)


def fill_bonus_tokens(accept_tokens, accept_lens, bonus_tokens, accept_stride: int) -> None:
    """Bonus token of each request = its last accepted token (accept_lens counts the bonus)."""
    idx = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.flatten()[idx].to(bonus_tokens.dtype))


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index,
                                       retrive_next_token, retrive_next_sibling,
                                       batch_size: int, draft_token_num: int) -> None:
    """Positions and first-child / next-sibling links from an ancestors-or-self mask [bs, n, n]."""
    n = draft_token_num
    node = torch.arange(n)
    anc = tree_mask.view(batch_size, n, n).bool() & (node[None, :] < node[:, None])  # [b, i, j]: j anc of i
    depth = anc.sum(-1)
    positions.view(batch_size, n).copy_(depth + verified_seq_len.view(-1, 1).long())
    retrive_index.view(batch_size, n).copy_(torch.arange(batch_size * n).view(batch_size, n))
    parent = torch.where(anc, node, -1).amax(-1)  # [b, i]
    child_of = parent[:, :, None] == node[None, None, :]  # [b, k, i]: k is a child of i
    first_child = torch.where(child_of, node[None, :, None], n).amin(1)
    retrive_next_token.view(batch_size, n).copy_(torch.where(first_child < n, first_child, -1))
    later_sibling = (parent[:, :, None] == parent[:, None, :]) & (node[:, None] > node[None, :])
    later_sibling &= (parent >= 0)[:, None, :]  # [b, k, i]: k is a later sibling of i
    next_sib = torch.where(later_sibling, node[None, :, None], n).amin(1)
    retrive_next_sibling.view(batch_size, n).copy_(torch.where(next_sib < n, next_sib, -1))


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling, target_predict) -> None:
    """Walk each tree from the root, following the child equal to the target's argmax."""
    bs, _ = candidates.shape
    max_accept = accept_index.shape[1]
    cand, target = candidates.tolist(), target_predict.flatten().tolist()
    index, first, sibling = retrive_index.tolist(), retrive_next_token.tolist(), retrive_next_sibling.tolist()
    for b in range(bs):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        while accepted + 1 < max_accept:
            child = first[b][node]
            while child != -1 and cand[b][child] != target[last]:
                child = sibling[b][child]
            if child == -1:
                break
            predicts[last] = target[last]
            accepted += 1
            last = index[b][child]
            accept_index[b, accepted] = last
            node = child
        accept_token_num[b] = accepted
        predicts[last] = target[last]


_OPS = {
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        copy_all_layer_kv_cache),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()",
        assign_extend_cache_locs),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()",
        assign_req_to_token_pool),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()",
        fill_accept_out_cache_loc),
    "fill_bonus_tokens_cpu": (
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride) -> ()",
        fill_bonus_tokens),
    "reconstruct_indices_from_tree_mask_cpu": (
        "(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, Tensor(b!) retrive_index, "
        "Tensor(c!) retrive_next_token, Tensor(d!) retrive_next_sibling, int batch_size, "
        "int draft_token_num) -> ()",
        reconstruct_indices_from_tree_mask),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, Tensor candidates, "
        "Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
        "Tensor target_predict) -> ()",
        verify_tree_greedy),
}


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.sgl_kernel, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register_missing() -> list[str]:
    """Register every op above that sgl_kernel does not provide; return the names added."""
    global _LIBRARY
    import sgl_kernel  # noqa: F401  (a real CPU build registers its ops on import)

    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")
    added = []
    for name, (schema, fn) in _OPS.items():
        if _has_op(name):
            continue
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CPU")
        added.append(name)
    return added
