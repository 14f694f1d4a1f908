"""Real checkpoint formats through real servers (``sglang.launch_server --dtype float32``): the published
DeepSeek-V4 layout (FP8 block-scaled attention / shared experts, FP4 experts, 2 shards + index), kept quantized in
the server, at ``--tp 1`` and ``--tp 2``, without and with TREE_V4; and a checkpoint written by transformers'
``save_pretrained``. Greedy tokens must equal HF transformers run on the dequantised weights (a divergence is only
tolerated at a top-2 log-prob gap < 1e-3)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from sglang_tree_v4.testing import launcher, prompts
from support import real_format as rf
from support.serving_checks import assert_speculation_exercised

pytestmark = pytest.mark.server
NEW = 24
COMMON = ["--dtype", "float32", "--max-total-tokens", "8192", "--sleep-on-idle"]
TREE = ["--speculative-algorithm", "TREE_V4", "--speculative-num-draft-tokens", "6", "--speculative-eagle-topk", "3",
        "--speculative-num-steps", "3"]
# transformers' own config class only knows HCA ratio 128 in DeepSeek's layout, and SGLang asks it while loading the
# tokenizer; the embedded model (re-written here) uses HCA 16, so its tokenizer is named from its HF-layout folder.
TOKENIZER = ["--tokenizer-path", str(rf.EMBEDDED)]
SERVERS = {"published": ("published", TOKENIZER), "published-tree": ("published", TOKENIZER + TREE),
           "published-tree-tp2": ("published", TOKENIZER + TREE + ["--tp", "2"]),
           "save_pretrained": ("save_pretrained", [])}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"published": rf.published_checkpoint(root / "published"),
            "save_pretrained": rf.save_pretrained_checkpoint(root / "save_pretrained")}


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started = {name: launcher.launch(checkpoints[ckpt], COMMON + args, logs / f"{name}.log")
               for name, (ckpt, args) in SERVERS.items()}
    try:
        yield {name: launcher.wait_healthy(s, timeout=600) for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def prompt_ids():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(rf.EMBEDDED))
    return [tok(r["question"], add_special_tokens=False)["input_ids"] for r in prompts.gsm8k("test")[:3]]


def _greedy(server, ids):
    sampling = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(len(ids)) as pool:
        return list(pool.map(lambda p: server.generate({"input_ids": p, "sampling_params": sampling}), ids))


@pytest.mark.parametrize("name", ["published", "published-tree", "published-tree-tp2"])
def test_published_layout_matches_hf(servers, checkpoints, prompt_ids, name):
    hf = rf.hf_reference(checkpoints["published"])
    outs = _greedy(servers[name], prompt_ids)
    for ids, out in zip(prompt_ids, outs, strict=False):
        want, gaps = rf.hf_greedy(hf, ids, NEW)
        rf.assert_matches_hf(out["output_ids"], want, gaps)
    if "tree" in name:
        assert_speculation_exercised(outs)


def test_server_holds_what_the_footprint_report_predicts(servers, checkpoints):
    """The server logs the parameter bytes each rank holds after loading; ``python -m sglang_tree_v4.footprint``
    builds the same model on the meta device from the checkpoint's config (``--tp 2 --tp-rank r`` for the
    sharded server's ranks): the two agree, and the kept-quantized model is far below its dense float32 size (FP4
    experts take 1/8 of float32, FP8 linears 1/4)."""
    import json
    import re
    import subprocess
    import sys

    def footprint(*args):
        report = subprocess.run([sys.executable, "-m", "sglang_tree_v4.footprint", str(checkpoints["published"]),
                                 "--dtype", "float32", *args], capture_output=True, text=True, timeout=300,
                                env=launcher.clean_env())
        assert report.returncode == 0, report.stderr[-2000:]
        return json.loads(report.stdout.strip().splitlines()[-1])

    def held(name):
        lines = re.findall(r"TREE_V4 DeepSeek-V4 parameters: (\{.*\})", servers[name].log.read_text())
        return {(h["tp"], h["tp_rank"]): h for h in map(json.loads, lines)}

    tp1 = held("published")[(1, 0)]
    predicted = footprint()
    assert tp1["param_bytes_per_rank"] == predicted["param_bytes_per_rank"]
    assert tp1["param_bytes_by_dtype"] == predicted["param_bytes_by_dtype"]
    tp2 = held("published-tree-tp2")
    assert set(tp2) == {(2, 0), (2, 1)}, tp2
    for rank in (0, 1):  # each rank of the --tp 2 server holds exactly what the report says for that rank
        predicted = footprint("--tp", "2", "--tp-rank", str(rank))
        assert tp2[(2, rank)]["param_bytes_by_dtype"] == predicted["param_bytes_by_dtype"]
        assert tp2[(2, rank)]["param_bytes_per_rank"] < 0.8 * tp1["param_bytes_per_rank"]
    dense = subprocess.run([sys.executable, "-m", "sglang_tree_v4.footprint", str(rf.EMBEDDED), "--dtype", "float32"],
                           capture_output=True, text=True, timeout=300, env=launcher.clean_env())
    dense_bytes = json.loads(dense.stdout.strip().splitlines()[-1])["param_bytes_per_rank"]
    assert tp1["param_bytes_per_rank"] < 0.6 * dense_bytes, (tp1, dense_bytes)
    # The state: SGLang logs the two halves of the hybrid pool it allocated (GiB, two decimals): the entries (a row
    # per block) and window rows (with the CSA compressor ring, sized for TREE_V4's default D = 8 as the report);
    # the report's bytes per token slot and per window row predict them.
    log = servers["published-tree"].log.read_text()
    pattern = r"(Full|SWA) KV Cache is allocated\. dtype: \S+, #tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB"
    alloc = {m[0]: (int(m[1]), float(m[2]) + float(m[3])) for m in re.findall(pattern, log)}
    assert set(alloc) == {"Full", "SWA"}, servers["published-tree"].log_tail()
    report = footprint("--tokens", "1")
    for half, row in (("Full", report["state_bytes_per_token"]), ("SWA", report["window_row_bytes"])):
        rows, gib = alloc[half]
        pad = report["page_size"]  # SGLang's padding page
        assert abs((rows + pad) * row / 2**30 - gib) <= 0.011, (half, rows, row, gib)
    assert report["window_row_bytes"] > 4 * report["state_bytes_per_token"]  # most state is window-only


def test_tp2_tree_equals_tp1_tree(servers, prompt_ids):
    """The sharded ``--tp 2`` TREE_V4 server emits exactly the ``--tp 1`` TREE_V4 server's greedy tokens."""
    one, two = _greedy(servers["published-tree"], prompt_ids), _greedy(servers["published-tree-tp2"], prompt_ids)
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]


def test_save_pretrained_checkpoint_matches_hf(servers, checkpoints, prompt_ids):
    from support.hf_reference import build_hf
    hf = build_hf(8, seed=0, vocab=3072)  # the very model save_pretrained wrote (same seed)
    outs = _greedy(servers["save_pretrained"], prompt_ids)
    for ids, out in zip(prompt_ids, outs, strict=False):
        want, gaps = rf.hf_greedy(hf, ids, NEW)
        rf.assert_matches_hf(out["output_ids"], want, gaps)
