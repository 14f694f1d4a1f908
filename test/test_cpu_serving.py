"""Stock SGLang on a plain CPU through our plugin: plain and NGRAM serving of a tiny Llama.

One plain server and one NGRAM server are shared by the module. Speculative outputs are compared
token for token with the plain server's (greedy), which is the ground truth.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys

import pytest
import requests

from sglang_tree_v4.testing import launcher as srv
from sglang_tree_v4.testing import prompts
from support import tiny_llama

pytestmark = pytest.mark.server
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama.build(tmp_path_factory.mktemp("tinyllama"))


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    plain = srv.launch(model, ["--device", "cpu"], logs / "plain.log")
    ngram = srv.launch(model, ["--device", "cpu", "--speculative-algorithm", "NGRAM",
                               "--speculative-num-draft-tokens", "4"], logs / "ngram.log")
    try:
        yield srv.wait_healthy(plain), srv.wait_healthy(ngram)
    finally:
        plain.stop()
        ngram.stop()


def greedy(server, prompt=None, ids=None, n=NEW_TOKENS) -> dict:
    payload = {"sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    payload.update({"text": prompt} if prompt is not None else {"input_ids": ids})
    return server.generate(payload)


def test_generate_and_openai_endpoints(servers):
    plain, _ = servers
    out = greedy(plain, "Natalia sold clips to 48 of her friends.")
    assert len(out["output_ids"]) == NEW_TOKENS and out["meta_info"]["completion_tokens"] == NEW_TOKENS
    r = plain.post("/v1/completions", {"model": "default", "prompt": "Tom has 3 apples", "max_tokens": 8,
                                        "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    r = plain.post("/v1/chat/completions", {"model": "default", "max_tokens": 8, "temperature": 0,
                                             "messages": [{"role": "user", "content": "How many legs?"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_malformed_requests_get_4xx_and_server_keeps_serving(servers):
    plain, _ = servers
    r = requests.post(plain.url + "/generate", data=b"{not json", timeout=30,
                      headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500
    r = plain.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -3}})
    assert 400 <= r.status_code < 500
    r = plain.post("/v1/chat/completions", {"model": "default", "messages": "not a list"})
    assert 400 <= r.status_code < 500
    assert len(greedy(plain, "still there?", n=4)["output_ids"]) == 4


def test_ngram_greedy_equals_plain(servers):
    plain, ngram = servers
    texts = [r["question"] for r in prompts.gsm8k("test")[:4]]
    texts += [prompts.mbpp_prompt(r) for r in prompts.mbpp("test")[:3]]
    for prompt in texts:
        a, b = greedy(plain, prompt), greedy(ngram, prompt)
        assert a["output_ids"] == b["output_ids"], prompt
    assert sum(greedy(ngram, p)["meta_info"].get("spec_verify_ct", 0) for p in texts[:2]) > 0


def test_ngram_radix_continuation_equals_plain(servers):
    plain, ngram = servers
    prompt = prompts.gsm8k("test")[5]["question"]
    first = {name: greedy(s, prompt) for name, s in (("plain", plain), ("ngram", ngram))}
    assert first["plain"]["output_ids"] == first["ngram"]["output_ids"]
    ids = tiny_llama_ids(plain, prompt) + first["plain"]["output_ids"]
    second = {name: greedy(s, ids=ids, n=12) for name, s in (("plain", plain), ("ngram", ngram))}
    assert second["ngram"]["meta_info"]["cached_tokens"] > len(ids) // 2
    assert second["plain"]["output_ids"] == second["ngram"]["output_ids"]


def test_ngram_concurrent_batch_equals_plain(servers):
    plain, ngram = servers
    texts = [r["question"] for r in prompts.gsm8k("test")[6:14]]
    with cf.ThreadPoolExecutor(len(texts)) as pool:
        spec = list(pool.map(lambda p: greedy(ngram, p), texts))
    for prompt, out in zip(texts, spec, strict=False):
        assert out["output_ids"] == greedy(plain, prompt)["output_ids"], prompt


def tiny_llama_ids(server, prompt: str) -> list[int]:
    """The prompt's token ids as the server tokenises them (bos included)."""
    r = server.post("/tokenize", {"prompt": prompt})
    if r.status_code == 200 and "tokens" in r.json():
        return r.json()["tokens"]
    out = server.generate({"text": prompt, "sampling_params": {"max_new_tokens": 1},
                           "return_logprob": True, "logprob_start_len": 0})
    return [t[1] for t in out["meta_info"]["input_token_logprobs"]]


def test_missing_c_compiler_fails_at_startup_with_one_message(model, tmp_path):
    """Where the stand-in driver cannot be built, the launcher stops and says what is missing."""
    venv_bin = os.path.dirname(sys.executable)
    env = srv.clean_env(PATH=venv_bin, SGLANG_TREE_V4_CACHE=str(tmp_path / "cache"))
    env.pop("CC", None)
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                           "--device", "cpu", "--port", str(srv.free_port())],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "needs a C compiler" in proc.stderr
    assert "Traceback" not in proc.stderr
