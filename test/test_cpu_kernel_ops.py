"""The pure-torch sgl_kernel CPU ops against straightforward per-element references."""

from __future__ import annotations

import torch

from sglang_tree_v4.cpu import kernel_ops
from sglang_tree_v4.tree.synthetic import random_parents


def _links_reference(parents: list[int]) -> tuple[list[int], list[int]]:
    n = len(parents)
    first = [next((k for k in range(i + 1, n) if parents[k] == i), -1) for i in range(n)]
    sibling = [next((k for k in range(i + 1, n) if parents[k] == parents[i]), -1) if parents[i] >= 0 else -1
               for i in range(n)]
    return first, sibling


def test_reconstruct_indices_from_tree_mask():
    gen = torch.Generator().manual_seed(0)
    bs, n = 6, 9
    parents = torch.cat([random_parents(2, n, shape, gen) for shape in ("chain", "star", "random")])
    anc = torch.eye(n, dtype=torch.bool).repeat(bs, 1, 1)
    for b in range(bs):
        for i in range(1, n):
            anc[b, i] |= anc[b, int(parents[b, i])]
    seq = torch.randint(3, 50, (bs,), generator=gen)
    out = [torch.full((bs * n,), -7, dtype=torch.long) for _ in range(4)]
    kernel_ops.reconstruct_indices_from_tree_mask(anc.flatten(), seq, *out, bs, n)
    positions, index, first, sibling = (o.view(bs, n) for o in out)
    for b in range(bs):
        assert positions[b].tolist() == [int(seq[b]) + int(anc[b, i].sum()) - 1 for i in range(n)]
        assert index[b].tolist() == list(range(b * n, (b + 1) * n))
        want_first, want_sibling = _links_reference(parents[b].tolist())
        assert first[b].tolist() == want_first and sibling[b].tolist() == want_sibling


def test_copy_all_layer_kv_cache_moves_whole_rows():
    buffers = [torch.randn(20, 3, 4), torch.randn(20, 1, 7)]
    before = [b.clone() for b in buffers]
    ptrs = torch.tensor([b.data_ptr() for b in buffers])
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers])
    tgt, src = torch.tensor([2, 3, 4]), torch.tensor([3, 4, 9])  # overlapping: 3 and 4 are read and written
    kernel_ops.copy_all_layer_kv_cache(ptrs, strides, tgt, src)
    for b, old in zip(buffers, before, strict=False):
        want = old.clone()
        want[tgt] = old[src]
        assert torch.equal(b, want)


def test_ragged_cache_loc_ops_round_trip():
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    rpi, start, end = torch.tensor([2, 0]), torch.tensor([3, 5]), torch.tensor([6, 7])
    out = torch.zeros(5, dtype=torch.int64)
    kernel_ops.assign_extend_cache_locs(rpi, req_to_token, start, end, out, 10)
    assert out.tolist() == [23, 24, 25, 5, 6]
    table = torch.zeros(4, 10, dtype=torch.int32)
    kernel_ops.assign_req_to_token_pool(rpi, table, start, end, out, 10)
    assert table[2, 3:6].tolist() == [23, 24, 25] and table[0, 5:7].tolist() == [5, 6] and int(table.sum()) == 83
