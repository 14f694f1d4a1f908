"""Startup validation and defaults of TREE_V4's server arguments.

Budget flags follow SGLang: ``--speculative-num-draft-tokens`` D (tokens verified per request per step, root
included), ``--speculative-eagle-topk`` K (branching of the dynamic tree), ``--speculative-num-steps`` S (draft
depth). ``K = 1, S = D - 1`` is the matched linear chain. Impossible values and models that are not DeepSeek-V4
with an MTP layer or a DSpark drafter stop the launcher with a message naming the flag or the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dsv4.config import DSV4Config, is_deepseek_v4, read_checkpoint_config
from ..dsv4.dspark import DSparkConfig
from ..serving.sglang_pool import check_page_size

# Defaults when only --speculative-algorithm TREE_V4 is given: a real tree (K > 1). Among the D = 8 tree shapes
# measured on the embedded model with calibrated draft scores (benchmark/RESULTS.md, "Tree shapes at D=8"; batch 1,
# 24 prompts, shapes run in side-by-side pairs), (K, S) = (3, 4) accepted as much as the best (GSM8K 2.98 vs 2.99
# for (4, 4)) at the lowest step time but one, and beat (3, 3) on GSM8K, MBPP and ShareGPT (+0.17, +0.14, +0.01
# tokens per pass); the matched chain accepted 2.60 on GSM8K.
DEFAULT_DRAFT_TOKENS = 8
DEFAULT_TOPK = 3
DEFAULT_STEPS = 4
MAX_DRAFT_TOKENS = 64
DSPARK_DRAFT_TOKENS = 16  # the largest D and the K of the adaptive budget over DSpark (``dspark_adaptive_budget``)
DSPARK_TOPK = 4
MAX_TOPK = 16


@dataclass(frozen=True)
class TreeBudget:
    draft_tokens: int  # D
    topk: int  # K
    steps: int  # S

    @property
    def is_chain(self) -> bool:
        return self.topk == 1


def max_tree_nodes(topk: int, steps: int) -> int:
    """Nodes an S-step, top-K dynamic tree can offer besides the root: K children of the root, then K*K candidates
    per further step (K frontier nodes times K children)."""
    return topk + (steps - 1) * topk * topk


def dspark_adaptive_budget(block_size: int) -> tuple[int, int, int]:
    """(D, K, S), the largest shape of the adaptive budget over a DSpark drafter of ``block_size`` γ: depth γ (its
    block), K = ``DSPARK_TOPK`` and D up to ``DSPARK_DRAFT_TOKENS``. Its draft costs one block pass at every shape,
    so the menu reaches further than the MTP's, whose every depth is a forward (RESULTS, "DSpark": on the embedded
    model the tree accepted most at D = 16)."""
    return min(DSPARK_DRAFT_TOKENS, 1 + max_tree_nodes(DSPARK_TOPK, block_size)), DSPARK_TOPK, block_size


def validate_budget(draft_tokens: int | None, topk: int | None, steps: int | None) -> TreeBudget:
    """Fill defaults and check that the three flags describe a buildable tree."""
    d = DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens
    k = (1 if steps is not None and steps == d - 1 and topk is None else DEFAULT_TOPK) if topk is None else topk
    s = (d - 1 if k == 1 else min(DEFAULT_STEPS, d - 1)) if steps is None else steps
    if not 2 <= d <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--speculative-num-draft-tokens must be in [2, {MAX_DRAFT_TOKENS}] for TREE_V4, got {d}")
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"--speculative-eagle-topk must be in [1, {MAX_TOPK}] for TREE_V4, got {k}")
    if not 1 <= s <= d - 1:
        raise ValueError(f"--speculative-num-steps must be in [1, D-1 = {d - 1}] for TREE_V4 "
                         f"(--speculative-num-draft-tokens {d}), got {s}")
    if max_tree_nodes(k, s) < d - 1:
        raise ValueError(
            f"--speculative-num-draft-tokens {d} cannot be filled by a tree with --speculative-eagle-topk {k} and "
            f"--speculative-num-steps {s} (at most {max_tree_nodes(k, s)} draft nodes besides the root); "
            f"raise --speculative-num-steps or --speculative-eagle-topk")
    return TreeBudget(d, k, s)


def validate_model(model_path: str) -> dict:
    """The checkpoint must be DeepSeek-V4 with a drafter: at least one MTP (next-n) layer, or DSpark, told apart by
    the config's keys and the tensors, which must agree (``drafter_kind``)."""
    cfg = read_checkpoint_config(model_path)
    if cfg is None:
        raise ValueError(f"--speculative-algorithm TREE_V4 needs a local DeepSeek-V4 checkpoint; "
                         f"--model-path {model_path!r} has no config.json")
    if cfg.get("model_type") == "deepseek_v41":
        raise ValueError(f"--model-path {model_path!r}: model_type 'deepseek_v41' (DeepSeek-V4.1) is not supported; "
                         f"TREE_V4 serves DeepSeek-V4 ('deepseek_v4') checkpoints")
    if not is_deepseek_v4(cfg):
        raise ValueError(f"--speculative-algorithm TREE_V4 supports DeepSeek-V4 models only; --model-path "
                         f"{model_path!r} is {cfg.get('architectures') or cfg.get('model_type')!r}")
    if drafter_kind(model_path, cfg) is None and int(cfg.get("num_nextn_predict_layers") or 0) < 1:
        raise ValueError(f"--speculative-algorithm TREE_V4 drafts with the model's MTP layer, but --model-path "
                         f"{model_path!r} has num_nextn_predict_layers = 0")
    return cfg


def drafter_kind(model_path: str, cfg: dict):
    """The checkpoint's DSpark config, or None for an MTP drafter; where the config's ``dspark_*`` keys and the
    ``mtp.*`` tensors disagree (a DSpark stage has ``main_proj`` on stage 0, an MTP layer ``e_proj``), stops naming
    both."""
    from ..checkpoint.weights import checkpoint_names

    dcfg = DSV4Config.from_dict(cfg)
    dspark = DSparkConfig.from_dict(cfg, dcfg.num_layers, dcfg.vocab_size)
    try:
        names = set(checkpoint_names(model_path))
    except (OSError, ValueError):  # no weights here (yet): the loader names what is missing
        names = set()
    stage = "mtp.0.main_proj.weight"
    if dspark is not None and names and stage not in names:
        raise ValueError(f"--model-path {model_path!r}: config.json declares a DSpark drafter (dspark_* keys) but "
                         f"the checkpoint has no {stage}"
                         + (" (its mtp.0.* is an MTP layer: mtp.0.e_proj.weight)" if "mtp.0.e_proj.weight" in names
                            else ""))
    if dspark is None and stage in names:
        raise ValueError(f"--model-path {model_path!r}: the checkpoint's mtp.0.* is a DSpark stage ({stage}) but "
                         f"config.json has no dspark_* keys (dspark_block_size, dspark_target_layer_ids, ...)")
    return dspark


CALIBRATION_KEY = "tree_v4"  # config.json section written by scripts/calibrate_tiny_v4.py


def draft_score_temperature(cfg: dict) -> float:
    """The temperature that calibrates the MTP's draft confidence for the tree's reranking (``tree.build``), read
    from the checkpoint's ``config.json`` section ``tree_v4.draft_score_temperature``; 1.0 (EAGLE-2's raw draft
    probabilities) when absent. It is a property of the checkpoint's target + MTP pair, fitted offline, so it travels
    with the weights instead of being a flag every launch must repeat."""
    section = cfg.get(CALIBRATION_KEY) or {}
    if not isinstance(section, dict):
        raise ValueError(f"config.json key {CALIBRATION_KEY!r} must be an object, got {section!r}")
    value = section.get("draft_score_temperature", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 100:
        raise ValueError(f"config.json {CALIBRATION_KEY}.draft_score_temperature must be a number in (0, 100], "
                         f"got {value!r}")
    return float(value)


def checkpoint_score_temperature(model_path: str) -> float:
    """``draft_score_temperature`` of the checkpoint at ``model_path`` (1.0 without a readable config.json)."""
    return draft_score_temperature(read_checkpoint_config(model_path) or {})


ADAPTIVE_ENV = "SGLANG_TREE_V4_ADAPTIVE"  # "1": no shape flag was given, the worker picks the shape per step
OVERLAP_ENV = "SGLANG_TREE_V4_OVERLAP"  # "1": overlap scheduling on any device, "0": never; unset: not on a CPU


def keeps_overlap(device: str | None) -> bool:
    """Whether TREE_V4 keeps SGLang's overlap scheduling (the worker supports both schedules).

    On a GPU yes: it hides the scheduler's host work behind the device's forward. On a CPU the forward is
    synchronous, so overlap hides nothing, and measured side by side it did not pay (``benchmark/RESULTS.md``,
    "Overlap scheduling"); ``SGLANG_TREE_V4_OVERLAP=1`` keeps it there anyway (tests serve the GPU's schedule on
    the CPU that way)."""
    import os

    forced = os.environ.get(OVERLAP_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return str(device) != "cpu"


def handle_server_args(server_args) -> None:
    """SGLang calls this while resolving arguments (on a recording stand-in: plain assignments are declared).
    Without any of the three shape flags the budget is adaptive (``adaptive.policy``), the defaults then being its
    largest shape; the decision travels to the scheduler processes in ``ADAPTIVE_ENV``."""
    import os

    raw = validate_model(server_args.model_path)
    draft_score_temperature(raw)
    if getattr(server_args, "enable_watermark", False):
        raise ValueError("--enable-watermark is not supported with --speculative-algorithm TREE_V4: the watermark "
                         "biases each sampled token by its context, which the tree's verification does not "
                         "reproduce")
    cfg = DSV4Config.from_dict(raw)
    server_args.page_size = check_page_size(cfg, server_args.page_size)
    flags = (server_args.speculative_num_draft_tokens, server_args.speculative_eagle_topk,
             server_args.speculative_num_steps)
    # validate_model checked that keys and tensors agree (``drafter_kind``); the keys alone say which drafter.
    dspark = DSparkConfig.from_dict(raw, cfg.num_layers, cfg.vocab_size)
    adaptive = all(v is None for v in flags)
    if dspark is not None:
        gamma = dspark.block_size
        if adaptive:  # the adaptive budget over DSpark's trees, up to its largest shape
            server_args.speculative_num_draft_tokens, server_args.speculative_eagle_topk, \
                server_args.speculative_num_steps = dspark_adaptive_budget(gamma)
        elif server_args.speculative_num_steps is not None and server_args.speculative_num_steps > gamma:
            raise ValueError(f"--speculative-num-steps {server_args.speculative_num_steps}: this checkpoint's DSpark "
                             f"drafter drafts blocks of dspark_block_size = {gamma} tokens, so at most {gamma} steps")
    os.environ[ADAPTIVE_ENV] = "1" if adaptive else "0"
    budget = validate_budget(server_args.speculative_num_draft_tokens, server_args.speculative_eagle_topk,
                             server_args.speculative_num_steps)
    if dspark is not None and budget.steps > dspark.block_size:  # steps filled from the other flags
        raise ValueError(f"--speculative-num-draft-tokens {budget.draft_tokens} with --speculative-eagle-topk "
                         f"{budget.topk} needs {budget.steps} draft steps; this checkpoint's DSpark drafter drafts at "
                         f"most dspark_block_size = {dspark.block_size}: set --speculative-num-steps")
    server_args.speculative_num_draft_tokens = budget.draft_tokens
    server_args.speculative_eagle_topk = budget.topk
    server_args.speculative_num_steps = budget.steps
    if not keeps_overlap(server_args.device):
        server_args.disable_overlap_schedule = True  # on a CPU (``keeps_overlap``)
    server_args.enable_mixed_chunk = False
    # The graphs are ours, verify per context bucket (``serving.step_graphs``): SGLang's decode graph runner would
    # pin every captured verify to the whole context. --disable-cuda-graph turns ours off too.
    from ..serving.step_graphs import GRAPHS_ENV
    if os.environ.get(GRAPHS_ENV) != "force":
        os.environ[GRAPHS_ENV] = "0" if server_args.disable_cuda_graph else "1"
    server_args.disable_cuda_graph = True
    if server_args.max_running_requests is None:
        server_args.max_running_requests = 64
    if server_args.swa_full_tokens_ratio is None:  # window rows per token slot, as upstream SGLang sets for V4
        server_args.swa_full_tokens_ratio = 0.1
