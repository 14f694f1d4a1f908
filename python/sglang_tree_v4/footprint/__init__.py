"""The footprint report (``python -m sglang_tree_v4.footprint``): parameter bytes per rank (``__main__``) and the
attention state per token and per request (``state``)."""
