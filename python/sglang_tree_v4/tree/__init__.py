"""Tree speculation core (plain torch, no SGLang): draft trees, EAGLE-2 construction, lossless verification."""

from .build import build_draft_tree
from .draft_tree import DraftTree
from .drafter import Drafter, DraftStep
from .target_distribution import SamplingParams, target_probs
from .verify_greedy import verify_greedy, verify_greedy_from_argmax
from .verify_result import VerifyResult
from .verify_sampling import VerifyCoins, verify_sampling

__all__ = [
    "DraftStep",
    "DraftTree",
    "Drafter",
    "SamplingParams",
    "VerifyCoins",
    "VerifyResult",
    "build_draft_tree",
    "target_probs",
    "verify_greedy",
    "verify_greedy_from_argmax",
    "verify_sampling",
]
