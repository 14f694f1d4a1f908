"""The step-cost report (``python -m sglang_tree_v4.step_cost``): what one TREE_V4 round moves on one TP rank,
counted on the meta device (``counter``) over the round's device work (``round``)."""
