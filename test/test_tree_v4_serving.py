"""TREE_V4 end to end on a real SGLang server (CPU): every output must equal non-speculative serving.

Five servers share the module: no speculation (the ground truth), TREE_V4 with a real tree (K > 1) served through
the fixed-shape verify step a GPU runs (``SGLANG_TREE_V4_FIXED_SHAPES=1``; the others run the CPU's eager step), the
matched chain (K = 1, S = D - 1), the default TREE_V4 (no shape flags: the adaptive budget picks the shape per step) and
the adaptive budget forced to cycle through every shape of its menu, "no speculation" included (``cycle_shapes`` in
``support/mutations``), so that every switch between shapes is exercised. The tree and the cycling server keep
SGLang's overlap scheduling, as on a GPU (``SGLANG_TREE_V4_OVERLAP=1``: a round starts before the previous one's
result is processed); the others run the CPU's synchronous schedule. Prompts come from GSM8K test, MBPP test and
ShareGPT, including prompts longer
than 300 tokens so that HCA boundaries fall inside draft trees.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from sglang_tree_v4.serving.sglang_model import FIXED_SHAPES_ENV
from sglang_tree_v4.speculative.adaptive.measure import verify_widths
from sglang_tree_v4.speculative.server_args import OVERLAP_ENV
from sglang_tree_v4.testing import launcher as srv
from sglang_tree_v4.testing import prompts
from support import serving_checks as checks
from support.served import (
    CHAIN,
    COMMON,
    EMBEDDED,
    SAMPLED_TOKENS,
    SAMPLES_PER_CASE,
    TREE,
)

pytestmark = pytest.mark.server
NEW_TOKENS = 64
ADAPTIVE = ["--speculative-algorithm", "TREE_V4"]
SPECULATIVE = ("tree", "chain", "adaptive", "cycling")


@pytest.fixture(scope="module")
def model() -> Path:
    """The embedded model: trained, so drafts are accepted and multi-node commits are exercised."""
    return EMBEDDED

@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """The adaptive servers keep their step-time cache in a fresh folder: the default server measures at startup,
    the cycling one, started once it is up, must read the cache instead."""
    logs = tmp_path_factory.mktemp("logs")
    cache = str(tmp_path_factory.mktemp("cache"))
    env = {name: srv.clean_env(XDG_CACHE_HOME=cache) for name in ("plain", "chain", "adaptive")}
    env["tree"] = srv.clean_env(XDG_CACHE_HOME=cache, **{FIXED_SHAPES_ENV: "1", OVERLAP_ENV: "1"})  # the GPU's path
    # The tree server's pages of 32 keep its CSA compressor rows in a ring of 16 per page (the plain server's pages
    # of 16: 8; the others': every row), so the identity checks run through both ring layouts.
    started = {name: srv.launch(model, COMMON + args, logs / f"{name}.log", env=env[name])
               for name, args in (("plain", []), ("tree", TREE + ["--page-size", "32"]), ("chain", CHAIN),
                                  ("adaptive", ADAPTIVE))}
    try:
        srv.wait_healthy(started["adaptive"])
        started["cycling"] = checks.launch_mutated(model, COMMON + ADAPTIVE, "cycle_shapes", logs / "cycling.log",
                                                   XDG_CACHE_HOME=cache, **{OVERLAP_ENV: "1"})
        yield {name: srv.wait_healthy(s) for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def greedy_outputs(servers):
    items = checks.eval_prompts(servers["plain"])
    # 32 concurrent mixed-length requests per server: the prompts, then repeats of the first ones.
    items = (items * 2)[:32]
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return {name: checks.run_all(s, items, sampling) for name, s in servers.items()}


@pytest.mark.parametrize("shape", SPECULATIVE)
def test_greedy_equals_non_speculative(greedy_outputs, shape):
    plain, spec = greedy_outputs["plain"], greedy_outputs[shape]
    for i, (a, b) in enumerate(zip(plain, spec, strict=False)):
        assert len(a["output_ids"]) == NEW_TOKENS
        assert a["output_ids"] == b["output_ids"], f"request {i}"
    checks.assert_speculation_exercised(spec)


def test_verify_step_kind_as_asked(servers):
    """The tree server serves through the fixed-shape step (asked for by environment), the others eagerly; the tree
    and the cycling server keep overlap scheduling (asked for by environment), the others run without it."""
    for name in SPECULATIVE:
        kind = "fixed-shape" if name == "tree" else "eager"
        assert f"{kind} verify step" in servers[name].log.read_text(), (name, servers[name].log_tail())
        info = requests.get(servers[name].url + "/server_info", timeout=30).json()
        assert info.get("disable_overlap_schedule") is (name not in ("tree", "cycling")), name


def test_accept_length_reported(servers, greedy_outputs):
    """Per request in meta_info, server-wide in /get_server_info; the trained model accepts drafts."""
    for shape in ("tree", "chain"):
        metas = [o["meta_info"] for o in greedy_outputs[shape]]
        assert sum(m["spec_accept_length"] for m in metas) / len(metas) > 1.2
        info = requests.get(servers[shape].url + "/get_server_info", timeout=30).json()
        assert info["internal_states"][0]["avg_spec_accept_length"] > 1.2


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_served_acceptance_is_the_offline_loops(servers, greedy_outputs, target_model, shape):
    """The served MTP (prefill rounds over the prompt's last window from their own streams, catch-ups from the
    few streams per page the pool keeps, the overlap schedule on the tree server) drafts what the offline loop's
    MTP drafts (``testing.offline``: every stream kept, the MTP over the whole prompt): tokens per verify round
    per prompt within 10 % of the loop's, on average within 5 % (``serving_checks.acceptance_vs_offline``). Sharp
    for the streams a catch-up reads (one position off: 0.68x, ``test_negative_controls``); coarse for the MTP's
    window after a prefill, on which the embedded model's drafts depend little (rows never written: 0.98x on
    average), hence ``test_speculative_mtp_drafter``'s check of the prefill catch-up itself."""
    items = checks.eval_prompts(servers["plain"])[:8]
    ratios = checks.acceptance_vs_offline(servers["plain"], target_model, EMBEDDED, TREE if shape == "tree" else CHAIN,
                                          items, greedy_outputs[shape][:8], NEW_TOKENS)
    assert checks.acceptance_matches(ratios), ratios


def _state(server) -> dict:
    return requests.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def _shape_steps(server) -> tuple[dict[str, int], bool]:
    state = _state(server)
    return state["tree_v4_shape_steps"], state["tree_v4_adaptive"]


def test_shape_counters_in_server_info(servers, greedy_outputs):
    """Steps per tree shape in ``/get_server_info``: a pinned server runs its one shape; the adaptive default
    reports its choices; the cycling server has run every shape of the menu, "no speculation" included."""
    from sglang_tree_v4.speculative.adaptive.policy import shape_menu
    pinned, adaptive = _shape_steps(servers["tree"])
    assert set(pinned) == {"D6_K3_S3"} and not adaptive
    steps, adaptive = _shape_steps(servers["adaptive"])
    assert adaptive and sum(steps.values()) > 0
    steps, adaptive = _shape_steps(servers["cycling"])
    menu = shape_menu(8, 3, 4)
    assert adaptive and len(steps) == len(menu) and steps.get("none", 0) > 0, steps
    # Every other prefill round of the cycling server finds its batch "not speculating" and defers the MTP's rows;
    # its outputs are still the plain server's (``test_greedy_equals_non_speculative``) and it drafts after such
    # prefills (every shape ran). A pinned server always drafts, so it never defers.
    prefills = {name: _state(servers[name])["tree_v4_mtp_prefills"] for name in ("tree", "cycling")}
    assert prefills["tree"]["deferred"] == 0 and prefills["tree"]["run"] > 0, prefills
    assert prefills["cycling"]["deferred"] > 0 and prefills["cycling"]["run"] > 0, prefills


def test_step_times_measured_once_then_read_from_the_cache(servers):
    """The default server measured its step-time model at startup (the seconds it took are in its log and printed
    here), wrote it to the cache folder (verification non-decreasing in D at every batch size), and the cycling
    server (same model, device and TP) read it from there."""
    import re
    measured = re.findall(r"TREE_V4 adaptive budget: step times measured in ([0-9.]+) s \((.*)\)",
                          servers["adaptive"].log.read_text())
    assert measured, servers["adaptive"].log_tail()
    print("step-time measurement at startup:", measured[0][0], "s")
    assert Path(measured[0][1]).is_file()
    verify = json.loads(Path(measured[0][1]).read_text())["times"]["verify"]  # per D, over the batch size
    assert sorted(int(d) for d in verify) == verify_widths(8) and all(len(c) >= 2 for c in verify.values()), verify
    for b in verify["1"]:  # at every batch size, more verified tokens never cost less (``measure.monotone``)
        by_width = [verify[str(d)][b] for d in verify_widths(8)]
        assert by_width == sorted(by_width), (b, by_width)
    read = re.findall(r"TREE_V4 adaptive budget: step times read in [0-9.]+ s \((.*)\)",
                      servers["cycling"].log.read_text())
    assert read == [measured[0][1]]


def test_chat_completions_answer_a_gsm8k_question(servers):
    """The OpenAI chat endpoint with the checkpoint's chat template: the embedded model writes a worked answer in
    GSM8K's format ('#### <number>') and ends its turn, and the tree serves exactly the non-speculative answer."""
    question = prompts.gsm8k("test")[0]["question"]
    payload = {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": 128,
               "temperature": 0}
    answers = {}
    for name in ("plain", "tree"):
        r = servers[name].post("/v1/chat/completions", payload)
        assert r.status_code == 200, r.text
        answers[name] = r.json()["choices"][0]
    assert answers["tree"]["message"]["content"] == answers["plain"]["message"]["content"]
    assert answers["tree"]["finish_reason"] == "stop"
    assert "####" in answers["tree"]["message"]["content"]


def test_stops_inside_accepted_blocks_match(servers):
    """Stop strings, stop token ids and max_new_tokens behave exactly as without speculation."""
    plain = servers["plain"]
    text = prompts.gsm8k("test")[20]["question"]
    ref = plain.generate({"text": text, "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                           "ignore_eos": True}})
    stop_id = ref["output_ids"][17]
    stop_str = ref["text"][len(ref["text"]) // 2: len(ref["text"]) // 2 + 3]
    cases = [{"max_new_tokens": 13}, {"max_new_tokens": 40, "stop_token_ids": [stop_id]},
             {"max_new_tokens": 40, "stop": [stop_str]}]
    for case in cases:
        sampling = {"temperature": 0, "ignore_eos": True, **case}
        want = plain.generate({"text": text, "sampling_params": sampling})
        for shape in SPECULATIVE:
            got = servers[shape].generate({"text": text, "sampling_params": sampling})
            assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], (shape, case)
            assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], (shape, case)


def test_logprobs_returned(servers):
    text = prompts.gsm8k("test")[21]["question"]
    payload = {"text": text, "return_logprob": True,
               "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    want = servers["plain"].generate(payload)["meta_info"]["output_token_logprobs"]
    got = servers["tree"].generate(payload)["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in got] == [t[1] for t in want]
    assert max(abs(a[0] - b[0]) for a, b in zip(got, want, strict=False)) < 1e-3


def page_size(server) -> int:
    return int(requests.get(server.url + "/get_server_info", timeout=60).json()["page_size"])


def test_radix_cache_prefix_reuse(servers):
    """A prompt that extends a finished request's prompt and output reuses them: SGLang's radix cache matches whole
    pages, so at least the prompt's whole pages are cached."""
    base = " ".join(prompts.sharegpt_prompts(12)[6:12])
    ids = servers["plain"].post("/tokenize", {"prompt": base}).json()["tokens"][:200]
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    for shape in ("tree", "chain"):
        first = servers[shape].generate({"input_ids": ids, "sampling_params": sampling})
        second_ids = ids + first["output_ids"][:5] + ids[:7]
        second = servers[shape].generate({"input_ids": second_ids, "sampling_params": sampling})
        page = page_size(servers[shape])
        assert page > 1 and second["meta_info"]["cached_tokens"] >= len(ids) // page * page
        want = servers["plain"].generate({"input_ids": second_ids, "sampling_params": sampling})
        assert second["output_ids"] == want["output_ids"], shape


def test_radix_hits_give_the_tokens_of_a_cold_run(servers):
    """The hybrid pool keeps every block's entries but a window row (keys, compressor rows, streams) only for the
    last window, and a CSA layer's compressor rows only in its page's ring (the last 8 or 16 positions of a page
    stay); SGLang's radix cache matches whole pages (16 tokens on the plain server, 32 on the tree server: whole CSA
    and HCA blocks) of a cached
    prefix, and only where the window behind the match is still held. A 40-token prompt decodes 220 tokens (so the
    window rows of positions ~40..128 are freed on the way), then three requests share its first 37, 45 and 230
    tokens (each ending inside a page, a CSA and an HCA block; all crossing the window of 32; 45 and 230 go past the
    prompt, 230 past the freed rows) and go on with other tokens. On the tree and the plain server each gives
    exactly the tokens of a cold run (the plain server after a cache flush), and the hits are real
    (``cached_tokens``: at least 32 for 45 and 224 for 230; a match of 32 for 37 would leave no token to compute
    the window from, so 37 checks tokens only), so the request computes its own page after the match and reads the
    entries of the cached blocks and the compressor rows of the last cached page's ring."""
    checks.assert_radix_hits_match_cold_runs(servers["plain"], servers["tree"])


@pytest.fixture(scope="module")
def sampling_cases():
    return checks.sampling_cases(EMBEDDED)


@pytest.mark.parametrize("name", ["plain", "tree", "chain", "cycling"])
def test_sampled_tokens_follow_the_target(servers, sampling_cases, target_model, name):
    """Sampled losslessness with power. 3 GSM8K prompts x 3 settings (temperature 1; 0.6 + top-p 0.9; top-k 20 +
    min-p 0.05) x 500 samples of 10 tokens, with the server's random seed fixed (``--random-seed 7``). Positions
    1-9 (position 0 is the prefill's own sample) span about 5.7 verify rounds per sample.

    Each sampled token is scored against the target's exact conditional distribution given the sampled prefix (our
    model teacher-forced on the same checkpoint, processed like SGLang's sampler). Two statistics, pooled over
    every (sample, position): "the token is the target's top-1" and "... among its top-3". With P the target's
    probability of the event, ``z = sum(hit - P) / sqrt(sum P(1 - P))`` is standard normal under exact sampling
    (a martingale sum). The test fails when |z| > 3.5 for either (two-sided p = 4.7e-4 each).

    Power: a distortion that moves 2 % of the mass (total variation 0.02) into or out of the target's top-1 (or
    top-3) at each position shifts the sum by 0.02 n, so ``z ~ N(0.02 sqrt(n / v), 1)`` with v the mean P(1 - P)
    (about 0.15 here). It is detected with probability >= 0.9 once ``0.02 sqrt(n / v) >= 3.5 + 1.28``, i.e.
    n >= 57,100 v ~ 8,800 positions; the run has 40,500 and the test checks the bound with the v it measured.
    The non-speculative server passes the same test: the oracle matches SGLang's real sampler. Negative control:
    ``test_negative_controls.py`` biases the acceptance by 2 % and this check fails."""
    stats = checks.sampled_position_stats(servers[name], target_model, sampling_cases, SAMPLES_PER_CASE,
                                          SAMPLED_TOKENS)
    print(name, stats)
    checks.assert_follows_target(stats)
    if name != "plain":
        assert stats.mean_verify_rounds >= 3, stats


def test_abort_and_malformed_requests_leave_the_server_serving(servers):
    tree = servers["tree"]
    for bad in ({"text": "hi", "sampling_params": {"max_new_tokens": -1}},
                {"text": "hi", "sampling_params": {"temperature": -2}}):
        assert 400 <= tree.post("/generate", bad).status_code < 500
    r = requests.post(tree.url + "/generate", data=b"{oops", headers={"Content-Type": "application/json"},
                      timeout=30)
    assert 400 <= r.status_code < 500
    # Streaming requests dropped mid-generation by the client are aborted by the server.
    text = prompts.gsm8k("test")[30]["question"]
    for _ in range(3):
        with requests.post(tree.url + "/generate", stream=True, timeout=120,
                           json={"text": text, "stream": True,
                                 "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as resp:
            next(resp.iter_lines())
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    assert tree.generate({"text": text, "sampling_params": sampling})["output_ids"] == \
        servers["plain"].generate({"text": text, "sampling_params": sampling})["output_ids"]


def test_no_kv_leak_after_load(servers):
    """200 mixed requests, 20 of them dropped mid-stream by the client: once idle, the token pool holds exactly
    what it held before (read without a cache flush, which would hide a leak). Negative control: a server that
    forgets to free aborted requests fails this check (``test_negative_controls.py``)."""
    tree = servers["tree"]
    assert checks.idle_used_tokens_after_load(tree) == 0
    assert "memory leak" not in tree.log.read_text()  # SGLang's own idle check agrees
