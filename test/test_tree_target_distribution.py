"""The processed target distribution against a per-row reference of SGLang's sampler semantics.

Reference semantics (SGLang 0.5.23 ``Sampler``, torch backend): softmax(logits / T); sort descending (ties: lower
token id first); keep rank r iff r < top_k and the mass before r is <= top_p (top_p = 1 keeps all: no float cumsum
artefacts); drop p < min_p * max p; renormalise.
Greedy (T = 0 or top_k = 1): one-hot at the first argmax.
"""

import itertools

import pytest
import torch

from sglang_tree_v4.tree import SamplingParams, target_probs
from support.oracles import reference_row


def run_grid(logits: torch.Tensor, grid: list[tuple], caps: tuple[int, ...]) -> None:
    rows = len(grid)
    temps, ks, ps, mins = zip(*grid, strict=False)
    params = SamplingParams(
        torch.tensor(temps), torch.tensor(ks, dtype=torch.long), torch.tensor(ps), torch.tensor(mins)
    )
    got = target_probs(logits[:rows], params, candidate_caps=caps)
    for r, (t, k, p, m) in enumerate(grid):
        want = reference_row(logits[r], t, k, p, m)
        assert torch.equal(got[r] > 0, want > 0), f"support differs for T={t} top_k={k} top_p={p} min_p={m}"
        torch.testing.assert_close(got[r].double(), want, atol=1e-6, rtol=1e-5)


GRID = list(itertools.product([0.0, 0.4, 1.0, 1.7], [-1, 1, 3, 40, 300], [1.0, 0.95, 0.6, 0.1], [0.0, 0.05, 0.4]))


# Candidate caps: none below the vocabulary (full sort only), one small, two in turn.
CAPS = [(4096,), (4,), (2, 64)]


@pytest.mark.parametrize("caps", CAPS)
def test_matches_reference_on_continuous_logits(caps):
    gen = torch.Generator().manual_seed(sum(caps))
    logits = torch.randn(len(GRID), 257, generator=gen) * 3
    run_grid(logits, GRID, caps)


@pytest.mark.parametrize("caps", CAPS)
def test_ties_are_broken_by_lower_token_id(caps):
    gen = torch.Generator().manual_seed(7)
    # Few distinct values: every cutoff falls inside a run of ties.
    logits = torch.randint(0, 4, (len(GRID), 50), generator=gen).float()
    run_grid(logits, GRID, caps)


def test_rows_are_independent_of_the_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=gen)
    params = SamplingParams(
        torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.5]),
        torch.tensor([-1, 20, -1, 5, 1, 900]),
        torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0, 0.3]),
        torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0]),
    )
    together = target_probs(logits, params)
    for r in range(6):
        alone = target_probs(logits[r : r + 1], params.select(torch.tensor([r])))
        torch.testing.assert_close(together[r : r + 1], alone, atol=0, rtol=0)


def test_bucketed_top_p_matches_reference_and_leaves_crowded_buckets_to_the_sort():
    from sglang_tree_v4.tree.target_distribution import _top_p_by_buckets

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(12, 3000, generator=gen) * torch.linspace(0.2, 4, 12)[:, None]
    logits[3] = 0.0  # uniform: one bucket of 3000 tokens
    logits[7] = -5.0
    logits[7, 500:2500] = 0.0  # 2000 tied tokens on top
    top_ps = torch.tensor([0.5, 0.9, 0.99, 0.7123, 0.3, 0.95, 0.8, 0.6, 0.999, 0.2, 0.9, 0.75])  # 0.7123: off k/3000
    probs = torch.softmax(logits, dim=-1)
    out = torch.full_like(probs, -1.0)
    solved = _top_p_by_buckets(out, probs, torch.arange(12), top_ps, max_boundary=1000)
    assert solved.tolist() == [r not in (3, 7) for r in range(12)]
    for r in range(12):
        if solved[r]:
            want = reference_row(logits[r], 1.0, -1, top_ps[r].item(), 0.0)
            assert torch.equal(out[r] > 0, want > 0), f"row {r}"
            torch.testing.assert_close(out[r].double(), want, atol=1e-6, rtol=1e-5)
        else:
            assert (out[r] == -1.0).all()
    # The caller falls back to the full sort for those rows, with the same semantics.
    params = SamplingParams(torch.ones(12), torch.full((12,), -1), top_ps, torch.zeros(12))
    got = target_probs(logits, params)
    for r in (3, 7):
        torch.testing.assert_close(got[r].double(), reference_row(logits[r], 1.0, -1, top_ps[r].item(), 0.0),
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shift", [16, 20, 23])
def test_bucketed_top_p_ranks_the_crossing_bucket_exactly(shift):
    from sglang_tree_v4.tree.target_distribution import _top_p_by_buckets

    gen = torch.Generator().manual_seed(shift)
    logits = torch.randn(10, 2000, generator=gen) * torch.linspace(0.3, 3, 10)[:, None]
    logits[4] = torch.randint(0, 3, (2000,), generator=gen).float()  # runs of ties
    top_ps = torch.tensor([0.5, 0.9, 0.99, 0.7, 0.3, 0.95, 0.8, 0.6, 0.999, 0.2])
    probs = torch.softmax(logits, dim=-1)
    out = torch.zeros_like(probs)
    solved = _top_p_by_buckets(out, probs, torch.arange(10), top_ps, shift=shift, max_boundary=10**9)
    assert solved.all()
    for r in range(10):
        want = reference_row(logits[r], 1.0, -1, top_ps[r].item(), 0.0)
        assert torch.equal(out[r] > 0, want > 0), f"row {r}"
        torch.testing.assert_close(out[r].double(), want, atol=1e-6, rtol=1e-5)


def test_large_vocabulary_rows_through_every_path():
    """Rows decided by the candidates, by the buckets and by the full sort, in one call on a large vocabulary."""
    from sglang_tree_v4.tree.target_distribution import BUCKETS_FROM_VOCAB

    vocab = BUCKETS_FROM_VOCAB + 123
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, vocab, generator=gen)
    logits[0, 7] += 12.0  # peaked: the top candidates decide
    grid = [(1.0, -1, 0.9, 0.0), (1.0, -1, 0.9, 0.0), (0.7, -1, 0.5, 0.02), (1.0, 5000, 0.95, 0.0), (1.2, -1, 1.0, 0.0)]
    run_grid(logits, grid, (64, 1024))


def _sglang_processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """SGLang 0.5.23's own torch sampler on one row: the temperature and softmax of ``Sampler.forward``, then
    ``top_k_top_p_min_p_sampling_from_probs_torch``'s filtered weights (``return_filtered_probs``), scattered back
    to token order and renormalised (multinomial sampling normalises them)."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    vocab = logits.shape[0]
    probs = torch.softmax(logits.float()[None] / temperature, dim=-1)
    _, weights, order, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs, torch.tensor([top_k if top_k > 0 else vocab]), torch.tensor([top_p]), torch.tensor([min_p]),
        need_min_p_sampling=min_p > 0, sampling_seed=None, positions=torch.zeros(1, dtype=torch.long),
        return_filtered_probs=True)
    out = torch.zeros(vocab, dtype=torch.float64).scatter_(0, order[0].long(), weights[0].double())
    return out / out.sum()


SAMPLER_GRID = list(itertools.product([0.4, 1.0, 1.7], [-1, 3, 40], [1.0, 0.9, 0.3], [0.0, 0.05, 0.4]))


def test_reference_row_equals_sglang_sampler():
    """The reference semantics the exact tests use (``reference_row``) against SGLang's own sampler code on the same
    logits and parameters (seeded random logits, plus rows with ties and a peaked row)."""
    g = torch.Generator().manual_seed(2024)
    rows = [torch.randn(257, generator=g) * s for s in (0.5, 2.0, 6.0)]
    ties = torch.randint(0, 4, (257,), generator=g).float()  # many exact ties
    for i, logits in enumerate(rows + [ties]):
        for t, k, p, m in SAMPLER_GRID:
            want = _sglang_processed(logits, t, k, p, m)
            got = reference_row(logits, t, k, p, m)
            if i == len(rows):  # which of equal tokens a cutoff keeps is unspecified in SGLang: compare the masses
                got, want = got.sort().values, want.sort().values
            assert (got - want).abs().sum() < 1e-5, f"row {i}: T={t} top_k={k} top_p={p} min_p={m}"
