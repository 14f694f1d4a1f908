"""The embedded DSpark model written in DeepSeek's published layout (``save_published``: FP8 block-scaled attention,
shared experts and ``main_proj``, FP4 experts, bf16 Markov and confidence heads, 2 shards + index) and kept
quantized in the server: TREE_V4's DSpark chain at ``--tp 1`` and ``--tp 2`` and its best-first tree (D=12, K=4,
S=γ) at ``--tp 2`` give the plain server's greedy tokens on the same checkpoint, with drafts accepted, and ``--tp 2``
runs two ranks."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sglang_tree_v4.checkpoint.weights import load_model, save_published
from sglang_tree_v4.testing import launcher as srv
from support import serving_checks as checks

pytestmark = pytest.mark.server

DSPARK = Path(__file__).resolve().parents[1] / "models" / "tiny-v4-dspark"
COMMON = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192", "--sleep-on-idle",
          "--tokenizer-path", str(DSPARK)]  # transformers' config class rejects the embedded HCA ratio in this layout
CHAIN = ["--speculative-algorithm", "TREE_V4", "--speculative-num-draft-tokens", "5", "--speculative-eagle-topk", "1",
         "--speculative-num-steps", "4"]
TREE = ["--speculative-algorithm", "TREE_V4", "--speculative-num-draft-tokens", "12", "--speculative-eagle-topk", "4",
        "--speculative-num-steps", "4"]
SERVERS = {"plain": [], "chain": CHAIN, "chain-tp2": CHAIN + ["--tp", "2"], "tree-tp2": TREE + ["--tp", "2"]}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    save_published(load_model(str(DSPARK)), str(root), max_shard_bytes=2_000_000)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(DSPARK / name, root / name)
    logs = tmp_path_factory.mktemp("logs")
    started = {name: srv.launch(root, COMMON + args, logs / f"{name}.log", env=srv.clean_env())
               for name, args in SERVERS.items()}
    with checks.healthy(started) as up:
        yield up


def test_quantized_dspark_chain_and_tree_equal_plain_decoding_at_tp1_and_tp2(servers):
    items = checks.eval_prompts(servers["plain"])[:10]
    sampling = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    want = [o["output_ids"] for o in checks.run_all(servers["plain"], items, sampling)]
    for name in ("chain", "chain-tp2", "tree-tp2"):
        got = checks.run_all(servers[name], items, sampling)
        assert [o["output_ids"] for o in got] == want, name
        checks.assert_speculation_exercised(got)
    assert "TP1" in servers["chain-tp2"].log.read_text()  # two ranks really ran
    assert '"float8_e4m3fn"' in servers["chain"].log.read_text()  # FP8 weights kept quantized (parameter report)
