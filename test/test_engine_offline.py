"""The offline ``sglang.Engine(..., speculative_algorithm="TREE_V4")`` path, against our own model's plain greedy
decoding (the non-speculative ground truth, computed without SGLang)."""

from __future__ import annotations

import pytest
import torch

from sglang_tree_v4 import prompts
from sglang_tree_v4.dsv4.runner import DSV4Runner
from sglang_tree_v4.dsv4.weights import load_model
from support import tiny_v4

pytestmark = pytest.mark.server
NEW_TOKENS = 24


def reference_greedy(model_path, prompt_ids: list[int], n: int) -> list[int]:
    runner = DSV4Runner(load_model(str(model_path)), num_slots=1024, max_len=512, max_reqs=2)
    rid = runner.add_request()
    logits = runner.extend([rid], [prompt_ids])[0].logits[-1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = runner.decode([rid], [out[-1]])[0].logits[-1]
    return out


def test_engine_tree_v4_greedy_equals_plain_decoding(tmp_path):
    import sglang

    model = tiny_v4.build(tmp_path / "tinyv4")
    engine = sglang.Engine(model_path=str(model), speculative_algorithm="TREE_V4", device="cpu",
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
    for prompt_ids, out in zip(ids, outs):
        assert out["output_ids"] == reference_greedy(model, prompt_ids, NEW_TOKENS)
        assert out["meta_info"]["spec_verify_ct"] > 0
