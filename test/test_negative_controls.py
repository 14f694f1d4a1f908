"""Negative controls: each end-to-end check of ``test_tree_v4_serving.py`` run against a TREE_V4 server with one
injected fault (``support/mutations/sitecustomize.py``, loaded only into these servers) must fail. A check that
still passed here could not see the bug it is named after.

* a verifier that emits one wrong token      -> the greedy identity check fails;
* a pool that forgets to free aborted requests -> the leak check sees held slots;
* an acceptance biased by 2 %                -> the sampled-losslessness statistic leaves its band;
* window rows kept one page short            -> served tokens are not the model's (``test_window_retention.py``);
* CSA compressor rows read only from the ring  -> the same check fails (pages of 64, a ring of 16);
* the MTP reading the stream one position back -> served acceptance leaves the offline loop's.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests

from sglang_tree_v4.checkpoint.weights import load_model
from sglang_tree_v4.testing import prompts
from sglang_tree_v4.testing.offline import plain_greedy
from sglang_tree_v4.testing.runner import DSV4Runner
from support import serving_checks as checks
from support.served import (
    COMMON,
    EARLIEST_EVICTION,
    EMBEDDED,
    RING_PAGES,
    SAMPLED_TOKENS,
    SAMPLES_PER_CASE,
    TREE,
)

pytestmark = pytest.mark.server
NEW_TOKENS = 64  # the acceptance check of test_tree_v4_serving
MUTATIONS = ("wrong_token", "leak_aborted", "biased_accept", "short_window", "ring_stored_only", "stream_off_by_one")
ENV = {"short_window": EARLIEST_EVICTION}
ARGS = {"ring_stored_only": RING_PAGES}


@pytest.fixture(scope="module")
def mutated(tmp_path_factory):
    logs = tmp_path_factory.mktemp("mutated")
    started = {m: checks.launch_mutated(EMBEDDED, COMMON + TREE + ARGS.get(m, []) + ["--sleep-on-idle"], m,
                                        logs / f"{m}.log", **ENV.get(m, {}))
               for m in MUTATIONS}
    with checks.healthy(started) as servers:
        yield servers


@pytest.fixture(scope="module")
def target_model():
    return load_model(str(EMBEDDED))


def test_wrong_token_fails_greedy_identity(mutated, target_model):
    server = mutated["wrong_token"]
    texts = [r["question"] for r in prompts.gsm8k("test")[:4]]
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    ids = [server.post("/tokenize", {"prompt": t}).json()["tokens"] for t in texts]
    with cf.ThreadPoolExecutor(len(ids)) as pool:
        outs = list(pool.map(lambda p: server.generate({"input_ids": p, "sampling_params": sampling}), ids))
    checks.assert_speculation_exercised(outs)
    runner = DSV4Runner(target_model, num_slots=2048, max_len=512, max_reqs=2)
    differing = [i for i, (p, o) in enumerate(zip(ids, outs, strict=True))
                 if o["output_ids"] != plain_greedy(runner, p, 24)]
    assert differing, "the greedy identity check did not see the wrong token"


def test_forgotten_free_is_seen_by_the_leak_check(mutated):
    """The leak is seen twice over: slots still held at idle, or SGLang's own idle check (which the leak check
    also reads) stopping the server with "memory leak detected" before the count can be read."""
    server = mutated["leak_aborted"]
    try:
        held = checks.idle_used_tokens_after_load(server)
    except requests.RequestException:
        held = None
    assert (held is not None and held > 0) or "memory leak detected" in server.log.read_text(), held


def test_biased_acceptance_fails_the_sampling_check(mutated, target_model):
    stats = checks.sampled_position_stats(mutated["biased_accept"], target_model, checks.sampling_cases(EMBEDDED),
                                          SAMPLES_PER_CASE, SAMPLED_TOKENS)
    print(stats)
    assert max(abs(z) for z in stats.z.values()) > checks.Z_CRITICAL, stats


def test_short_window_fails_the_window_check(mutated, target_model):
    bad = checks.window_read_violations(mutated["short_window"], target_model)
    assert bad, "the window check did not see reads of freed window rows"


def test_ring_stored_only_fails_the_window_check(mutated, target_model):
    bad = checks.window_read_violations(mutated["ring_stored_only"], target_model)
    assert bad, "the window check did not see compressor rows a prefill overwrote in its ring"


def test_stream_off_by_one_fails_the_acceptance_check(mutated, target_model):
    server = mutated["stream_off_by_one"]
    items = checks.eval_prompts(server)[:8]
    outs = checks.run_all(server, items, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    ratios = checks.acceptance_vs_offline(server, target_model, EMBEDDED, TREE, items, outs, NEW_TOKENS)
    assert not checks.acceptance_matches(ratios), ratios
