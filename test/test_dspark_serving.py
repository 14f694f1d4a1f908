"""TREE_V4 serving a DSpark checkpoint (``models/tiny-v4-dspark``): DSpark's chain and best-first trees (D=12, K=4,
S=γ) through real servers.

* Greedy: 32 concurrent mixed-length requests and 4 one by one give plain decoding's tokens, with drafts accepted,
  on the CPU's step and on the GPU's (the adaptive default with fixed shapes, overlap scheduling, graphs through
  their eager stand-in, which return the taps too), and with fp8 state and prompts prefilled in chunks of 64 (against
  a plain server with the same flags).
* Sampled: the powered distribution test of the MTP path (``test_tree_v4_serving``), chain and tree.
* The radix cache: a request's tokens and verify rounds are those of a cold run of it after a hit (its context
  keys were written by the earlier request's prefill and commits, the cold run's by its own prefill).
* Retraction (a pool too small for the batch) gives plain decoding's tokens.
* ``--speculative-num-steps`` past the block size stops the launcher naming the flag and the block size; with no
  shape flag the server runs the adaptive budget over DSpark's trees (``server_args.dspark_adaptive_budget``).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import requests

from sglang_tree_v4.serving.sglang_model import FIXED_SHAPES_ENV
from sglang_tree_v4.serving.step_graphs import GRAPHS_ENV
from sglang_tree_v4.speculative.server_args import OVERLAP_ENV
from sglang_tree_v4.testing import launcher as srv
from sglang_tree_v4.testing import prompts
from support import serving_checks as checks
from support.served import COMMON, SAMPLED_TOKENS, SAMPLES_PER_CASE, SLEEP

pytestmark = pytest.mark.server

DSPARK = Path(__file__).resolve().parents[1] / "models" / "tiny-v4-dspark"
GAMMA = 4
CHAIN = ["--speculative-algorithm", "TREE_V4", "--speculative-num-draft-tokens", str(GAMMA + 1),
         "--speculative-eagle-topk", "1", "--speculative-num-steps", str(GAMMA)]
TREE = ["--speculative-algorithm", "TREE_V4", "--speculative-num-draft-tokens", "12", "--speculative-eagle-topk", "4",
        "--speculative-num-steps", str(GAMMA)]
FP8_CHUNKED = ["--kv-cache-dtype", "fp8_e4m3", "--chunked-prefill-size", "64"]  # fp8 state, prompts in chunks
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # (its own step-time cache: the adaptive default measures at startup, as on a fresh machine)
    gpu_path = srv.clean_env(**{FIXED_SHAPES_ENV: "1", OVERLAP_ENV: "1", GRAPHS_ENV: "force",
                                "XDG_CACHE_HOME": str(logs / "step_time_cache")})
    started = {"plain": srv.launch(DSPARK, COMMON + SLEEP, logs / "plain.log", env=srv.clean_env()),
               "chain": srv.launch(DSPARK, COMMON + SLEEP + CHAIN, logs / "chain.log", env=srv.clean_env()),
               "tree": srv.launch(DSPARK, COMMON + SLEEP + TREE, logs / "tree.log", env=srv.clean_env()),
               "plain_fp8": srv.launch(DSPARK, COMMON + SLEEP + FP8_CHUNKED, logs / "plain_fp8.log",
                                       env=srv.clean_env()),
               "chain_fp8": srv.launch(DSPARK, COMMON + SLEEP + FP8_CHUNKED + CHAIN, logs / "chain_fp8.log",
                                       env=srv.clean_env()),
               # A pool of 1,024 tokens: 16 requests decoding 160 tokens each must be retracted and re-run.
               "small": srv.launch(DSPARK, [a if a != "32768" else "1024" for a in COMMON] + SLEEP + CHAIN,
                                   logs / "small.log", env=srv.clean_env()),
               "default": srv.launch(DSPARK, COMMON + SLEEP + ["--speculative-algorithm", "TREE_V4"],
                                     logs / "default.log", env=gpu_path)}
    with checks.healthy(started) as up:
        yield up


@pytest.fixture(scope="module")
def greedy_outputs(servers):
    items = (checks.eval_prompts(servers["plain"]) * 2)[:32]
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return items, {name: checks.run_all(s, items, sampling) for name, s in servers.items() if name != "small"}


@pytest.mark.parametrize("name", ["chain", "tree", "default", "chain_fp8"])
def test_greedy_equals_plain_decoding(servers, greedy_outputs, name):
    items, outs = greedy_outputs
    plain = "plain_fp8" if name.endswith("fp8") else "plain"
    assert [o["output_ids"] for o in outs[name]] == [o["output_ids"] for o in outs[plain]]
    checks.assert_speculation_exercised(outs[name])
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    for item, ref in list(zip(items, outs[plain], strict=True))[:4]:
        assert servers[name].generate({**item, "sampling_params": sampling})["output_ids"] == ref["output_ids"]


def test_retracted_requests_give_plain_decodings_tokens(servers):
    """Retraction frees a request's state and prefills it again later: its stage keys are rewritten by that
    prefill, so the tokens are plain decoding's."""
    items = checks.eval_prompts(servers["plain"])[:16]
    sampling = {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}
    want = checks.run_all(servers["plain"], items, sampling)
    got = checks.run_all(servers["small"], items, sampling)
    assert "Retract requests" in servers["small"].log.read_text()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    checks.assert_speculation_exercised(got)


def test_default_is_the_adaptive_budget_over_dspark_trees(servers, greedy_outputs):
    """No shape flag: the adaptive budget, up to D=16 K=4 S=γ, timed at startup with DSpark's own round (block pass,
    best-first search), served trees of several shapes (its choices and explorations) through the graphs."""
    log = servers["default"].log.read_text()
    assert f"D=16 K=4 S={GAMMA} (the largest shape of the adaptive budget)" in log, log[-2000:]
    assert f"draft steps [{GAMMA}]" in log  # one block pass timed: it drafts every depth at once
    assert "TREE_V4 graphs: captured verify" in log and "captured draft" not in log  # DSpark drafts need no graph
    info = requests.get(servers["default"].url + "/get_server_info", timeout=60).json()["internal_states"][0]
    assert info["tree_v4_adaptive"] is True
    trees = [k for k in info["tree_v4_shape_steps"] if k != "none"]
    assert len(trees) >= 2, info  # the largest shape first (warm-up), then its own choices


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_radix_hits_give_the_tokens_and_rounds_of_a_cold_run(servers, name):
    chain = servers[name]
    text = " ".join(prompts.sharegpt_prompts(36)[28:36])
    ids = chain.post("/tokenize", {"prompt": text}).json()["tokens"]
    prompt, tail = ids[:40], ids[60:67]
    first = chain.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 220, "temperature": 0,
                                                                     "ignore_eos": True}})
    seq = prompt + first["output_ids"]
    sampling = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    hits = {n: chain.generate({"input_ids": seq[:n] + tail, "sampling_params": sampling}) for n in (45, 230)}
    for n, hit in hits.items():
        assert hit["meta_info"]["cached_tokens"] >= {45: 32, 230: 224}[n], (n, hit["meta_info"])
        assert chain.post("/flush_cache", {}).status_code == 200
        cold = chain.generate({"input_ids": seq[:n] + tail, "sampling_params": sampling})
        assert cold["meta_info"]["cached_tokens"] == 0
        assert hit["output_ids"] == cold["output_ids"], n
        assert hit["meta_info"]["spec_verify_ct"] == cold["meta_info"]["spec_verify_ct"], n
    checks.assert_speculation_exercised([first, *hits.values()])


@pytest.fixture(scope="module")
def sampling_cases():
    return checks.sampling_cases(DSPARK)


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_sampled_tokens_follow_the_target(servers, sampling_cases, target_model, name):
    """As ``test_tree_v4_serving.test_sampled_tokens_follow_the_target`` (its docstring has the statistics and the
    power); the target is ``tiny-v4``'s, bit for bit."""
    stats = checks.sampled_position_stats(servers[name], target_model, sampling_cases, SAMPLES_PER_CASE,
                                          SAMPLED_TOKENS)
    print("dspark", name, stats)
    checks.assert_follows_target(stats)
    assert stats.mean_verify_rounds >= 3, stats


def test_steps_past_the_block_stop_the_launcher():
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(DSPARK),
                           "--speculative-algorithm", "TREE_V4", "--speculative-eagle-topk", "1",
                           "--speculative-num-steps", str(GAMMA + 1), "--port", str(srv.free_port())],
                          env=srv.clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"--speculative-num-steps {GAMMA + 1}" in proc.stderr and f"dspark_block_size = {GAMMA}" in proc.stderr
