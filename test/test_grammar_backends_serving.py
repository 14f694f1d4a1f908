"""Grammar-constrained requests under TREE_V4 on SGLang's other grammar backends (CPU, real servers, embedded model).

``test_sampling_params_serving`` covers the default backend (xgrammar). The per-node walk must also hold for
llguidance (a matcher with ``rollback``) and outlines (no rollback: a saved guide ``state``). For each backend a plain
server is the ground truth beside a TREE_V4 tree on the GPU's path (fixed-shape verify step, overlap scheduling):
every grammar request of 8 prompts at once, greedy, identical outputs and statuses, valid finished outputs, drafts
accepted.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from sglang_tree_v4.serving.sglang_model import FIXED_SHAPES_ENV
from sglang_tree_v4.speculative.server_args import OVERLAP_ENV
from sglang_tree_v4.testing import launcher as srv
from support import grammar_cases, served
from support import serving_checks as checks
from support.served import EMBEDDED, TREE

pytestmark = pytest.mark.server
BACKENDS = ("llguidance", "outlines")
COMMON = served.COMMON + served.SLEEP
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    cache = str(tmp_path_factory.mktemp("cache"))
    plain_env = srv.clean_env(XDG_CACHE_HOME=cache)
    tree_env = srv.clean_env(XDG_CACHE_HOME=cache, **{FIXED_SHAPES_ENV: "1", OVERLAP_ENV: "1"})
    started = {}
    for backend in BACKENDS:
        flags = COMMON + ["--grammar-backend", backend]
        started[f"plain-{backend}"] = srv.launch(EMBEDDED, flags, logs / f"plain-{backend}.log", env=plain_env)
        started[f"tree-{backend}"] = srv.launch(EMBEDDED, flags + TREE, logs / f"tree-{backend}.log", env=tree_env)
    with checks.healthy(started) as up:
        yield up


@pytest.fixture(scope="module")
def outputs(servers):
    """Per backend and server: every (grammar, prompt) request, all at once; responses as (status, body)."""
    items = checks.eval_prompts(servers[f"plain-{BACKENDS[0]}"])[:8]
    jobs = [(feature, {**item, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, **params}})
            for feature, params in grammar_cases.PARAMS.items() for item in items]

    def run(server):
        def one(payload):
            r = server.post("/generate", payload)
            return r.status_code, (r.json() if r.status_code == 200 else r.text)

        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: one(job[1]), jobs))

    return [feature for feature, _ in jobs], {name: run(server) for name, server in servers.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_equals_plain(outputs, backend):
    features, outs = outputs
    served = 0
    for i, (feature, (code_a, a), (code_b, b)) in enumerate(zip(features, outs[f"plain-{backend}"],
                                                               outs[f"tree-{backend}"], strict=False)):
        assert code_a == code_b, (feature, i, a, b)
        if code_a != 200:
            continue  # the backend refuses this grammar kind itself, on both servers
        served += 1
        assert a["output_ids"] == b["output_ids"], (feature, i)
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"], (feature, i)
        grammar_cases.check_valid(feature, b)
    assert served >= 16, served  # regex and JSON at least, on every backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_drafts_accepted(outputs, backend):
    features, outs = outputs
    group = [body for code, body in outs[f"tree-{backend}"] if code == 200]
    tokens = sum(len(o["output_ids"]) - 1 for o in group)
    rounds = sum(o["meta_info"].get("spec_verify_ct", 0) for o in group)
    assert rounds > 0 and tokens / rounds > 1.3, (tokens, rounds)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_finish_in_the_language(outputs, backend):
    """Some outputs end by the grammar (not only by length), so the termination cut is exercised."""
    features, outs = outputs
    ended = sum(code == 200 and body["meta_info"]["finish_reason"]["type"] != "length"
                for code, body in outs[f"tree-{backend}"])
    assert ended > 0
