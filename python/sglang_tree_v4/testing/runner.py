"""Per-request convenience over the slot-level model: a slot allocator, each request's canonical
position -> slot table, and ``extend`` / ``decode`` / MTP steps. For tests, benchmarks and training-time
evaluation; SGLang brings its own allocator and ``req_to_token`` instead."""
from __future__ import annotations

import torch

from ..dsv4.model import DSV4Model, ModelOutput
from ..dsv4.mtp import mtp_forward, new_mtp_store
from ..dsv4.storage import ForwardBatch, SlotStore, SlotTable


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of slots: need {n}, have {len(self.free)}")
        out = [self.free.pop() for _ in range(n)]
        return out

    def release(self, slots: list[int]) -> None:
        self.free.extend(reversed(slots))


class DSV4Runner:
    """Requests are small ints (rows of ``req_table``). ``lens[rid]`` = committed target positions;
    ``mtp_lens[rid]`` = positions the MTP layer has processed (it lags the target by one token)."""

    def __init__(self, model: DSV4Model, num_slots: int = 4096, max_len: int = 4096, max_reqs: int = 64,
                 entry_format: str | None = None, draft_scratch_rows: int = 64):
        """``entry_format``: how compressed entries and window keys are kept (``entry_codec.entry_codecs``; None: the
        model's dtype).
        ``draft_scratch_rows``: the MTP's draft-tree scratch (``mtp_drafter``), K (S - 1) rows per request drafted
        at once."""
        self.model = model
        dev = model.embed.weight.device
        dt = model.embed.weight.dtype
        self.store: SlotStore = model.new_store(num_slots, dt, dev, entry_format)
        self.mtp_store: SlotStore | None = (new_mtp_store(model.cfg, num_slots, dt, dev, draft_scratch_rows)
                                            if len(model.mtp) else None)
        self.alloc = SlotAllocator(num_slots)
        self.req_table = torch.full((max_reqs, max_len), -1, dtype=torch.long, device=dev)
        self.lens: dict[int, int] = {}
        self.mtp_lens: dict[int, int] = {}
        self.shared: dict[int, int] = {}  # rid -> number of leading positions whose slots it borrows (fork)
        self._free_rids = list(range(max_reqs - 1, -1, -1))

    @property
    def device(self) -> torch.device:
        return self.req_table.device

    def add_request(self) -> int:
        rid = self._free_rids.pop()
        self.lens[rid] = 0
        self.mtp_lens[rid] = 0
        self.shared[rid] = 0
        return rid

    def fork(self, rid: int, length: int | None = None) -> int:
        """A new request whose first ``length`` positions are ``rid``'s (their rows are shared read-only, as a
        radix-cache hit would share them). The parent must outlive the fork."""
        length = self.lens[rid] if length is None else length
        new = self.add_request()
        self.req_table[new, :length] = self.req_table[rid, :length]
        self.lens[new] = self.shared[new] = length
        self.mtp_lens[new] = min(self.mtp_lens[rid], length)
        return new

    def release(self, rid: int) -> None:
        n = self.lens.pop(rid)
        self.mtp_lens.pop(rid)
        self.alloc.release(self.req_table[rid, self.shared.pop(rid):n].tolist())
        self.req_table[rid] = -1
        self._free_rids.append(rid)

    def slots_of(self, rid: int) -> torch.Tensor:
        return self.req_table[rid, : self.lens[rid]]

    @torch.no_grad()
    def extend(self, rids: list[int], tokens: list[torch.Tensor | list[int]]) -> list[ModelOutput]:
        """Append ``tokens[i]`` to request ``rids[i]`` (prefill, a chunk, or one decode token) in one forward."""
        ids, pos, out, req, counts = [], [], [], [], []
        for rid, tok in zip(rids, tokens, strict=False):
            tok = torch.as_tensor(tok, dtype=torch.long, device=self.device).reshape(-1)
            L, n = self.lens[rid], tok.numel()
            slots = torch.tensor(self.alloc.alloc(n), dtype=torch.long, device=self.device)
            self.req_table[rid, L:L + n] = slots
            self.lens[rid] = L + n
            ids.append(tok)
            pos.append(torch.arange(L, L + n, device=self.device))
            out.append(slots)
            req.append(torch.full((n,), rid, dtype=torch.long, device=self.device))
            counts.append(n)
        positions = torch.cat(pos)
        fb = ForwardBatch(torch.cat(ids), positions, torch.cat(out),
                          SlotTable.for_requests(self.req_table, torch.cat(req), positions))
        res = self.model(fb, self.store)
        return _split(res, counts)

    def decode(self, rids: list[int], tokens: list[int]) -> list[ModelOutput]:
        return self.extend(rids, [[t] for t in tokens])

    @torch.no_grad()
    def mtp_extend(self, rids: list[int], next_tokens: list[torch.Tensor | list[int]],
                   streams: list[torch.Tensor]) -> list[ModelOutput]:
        """Run the MTP layer for the next ``len(next_tokens[i])`` positions of request i (target streams of those
        positions, tokens one ahead). Positions must already be committed for the target (their slots exist)."""
        ids, pos, out, req, counts, hs = [], [], [], [], [], []
        for rid, tok, h in zip(rids, next_tokens, streams, strict=False):
            tok = torch.as_tensor(tok, dtype=torch.long, device=self.device).reshape(-1)
            P, n = self.mtp_lens[rid], tok.numel()
            if P + n > self.lens[rid]:
                raise ValueError(f"request {rid}: MTP positions {P}..{P + n - 1} not committed by the target")
            self.mtp_lens[rid] = P + n
            ids.append(tok)
            pos.append(torch.arange(P, P + n, device=self.device))
            out.append(self.req_table[rid, P:P + n])
            req.append(torch.full((n,), rid, dtype=torch.long, device=self.device))
            counts.append(n)
            hs.append(h)
        positions = torch.cat(pos)
        fb = ForwardBatch(torch.cat(ids), positions, torch.cat(out),
                          SlotTable.for_requests(self.req_table, torch.cat(req), positions))
        return _split(mtp_forward(self.model, fb, torch.cat(hs), self.mtp_store), counts)


def _split(res: ModelOutput, counts: list[int]) -> list[ModelOutput]:
    return [ModelOutput(lg, st) for lg, st in zip(res.logits.split(counts), res.streams.split(counts), strict=False)]
