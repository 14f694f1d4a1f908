"""An HCA layer's running pooling state (``dsv4.hca_compressor``) gives the pooled entries, bit for bit the same
however the positions are split into forwards.

The entry is the per-channel softmax pooling of a block's rows; the state folds one position at a time, so its
entries must match the pooling of the same rows (``compress_entries_ref``) to rounding, and -- the lossless
property -- a whole prompt in one forward, one position per forward, chunks, and draft-tree nodes (siblings
at the same position, branches crossing a block boundary) must all give exactly the states and entries of the
one-by-one folds. The projections are identities here, so the rows themselves are the same in every split and
only the state arithmetic is compared. Controls: too few sweeps inside a forward, and a regrouped sum (a chunk
pooled on its own and merged), must each break the exact check.
"""
import pytest
import torch

from sgl_kernel_ext.reference import compress_entries_ref
from sglang_tree_v4.dsv4 import hca_compressor
from sglang_tree_v4.dsv4.hca_compressor import HcaCompressor
from sglang_tree_v4.dsv4.rope import Rope
from sglang_tree_v4.dsv4.storage import (
    ForwardBatch,
    LayerLayout,
    SlotStore,
    SlotTable,
    StepCaps,
)

torch.set_num_threads(1)
D, R, T, SLOTS = 16, 8, 27, 64  # channels, block, sequence length


def compressor() -> HcaCompressor:
    torch.manual_seed(0)
    c = HcaCompressor(D, D, R, 1e-6)
    with torch.no_grad():
        c.wkv.weight.copy_(torch.eye(D))  # identities: a row is its input, in any batch
        c.wgate.weight.copy_(torch.eye(D))
        c.ape.normal_()
        c.norm.weight.uniform_(0.5, 1.5)
    return c


def new_store() -> SlotStore:
    return SlotStore([LayerLayout.of([("cstate", 2 * D)])], SLOTS, token_layouts=[LayerLayout.of([("entry", D)])])


ROPE = Rope(4, 10000.0)
X = torch.randn(T, D, generator=torch.Generator().manual_seed(1)) * 3
TABLE = torch.arange(T + 8)[None]  # one request, position p in slot p (slots past T: tree nodes)


def forward(c, store, positions, rows=None, out=None, base=None, anc=None, caps=None):
    positions = torch.tensor(positions)
    n = len(positions)
    req = torch.zeros(n, dtype=torch.long)
    if anc is None:
        tab = SlotTable.for_requests(TABLE, req, positions)
    else:
        tab = SlotTable(TABLE, req, torch.tensor(base), torch.tensor(anc))
    out = positions if out is None else torch.tensor(out)
    x = X[positions] if rows is None else rows
    with torch.no_grad():
        c.update(c.project(x), ForwardBatch(positions, positions, out, tab, caps), store, 0, ROPE)


def states(store, slots):
    return store.read(0, "cstate", torch.tensor(slots))


def entries(store):
    closing = [p for p in range(T) if (p + 1) % R == 0]
    return store.read(0, "entry", torch.tensor(closing))


@pytest.fixture(scope="module")
def one_by_one():
    c, store = compressor(), new_store()
    for p in range(T):
        forward(c, store, [p])
    return c, store


def test_entries_are_the_pooled_rows(one_by_one):
    c, store = one_by_one
    blocks = T // R
    idx = torch.arange(blocks * R).view(blocks, R)
    cos, sin = ROPE.cos_sin(idx[:, 0])
    ref = compress_entries_ref(X, X, idx, torch.zeros(R, dtype=torch.long), c.ape.detach(),
                               c.norm.weight.detach(), c.norm.eps, cos, sin, out_dtype=torch.float32)
    got = entries(store)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("split", [[T], [5, 22], [3, 9, 1, 14], [1] * 4 + [T - 4]], ids=str)
@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed"])
def test_any_split_into_forwards_is_exact(one_by_one, split, fixed):
    _, ref = one_by_one
    c, store = compressor(), new_store()
    p = 0
    for n in split:
        forward(c, store, list(range(p, p + n)), caps=StepCaps(64) if fixed else None)
        p += n
    assert torch.equal(states(store, range(T)), states(ref, range(T)))
    assert torch.equal(entries(store), entries(ref))


def test_tree_nodes_are_exact(one_by_one):
    """Committed up to L = 13; a tree in slots 40.. : root at 13, siblings at 14 and 15 crossing the block
    boundary at 16, a node at 16 starting the next block. A node's state must equal the one-by-one state of the
    same position when its path is the sequence's tokens, and each sibling's state its own fold."""
    _, ref = one_by_one
    c, store = compressor(), new_store()
    L = 13
    forward(c, store, list(range(L)))
    # nodes: 0 root (13), 1 (14), 2 (15), 3 (16), 4 sibling of 1 at 14 with another row, 5 (15) child of 4
    parents = [-1, 0, 1, 2, 0, 4]
    pos = [13, 14, 15, 16, 14, 15]
    rows = X[torch.tensor(pos)].clone()
    rows[4] = rows[4] * -0.5 + 1  # a different token at 14
    out = [40 + i for i in range(6)]
    anc = []
    for i in range(6):  # path slots root .. node, padded with the node's own
        path, j = [], i
        while j != -1:
            path.append(out[j])
            j = parents[j]
        path = path[::-1]
        anc.append(path + [path[-1]] * (4 - len(path)))
    for fixed in (None, StepCaps(64, 4)):
        forward(c, store, pos, rows=rows, out=out, base=[L] * 6, anc=anc, caps=fixed)
        on_path = [0, 1, 2, 3]  # nodes whose path is the sequence's own tokens
        assert torch.equal(states(store, [out[i] for i in on_path]), states(ref, [pos[i] for i in on_path]))
        assert torch.equal(store.read(0, "entry", torch.tensor([out[2]])), entries(ref)[1:2])  # closes block 1
        # the sibling branch: its own folds, one position at a time, from the committed state at 13
        side = new_store()
        forward(c, side, list(range(L)))
        forward(c, side, [13])
        forward(c, side, [14], rows=rows[4:5])
        forward(c, side, [15], rows=rows[5:6])
        assert torch.equal(states(store, [out[4], out[5]]), states(side, [14, 15]))
        assert not torch.equal(states(store, [out[5]]), states(store, [out[2]]))


def test_too_few_sweeps_break_the_exact_check(one_by_one, monkeypatch):
    _, ref = one_by_one
    monkeypatch.setattr(hca_compressor, "iterations", lambda fb, r: 1)
    c, store = compressor(), new_store()
    forward(c, store, list(range(T)))
    assert not torch.equal(states(store, range(T)), states(ref, range(T)))


def test_a_regrouped_sum_breaks_the_exact_check(one_by_one):
    """Pool positions 8..15 as one group and merge it into nothing: same math, another order of operations."""
    c, _ = one_by_one
    _, ref = one_by_one
    v = X[8:16]
    s = X[8:16] + c.ape.detach()
    lse = torch.logsumexp(s, 0)
    o = (torch.softmax(s, 0) * v).sum(0)
    stored = states(ref, [15])[0]
    assert torch.allclose(o, stored[:D], atol=1e-5) and torch.allclose(lse, stored[D:], atol=1e-5)
    assert not (torch.equal(o, stored[:D]) and torch.equal(lse, stored[D:]))
