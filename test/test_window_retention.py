"""Every read of a step stays inside the window rows SGLang keeps.

SGLang frees a request's window rows (window keys, compressor rows, the MTP's keys and input streams) once their
positions are ``retained_window`` behind the newest (its ``sliding_window``, rounded to whole pages), and a freed
position then reads its padding row. What the state needs back from the newest committed position: the window
(keys of the last ``window`` positions, the query's own included), a block-closing query's rows (``r`` positions,
its own included) and the MTP's root draft (the last window of its keys); so ``retained_window`` is the larger of
the window and the longest block. A wrong read would be the same on every server and on a cold run, so this
compares served tokens with our model outside SGLang (``serving_checks.window_read_violations``), with SGLang
freeing rows as early as it ever does (``SGLANG_SWA_EVICTION_INTERVAL=1``), on a plain server and on TREE_V4 with
the CPU's eager step and with the GPU's fixed-shape step under overlap scheduling (whose eviction runs while the
previous round's forward is still reading). The CSA compressor rows live in a ring of a few rows per page
(``storage.SlotStore``): the plain server's pages of 16 keep 8, the tree servers' pages of 64 keep 16, so prefills
wrap their rings and trees write next to the committed rows their blocks read. Negative control:
``test_negative_controls.py`` keeps a window of one page less, and the same check fails.
"""

from __future__ import annotations

import pytest

from sglang_tree_v4.serving.sglang_model import FIXED_SHAPES_ENV
from sglang_tree_v4.speculative.server_args import OVERLAP_ENV
from sglang_tree_v4.testing import launcher as srv
from support import serving_checks as checks
from support.served import COMMON, EARLIEST_EVICTION, EMBEDDED, RING_PAGES, TREE

pytestmark = pytest.mark.server
SERVERS = {
    "plain": ([], {}),
    "tree": (TREE + RING_PAGES, {}),
    "tree_fixed_overlap": (TREE + RING_PAGES, {FIXED_SHAPES_ENV: "1", OVERLAP_ENV: "1"}),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started = {name: srv.launch(EMBEDDED, COMMON + args + ["--sleep-on-idle"], logs / f"{name}.log",
                                env=srv.clean_env(**EARLIEST_EVICTION, **env))
               for name, (args, env) in SERVERS.items()}
    with checks.healthy(started) as ready:
        yield ready


RING_LOG = {"plain": "MTP input streams): 8 per page of 16", "tree": "MTP input streams): 16 per page of 64",
            "tree_fixed_overlap": "MTP input streams): 16 per page of 64"}


@pytest.mark.parametrize("name", list(SERVERS))
def test_served_tokens_are_the_models_past_freed_windows(servers, target_model, name):
    """4 prompts of GSM8K test, 160 greedy tokens each in one batch: 5 windows of the embedded model (32), so
    every request's early rows are freed while it decodes."""
    bad = checks.window_read_violations(servers[name], target_model)
    assert not bad, f"{len(bad)} served tokens are not the model's top-1: {bad[:5]}"
    assert RING_LOG[name] in servers[name].log.read_text(errors="replace"), "the server built no CSA ring"
