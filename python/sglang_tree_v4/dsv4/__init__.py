"""DeepSeek-V4 (target + MTP) in plain torch over explicit per-slot state; no sglang import.

Modules: ``config`` (both config layouts), ``rope``, ``norm``, ``hyper`` (mHC), ``compressor`` (CSA/HCA compressor
and lightning indexer), ``attention`` (gather + sink softmax over per-query slot lists), ``moe``, ``block`` (the V4
block the target and the MTP layer share), ``model``, ``mtp``, ``storage`` (per-slot rows, layouts, slot tables),
``weights`` (DeepSeek / HF naming, FP8), ``runner`` (per-request wrapper), ``tree_state`` (tree verification,
isolation, accepted-path commit). MTP drafting over a tree is ``speculative.mtp_drafter``.
"""
