"""DSpark, DeepSeek's block drafter for V4 (the ``mtp.0..`` tensors of the current checkpoints), in plain torch.

One drafting call proposes a block of ``γ`` (``dspark_block_size``) tokens for a request at committed length L:

* **Context**: the target's features at every committed position -- for each id in ``dspark_target_layer_ids`` the
  mean over the hyper-connection streams of the residual after that layer, concatenated -- go through
  ``main_proj`` and ``main_norm`` (stage 0's), and each stage keeps ``wkv``, ``kv_norm`` and RoPE of that as its
  window key (K = V) for the position (``write_context``). Context tokens never run through a stage.
* **Block**: the inputs ``[anchor, noise × (γ - 1)]`` at positions ``L .. L + γ - 1`` (the anchor is the last
  committed token's successor, the round's bonus) run through the stages, each a ratio-0 V4 block whose rows see
  the stage's keys of the last ``window`` committed positions and every row of the block (bidirectional inside it);
  the last stage's HC head, ``norm`` and the target's LM head give ``U [γ, V]`` (``block_logits``).
* **Markov head** (vanilla): row j's draft distribution given the token ``t`` before it (the anchor for row 0) is
  ``softmax(U_j + W2 · W1[t])`` (``conditional_logits``): exact for any parent token, which is what lets a tree
  branch anywhere after one backbone pass.
* **Confidence head**: ``σ(w · [h_j ; W1[t]])``, ``h_j`` the last stage's collapsed output before its norm: an
  estimate of row j's acceptance given its parent.

The stages' keys live in a ``SlotStore`` of one window-key layer per stage (``dspark_layouts``); block rows write
theirs to the block's own slots, which nothing reads after the call.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from .block import Block
from .config import SLIDING, DSV4Config
from .hyper import HyperHead
from .norm import RMSNorm
from .storage import ForwardBatch, LayerLayout, SlotStore, SlotTable, layer_layout

REQUIRED_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")
MARKOV_TYPES = ("vanilla",)  # DeepSeek also defines "gated" and "rnn"


class DSparkConfigError(ValueError):
    pass


def block_size_of(raw: Mapping[str, Any]) -> int:
    """``dspark_block_size`` of a DSpark checkpoint's config (rows of drafter scratch per request); 0 for an MTP one."""
    return int(raw.get("dspark_block_size") or 0) if raw.get("dspark_target_layer_ids") else 0


@dataclass(frozen=True)
class DSparkConfig:
    block_size: int  # γ: rows of one drafting call, drafts per call
    markov_rank: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]  # one stage per id
    n_routed_experts: int | None = None  # the stages' MoE, where it differs from the target's
    num_experts_per_tok: int | None = None

    @property
    def num_stages(self) -> int:
        return len(self.target_layer_ids)

    @staticmethod
    def from_dict(raw: Mapping[str, Any], num_layers: int, vocab_size: int) -> DSparkConfig | None:
        """The drafter a checkpoint config describes; None where it has no ``dspark_*`` key (an MTP checkpoint).
        What we do not serve stops here, naming the key."""
        if not any(k.startswith("dspark_") for k in raw):
            return None
        if raw.get("model_type") == "deepseek_v41":
            raise DSparkConfigError("model_type 'deepseek_v41': DeepSeek-V4.1 (features taken at a layer's entry, "
                                    "another residual layout) is not supported; TREE_V4 serves DeepSeek-V4 "
                                    "('deepseek_v4') checkpoints")
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise DSparkConfigError(f"the config has DSpark keys but lacks {', '.join(missing)}")
        kind = raw.get("dspark_markov_head_type", "vanilla")
        if kind not in MARKOV_TYPES:
            raise DSparkConfigError(f"dspark_markov_head_type {kind!r} is not supported (only "
                                    f"{', '.join(MARKOV_TYPES)})")
        ids = tuple(int(i) for i in raw["dspark_target_layer_ids"])
        if not ids or any(not 0 <= i < num_layers for i in ids):
            raise DSparkConfigError(f"dspark_target_layer_ids {list(ids)}: need layer ids in [0, {num_layers})")
        gamma, rank, noise = (int(raw[k]) for k in ("dspark_block_size", "dspark_markov_rank",
                                                     "dspark_noise_token_id"))
        if gamma < 1 or rank < 1:
            raise DSparkConfigError(f"dspark_block_size {gamma} and dspark_markov_rank {rank} must be >= 1")
        if not 0 <= noise < vocab_size:
            raise DSparkConfigError(f"dspark_noise_token_id {noise} is outside the vocabulary ({vocab_size})")
        return DSparkConfig(gamma, rank, noise, ids, raw.get("dspark_n_routed_experts"),
                            raw.get("dspark_num_experts_per_tok"))

    def to_dict(self) -> dict[str, Any]:
        """The config keys, as a checkpoint carries them."""
        out = {"dspark_block_size": self.block_size, "dspark_markov_rank": self.markov_rank,
               "dspark_markov_head_type": "vanilla", "dspark_noise_token_id": self.noise_token_id,
               "dspark_target_layer_ids": list(self.target_layer_ids)}
        if self.n_routed_experts:
            out["dspark_n_routed_experts"] = self.n_routed_experts
        if self.num_experts_per_tok:
            out["dspark_num_experts_per_tok"] = self.num_experts_per_tok
        return out

    def stage_config(self, cfg: DSV4Config) -> DSV4Config:
        """The target's config with the stages' expert count and top-k where the checkpoint overrides them."""
        changes = {}
        if self.n_routed_experts:
            changes["n_routed_experts"] = int(self.n_routed_experts)
        if self.num_experts_per_tok:
            changes["num_experts_per_tok"] = int(self.num_experts_per_tok)
        return dataclasses.replace(cfg, **changes) if changes else cfg


class MarkovHead(nn.Module):
    """Vanilla: ``W1`` an embedding ``[V, r]``, ``W2`` a linear ``r -> V``; reads only the previous token."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """The bias ``W2 · W1[prev]`` in fp32, computed in the head's own dtype (bf16 in a bf16 server)."""
        return self.head(self.embed(prev)).float()


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=False)


class DSparkStage(Block):
    """A ratio-0 V4 block with a non-hash MoE; stage 0 also holds ``main_proj``/``main_norm``, the last one the
    HC head, ``norm``, the Markov head and the confidence head -- where the published checkpoint puts them
    (``mtp.{s}.*``)."""

    def __init__(self, cfg: DSV4Config, dcfg: DSparkConfig, first: bool, last: bool):
        super().__init__(dcfg.stage_config(cfg), ratio=0, hashed=False)
        H = cfg.hidden_size
        if first:
            self.main_proj = nn.Linear(dcfg.num_stages * H, H, bias=False)
            self.main_norm = RMSNorm(H, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.hc_head = HyperHead(cfg.hc_mult, H, cfg.hc_eps, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, dcfg.markov_rank)
            self.confidence_head = ConfidenceHead(H, dcfg.markov_rank)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DSV4Config, dcfg: DSparkConfig):
        super().__init__()
        self.cfg, self.dcfg = cfg, dcfg
        n = dcfg.num_stages
        self.stages = nn.ModuleList([DSparkStage(cfg, dcfg, s == 0, s == n - 1) for s in range(n)])

    @property
    def last(self) -> DSparkStage:
        return self.stages[-1]


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [B, γ, V]: U, the Markov head's bias not yet added
    hidden: torch.Tensor  # [B, γ, H]: the last stage's collapsed output before its norm (the confidence head's)


def dspark_layouts(cfg: DSV4Config, dcfg: DSparkConfig) -> list[LayerLayout]:
    """One window-key layer per stage."""
    return [layer_layout(cfg, SLIDING) for _ in range(dcfg.num_stages)]


def new_dspark_store(cfg: DSV4Config, dcfg: DSparkConfig, num_slots: int, dtype=torch.float32,
                     device="cpu", block_rows: int = 0) -> SlotStore:
    """``block_rows``: window scratch for blocks drafted in place (``speculative.dspark_drafter``)."""
    return SlotStore(dspark_layouts(cfg, dcfg), num_slots, dtype, device, window_scratch_rows=block_rows)


def target_features(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """``[N, k H]``: for each tapped layer's output streams ``[N, hc, H]`` (in ``dspark_target_layer_ids`` order)
    their mean over the streams, concatenated."""
    return torch.cat([h.float().mean(1).to(h.dtype) for h in per_layer], -1)


def write_context(model: nn.Module, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  store: SlotStore) -> None:
    """Each stage's window key of committed positions from the target's ``features [N, k H]`` there."""
    drafter: DSparkDrafter = model.dspark
    first = drafter.stages[0]
    x = first.main_norm(first.main_proj(features.to(model.embed.weight.dtype)))  # main_proj may be FP8
    rope = model.ropes["main"]
    cos, sin = rope.cos_sin(positions)
    for s, stage in enumerate(drafter.stages):
        k = rope.norm_rotate(stage.attn.wkv(x), stage.attn.kv_norm.weight, stage.attn.kv_norm.eps, cos, sin)
        store.write(s, "k", slots, k)


def block_key_slots(table: SlotTable, lens: torch.Tensor, block_slots: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, window + γ]``: the slots every row of request b's block reads -- its last ``window`` committed
    positions (``-1`` below 0 or where the table does not know them) and the block's own rows. ``table`` has one
    query per request (``query_req`` = its row)."""
    ctx = lens.long()[:, None] - window + torch.arange(window, device=lens.device)
    return torch.cat([table.lookup(ctx), block_slots], 1)


def block_logits(model: nn.Module, anchors: torch.Tensor, lens: torch.Tensor, key_slots: torch.Tensor,
                 block_slots: torch.Tensor, store: SlotStore) -> BlockOutput:
    """One backbone pass over each request's block ``[anchor, noise × (γ - 1)]`` at positions ``lens ..``;
    ``key_slots [B, K]`` (``block_key_slots``), ``block_slots [B, γ]`` the rows the block writes."""
    drafter: DSparkDrafter = model.dspark
    B, gamma = block_slots.shape
    dev = anchors.device
    ids = torch.cat([anchors.long()[:, None],
                     torch.full((B, gamma - 1), drafter.dcfg.noise_token_id, dtype=torch.long, device=dev)], 1)
    positions = (lens.long()[:, None] + torch.arange(gamma, device=dev)).flatten()
    rows = torch.arange(B, device=dev).repeat_interleave(gamma)
    # The table is never consulted: every row's key list is given (the memo below), bidirectional in the block.
    table = SlotTable(key_slots, rows, positions, torch.zeros(B * gamma, 0, dtype=torch.long, device=dev))
    fb = ForwardBatch(ids.flatten(), positions, block_slots.flatten(), table)
    fb.memo(("window", model.cfg.window), lambda: key_slots[rows])
    h = model.embed(fb.input_ids).unsqueeze(1).expand(-1, model.cfg.hc_mult, -1).contiguous()
    rope = model.ropes["main"]
    store.forward_memo = fb.memo_
    try:
        for s, stage in enumerate(drafter.stages):
            h = stage(h, fb, store, s, rope)
    finally:
        store.forward_memo = None
    hidden = drafter.last.hc_head(h)
    logits = model.head(drafter.last.norm(hidden))
    return BlockOutput(logits.view(B, gamma, -1), hidden.view(B, gamma, -1))


def conditional_logits(model: nn.Module, logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Row j's draft logits given the token before it: ``U_j + W2 · W1[prev]`` (fp32), any leading shape."""
    return logits.float() + model.dspark.last.markov_head(prev)


def confidence(model: nn.Module, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """``σ(w · [h_j ; W1[prev]])`` in [0, 1], any leading shape."""
    last = model.dspark.last
    x = torch.cat([hidden.float(), last.markov_head.embed(prev).float()], -1)
    return torch.sigmoid(last.confidence_head.proj(x.to(last.confidence_head.proj.weight.dtype)).float()).squeeze(-1)


def greedy_chain(model: nn.Module, out: BlockOutput, anchors: torch.Tensor) -> torch.Tensor:
    """``[B, γ]`` the greedy drafts: row j takes the argmax given row j - 1's draft (the anchor for row 0)."""
    prev, drafts = anchors.long(), []
    for j in range(out.logits.shape[1]):
        prev = conditional_logits(model, out.logits[:, j], prev).argmax(-1)
        drafts.append(prev)
    return torch.stack(drafts, 1)
