"""Kernels for DeepSeek-V4 tree verification: tree sparse attention, per-branch compression, tree-masked window
attention. Each has a torch reference (CPU path, oracle) and a GPU kernel; `ops` picks one by device."""
from .ops import (
    compress_entries,
    tree_mask_to_index_lists,
    tree_sparse_attention,
    tree_window_attention,
)

__all__ = ["compress_entries", "tree_mask_to_index_lists", "tree_sparse_attention", "tree_window_attention"]
