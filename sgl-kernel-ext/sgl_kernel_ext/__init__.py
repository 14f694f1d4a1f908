"""Kernels for DeepSeek-V4 tree verification: tree sparse attention, per-branch compression, tree-masked window
attention. Each has a torch reference (CPU path, oracle) and a GPU kernel; `ops` picks one by device."""
from .fp8_linear import fp8_block_linear as fp8_block_linear
from .ops import (
    compress_entries,
    tree_mask_to_index_lists,
    tree_sparse_attention,
    tree_window_attention,
)
from .routed_experts import routed_experts as routed_experts

__all__ = ["compress_entries", "tree_mask_to_index_lists", "tree_sparse_attention", "tree_window_attention"]
