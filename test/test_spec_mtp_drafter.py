"""The worker's MTP drafter (tree-core protocol, scratch slots past the verify block) drafts every node exactly as
drafting that node's path alone would: checked against the runner-level MTP drafter on a random tiny V4 with a
prompt longer than the window."""

from __future__ import annotations

import torch

from sglang_tree_v4.dsv4.config import DSV4Config
from sglang_tree_v4.dsv4.model import DSV4Model
from sglang_tree_v4.dsv4.mtp_draft import MTPTreeDrafter as PathDrafter
from sglang_tree_v4.dsv4.runner import DSV4Runner
from sglang_tree_v4.spec.mtp_drafter import MTPTreeDrafter
from sglang_tree_v4.tree import build_draft_tree
from support.tiny_v4 import randomize, tiny_config

D, K, S = 8, 3, 4


def _model() -> DSV4Model:
    model = DSV4Model(DSV4Config.from_dict(tiny_config(96, hca_ratio=8, window=16)), with_mtp=True).eval()
    randomize(model, seed=5)
    return model


def _prefilled(model, prompt):
    runner = DSV4Runner(model, num_slots=512, max_len=128, max_reqs=2)
    rid = runner.add_request()
    out = runner.extend([rid], [prompt])[0]
    bonus = int(out.logits[-1].argmax())
    path_drafter = PathDrafter(runner)
    root = path_drafter.refresh(rid, out.streams, prompt[1:] + [bonus])
    return runner, rid, path_drafter, root, bonus


@torch.no_grad()
def test_tree_drafts_equal_path_alone_drafting():
    model = _model()
    prompt = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    runner, rid, _, root, bonus = _prefilled(model, prompt)
    L = runner.lens[rid]
    runner.req_table[rid, L:L + D + K * S] = torch.tensor(runner.alloc.alloc(D + K * S))
    drafter = MTPTreeDrafter(model, runner.mtp_store, runner.req_table[rid:rid + 1], torch.tensor([L]), D, K)
    fed = []

    def recording(step):
        logits, hidden = drafter(step)
        fed.append((step, logits))
        return logits, hidden

    build_draft_tree(torch.tensor([bonus]), torch.tensor([L]), recording, S, K, D,
                     root_draft=(root.logits[None], root.streams[None]))
    token_parent = {0: (bonus, -1)}
    for step, _ in fed:
        for i in range(step.tokens.shape[1]):
            token_parent[int(step.slots[0, i])] = (int(step.tokens[0, i]), int(step.parent_slots[0, i]))
    checked = 0
    for step, logits in fed:
        for i in range(step.tokens.shape[1]):
            path, slot = [], int(step.slots[0, i])
            while slot != -1:
                path.append(token_parent[slot][0])
                slot = token_parent[slot][1]
            path.reverse()
            alone_runner, alone_rid, alone, alone_root, alone_bonus = _prefilled(model, prompt)
            state = alone.start(alone_rid, alone_bonus, alone_root, 16)
            for depth in range(1, len(path)):
                alone.draft_step([state], [[(depth - 1, path[depth])]])
            torch.testing.assert_close(logits[0, i], state.logits[-1], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == K * (S - 1)
