"""The adaptive budget's policy against a simulated server whose step times are as noisy as this CPU's.

    python benchmark/adaptive_policy_sim.py [--seeds 12] [--scenarios NAME ...] [--steps 600]
        [--set PROBE_EVERY=16 ...] [--quiet-machine] [--startup-error 1.3] [--hidden-per-token 0.05]
        [--overhead 6] [--learn-rest]

Why: on the CPU one server's runs at one sweep point spread 8-60 %, so a sweep cannot tell two settings of the
policy's constants apart. Here the server's own ``AdaptivePolicy`` (imported, not copied) chooses a shape per step
and observes that step's time, as the worker does, for ``--steps`` steps at one batch size. The true step times
come from a stated model, per scenario (milliseconds: a fixed part, the MTP's draft steps, and verification
linear in the verified tokens), shaped after the served per-step times the worker's debug log gave on the embedded
model (batch 32, GSM8K: no speculation 27 ms, D2 S1 41 ms, D3 S1 46 ms, D3 S2 62 ms). Acceptance per shape is
stated too (the batch-32 GSM8K values: D2 S1 1.69, D3 S1 1.84, D4 S2 2.33, D8 S4 3.0 tokens per step) and known to
the policy, so only the step times are learned. Each served step is the true time times noise: a per-step
log-normal factor (sigma 0.12), a slowly varying machine factor (AR(1), 0.95 per step, innovations 0.08: stretches
of tens of steps running 20-30 % slow or fast) and the first 30 steps 1.5x slower (memory touched for the first
time at a new batch size). Printed per scenario: the policy's tokens per second over the best fixed shape's on the
same noise sequence, min / median over the seeds, and over all scenarios. ``--quiet-machine`` drops the slow
factor and the cold start; ``--hidden-per-token`` adds a cost per verified token of a speculative step that the
startup model does not see (what the served batch-16 steps suggested: D6 S2 9.5 ms over D4 S2 where the model
said 3.5); ``--overhead`` adds a fixed cost per step that it does not see (SGLang's forward around the model's).

These are stated scenarios, not measurements; what they are for is comparing settings of the policy under one
noise model.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from sglang_tree_v4.speculative.adaptive.config import DEFAULT, PolicyConfig  # noqa: E402
from sglang_tree_v4.speculative.adaptive.policy import NO_SPECULATION, AdaptivePolicy  # noqa: E402
from sglang_tree_v4.speculative.adaptive.timing import Curve, StepTimes  # noqa: E402

# Tokens per step by (D, S) (K = 3), as the policy's statistics would hold them.
ACCEPT = {(1, 0): 1.0, (2, 1): 1.69, (3, 1): 1.84, (4, 1): 1.90, (3, 2): 2.12, (4, 2): 2.33, (5, 2): 2.45,
          (6, 2): 2.55, (7, 2): 2.60, (8, 2): 2.65, (4, 3): 2.30, (5, 3): 2.50, (6, 3): 2.70, (7, 3): 2.80,
          (8, 3): 2.88, (5, 4): 2.50, (6, 4): 2.75, (7, 4): 2.90, (8, 4): 3.00}
# name -> (batch, fixed ms, ms per draft step, verify ms at 0 tokens, verify ms per token, ms of a speculative
# step's acceptance and commit)
SCENARIOS = {
    "batch1": (1, 2.0, 4.0, 9.0, 0.3, 1.0),
    "batch4": (4, 2.5, 5.0, 11.0, 0.25, 1.2),
    "batch16": (16, 3.0, 7.0, 15.0, 0.16, 2.0),
    "batch32": (32, 3.4, 10.0, 19.0, 0.14, 2.6),
    "batch32_long_prompts": (32, 3.4, 10.0, 19.0, 0.42, 2.6),  # verification costly: no speculation is best
    "batch64": (64, 4.0, 16.0, 20.0, 0.16, 4.0),
    # As served at batch 32 on GSM8K on the CPU: no speculation 22 ms, D2 S1 40 ms, D4 S2 58 ms, D8 S4 ~90 ms
    # a step: no tree pays, the best (D2 S1) is 7 % behind.
    "batch32_none_ahead": (32, 3.4, 9.3, 15.4, 0.1, 7.8),
}


def true_ms(scenario: str, shape: tuple[int, int], hidden_per_token: float = 0.0) -> float:
    """``hidden_per_token``: ms per verified token of a speculative step that the startup model does not see."""
    batch, fixed, draft, v0, per_token, commit = SCENARIOS[scenario]
    d, s = shape
    drafting = 0.0 if s == 0 else draft * (0.75 if s == 1 else s) + commit + hidden_per_token * batch * d
    return fixed + drafting + v0 + per_token * batch * d


def _startup_model(scenario: str, rng: random.Random, error: float, config: PolicyConfig = DEFAULT) -> StepTimes:
    """What the startup measurement would give: the true costs, each curve point off by a factor between
    1 / ``error`` and ``error`` (log-uniform)."""
    batch = SCENARIOS[scenario][0]
    times = StepTimes(config=config)
    none = true_ms(scenario, NO_SPECULATION)

    def off():
        return math.exp(rng.uniform(-math.log(error), math.log(error)))

    for s in range(1, 5):
        times.draft[s] = Curve({batch: (true_ms(scenario, (1, s)) - none) / 1e3 * off()})
    times.verify = {d: Curve({batch: (true_ms(scenario, (d, 0))) / 1e3 * off()}) for d in range(1, 9)}
    return times


def run(scenario: str, seed: int, steps: int, quiet: bool, startup_error: float = 1.3,
        hidden_per_token: float = 0.0, overhead: float = 0.0, learn_rest: bool = False,
        config: PolicyConfig = DEFAULT) -> float:
    """The policy's throughput over the best fixed shape's, on one noise sequence."""
    rng = random.Random(seed)
    batch = SCENARIOS[scenario][0]
    policy = AdaptivePolicy(8, 3, 4, _startup_model(scenario, rng, startup_error, config), config)
    for d, s in policy.menu:
        policy.stats.sum[s, d], policy.stats.weight[s, d] = ACCEPT[(d, s)] * 10, 10
    slow, noise, tokens, seconds = 0.0, [], 0.0, 0.0
    for i in range(steps):
        if not quiet:
            slow = 0.95 * slow + rng.gauss(0, 0.08)
        factor = math.exp(slow + rng.gauss(0, 0.12)) * (1.5 if i < 30 and not quiet else 1.0)
        noise.append(factor)
        shape = policy.choose(batch)
        served = (true_ms(scenario, shape, hidden_per_token) + overhead) * factor / 1e3
        policy.times.observe(batch, shape, served)
        if learn_rest:  # the served verify's time over the model's into the rest of the round (not kept: see --help)
            verify = (true_ms(scenario, (shape[0], 0)) + overhead) * factor / 1e3
            policy.times.observe_rest(batch, max(verify - policy.times.verify_time(batch, shape[0]), 0.0))
        tokens += batch * ACCEPT[shape]
        seconds += served
    fixed = max(batch * ACCEPT[shape] * steps / sum((true_ms(scenario, shape, hidden_per_token) + overhead) * f / 1e3
                                                    for f in noise)
                for shape in policy.menu)
    return tokens / seconds / fixed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="override a field of the policy's PolicyConfig, e.g. PROBE_EVERY=16 "
                         "(a pair: FIT_MACHINE=0.9,0.1)")
    ap.add_argument("--quiet-machine", action="store_true")
    ap.add_argument("--startup-error", type=float, default=1.3,
                    help="each point of the startup model off by a factor up to this (a startup measured while "
                         "other processes started too was off by up to 5x on the CPU)")
    ap.add_argument("--hidden-per-token", type=float, default=0.0,
                    help="ms per verified token of a speculative step that the startup model misses (served at "
                         "batch 16 on the CPU: D6 S2 9.5 ms over D4 S2 where the model said 3.5, ~0.19 ms/token)")
    ap.add_argument("--overhead", type=float, default=0.0,
                    help="ms per step around the verify forward that the startup model does not time (served on "
                         "the CPU at batch 16: 4-7 ms)")
    ap.add_argument("--learn-rest", action="store_true",
                    help="learn the served verify's excess over the model online into the rest-of-round curve, as "
                         "a worker could (tried, not kept: 24 seeds, median 0.949-0.956 against 0.967 without)")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, value = item.split("=")
        if name not in {f.name for f in dataclasses.fields(PolicyConfig)}:
            raise SystemExit(f"PolicyConfig has no field {name}")
        default = getattr(DEFAULT, name)
        overrides[name] = (tuple(type(x)(v) for x, v in zip(default, value.split(","), strict=False))
                           if isinstance(default, tuple) else type(default)(value))
    config = dataclasses.replace(DEFAULT, **overrides)
    everything = []
    print("| scenario | policy / best fixed, min | median |")
    print("|---|---|---|")
    for scenario in args.scenarios:
        ratios = [run(scenario, seed, args.steps, args.quiet_machine, args.startup_error, args.hidden_per_token,
                      args.overhead, args.learn_rest, config)
                  for seed in range(args.seeds)]
        everything += ratios
        print(f"| {scenario} | {min(ratios):.3f} | {statistics.median(ratios):.3f} |")
    print(f"| all | {min(everything):.3f} | {statistics.median(everything):.3f} |")


if __name__ == "__main__":
    main()
