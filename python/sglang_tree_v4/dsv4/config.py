"""DeepSeek-V4 model configuration, read from either of the two layouts in circulation.

* DeepSeek's own ``config.json`` (what the published checkpoints ship and what SGLang reads): per-layer
  ``compress_ratios`` (0 = sliding window only, 4 = CSA, 128 = HCA; may carry one trailing entry per MTP layer),
  ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_theta`` / ``compress_rope_theta`` / ``rope_scaling``.
* HF transformers' ``DeepseekV4Config`` (``layer_types``, ``compress_rates``, ``mlp_layer_types``,
  ``rope_parameters`` keyed ``main`` / ``compress``, ``partial_rotary_factor``).

Both are normalised into one frozen dataclass. Values that the math cannot honour are rejected with an error that
names the offending key, because a silently misread config produces a model that runs but computes something else.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_SCORING = ("sqrtsoftplus", "softmax", "sigmoid")


class ConfigError(ValueError):
    """A config key is missing, unknown in value, or inconsistent with another key."""


@dataclass(frozen=True)
class DSV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: tuple[int, ...]  # one per main layer: 0 (SWA only), else the compression ratio
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    hash_layers: tuple[bool, ...]  # one per main layer
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # YaRN parameters for the compress rope, or None
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 1 << 20
    ignored_keys: tuple[str, ...] = field(default=(), compare=False)

    # --- derived -------------------------------------------------------------------------------------------
    def layer_type(self, i: int) -> str:
        r = self.compress_ratios[i]
        if r == 0:
            return SLIDING
        return CSA if self.is_csa_ratio(r) else HCA

    @staticmethod
    def is_csa_ratio(r: int) -> bool:
        """CSA is the overlapping ratio-4 compressor with an indexer; every other non-zero ratio is HCA."""
        return r == 4

    @property
    def csa_ratio(self) -> int:
        return 4

    def __post_init__(self) -> None:
        _check(self.num_layers > 0, "num_hidden_layers", "must be positive")
        _check(len(self.compress_ratios) == self.num_layers, "compress_ratios", "length must equal num_hidden_layers")
        for r in self.compress_ratios:
            _check(r == 0 or r >= 2, "compress_ratios", f"ratio {r} is neither 0 (sliding only) nor >= 2")
        _check(len(self.hash_layers) == self.num_layers, "num_hash_layers", "inconsistent with num_hidden_layers")
        _check(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, "qk_rope_head_dim",
               f"rope dims {self.rope_dim} must be even and in (0, head_dim={self.head_dim}]")
        _check(self.num_heads % self.o_groups == 0, "o_groups",
               f"num_attention_heads {self.num_heads} not divisible by o_groups {self.o_groups}")
        _check(self.scoring_func in _SCORING, "scoring_func", f"{self.scoring_func!r} not in {_SCORING}")
        _check(1 <= self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
               "must be in [1, n_routed_experts]")
        _check(self.index_topk > 0, "index_topk", "must be positive")
        _check(self.index_head_dim >= self.rope_dim, "index_head_dim", "must be >= the rope dims")
        _check(self.window > 0, "sliding_window", "must be positive")
        _check(self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, "hc_mult/hc_sinkhorn_iters", "must be >= 1")
        if self.rope_scaling is not None:
            t = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            _check(t == "yarn", "rope_scaling", f"only YaRN is supported for the compress rope, got type {t!r}")
            for k in ("factor", "original_max_position_embeddings"):
                _check(k in self.rope_scaling, f"rope_scaling.{k}", "missing")

    # --- constructors --------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DSV4Config":
        """Either layout; HF's is recognised by ``layer_types`` / ``compress_rates`` / nested ``rope_parameters``."""
        if "layer_types" in d or "compress_rates" in d or "mlp_layer_types" in d:
            cfg = cls.from_hf_dict(d)
        else:
            cfg = cls.from_deepseek_dict(d)
        if d.get("dspark_target_layer_ids"):  # a DSpark drafter: one drafter layer (window keys) per stage
            cfg = dataclasses.replace(cfg, num_nextn_predict_layers=len(d["dspark_target_layer_ids"]))
        return cfg

    @classmethod
    def from_pretrained(cls, path: str) -> "DSV4Config":
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_hf(cls, hf_config: Any) -> "DSV4Config":
        """From a transformers ``DeepseekV4Config`` object (or its ``to_dict()``)."""
        d = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        return cls.from_hf_dict(d)

    @classmethod
    def from_deepseek_dict(cls, d: Mapping[str, Any]) -> "DSV4Config":
        n = _req(d, "num_hidden_layers", int)
        nextn = int(d.get("num_nextn_predict_layers", 1))
        ratios = list(_req(d, "compress_ratios", list))
        if len(ratios) == n + nextn:
            for r in ratios[n:]:
                _check(r == 0, "compress_ratios", f"MTP entries must be 0 (sliding only), got {ratios[n:]}")
            ratios = ratios[:n]
        _check(len(ratios) == n, "compress_ratios",
               f"has {len(ratios)} entries; expected num_hidden_layers={n} (or {n + nextn} incl. MTP layers)")
        head_dim = _req(d, "head_dim", int)
        rope_dim = int(d.get("qk_rope_head_dim", 64))
        if "qk_nope_head_dim" in d:
            _check(d["qk_nope_head_dim"] + rope_dim == head_dim, "qk_nope_head_dim",
                   f"qk_nope_head_dim + qk_rope_head_dim != head_dim ({d['qk_nope_head_dim']}+{rope_dim}!={head_dim})")
        n_hash = int(d.get("num_hash_layers", 0))
        _check(0 <= n_hash <= n, "num_hash_layers", f"{n_hash} not in [0, {n}]")
        rs = d.get("rope_scaling")
        if rs is not None and rs.get("type", rs.get("rope_type")) in (None, "default"):
            rs = None
        return cls._build(d, n, ratios, [i < n_hash for i in range(n)], head_dim, rope_dim,
                          float(d.get("rope_theta", 10000.0)), float(d.get("compress_rope_theta", 160000.0)),
                          dict(rs) if rs else None, _known=_DEEPSEEK_KEYS)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "DSV4Config":
        n = _req(d, "num_hidden_layers", int)
        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        for k in rates:
            _check(k in (CSA, HCA), "compress_rates", f"unknown layer type {k!r}")
        _check(rates.get(CSA, 4) == 4, "compress_rates", "the CSA ratio must be 4 (overlapping compressor)")
        types = list(_req(d, "layer_types", list))[:n]
        _check(len(types) == n, "layer_types", f"has {len(types)} entries, num_hidden_layers={n}")
        ratios = []
        for t in types:
            _check(t in (SLIDING, CSA, HCA), "layer_types", f"unknown layer type {t!r}")
            ratios.append(0 if t == SLIDING else rates[t])
        mlp = list(d.get("mlp_layer_types") or (["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)))[:n]
        for t in mlp:
            _check(t in ("hash_moe", "moe"), "mlp_layer_types", f"unknown mlp type {t!r}")
        _check(len(mlp) == n, "mlp_layer_types", "length must equal num_hidden_layers")
        head_dim = _req(d, "head_dim", int)
        prf = d.get("partial_rotary_factor")
        rope_dim = int(round(head_dim * prf)) if prf else int(d.get("qk_rope_head_dim", 64))
        rp = d.get("rope_parameters") or {}
        main, comp = rp.get("main"), rp.get("compress")
        if isinstance(main, Mapping) and isinstance(comp, Mapping):
            theta = float(main.get("rope_theta", d.get("rope_theta", 10000.0)))
            ctheta = float(comp.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
            _check(main.get("rope_type", "default") == "default", "rope_parameters.main",
                   "the main rope must be plain RoPE")
            ctype = comp.get("rope_type", comp.get("type", "default"))
            _check(ctype in ("default", "yarn"), "rope_parameters.compress", f"unsupported rope type {ctype!r}")
            rs = None
            if ctype == "yarn":
                # transformers multiplies this rope's cos/sin by ``attention_factor``; when the key is absent it
                # infers YaRN's mscale from ``factor`` (and ``mscale`` / ``mscale_all_dim``). Same here.
                rs = {k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor")}
                rs["attention_factor"] = _yarn_attention_factor(comp, "rope_parameters.compress")
        else:  # flat legacy rope_parameters: YaRN params for the compress rope
            theta = float(d.get("rope_theta", 10000.0))
            ctheta = float(d.get("compress_rope_theta", 160000.0))
            t = rp.get("rope_type", rp.get("type", "default")) if rp else "default"
            rs = dict(rp) if t == "yarn" else None  # transformers sets attention_factor 1.0 unless one is given
        return cls._build(d, n, ratios, [t == "hash_moe" for t in mlp], head_dim, rope_dim, theta, ctheta, rs,
                          _known=_HF_KEYS)

    @classmethod
    def _build(cls, d, n, ratios, hash_layers, head_dim, rope_dim, theta, ctheta, rs, _known) -> "DSV4Config":
        if rs is not None:  # canonical YaRN dict; V4's reference never scales cos/sin unless a factor is given
            af = rs.get("attention_factor")
            af = 1.0 if af is None else float(af)
            _check(af > 0, "rope_parameters.compress.attention_factor", f"must be positive, got {af}")
            rs = {"type": rs.get("type", rs.get("rope_type")), "factor": rs.get("factor"),
                  "original_max_position_embeddings": rs.get("original_max_position_embeddings"),
                  "beta_fast": rs.get("beta_fast") or 32, "beta_slow": rs.get("beta_slow") or 1,
                  "attention_factor": af}
        nkv = int(d.get("num_key_value_heads", 1))
        _check(nkv == 1, "num_key_value_heads", f"V4 is single-KV-head MQA (K = V), got {nkv}")
        ignored = tuple(sorted(k for k in d if k not in _known))
        return cls(
            vocab_size=_req(d, "vocab_size", int), hidden_size=_req(d, "hidden_size", int), num_layers=n,
            num_heads=_req(d, "num_attention_heads", int), head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=_req(d, "q_lora_rank", int), o_groups=_req(d, "o_groups", int),
            o_lora_rank=_req(d, "o_lora_rank", int), window=_req(d, "sliding_window", int),
            compress_ratios=tuple(int(r) for r in ratios), index_n_heads=_req(d, "index_n_heads", int),
            index_head_dim=_req(d, "index_head_dim", int), index_topk=_req(d, "index_topk", int),
            hc_mult=int(d.get("hc_mult", 4)), hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)), n_routed_experts=_req(d, "n_routed_experts", int),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            num_experts_per_tok=_req(d, "num_experts_per_tok", int),
            moe_intermediate_size=_req(d, "moe_intermediate_size", int), hash_layers=tuple(hash_layers),
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)), rope_theta=theta, compress_rope_theta=ctheta,
            rope_scaling=rs, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 1)),
            max_position_embeddings=int(d.get("max_position_embeddings", 1 << 20)), ignored_keys=ignored,
        )

    def to_deepseek_dict(self) -> dict[str, Any]:
        """DeepSeek ``config.json`` layout (compress_ratios include one 0 per MTP layer)."""
        return {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_dim, "qk_nope_head_dim": self.head_dim - self.rope_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window,
            "compress_ratios": list(self.compress_ratios) + [0] * self.num_nextn_predict_layers,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps, "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size, "num_hash_layers": _hash_prefix(self.hash_layers),
            "scoring_func": self.scoring_func, "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": _deepseek_rope_scaling(self.rope_scaling),
            "rms_norm_eps": self.rms_norm_eps, "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "max_position_embeddings": self.max_position_embeddings,
        }


def read_checkpoint_config(path: str) -> dict | None:
    """A checkpoint folder's raw ``config.json`` (None if there is none, e.g. a hub id)."""
    file = os.path.join(str(path), "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def is_deepseek_v4(raw: Mapping[str, Any] | None) -> bool:
    """Whether a raw checkpoint config describes DeepSeek-V4 (either layout)."""
    return raw is not None and (raw.get("model_type") == "deepseek_v4"
                                or "DeepseekV4ForCausalLM" in (raw.get("architectures") or []))


def _yarn_attention_factor(yarn: Mapping[str, Any], key: str) -> float:
    """The cos/sin scale of a YaRN rope as transformers computes it: ``attention_factor`` if given, else
    ``0.1 ln(factor) + 1`` (or the ratio of that with ``mscale`` over ``mscale_all_dim`` when both are given)."""
    if yarn.get("attention_factor") is not None:
        return float(yarn["attention_factor"])
    factor = yarn.get("factor")
    _check(factor is not None, f"{key}.factor", "missing")

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)


def _deepseek_rope_scaling(rs: Mapping[str, Any] | None) -> dict | None:
    """DeepSeek's ``rope_scaling``: the attention factor is written only where it scales (DeepSeek's own code
    applies none)."""
    if not rs:
        return None
    return {k: v for k, v in rs.items() if k != "attention_factor" or v != 1.0}


def _hash_prefix(flags: tuple[bool, ...]) -> int:
    k = sum(flags)
    if any(flags[k:]) or not all(flags[:k]):
        raise ConfigError("num_hash_layers: DeepSeek's layout can only express hash routing on the first layers")
    return k


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"DeepSeek-V4 config key {key!r}: {msg}")


def _req(d: Mapping[str, Any], key: str, typ: type) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"DeepSeek-V4 config key {key!r}: missing")
    v = d[key]
    if typ is int and isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, typ) or isinstance(v, bool):
        raise ConfigError(f"DeepSeek-V4 config key {key!r}: expected {typ.__name__}, got {type(v).__name__} {v!r}")
    return v


_COMMON_KEYS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "moe_intermediate_size", "scoring_func", "routed_scaling_factor", "swiglu_limit", "rope_theta",
    "compress_rope_theta", "rms_norm_eps", "num_nextn_predict_layers", "max_position_embeddings",
    "qk_rope_head_dim", "norm_topk_prob",
}
_DEEPSEEK_KEYS = _COMMON_KEYS | {"compress_ratios", "num_hash_layers", "rope_scaling", "qk_nope_head_dim"}
_HF_KEYS = _COMMON_KEYS | {"layer_types", "compress_rates", "mlp_layer_types", "rope_parameters",
                           "partial_rotary_factor"}

