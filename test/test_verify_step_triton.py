"""The fixed-shape verify step with the GPU kernels (Triton tree sparse attention and per-branch compression), run by
Triton's CPU interpreter, against the same step on the torch references: the kernels inside the real step, with
their real index lists (window, committed and per-branch entries, the indexer's top-k, padding), not only in
kernel unit tests.

As in ``test_kernels_triton``, ``TRITON_INTERPRET=1`` must be set before Triton decorates the kernels and must not
leak into other tests, so the check runs in a child process.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_verify_step_with_triton_kernels_equals_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert "steps equal" in proc.stdout, proc.stdout[-2000:]


def _child() -> None:
    import random

    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.dsv4.storage import StepCaps
    from sglang_tree_v4.dsv4.verify_step import verify_step
    from sglang_tree_v4.testing.runner import DSV4Runner
    from sglang_tree_v4.tree import DraftTree, SamplingParams, VerifyCoins

    torch.set_num_threads(1)
    model = load_model(str(ROOT / "models" / "tiny-v4"))
    rng = random.Random(5)
    V, D = model.cfg.vocab_size, 6
    lens = [14, 30]  # trees cross a CSA block end and the HCA (16) block end
    prompts = [[rng.randrange(2, V) for _ in range(L)] for L in lens]
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 1, 2, -1]])
    tree = DraftTree.from_parents(torch.tensor([[rng.randrange(V) for _ in range(D)] for _ in lens]), parents,
                                  torch.tensor([6, 5]))
    params = SamplingParams.uniform(2, temperature=0.9, top_p=0.95)
    coins = VerifyCoins.draw(2, D, torch.Generator().manual_seed(2))
    import sgl_kernel_ext.triton_compress as tc
    import sgl_kernel_ext.triton_tree_attention as ta
    calls = {"attention": 0, "compress": 0}

    def counted(module, name, key):
        inner = getattr(module, name)

        def wrapper(*a, **k):
            calls[key] += 1
            return inner(*a, **k)
        setattr(module, name, wrapper)

    counted(ta, "tree_sparse_attention_triton", "attention")
    counted(tc, "compress_entries_triton", "compress")
    results = {}
    for backend in ("torch", "triton"):
        os.environ["SGL_KERNEL_EXT_BACKEND"] = "torch"  # the prefill on the reference either way
        runner = DSV4Runner(model, num_slots=256, max_len=64, max_reqs=2)
        rids = [runner.add_request() for _ in lens]
        runner.extend(rids, prompts)
        scratch = torch.tensor([runner.alloc.alloc(D) for _ in rids])
        os.environ["SGL_KERNEL_EXT_BACKEND"] = backend
        out = verify_step(model, runner.store, runner.req_table, torch.tensor(rids), torch.tensor(lens), tree,
                          scratch, scratch, StepCaps(64), params, coins)
        results[backend] = (out, runner.store.rows(scratch.flatten()))
    # every attention layer (4) and every CSA compressor (2, with its indexer's) ran the kernel; the HCA layer folds
    # its running state in torch (``hca_compressor``)
    assert calls == {"attention": 4, "compress": 4}, calls
    ref, tri = results["torch"][0], results["triton"][0]
    valid = tree.valid_mask()
    err = ((tri.logits[valid] - ref.logits[valid]).abs().amax() / ref.logits[valid].abs().amax()).item()
    assert err < 1e-4, f"logits relative error {err}"
    for name in ("accepted_nodes", "tokens", "accept_lens"):
        assert torch.equal(getattr(tri.verdict, name), getattr(ref.verdict, name)), name
    for a, b in zip(results["triton"][1], results["torch"][1], strict=False):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    print(f"steps equal: logits relative error {err:.2e}, accept lengths {ref.verdict.accept_lens.tolist()}")


if __name__ == "__main__":
    _child()
