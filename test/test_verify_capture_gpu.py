"""On a GPU: the fixed-shape verify step captured as one CUDA graph, with ``torch.cuda.set_sync_debug_mode("error")``
during warm-up and capture (any host synchronisation raises), replays to the same verdict and logits as the same
step run eagerly on an identical state. Skipped without CUDA (the CPU proof of the same property is
``test_verify_capturable``, on the meta device)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


def prepared(model, prompts, D):
    from sglang_tree_v4.testing.runner import DSV4Runner

    runner = DSV4Runner(model, num_slots=1024, max_len=128, max_reqs=len(prompts))
    rids = [runner.add_request() for _ in prompts]
    runner.extend(rids, prompts)
    scratch = torch.tensor([runner.alloc.alloc(D) for _ in rids], device="cuda")
    return runner, torch.tensor(rids, device="cuda"), scratch


@torch.no_grad()
def test_captured_step_replays_the_eager_step():
    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.dsv4.storage import StepCaps
    from sglang_tree_v4.dsv4.verify_step import verify_step
    from sglang_tree_v4.tree import DraftTree

    with torch.device("cuda"):  # built there: rope tables included, so nothing is copied to the GPU inside the step
        model = load_model(str(MODEL), dtype=torch.bfloat16)
    rng = random.Random(0)
    V, D = model.cfg.vocab_size, 8
    lens = [14, 30, 47, 63]
    prompts = [[rng.randrange(2, V) for _ in range(L)] for L in lens]
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 4, 6]] * len(lens), device="cuda")
    tree = DraftTree.from_parents(torch.randint(0, V, (len(lens), D), device="cuda"), parents)
    lens_t = torch.tensor(lens, device="cuda")
    caps = StepCaps(128)

    ref_runner, rids, scratch = prepared(model, prompts, D)
    ref = verify_step(model, ref_runner.store, ref_runner.req_table, rids, lens_t, tree, scratch, scratch, caps)

    runner, rids, scratch = prepared(model, prompts, D)

    def step():
        return verify_step(model, runner.store, runner.req_table, rids, lens_t, tree, scratch, scratch, caps)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    for name in ("accepted_nodes", "tokens", "accept_lens"):
        assert torch.equal(getattr(out.verdict, name), getattr(ref.verdict, name)), name
    torch.testing.assert_close(out.logits.float(), ref.logits.float(), rtol=2e-2, atol=2e-2)
