"""Stochastic verification is lossless: its output distribution is the target's sequential sampling distribution.

Exact check: for small trees, enumerate every outcome of the procedure (which children are accepted, which bonus
token), weigh each by its probability computed from the reference target distribution, run the implementation
with coins at the middle of each outcome's region, and require (a) the implementation to produce that outcome and
(b) the outcome probabilities to add up, per emitted sequence, to the target's sequential probability
``prod_i p_{node_i}(token_i)``. Statistical check: >= 1e5 sampled steps per configuration, total-variation distance
and a chi-square test at significance 1e-3 against the target, for the first emitted token and the first two.
"""

import math
from collections import defaultdict

import pytest
import torch

from sglang_tree_v4.tree import (
    DraftTree,
    SamplingParams,
    VerifyCoins,
    verify_greedy,
    verify_sampling,
)
from sglang_tree_v4.tree.synthetic import distinct_tokens, random_parents
from support.oracles import reference_row

END = -1  # second "token" when the step emitted only one


def node_probs(logits: torch.Tensor, params: tuple) -> list[torch.Tensor]:
    return [reference_row(logits[i], *params) for i in range(logits.shape[0])]


def enumerate_outcomes(tree: DraftTree, b: int, probs: list[torch.Tensor]) -> list[dict]:
    """Every outcome of one verify step with its probability and coins at the middle of its region."""
    n = int(tree.num_nodes[b])
    vocab = probs[0].shape[0]
    outcomes = []

    def visit(node: int, weight: float, coins: dict, tokens: list, nodes: list) -> None:
        p = probs[node]
        residual = p.clone()
        reach = 1.0  # probability that all earlier siblings were rejected
        kids = [j for j in range(n) if tree.parents[b, j] == node]
        for c in kids:
            token = int(tree.tokens[b, c])
            total = residual.sum().item()
            a = residual[token].item() / total if total > 0 else 0.0
            if a > 0:
                visit(c, weight * reach * a, {**coins, c: a / 2}, tokens + [token], nodes + [c])
            reach *= 1 - a
            coins = {**coins, c: (1 + a) / 2}
            residual[token] = 0.0
            if reach <= 0:
                return
        total = residual.sum().item()
        before = 0.0
        for v in range(vocab):
            r = residual[v].item()
            if r > 0:
                outcomes.append(dict(weight=weight * reach * r / total, coins=coins, bonus=(before + r / 2) / total,
                                     tokens=tokens + [v], nodes=nodes))
            before += r

    visit(0, 1.0, {}, [], [0])
    return outcomes


def exact_check(tree: DraftTree, logits: torch.Tensor, params: list[tuple]) -> None:
    """Runs the enumeration for every request of ``tree`` and checks implementation and distribution."""
    row_of, all_outcomes = [], []
    for b in range(tree.batch_size):
        probs = node_probs(logits[b], params[b])
        outcomes = enumerate_outcomes(tree, b, probs)
        assert sum(o["weight"] for o in outcomes) == pytest.approx(1.0, abs=1e-9)
        # Per emitted sequence, the procedure's probability must be the target's sequential probability.
        by_sequence = defaultdict(float)
        for o in outcomes:
            by_sequence[tuple(o["tokens"])] += o["weight"]
        for sequence, weight in by_sequence.items():
            node, target = 0, 1.0
            for t in sequence:
                target *= probs[node][t].item()
                kids = [j for j in range(int(tree.num_nodes[b]))
                        if tree.parents[b, j] == node and tree.tokens[b, j] == t]
                node = kids[0] if kids else None
            assert weight == pytest.approx(target, abs=1e-9), f"sequence {sequence}"
        all_outcomes += outcomes
        row_of += [b] * len(outcomes)
    # Every outcome region, one batch row each, with its coins.
    width = tree.width
    index = torch.tensor(row_of)
    accept = torch.full((len(index), width), 0.5, dtype=torch.float64)
    for r, o in enumerate(all_outcomes):
        for node, coin in o["coins"].items():
            accept[r, node] = coin
    bonus = torch.tensor([o["bonus"] for o in all_outcomes], dtype=torch.float64)
    fields = ("tokens", "parents", "depths", "logprobs", "scores", "num_nodes")
    batch_tree = DraftTree(*(getattr(tree, f)[index] for f in fields))
    sampling = SamplingParams(*(torch.tensor([params[b][i] for b in row_of]) for i in range(4)))
    result = verify_sampling(batch_tree, logits[index], sampling, coins=VerifyCoins(accept, bonus))
    for r, o in enumerate(all_outcomes):
        length = len(o["tokens"])
        assert result.accept_lens[r] == length
        assert result.tokens[r, :length].tolist() == o["tokens"], f"row {r} outcome {o}"
        assert result.accepted_nodes[r, :length].tolist() == o["nodes"]


def small_tree(parents: list[int], tokens: list[int], copies: int = 1) -> DraftTree:
    return DraftTree.from_parents(torch.tensor([tokens] * copies), torch.tensor([parents] * copies))


PARAMS = [
    (1.0, -1, 1.0, 0.0),
    (0.7, -1, 1.0, 0.0),
    (1.6, 4, 1.0, 0.0),
    (1.0, -1, 0.8, 0.0),
    (0.8, 5, 0.9, 0.15),
    (1.0, 2, 1.0, 0.0),  # support of two tokens: children can hold all the mass
    (0.0, -1, 1.0, 0.0),  # greedy
]


@pytest.mark.parametrize(
    "parents,tokens",
    [
        ([-1, 0, 0, 0], [2, 0, 3, 5]),  # star, K = 3 siblings
        ([-1, 0, 0, 1, 1, 2, 3], [1, 0, 4, 2, 5, 0, 3]),  # two levels of siblings, a chain below
        ([-1, 0, 0, 0, 1, 1], [0, 3, 3, 1, 2, 2]),  # repeated sibling tokens
        ([-1, 0, 1, 2, 3], [4, 1, 1, 1, 1]),  # chain
    ],
)
def test_exact_output_distribution(parents, tokens):
    vocab = 6
    gen = torch.Generator().manual_seed(len(parents) * 31 + tokens[1])
    tree = small_tree(parents, tokens, copies=len(PARAMS))
    logits = torch.randn(len(PARAMS), len(parents), vocab, generator=gen) * 1.5
    logits[:, :, 1] += 1.0  # make some children likely
    exact_check(tree, logits, PARAMS)


def test_exact_with_children_outside_the_support():
    tree = small_tree([-1, 0, 0, 2], [0, 3, 1, 2], copies=2)
    logits = torch.tensor([[0.0, 3.0, 2.9, -9.0, 1.0]]).repeat(2, 4, 1)  # token 3 is cut by top-k / top-p
    exact_check(tree, logits, [(1.0, 2, 1.0, 0.0), (1.0, -1, 0.5, 0.0)])


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """Upper 1e-3 quantile of chi-square(df) (Wilson-Hilferty; z is the normal 1e-3 upper quantile)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def compare_counts(counts: dict, expected: dict, samples: int) -> tuple[float, float, float]:
    """TV distance, chi-square statistic (bins with expectation < 5 pooled) and its 1e-3 critical value."""
    keys = set(counts) | set(expected)
    assert all(expected.get(k, 0.0) > 0 for k in counts), "sampled an outcome of probability zero"
    tv = 0.5 * sum(abs(counts.get(k, 0) / samples - expected.get(k, 0.0)) for k in keys)
    stat, bins, pooled_o, pooled_e = 0.0, 0, 0.0, 0.0
    for k in keys:
        e = expected.get(k, 0.0) * samples
        o = counts.get(k, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            bins += 1
        else:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-12)
        bins += 1
    return tv, stat, chi_square_critical(max(bins - 1, 1))


STAT_CONFIGS = [
    ("star", 1, 8, (1.0, -1, 1.0, 0.0)),
    ("kary", 3, 13, (0.6, -1, 1.0, 0.0)),
    ("random", 2, 16, (1.3, 8, 1.0, 0.0)),
    ("random", 2, 16, (0.9, -1, 0.85, 0.0)),
    ("kary", 2, 15, (1.0, 10, 0.9, 0.05)),
    ("chain", 2, 8, (0.8, -1, 1.0, 0.1)),
]


def test_sampled_distribution_of_first_two_tokens():
    """All configurations in one batch of 6 x 100,000 rows; per configuration TV and chi-square vs the target."""
    vocab, per_config = 24, 100_000
    gen = torch.Generator().manual_seed(2024)
    trees, logits_rows, params_rows, expectations = [], [], [], []
    width = max(c[2] for c in STAT_CONFIGS)
    for shape, arity, nodes, params in STAT_CONFIGS:
        parents = torch.full((1, width), -1)
        parents[:, :nodes] = random_parents(1, nodes, shape, gen, arity)
        tokens = torch.zeros(1, width, dtype=torch.long)
        tokens[:, :nodes] = distinct_tokens(1, nodes, vocab, gen)
        tree = DraftTree.from_parents(tokens, parents, torch.tensor([nodes]))
        logits = torch.randn(1, width, vocab, generator=gen) * 1.5
        # Give the drafted children a fair chance so that many steps go deep.
        for i in range(1, nodes):
            logits[0, parents[0, i], tokens[0, i]] += 2.5
        probs = node_probs(logits[0], params)
        first = {v: probs[0][v].item() for v in range(vocab) if probs[0][v] > 0}
        pairs = {}
        for v, pv in first.items():
            kid = [j for j in range(1, nodes) if parents[0, j] == 0 and tokens[0, j] == v]
            if kid:
                for w in range(vocab):
                    if probs[kid[0]][w] > 0:
                        pairs[(v, w)] = pv * probs[kid[0]][w].item()
            else:
                pairs[(v, END)] = pv
        trees.append(tree)
        logits_rows.append(logits)
        params_rows.append(params)
        expectations.append((first, pairs))
    batch = len(STAT_CONFIGS) * per_config
    index = torch.arange(len(STAT_CONFIGS)).repeat_interleave(per_config)
    tree = DraftTree(*(torch.cat([getattr(t, f) for t in trees])[index]
                       for f in ("tokens", "parents", "depths", "logprobs", "scores", "num_nodes")))
    sampling = SamplingParams(*(torch.tensor([params_rows[c][i] for c in range(len(STAT_CONFIGS))])[index]
                                for i in range(4)))
    result = verify_sampling(tree, torch.cat(logits_rows)[index], sampling, generator=torch.Generator().manual_seed(7))
    assert result.tokens.shape[0] == batch
    second = torch.where(result.accept_lens > 1, result.tokens[:, 1], END)
    for c, (first, pairs) in enumerate(expectations):
        rows = slice(c * per_config, (c + 1) * per_config)
        t1, t2 = result.tokens[rows, 0].tolist(), second[rows].tolist()
        counts1, counts2 = defaultdict(int), defaultdict(int)
        for a, b in zip(t1, t2, strict=False):
            counts1[a] += 1
            counts2[(a, b)] += 1
        for counts, expected in ((counts1, first), (counts2, pairs)):
            tv, stat, critical = compare_counts(counts, expected, per_config)
            assert tv < 0.02, f"config {STAT_CONFIGS[c]}: TV {tv:.4f}"
            assert stat < critical, f"config {STAT_CONFIGS[c]}: chi-square {stat:.1f} >= {critical:.1f}"
        deep = (result.accept_lens[rows] >= 3).float().mean().item()
        if STAT_CONFIGS[c][0] != "star":
            assert deep > 0.05, f"config {STAT_CONFIGS[c]}: steps were meant to accept several tokens ({deep:.3f})"


def test_greedy_rows_follow_greedy_verification_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(11)
    batch, width, vocab = 8, 12, 40
    tree = DraftTree.from_parents(distinct_tokens(batch, width, vocab, gen),
                                  random_parents(batch, width, "random", gen))
    logits = torch.randn(batch, width, vocab, generator=gen)
    for i in range(1, width):  # favour the drafted tokens so greedy accepts deep
        logits[torch.arange(batch), tree.parents[:, i], tree.tokens[:, i]] += 2.0
    params = SamplingParams.uniform(batch, temperature=1.0, top_p=0.9)
    params.temperatures[::2] = 0.0
    params.top_ks[1::4] = 1  # top_k = 1 is greedy too
    greedy_rows = params.is_greedy()
    want = verify_greedy(tree, logits)
    for seed in range(5):
        got = verify_sampling(tree, logits, params, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(got.tokens[greedy_rows], want.tokens[greedy_rows])
        assert torch.equal(got.accepted_nodes[greedy_rows], want.accepted_nodes[greedy_rows])
    assert want.accept_lens[greedy_rows].max() >= 3


def test_same_seed_same_result_and_rows_independent_of_batch():
    gen = torch.Generator().manual_seed(5)
    batch, width, vocab = 6, 10, 50
    tree = DraftTree.from_parents(distinct_tokens(batch, width, vocab, gen),
                                  random_parents(batch, width, "kary", gen, 3))
    logits = torch.randn(batch, width, vocab, generator=gen)
    params = SamplingParams.uniform(batch, temperature=0.9, top_k=20)
    a = verify_sampling(tree, logits, params, generator=torch.Generator().manual_seed(1))
    b = verify_sampling(tree, logits, params, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.accepted_nodes, b.accepted_nodes)
    coins = VerifyCoins.draw(batch, width, torch.Generator().manual_seed(2))
    whole = verify_sampling(tree, logits, params, coins=coins)
    for r in range(batch):
        fields = ("tokens", "parents", "depths", "logprobs", "scores", "num_nodes")
        sub = DraftTree(*(getattr(tree, f)[r : r + 1] for f in fields))
        one = verify_sampling(sub, logits[r : r + 1], params.select(torch.tensor([r])),
                              coins=VerifyCoins(coins.accept[r : r + 1], coins.bonus[r : r + 1]))
        assert torch.equal(one.tokens[0], whole.tokens[r])


@pytest.mark.parametrize("block", [1, 7, 16, 256])
def test_inverse_cdf_picks_the_interval_holding_the_coin(block):
    from sglang_tree_v4.tree.verify_sampling import inverse_cdf

    gen = torch.Generator().manual_seed(block)
    weights = torch.rand(40, 300, generator=gen) * (torch.rand(40, 300, generator=gen) < 0.3)
    weights[0] = 0.0
    weights[0, 299] = 2.0  # all mass on the last token
    weights[1] = 0.0
    weights[1, 0] = 1.0  # all mass on the first token
    coins = torch.rand(40, generator=gen, dtype=torch.float64)
    coins[2], coins[3] = 0.0, 1.0 - 1e-12
    got = inverse_cdf(weights, coins, block=block)
    for r in range(40):
        cdf = weights[r].double().cumsum(0)
        target = coins[r].item() * cdf[-1].item()
        want = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
        assert got[r] == want and weights[r, want] > 0
