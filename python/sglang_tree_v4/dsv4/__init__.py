"""DeepSeek-V4 (target + MTP) in plain torch over explicit per-slot state; no sglang import.

Modules: ``config`` (both config layouts), ``rope``, ``norm``, ``hyper`` (mHC), ``compressor`` (CSA compressor and
lightning indexer), ``hca_compressor`` (HCA's running state), ``attention`` (gather + sink softmax over per-query
slot lists), ``moe``, ``block`` (the V4 block the target and the MTP layer share), ``model``, ``mtp``, ``storage``
(per-slot rows, layouts, slot tables), ``entry_codec`` (fp8 entries), ``tree_state`` (tree verification, isolation,
accepted-path commit), ``verify_step`` (the fixed-shape verify forward). Loading, quantization and sharding are
``checkpoint/``; MTP drafting over a tree is ``speculative.mtp_drafter``.
"""
