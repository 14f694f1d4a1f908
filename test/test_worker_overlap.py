"""The worker's view of a request's tokens under overlap scheduling, where ``req.output_ids`` lags one round.

SGLang launches a round before it processes the previous round's result; the tokens that round accepted are then in
the batch's ``spec_info`` only. The serving tests run both schedules end to end; this pins the bookkeeping: which
case holds is read from the lengths, a history that fits neither stops the round, and the history the MTP catch-up
reads splices the pending tokens in at the right positions.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_tree_v4.speculative.worker import TreeV4Worker, _Output, _tokens_between

PROMPT, OUTPUT = [10, 11, 12, 13, 14], [20, 21]
D_MAX = 4


def _batch(accepted: list[list[int]] | None):
    req = SimpleNamespace(rid="r0", origin_input_ids=PROMPT, output_ids=OUTPUT)
    if accepted is None:
        return SimpleNamespace(reqs=[req], spec_info=None)
    rows = [a + [0] * (D_MAX - len(a)) for a in accepted]
    info = SimpleNamespace(accept_tokens=torch.tensor(rows).flatten(), accept_lens=torch.tensor([len(a) for a in
                                                                                                 accepted]))
    return SimpleNamespace(reqs=[req], spec_info=info)


def test_pending_tokens_follow_the_lengths():
    # The previous round accepted 3 tokens that output_ids does not hold yet: the sequence is 5 + 2 + 3 long, of
    # which the last (the bonus) is not committed.
    assert TreeV4Worker._pending_tokens(_batch([[30, 31, 32]]), [9]) == [[30, 31, 32]]
    # Processed already (no overlap, or the scheduler caught up): nothing pending, whatever spec_info holds.
    assert TreeV4Worker._pending_tokens(_batch([[30, 31, 32]]), [6]) == [[]]
    assert TreeV4Worker._pending_tokens(_batch(None), [6]) == [[]]
    with pytest.raises(RuntimeError, match="committed length of 12"):
        TreeV4Worker._pending_tokens(_batch([[30, 31, 32]]), [12])


def test_history_splices_pending_tokens():
    out = _Output(OUTPUT, [30, 31, 32])
    assert len(out) == 5 and out[-1] == 32 and out[0] == 20 and out[2] == 30
    assert out.slice(1, 4) == [21, 30, 31]
    full = PROMPT + OUTPUT + [30, 31, 32]
    for lo, hi in ((0, 10), (3, 6), (5, 7), (6, 9), (8, 10), (4, 4)):
        assert _tokens_between(PROMPT, out, lo, hi) == full[lo:hi], (lo, hi)
