"""DeepSeek-V4 (target + MTP) in plain torch over explicit per-slot state; no sglang import.

Modules: ``config`` (both config layouts), ``rope``, ``norm``, ``hyper`` (mHC), ``compressor`` (CSA/HCA compressor
and lightning indexer), ``attention`` (gather + sink softmax over per-query slot lists), ``moe``, ``model``,
``mtp``, ``storage`` (per-slot rows, layouts, slot tables), ``weights`` (DeepSeek / HF naming, FP8), ``runner``
(per-request wrapper), ``tree_state`` (tree verification, isolation, accepted-path commit), ``mtp_draft``
(MTP drafting over a tree, MTP refresh after acceptance).
"""
