"""``--tp 2`` on the CPU: a TREE_V4 server whose two ranks each hold the whole model must emit exactly plain
greedy decoding (our model without SGLang is the ground truth) on the embedded trained model, whose drafts are
accepted, and serve sampled requests."""

from __future__ import annotations

import pytest

from sglang_tree_v4 import launcher as srv, prompts
from support.serving_checks import assert_speculation_exercised
from test_engine_offline import EMBEDDED, reference_greedy

pytestmark = pytest.mark.server


def test_tp2_tree_v4_greedy_equals_plain_decoding(tmp_path):
    server = srv.launch(EMBEDDED, ["--device", "cpu", "--tp", "2", "--max-total-tokens", "8192",
                                   "--speculative-algorithm", "TREE_V4", "--speculative-num-draft-tokens", "6",
                                   "--speculative-eagle-topk", "3", "--speculative-num-steps", "3"],
                        tmp_path / "tp2.log")
    try:
        srv.wait_healthy(server)
        outs = []
        for record in prompts.gsm8k("test")[:3]:
            ids = server.post("/tokenize", {"prompt": record["question"]}).json()["tokens"]
            out = server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                                         "ignore_eos": True}})
            assert out["output_ids"] == reference_greedy(EMBEDDED, ids, 24)
            outs.append(out)
        assert_speculation_exercised(outs)
        sampled = server.generate({"text": ["Tom has"] * 8,
                                   "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}})
        assert [len(o["output_ids"]) for o in sampled] == [16] * 8
        assert "TP1" in server.log.read_text()  # two ranks really ran
    finally:
        server.stop()
