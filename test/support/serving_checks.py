"""End-to-end checks of a served TREE_V4, shared by the serving tests and their negative controls (the same check
must pass on the real server and fail on a server with an injected fault: ``support/mutations``).

* ``assert_speculation_exercised``: outputs of a greedy-identity check really went through accepted drafts.
* ``eval_prompts`` / ``run_all`` / ``assert_radix_hits_match_cold_runs``: the greedy-identity loads.
* ``idle_used_tokens_after_load``: 200 mixed requests, 20 dropped mid-stream, then the idle server's token pool,
  read without flushing anything.
* ``sampled_position_stats``: sampled continuations scored against the target's exact conditional distributions.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import torch

from sglang_tree_v4.testing import launcher, prompts

MUTATIONS_DIR = Path(__file__).resolve().parent / "mutations"


def launch_mutated(model, args: list[str], mutation: str, log: Path, **env_vars: str) -> launcher.Server:
    """A server with one injected fault (see ``mutations/sitecustomize.py``)."""
    path = os.pathsep.join(p for p in (str(MUTATIONS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = launcher.clean_env(PYTHONPATH=path, TREE_V4_TEST_MUTATION=mutation, **env_vars)
    return launcher.launch(model, args, log=log, env=env)


@contextlib.contextmanager
def healthy(started: dict[str, launcher.Server]):
    """Servers started together (``launcher.launch`` returns at once), once all answer; all stopped on the way out,
    also when one of them never comes up."""
    try:
        yield {name: launcher.wait_healthy(s) for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def assert_speculation_exercised(outputs: list[dict]) -> None:
    """Every emitted token after the prefill's comes from a verify round that emits its accepted drafts plus one, so
    ``tokens - 1 - verify rounds`` is a lower bound of the accepted drafts of a request."""
    tokens = sum(len(o["output_ids"]) for o in outputs)
    rounds = sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
    accepted = sum(len(o["output_ids"]) - 1 - o["meta_info"]["spec_verify_ct"] for o in outputs)
    assert rounds > 0, "no verify round ran"
    assert accepted > 0 and rounds < tokens, f"no draft accepted: {rounds} verify rounds for {tokens} tokens"


# --- greedy identity ---------------------------------------------------------------------------------------------
def eval_prompts(tokenizer_server) -> list[dict]:
    """20 short prompts plus long ones (> 300 tokens), as generate payload fragments."""
    texts = ([r["question"] for r in prompts.gsm8k("test")[:8]]
             + [prompts.mbpp_prompt(r) for r in prompts.mbpp("test")[:6]]
             + prompts.sharegpt_prompts(6))
    items = [{"text": t} for t in texts]
    long_text = " ".join(prompts.sharegpt_prompts(40)[-20:])
    ids = tokenizer_server.post("/tokenize", {"prompt": long_text}).json()["tokens"]
    assert len(ids) > 420
    items += [{"input_ids": ids[:310]}, {"input_ids": ids[:333]}, {"input_ids": ids[:421]}]
    return items


def run_all(server, items: list[dict], sampling: dict) -> list[dict]:
    """All ``items`` at once (batched by the server)."""
    with cf.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(lambda it: server.generate({**it, "sampling_params": sampling}), items))


def assert_radix_hits_match_cold_runs(plain, spec) -> None:
    """A 40-token prompt decodes 220 tokens, then requests sharing its first 37, 45 and 230 tokens go on with other
    tokens; on ``spec`` and ``plain`` each gives the tokens of a cold run (``plain`` after a cache flush) and the
    hits are real (whole pages of 16: at least 32 cached for 45, 224 for 230). The test that calls it says why."""
    text = " ".join(prompts.sharegpt_prompts(36)[28:36])
    ids = plain.post("/tokenize", {"prompt": text}).json()["tokens"]
    prompt, tail = ids[:40], ids[60:67]
    first_sampling = {"max_new_tokens": 220, "temperature": 0, "ignore_eos": True}
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    hits = {}
    for name, server in (("spec", spec), ("plain", plain)):
        first = server.generate({"input_ids": prompt, "sampling_params": first_sampling})
        seq = prompt + first["output_ids"]
        hits[name] = {n: server.generate({"input_ids": seq[:n] + tail, "sampling_params": sampling})
                      for n in (37, 45, 230)}
        hits[name]["seq"] = seq
    assert hits["spec"]["seq"] == hits["plain"]["seq"]
    seq = hits["plain"]["seq"]
    for n in (37, 45, 230):
        assert plain.post("/flush_cache", {}).status_code == 200
        cold = plain.generate({"input_ids": seq[:n] + tail, "sampling_params": sampling})
        assert cold["meta_info"]["cached_tokens"] == 0
        for name in ("spec", "plain"):
            hit = hits[name][n]
            assert hit["output_ids"] == cold["output_ids"], (name, n)
            assert hit["meta_info"]["cached_tokens"] >= {37: 0, 45: 32, 230: 224}[n], (name, n, hit["meta_info"])


def window_read_violations(server, model, n_prompts: int = 4, new_tokens: int = 160,
                           tie: float = 1e-3) -> list[tuple[int, int, float]]:
    """Greedy continuations served in one batch, each token checked against our model outside SGLang (a
    ``DSV4Runner``, which frees nothing), teacher-forced on the served sequence: the served token must be that
    model's top-1 up to a near tie (top log-prob minus the token's below ``tie``). Returns (request, token,
    gap) for every token that is not.

    Why outside SGLang: SGLang frees a request's window rows once they are ``retained_window`` positions behind
    (its ``sliding_window``), and a freed position reads SGLang's padding row. A step that read further back would
    read it on every server and on a cold run alike, so comparing servers cannot see it; the model that keeps
    everything can. Run the server with ``SGLANG_SWA_EVICTION_INTERVAL=1`` so rows are freed as early as SGLang
    ever frees them."""
    texts = [r["question"] for r in prompts.gsm8k("test")[10:10 + n_prompts]]
    ids = [server.post("/tokenize", {"prompt": t}).json()["tokens"] for t in texts]
    sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    outs = run_all(server, [{"input_ids": p} for p in ids], sampling)
    from sglang_tree_v4.testing.runner import DSV4Runner

    longest = max(len(p) for p in ids) + new_tokens
    runner = DSV4Runner(model, num_slots=longest + 16, max_len=longest + 1, max_reqs=1)
    bad = []
    for i, (prompt, out) in enumerate(zip(ids, outs, strict=False)):
        got = out["output_ids"]
        assert len(got) == new_tokens, (i, len(got))
        rid = runner.add_request()
        with torch.no_grad():
            logits = runner.extend([rid], [prompt + got[:-1]])[0].logits[len(prompt) - 1:]
        runner.release(rid)
        logp = torch.log_softmax(logits.double(), -1)
        gaps = logp.max(-1).values - logp.gather(1, torch.tensor(got)[:, None]).squeeze(1)
        bad += [(i, j, float(g)) for j, g in enumerate(gaps.tolist()) if g >= tie]
    return bad


# --- leaks -----------------------------------------------------------------------------------------------------
def _loads(server) -> dict:
    loads = requests.get(server.url + "/v1/loads", timeout=30).json()["loads"]
    return {k: sum(entry[k] for entry in loads) for k in ("num_used_tokens", "num_running_reqs", "num_waiting_reqs")}


def idle_used_tokens_after_load(server, n: int = 200, dropped: int = 20, seed: int = 0) -> int:
    """Token slots still held once the server is idle after ``n`` mixed requests (greedy and sampled, short and
    long), ``dropped`` of them streamed and abandoned by the client after their first chunk.

    Read from ``/v1/loads`` (``num_used_tokens`` = capacity - free - evictable radix entries), never after a
    ``/flush_cache``, which resets the allocator and would hide a leak. 0 means no leak."""
    texts = [r["question"] for r in prompts.gsm8k("test")[40:90]]
    rng = torch.Generator().manual_seed(seed)
    drop_at = set(torch.randperm(n, generator=rng)[:dropped].tolist())

    def one(i: int):
        sampling = {"max_new_tokens": 4 + i % 29, "ignore_eos": True,
                    "temperature": 0.0 if i % 3 == 0 else 0.8, "top_p": 0.95}
        payload = {"text": texts[i % len(texts)] + f" ({i})", "sampling_params": sampling}
        if i not in drop_at:
            return server.generate(payload)
        sampling["max_new_tokens"] = 400
        with requests.post(server.url + "/generate", json={**payload, "stream": True}, stream=True,
                           timeout=120) as resp:
            next(resp.iter_lines())  # the first chunk, then the client goes away
        return None

    before = _loads(server)["num_used_tokens"]
    with cf.ThreadPoolExecutor(24) as pool:
        outs = list(pool.map(one, range(n)))
    assert sum(o is not None for o in outs) == n - dropped
    deadline = time.time() + 60
    while time.time() < deadline:
        load = _loads(server)
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 and load["num_used_tokens"] == before:
            break
        time.sleep(1)
    return _loads(server)["num_used_tokens"] - before


# --- sampled losslessness --------------------------------------------------------------------------------------
Z_CRITICAL = 3.5  # two-sided p = 4.7e-4 per statistic; 2 statistics x 3 servers: a false alarm in < 0.3 % of runs
Z_POWER = 1.2816  # one-sided standard normal quantile for power 0.9
TV_DISTORTION = 0.02
SETTINGS = ({"temperature": 1.0},
            {"temperature": 0.6, "top_p": 0.9},
            {"temperature": 1.0, "top_k": 20, "min_p": 0.05})


@dataclass
class SampledStats:
    positions: int  # scored (sample, position) pairs
    z: dict  # statistic -> z score
    variance: dict  # statistic -> mean Bernoulli variance per position
    mean_verify_rounds: float

    def required_positions(self, name: str) -> int:
        return math.ceil(((Z_CRITICAL + Z_POWER) / TV_DISTORTION) ** 2 * self.variance[name])


def chat_prompt_ids(model_path, n_prompts: int = 3) -> list[list[int]]:
    """The first GSM8K test questions as first-turn generation prompts in the checkpoint's chat template."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    out = []
    for record in prompts.gsm8k("test")[:n_prompts]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": record["question"]}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def sampling_cases(model_path, n_prompts: int = 3) -> list[tuple[list[int], dict]]:
    """(prompt ids, sampling setting) pairs: every prompt of ``chat_prompt_ids`` with every one of ``SETTINGS``."""
    return [(ids, setting) for ids in chat_prompt_ids(model_path, n_prompts) for setting in SETTINGS]


def sample_continuations(server, prompt_ids: list[int], setting: dict, n: int, new_tokens: int) -> list[dict]:
    payload = {"input_ids": [prompt_ids] * n,
               "sampling_params": {**setting, "max_new_tokens": new_tokens, "ignore_eos": True}}
    return server.generate(payload)


@torch.no_grad()
def score_against_target(model, prompt_ids: list[int], setting: dict, samples: list[list[int]],
                         entry_format: str | None = None):
    """Per sample and position j >= 1 (the speculative ones; position 0 is the prefill's own sample): whether the
    sampled token is the target's top-1 / among its top-3 under the processed conditional distribution, and those
    probabilities. Conditionals come from our model run teacher-forced on the sampled prefix (the same checkpoint
    and float32 math as the server, its entries kept as the server keeps them: ``entry_format``), processed like
    SGLang's sampler (``tree.target_probs``)."""
    from sglang_tree_v4.testing.runner import DSV4Runner
    from sglang_tree_v4.tree import SamplingParams, target_probs

    chunk = 64
    m = len(samples[0])
    runner = DSV4Runner(model, num_slots=len(prompt_ids) + chunk * m + 16, max_len=len(prompt_ids) + m + 1,
                        max_reqs=chunk + 1, entry_format=entry_format)
    root = runner.add_request()
    runner.extend([root], [prompt_ids])
    hits = {"top1": [], "top3": []}
    probs_of = {"top1": [], "top3": []}
    for lo in range(0, len(samples), chunk):
        part = samples[lo:lo + chunk]
        rids = [runner.fork(root) for _ in part]
        outs = runner.extend(rids, [s[:-1] for s in part])  # logits predicting tokens 1 .. m-1
        logits = torch.cat([o.logits for o in outs])
        params = SamplingParams.uniform(logits.shape[0], setting.get("temperature", 1.0), setting.get("top_k", -1),
                                        setting.get("top_p", 1.0), setting.get("min_p", 0.0))
        if any(k in setting for k in PENALTY_KEYS):
            logits = apply_penalties(logits, [s[:j] for s in part for j in range(1, m)], setting)
        p = target_probs(logits, params).double()
        sampled = torch.tensor([s[1:] for s in part]).reshape(-1)
        top = p.topk(3, dim=-1)
        hits["top1"].append((top.indices[:, 0] == sampled).double())
        probs_of["top1"].append(top.values[:, 0])
        hits["top3"].append((top.indices == sampled[:, None]).any(-1).double())
        probs_of["top3"].append(top.values.sum(-1))
        for rid in rids:
            runner.release(rid)
    return ({k: torch.cat(v) for k, v in hits.items()}, {k: torch.cat(v) for k, v in probs_of.items()})


PENALTY_KEYS = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def apply_penalties(logits: torch.Tensor, outputs: list[list[int]], setting: dict) -> torch.Tensor:
    """``logits [N, V]`` of rows whose outputs so far are ``outputs``, with the setting's penalties applied as
    SGLang's sampler applies them (``tree.path_logits`` with the committed output alone)."""
    from sglang_tree_v4.tree.path_logits import PenaltyState, process_path_logits

    n, vocab = logits.shape
    state = PenaltyState.from_outputs(
        outputs, vocab, frequency=[setting.get("frequency_penalty", 0.0)] * n,
        presence=[setting.get("presence_penalty", 0.0)] * n, repetition=[setting.get("repetition_penalty", 1.0)] * n,
        min_new_tokens=[0] * n, stop_tokens=[set()] * n)
    empty = torch.zeros(n, 1, 0, dtype=torch.long)
    return process_path_logits(logits.float().clone()[:, None, :], empty, empty.bool(), state)[:, 0]


def assert_follows_target(stats: SampledStats) -> None:
    """The run has the power its docstring promises for each statistic, and no statistic is off by more than
    ``Z_CRITICAL`` standard deviations."""
    for stat in stats.z:
        assert stats.positions >= stats.required_positions(stat), ("underpowered", stat, stats)
        assert abs(stats.z[stat]) <= Z_CRITICAL, (stat, stats)


def sampled_position_stats(server, model, cases: list[tuple[list[int], dict]], n: int, new_tokens: int,
                           entry_format: str | None = None) -> SampledStats:
    """Pooled over cases, samples and positions, for each statistic: ``z = sum(hit - P) / sqrt(sum P (1 - P))``.

    Under exact sampling the hits of successive positions are Bernoulli(P) given the past, so the sum is a
    martingale and z is standard normal (by the martingale central limit theorem) whatever the dependence
    between positions."""
    hits_all, probs_all, rounds, count = {"top1": [], "top3": []}, {"top1": [], "top3": []}, 0, 0
    for prompt_ids, setting in cases:
        outs = sample_continuations(server, prompt_ids, setting, n, new_tokens)
        assert all(len(o["output_ids"]) == new_tokens for o in outs)
        rounds += sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        count += len(outs)
        hits, probs = score_against_target(model, prompt_ids, setting, [o["output_ids"] for o in outs],
                                           entry_format)
        for k in hits_all:
            hits_all[k].append(hits[k])
            probs_all[k].append(probs[k])
    z, variance = {}, {}
    for k in hits_all:
        h, p = torch.cat(hits_all[k]), torch.cat(probs_all[k])
        var = p * (1 - p)
        z[k] = float((h - p).sum() / var.sum().sqrt())
        variance[k] = float(var.mean())
    return SampledStats(int(torch.cat(hits_all["top1"]).numel()), z, variance, rounds / max(count, 1))


def acceptance_vs_offline(tokenizer_server, model, model_path, shape_args: list[str], items: list[dict],
                          outputs: list[dict], new_tokens: int) -> list[float]:
    """Per served greedy output of ``items`` (text prompts): its tokens per verify round over those of the offline
    loop (``testing.offline.speculative_greedy``, every stream kept, the MTP over the whole prompt) with the
    server's tree shape (``shape_args``: its flags) and draft score temperature. A served MTP that drafts from
    stale or missing rows (e.g. after a prefill) accepts less than the loop."""
    from sglang_tree_v4.speculative.server_args import checkpoint_score_temperature
    from sglang_tree_v4.testing.offline import speculative_greedy
    from sglang_tree_v4.testing.runner import DSV4Runner

    D, K, S = (int(shape_args[shape_args.index(flag) + 1]) for flag in (
        "--speculative-num-draft-tokens", "--speculative-eagle-topk", "--speculative-num-steps"))
    runner = DSV4Runner(model, num_slots=2048, max_len=512, max_reqs=2)
    ratios = []
    for item, out in zip(items, outputs, strict=False):
        ids = tokenizer_server.post("/tokenize", {"prompt": item["text"]}).json()["tokens"]
        with torch.no_grad():
            run = speculative_greedy(runner, ids, D, K, S, new_tokens,
                                     score_temperature=checkpoint_score_temperature(str(model_path)))
        ratios.append(out["meta_info"]["spec_accept_length"] / (len(run.tokens) / len(run.accepts)))
    return ratios


def acceptance_matches(ratios: list[float]) -> bool:
    """Served acceptance is the offline loop's: every prompt within 10 %, the mean within 5 %."""
    return all(0.9 <= r <= 1.1 for r in ratios) and abs(sum(ratios) / len(ratios) - 1) <= 0.05
