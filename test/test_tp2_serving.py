"""``--tp 2`` on the CPU: a TREE_V4 server whose two ranks each hold half of the heads, experts and vocabulary
(SGLang's parallel layers over its gloo TP group) must emit exactly plain greedy decoding (our unsharded model
without SGLang is the ground truth, the one ``--tp 1`` matches too) on the embedded trained model, whose drafts are
accepted, and serve sampled requests."""

from __future__ import annotations

import json
import re

import pytest

from sglang_tree_v4.testing import launcher as srv
from sglang_tree_v4.testing import prompts
from support.served import EMBEDDED, reference_greedy
from support.serving_checks import assert_speculation_exercised

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
        log = server.log.read_text()
        assert "TP1" in log  # two ranks really ran
        held = [json.loads(h) for h in re.findall(r"TREE_V4 DeepSeek-V4 parameters: (\{.*\})", log)]
        assert sorted((h["tp"], h["tp_rank"]) for h in held) == [(2, 0), (2, 1)]
    finally:
        server.stop()


def test_tp2_adaptive_budget_switching_shapes_equals_plain_decoding(tmp_path):
    """The default (adaptive) TREE_V4 at ``--tp 2``, forced to cycle through every shape of its menu ("no
    speculation" included): rank 0 chooses and broadcasts, both ranks run the same shape every step, and greedy
    outputs stay exactly plain decoding, one by one and batched."""
    from support.serving_checks import launch_mutated
    server = launch_mutated(EMBEDDED, ["--device", "cpu", "--tp", "2", "--max-total-tokens", "8192",
                                       "--speculative-algorithm", "TREE_V4"], "cycle_shapes", tmp_path / "tp2.log",
                            XDG_CACHE_HOME=str(tmp_path / "cache"))
    try:
        srv.wait_healthy(server)
        sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        ids = [server.post("/tokenize", {"prompt": r["question"]}).json()["tokens"] for r in prompts.gsm8k("test")[:4]]
        for p in ids[:2]:
            assert server.generate({"input_ids": p, "sampling_params": sampling})["output_ids"] == \
                reference_greedy(EMBEDDED, p, 24)
        batched = server.generate({"input_ids": ids, "sampling_params": sampling})
        assert [o["output_ids"] for o in batched] == [reference_greedy(EMBEDDED, p, 24) for p in ids]
        import requests
        state = requests.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]
        assert state["tree_v4_adaptive"] and state["tree_v4_shape_steps"].get("none", 0) > 0
        assert len(state["tree_v4_shape_steps"]) > 5, state["tree_v4_shape_steps"]
    finally:
        server.stop()
