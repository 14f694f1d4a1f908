"""TREE_V4 with fp8 entries and window keys (``--kv-cache-dtype fp8_e4m3``, upstream's V4 default) on real SGLang
servers (CPU): every output equals a non-speculative server with the same flag.

Five servers share the module, all with fp8 entries: on the embedded model no speculation (the ground truth), a
real tree (K = 3) through the fixed-shape verify step a GPU runs, and the default TREE_V4 (adaptive budget); on the
embedded model re-written in DeepSeek's published V4-Flash layout (FP8 attention, FP4 experts, kept quantized in
the server) no speculation and the tree. Greedy tokens are compared batched (32 mixed requests at once, prompts
past 400 tokens so HCA and window boundaries fall inside draft trees) and one by one; sampled tokens are scored
against the fp8 target's own distribution; radix hits, aborts and the pool's free count are checked as for
full-precision entries. That the fp8 state is really in use: the server's first-token log-probabilities are the
offline fp8 model's, not the full-precision model's.
"""

from __future__ import annotations

import pytest
import requests
import torch

from sglang_tree_v4.serving.sglang_model import FIXED_SHAPES_ENV
from sglang_tree_v4.testing import launcher as srv
from support import real_format as rf
from support import served
from support import serving_checks as checks
from support.served import EMBEDDED, TREE

pytestmark = pytest.mark.server
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
NEW_TOKENS = 48
COMMON = served.COMMON + served.SLEEP + FP8
PUBLISHED = ["--dtype", "float32", "--max-total-tokens", "8192", "--sleep-on-idle", "--tokenizer-path",
             str(rf.EMBEDDED), *FP8]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    cache = str(tmp_path_factory.mktemp("cache"))
    published = rf.published_checkpoint(tmp_path_factory.mktemp("ckpt") / "published")
    specs = {"plain": (EMBEDDED, COMMON, {}),
             "tree": (EMBEDDED, COMMON + TREE, {FIXED_SHAPES_ENV: "1"}),
             "adaptive": (EMBEDDED, COMMON + ["--speculative-algorithm", "TREE_V4"], {}),
             "published": (published, PUBLISHED, {}),
             "published-tree": (published, PUBLISHED + TREE, {})}
    started = {name: srv.launch(model, args, logs / f"{name}.log", env=srv.clean_env(XDG_CACHE_HOME=cache, **env))
               for name, (model, args, env) in specs.items()}
    try:
        yield {name: srv.wait_healthy(s, timeout=600) for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def batched(servers):
    items = (checks.eval_prompts(servers["plain"]) * 2)[:32]
    return {name: checks.run_all(servers[name], items, GREEDY) for name in ("plain", "tree", "adaptive")}


def test_servers_keep_entries_as_fp8(servers):
    for name, server in servers.items():
        log = server.log.read_text()
        assert "entries kept as fp8_e4m3" in log and "window keys kept as fp8_e4m3" in log, (name, server.log_tail())
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
        assert info["kv_cache_dtype"] == "fp8_e4m3"


def test_first_token_logprobs_are_the_fp8_models(servers):
    """The plain server's log-probability of its first token, against our model offline over fp8 entries and over
    full-precision ones: it is the fp8 model's (within float rounding), and the two models differ by more."""
    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.testing.runner import DSV4Runner

    model = load_model(str(EMBEDDED))
    gaps = {None: [], "fp8_e4m3": []}
    for ids in checks.chat_prompt_ids(EMBEDDED):
        out = servers["plain"].generate({"input_ids": ids, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        logprob, token = out["meta_info"]["output_token_logprobs"][0][:2]
        for fmt in gaps:
            runner = DSV4Runner(model, num_slots=1024, max_len=256, max_reqs=2, entry_format=fmt)
            logits = runner.extend([runner.add_request()], [torch.tensor(ids)])[0].logits[-1]
            gaps[fmt].append(abs(float(torch.log_softmax(logits.double(), -1)[token]) - logprob))
    assert max(gaps["fp8_e4m3"]) < 1e-4, gaps
    assert max(gaps[None]) > 10 * max(max(gaps["fp8_e4m3"]), 1e-5), gaps


@pytest.mark.parametrize("shape", ["tree", "adaptive"])
def test_batched_greedy_equals_non_speculative_fp8(batched, shape):
    for i, (a, b) in enumerate(zip(batched["plain"], batched[shape], strict=False)):
        assert len(a["output_ids"]) == NEW_TOKENS
        assert a["output_ids"] == b["output_ids"], f"request {i}"
    checks.assert_speculation_exercised(batched[shape])


def test_one_by_one_greedy_equals_non_speculative_fp8(servers):
    items = checks.eval_prompts(servers["plain"])
    items = items[:2] + items[-2:]  # short and long (> 300 tokens) prompts, each alone on the server
    for name in ("tree", "adaptive"):
        for item in items:
            want = servers["plain"].generate({**item, "sampling_params": GREEDY})["output_ids"]
            assert servers[name].generate({**item, "sampling_params": GREEDY})["output_ids"] == want, name


def test_published_layout_tree_equals_non_speculative_fp8(servers):
    ids = checks.chat_prompt_ids(EMBEDDED)
    plain = checks.run_all(servers["published"], [{"input_ids": p} for p in ids], GREEDY)
    tree = checks.run_all(servers["published-tree"], [{"input_ids": p} for p in ids], GREEDY)
    assert [o["output_ids"] for o in tree] == [o["output_ids"] for o in plain]
    checks.assert_speculation_exercised(tree)
    for p, want in zip(ids, plain, strict=False):  # one by one
        got = servers["published-tree"].generate({"input_ids": p, "sampling_params": GREEDY})
        assert got["output_ids"] == want["output_ids"]


def test_radix_hits_give_the_tokens_of_a_cold_run_fp8(servers):
    """As ``test_tree_v4_serving``'s check of the same name: a cached prefix's fp8 entries are shared (crossing a
    page, an HCA block and the window), and a hit gives the tokens of a cold run."""
    checks.assert_radix_hits_match_cold_runs(servers["plain"], servers["tree"])


def test_sampled_tokens_follow_the_fp8_target(servers):
    """As ``test_tree_v4_serving.test_sampled_tokens_follow_the_target``, with the target over fp8 entries."""
    from sglang_tree_v4.checkpoint.weights import load_model

    stats = checks.sampled_position_stats(servers["tree"], load_model(str(EMBEDDED)), checks.sampling_cases(EMBEDDED),
                                          500, 10, entry_format="fp8_e4m3")
    print(stats)
    checks.assert_follows_target(stats)
    assert stats.mean_verify_rounds >= 3, stats


def test_no_kv_leak_after_load_fp8(servers):
    """200 mixed requests, 20 dropped mid-stream: the idle pool holds what it held before, and SGLang's own idle
    leak check stays quiet."""
    assert checks.idle_used_tokens_after_load(servers["tree"]) == 0
    assert "memory leak" not in servers["tree"].log.read_text()
