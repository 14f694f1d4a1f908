"""The offline ``sglang.Engine(..., speculative_algorithm="TREE_V4")`` path on the embedded trained model (its drafts
are accepted), against our own model's plain greedy decoding (the non-speculative ground truth, computed without
SGLang)."""

from __future__ import annotations

import pytest
import torch

from sglang_tree_v4.testing import prompts
from support.served import EMBEDDED, reference_greedy
from support.serving_checks import assert_speculation_exercised

pytestmark = pytest.mark.server
NEW_TOKENS = 24


def test_engine_tree_v4_greedy_equals_plain_decoding():
    import sglang
    engine = sglang.Engine(model_path=str(EMBEDDED), speculative_algorithm="TREE_V4", device="cpu",
                           max_total_tokens=8192, speculative_num_draft_tokens=5, speculative_eagle_topk=2,
                           speculative_num_steps=3)
    try:
        texts = [r["question"] for r in prompts.gsm8k("test")[:3]]
        ids = [engine.tokenizer_manager.tokenizer.encode(t) for t in texts]
        outs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                               "ignore_eos": True})
    finally:
        engine.shutdown()
    torch.set_num_threads(1)
    for prompt_ids, out in zip(ids, outs, strict=False):
        assert out["output_ids"] == reference_greedy(EMBEDDED, prompt_ids, NEW_TOKENS)
    assert_speculation_exercised(outs)
