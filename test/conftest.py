"""Shared pytest setup: CPU tests run with one torch thread (two threads are far slower on small ops here), and the
fixtures several modules use."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target_model():
    """The embedded model in our plain torch code, loaded once: the oracle for served tokens and distributions."""
    from sglang_tree_v4.checkpoint.weights import load_model
    from support.served import EMBEDDED

    return load_model(str(EMBEDDED))
