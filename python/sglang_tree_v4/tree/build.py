"""EAGLE-2 dynamic draft-tree construction: expand the most promising frontier, then rerank to the budget.

Objective: among the candidates drafted (the root's top-K children, then at each later step the top-K children of
the K best new nodes), keep the ``num_nodes - 1`` with the highest cumulative draft log-probability (score). A child's
score never exceeds its parent's (log-probs are <= 0) and ties are broken by creation order, parents being created
first, so the kept set always contains each kept node's parent: it is a tree, and the best one among all subtrees of
the candidate set for any objective that increases with the scores (e.g. the sum of path probabilities, EAGLE-2's
estimate of the expected accept length).

``topk = 1`` and ``num_steps = num_nodes - 1`` give the linear chain drafted greedily.

The scores stand in for acceptance probabilities, which is only as good as the drafter's calibration. A draft
model trained on data is often far less confident than its agreement with the target's greedy choice (the embedded
model's MTP: mean top-1 probability 0.31 at 73% agreement), and an under-confident drafter makes the reranking trade
depth for width too eagerly. ``score_temperature`` T < 1 sharpens the draft distribution (log-softmax of logits / T)
for scoring only: the drafted tokens, the verification and therefore the output are unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch

from .draft_tree import DraftTree
from .drafter import Drafter, DraftStep


def build_draft_tree(
    root_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    drafter: Drafter,
    num_steps: int,
    topk: int,
    num_nodes: int | torch.Tensor,
    root_parent_hidden: torch.Tensor | None = None,
    root_draft: tuple[torch.Tensor, torch.Tensor] | None = None,
    score_temperature: float | torch.Tensor = 1.0,
    logits_hook: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> DraftTree:
    """Drafts and reranks one tree per request.

    Args:
        root_tokens: ``[B]`` the last accepted token of each request (the root, depth 0).
        prefix_lens: ``[B]`` committed tokens before the root (the root's position).
        drafter: see :class:`~.drafter.Drafter`; called ``num_steps`` times (``num_steps - 1`` with ``root_draft``).
        num_steps: S >= 1, the maximum depth of the tree.
        topk: K >= 1, children per expanded node and frontier width.
        num_nodes: D, the node budget with the root included; an int or ``[B]`` per request (padded width = max).
        root_parent_hidden: ``[B, *H]`` handed to the drafter as the root's ``parent_hidden`` at step 0.
        root_draft: ``(logits [B, 1, V], hidden [B, 1, *H])`` if the caller already ran the drafter on the root
            (e.g. during draft extend); step 0 then does not call the drafter.
        score_temperature: T > 0 applied to the draft logits before the log-softmax that scores nodes (1: EAGLE-2's
            raw draft confidence); a float (checked) or a tensor, ``[B]`` per request (not checked: that would read
            it back to the host).
        logits_hook: ``hook(logits [B, n, V], paths [B, n, s]) -> logits`` applied to every draft step's logits
            before children are chosen, ``paths`` holding the fed nodes' tokens below the root (e.g. the request's
            penalties and grammar along each path, so that drafts are tokens the target can accept).

    Returns:
        The reranked :class:`DraftTree`, nodes in creation order (topological; siblings best first).
    """
    if num_steps < 1 or topk < 1:
        raise ValueError("num_steps and topk must be >= 1")
    batch = root_tokens.shape[0]
    device = root_tokens.device
    if isinstance(score_temperature, torch.Tensor):  # per request; the caller keeps it > 0 (no host read here)
        temperature = score_temperature.to(device=device, dtype=torch.float32).expand(batch)
    elif not score_temperature > 0:
        raise ValueError(f"score_temperature must be > 0, got {score_temperature}")
    else:  # 1: no rescaling
        temperature = None if score_temperature == 1 else torch.full((batch,), float(score_temperature),
                                                                       device=device)
    budget = torch.as_tensor(num_nodes, dtype=torch.long, device=device).expand(batch)
    # An int budget fixes the width; a per-request budget is read once (the one host sync left here).
    width = num_nodes if isinstance(num_nodes, int) else int(budget.max())
    prefix_lens = prefix_lens.long()
    batch_idx = torch.arange(batch, device=device)[:, None]

    if root_draft is None:
        if root_parent_hidden is None:
            raise ValueError("give root_parent_hidden (or root_draft)")
        root_step = DraftStep(
            step=0,
            tokens=root_tokens.long()[:, None],
            positions=prefix_lens[:, None],
            slots=torch.zeros(batch, 1, dtype=torch.long, device=device),
            parent_slots=torch.full((batch, 1), -1, dtype=torch.long, device=device),
            ancestors=torch.ones(batch, 1, 1, dtype=torch.bool, device=device),
            parent_hidden=root_parent_hidden[:, None],
        )
        logits, hidden = drafter(root_step)
    else:
        logits, hidden = root_draft

    # The fed nodes of the current step ("frontier"): their pool index, slot, ancestors over slots, score.
    frontier_pool = torch.zeros(batch, 1, dtype=torch.long, device=device)
    frontier_slots = torch.zeros(batch, 1, dtype=torch.long, device=device)
    frontier_anc = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
    frontier_score = torch.zeros(batch, 1, device=device)
    frontier_paths = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)

    # Candidate pool, root at index 0, then each step's children in (parent, rank) order.
    pool_tokens = [root_tokens.long()[:, None]]
    pool_parents = [torch.full((batch, 1), -1, dtype=torch.long, device=device)]
    pool_logprobs = [torch.zeros(batch, 1, device=device)]
    pool_scores = [torch.zeros(batch, 1, device=device)]
    pool_depths = [torch.zeros(batch, 1, dtype=torch.long, device=device)]
    pool_size = 1

    for step in range(num_steps):
        fed = logits.shape[1]
        if logits_hook is not None:
            logits = logits_hook(logits, frontier_paths)
        row_temperature = None if temperature is None else temperature[:, None].expand(batch, fed)
        logprobs, top_tokens = top_children(logits, topk, row_temperature)
        scores = (frontier_score[:, :, None] + logprobs).flatten(1)
        tokens = top_tokens.flatten(1)
        pool_tokens.append(tokens)
        pool_parents.append(frontier_pool.repeat_interleave(topk, dim=1))
        pool_logprobs.append(logprobs.flatten(1))
        pool_scores.append(scores)
        pool_depths.append(torch.full_like(tokens, step + 1))
        new_pool_idx = pool_size + torch.arange(fed * topk, device=device).expand(batch, -1)
        pool_size += fed * topk
        if step == num_steps - 1:
            break

        # Next frontier: the K best new candidates (ties: earlier candidate first).
        pick = scores.argsort(dim=-1, descending=True, stable=True)[:, :topk]
        parent_local = pick // topk
        frontier_tokens = tokens.gather(1, pick)
        frontier_score = scores.gather(1, pick)
        frontier_pool = new_pool_idx.gather(1, pick)
        frontier_parent_slots = frontier_slots.gather(1, parent_local)
        frontier_slots = 1 + step * topk + torch.arange(topk, device=device).expand(batch, -1)
        parent_anc = frontier_anc[batch_idx, parent_local]
        own = torch.zeros(batch, topk, topk, dtype=torch.bool, device=device)
        own[:, torch.arange(topk), torch.arange(topk)] = True
        frontier_anc = torch.cat([parent_anc, own], dim=-1)
        frontier_paths = torch.cat([frontier_paths[batch_idx, parent_local], frontier_tokens[:, :, None]], dim=-1)
        # The next step's drafter pass, over the new frontier.
        logits, hidden = drafter(
            DraftStep(
                step=step + 1,
                tokens=frontier_tokens,
                positions=(prefix_lens[:, None] + step + 1).expand(batch, topk),
                slots=frontier_slots,
                parent_slots=frontier_parent_slots,
                ancestors=frontier_anc,
                parent_hidden=hidden[batch_idx, parent_local],
            )
        )

    return _rerank(
        torch.cat(pool_tokens, 1),
        torch.cat(pool_parents, 1),
        torch.cat(pool_depths, 1),
        torch.cat(pool_logprobs, 1),
        torch.cat(pool_scores, 1),
        budget,
        width,
    )


def top_children(logits: torch.Tensor, topk: int, temperature: torch.Tensor | None = None,
                 cpu_rows_per_chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, tokens)`` of the ``topk`` most likely next tokens: ``logits [..., V]`` -> ``[..., topk]`` each,
    log-probs of ``softmax(logits / temperature)`` with ``temperature [...]`` per row (default 1).

    On a CPU the rows are reduced a few at a time: whole-vocabulary temporaries of many rows fall out of cache and
    cost several times more than the arithmetic.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    temps = None if temperature is None else temperature.reshape(-1, 1).float()
    chunk = max(cpu_rows_per_chunk if flat.device.type == "cpu" else flat.shape[0], 1)
    values, tokens = [], []
    for start in range(0, flat.shape[0], chunk):
        rows = flat[start:start + chunk].float()
        if temps is not None:
            rows = rows / temps[start:start + chunk]
        top, tok = rows.topk(topk, dim=-1)
        values.append(top - rows.logsumexp(-1, keepdim=True))
        tokens.append(tok)
    shape = (*logits.shape[:-1], topk)
    return torch.cat(values).clamp(max=0.0).view(shape), torch.cat(tokens).view(shape)


def _rerank(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    logprobs: torch.Tensor,
    scores: torch.Tensor,
    budget: torch.Tensor,
    width: int,
) -> DraftTree:
    """Keeps the ``budget[b]`` best pool entries of each request (root first), in pool order, ``width`` columns."""
    batch, pool = tokens.shape
    device = tokens.device
    take = min(width, pool)
    best = scores.argsort(dim=-1, descending=True, stable=True)[:, :take]
    num_valid = budget.clamp(max=pool)
    rank = torch.arange(take, device=device)[None, :]
    # Valid picks sorted back into pool (= topological) order; the rest pushed to the end.
    keep_idx = torch.where(rank < num_valid[:, None], best, pool).sort(dim=-1).values
    valid = keep_idx < pool
    src = keep_idx.clamp(max=pool - 1)
    # Pool index -> tree index; the invalid picks all land in the spare last column.
    to_tree = torch.full((batch, pool + 1), -1, dtype=torch.long, device=device)
    to_tree.scatter_(1, keep_idx, rank.expand(batch, take).contiguous())
    pool_parent = parents.gather(1, src)
    tree_parent = torch.where(pool_parent >= 0, to_tree.gather(1, pool_parent.clamp(min=0)), -1)

    def pad(x: torch.Tensor, fill: float | int) -> torch.Tensor:
        x = torch.where(valid, x, fill)
        if take < width:
            x = torch.cat([x, torch.full((batch, width - take), fill, dtype=x.dtype, device=device)], 1)
        return x

    return DraftTree(
        tokens=pad(tokens.gather(1, src), 0),
        parents=pad(tree_parent, -1),
        depths=pad(depths.gather(1, src), 0),
        logprobs=pad(logprobs.gather(1, src), 0.0),
        scores=pad(scores.gather(1, src), 0.0),
        num_nodes=num_valid,
    )
