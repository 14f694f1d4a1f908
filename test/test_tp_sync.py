"""Tensor parallelism at the worker level: with rank 0's verdict broadcast, two ranks whose random streams differ
still commit identical tokens; without it they would diverge (checked too, so the test can fail)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_tree_v4.speculative.tp_sync import broadcast_verdict
from sglang_tree_v4.tree import DraftTree, SamplingParams, verify_sampling
from sglang_tree_v4.tree.synthetic import distinct_tokens, random_parents

BATCH, WIDTH, VOCAB = 16, 8, 12


class GlooGroup:
    """The two members of SGLang's ``GroupCoordinator`` that the worker uses, over a plain gloo group."""

    def __init__(self):
        self.world_size = dist.get_world_size()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src=src)
        return tensor


def _rank(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shared = torch.Generator().manual_seed(0)  # identical model outputs on both ranks
    tree = DraftTree.from_parents(distinct_tokens(BATCH, WIDTH, VOCAB, shared),
                                  random_parents(BATCH, WIDTH, "random", shared))
    logits = torch.randn(BATCH, WIDTH, VOCAB, generator=shared)
    params = SamplingParams.uniform(BATCH, temperature=1.0)
    own = verify_sampling(tree, logits, params, generator=torch.Generator().manual_seed(100 + rank))
    synced = broadcast_verdict(own, GlooGroup())
    out[rank] = {"own": own.tokens.clone(), "synced": synced.tokens.clone(),
                 "synced_nodes": synced.accepted_nodes.clone(), "synced_lens": synced.accept_lens.clone()}
    dist.destroy_process_group()


def test_ranks_commit_rank0_verdict():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        r0, r1 = out[0], out[1]
    assert not torch.equal(r0["own"], r1["own"]), "different random streams should disagree somewhere"
    assert torch.equal(r1["synced"], r0["own"]) and torch.equal(r0["synced"], r0["own"])
    assert torch.equal(r0["synced_nodes"], r1["synced_nodes"]) and torch.equal(r0["synced_lens"], r1["synced_lens"])
