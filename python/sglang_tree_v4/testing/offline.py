"""TREE_V4's decode loop without SGLang, over a ``testing.runner.DSV4Runner``: for offline accept-length measurements
and for tests that need the whole draft -> verify -> commit -> MTP catch-up cycle on a real checkpoint.

It drafts with the same ``mtp_drafter.MTPTreeDrafter`` and ``tree.build_draft_tree`` the SGLang worker runs, verifies
with ``dsv4.tree_state.TreeVerifier`` and picks the accepted path with ``tree.verify_greedy``. A round over
committed length L with root (bonus) token b:

1. the MTP catches up over the positions committed since its last round with the TARGET's streams; its last
   query, at L - 1 with token b, is the root's draft);
2. the tree is drafted over scratch slots ``L + D ..`` (never a committed slot) and verified in one target forward;
3. the accepted nodes' rows are committed and the scratch released.

Accept length = tokens emitted per round (accepted drafts + the bonus), SGLang's definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..dsv4.block import ModelOutput
from ..dsv4.tree_state import TreeVerifier
from ..speculative.mtp_drafter import MTPTreeDrafter
from ..tree import build_draft_tree, verify_greedy
from .runner import DSV4Runner


@dataclass
class SpeculativeRun:
    tokens: list[int]  # emitted tokens (the first is the prefill's own greedy token)
    accepts: list[int] = field(default_factory=list)  # tokens emitted per verify round
    root_logits: torch.Tensor | None = None  # the MTP's draft for the round after the last (what it would propose)

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens the target accepted (each round emits its accepted drafts plus one bonus token)."""
        return sum(self.accepts) - len(self.accepts)


def _mtp_root(runner: DSV4Runner, rid: int, target_streams: torch.Tensor, next_tokens: list[int]) -> ModelOutput:
    """MTP over the committed positions it has not processed yet (``target_streams`` [n, hc, D] of those positions,
    ``next_tokens`` the tokens one ahead, the bonus last); returns the last query's output: the root's draft."""
    out = runner.mtp_extend([rid], [next_tokens], [target_streams])[0]
    return ModelOutput(out.logits[-1:], out.streams[-1:])


@torch.no_grad()
def speculative_greedy(runner: DSV4Runner, prompt: list[int], D: int, K: int, S: int, max_new: int,
                       eos: int | None = None, score_temperature: float = 1.0) -> SpeculativeRun:
    """Greedy TREE_V4 decoding of one request. Stops once ``max_new`` tokens are out (the last round may pass it, as
    in serving) or at the first ``eos``."""
    tv = TreeVerifier(runner)
    rid = runner.add_request()
    out = runner.extend([rid], [prompt])[0]
    bonus = int(out.logits[-1].argmax())
    root = _mtp_root(runner, rid, out.streams, prompt[1:] + [bonus])
    run = SpeculativeRun([bonus])
    while len(run.tokens) < max_new and eos not in run.tokens:
        L = runner.lens[rid]
        slots = torch.tensor(runner.alloc.alloc(D), dtype=torch.long, device=runner.device)
        runner.req_table[rid, L:L + slots.numel()] = slots
        drafter = MTPTreeDrafter(runner.model, runner.mtp_store, runner.req_table[rid:rid + 1],
                                 torch.tensor([L], device=runner.device), K, S)
        tree = build_draft_tree(torch.tensor([bonus]), torch.tensor([L]), drafter, S, K, D,
                                root_draft=(root.logits[None], root.streams[None]),
                                score_temperature=score_temperature)
        n = int(tree.num_nodes[0])
        res = tv.verify([rid], tree.tokens[:, :n], tree.parents[:, :n], tree.num_nodes, scratch=[slots[:D]])
        logits = torch.zeros(1, tree.width, res.logits[0].shape[-1])
        logits[0, :n] = res.logits[0]
        vr = verify_greedy(tree, logits)
        k = int(vr.accept_lens[0])
        acc = vr.accepted_nodes[0, :k].tolist()
        new = vr.tokens[0, :k].tolist()  # accepted draft tokens (depth >= 1) then the bonus
        tv.commit(rid, acc)
        runner.alloc.release(slots[D:].tolist())
        root = _mtp_root(runner, rid, res.streams[0][acc], new)
        bonus = new[-1]
        if eos is not None and eos in new:  # the request ends at its first eos, even one accepted mid-round
            new = new[: new.index(eos) + 1]
        run.tokens += new
        run.accepts.append(len(new))
    run.root_logits = root.logits[0]
    runner.release(rid)
    return run


@torch.no_grad()
def plain_greedy(runner: DSV4Runner, prompt: list[int], n: int) -> list[int]:
    """The ground truth: ``n`` greedy tokens decoded one at a time without speculation."""
    rid = runner.add_request()
    tok = int(runner.extend([rid], [prompt])[0].logits[-1].argmax())
    out = [tok]
    while len(out) < n:
        tok = int(runner.decode([rid], [tok])[0].logits[0].argmax())
        out.append(tok)
    runner.release(rid)
    return out
