"""Tensor parallelism as one swap step over the plain model (gpt-fast's ``tp.py`` is the pattern): SGLang's own
parallel layers replace our linears, its TP group carries the collectives, and the model code stays unaware.

What each rank holds (upstream SGLang's V4 split):

* attention: its share of the heads -- ``wq_b`` and the per-group ``wo_a`` column-parallel (whole output groups
  per rank), ``wo_b`` row-parallel with SGLang's all-reduce, ``attn_sink`` sliced by head; ``wq_a``, ``wkv``, the
  compressors, the indexer and the hyper-connections replicated;
* MoE: expert parallel -- rank r holds routed experts ``[r E/tp, (r+1) E/tp)``; the shared expert column-parallel
  ``w1, w3`` / row-parallel ``w2`` without its own reduce; one all-reduce sums the routed and shared shares;
* embedding and LM head vocabulary-parallel (``VocabParallelEmbedding`` / ``ParallelLMHead``); the head gathers
  full logits where our own code asks it for logits (the MTP drafter), SGLang's logits processor gathers them for
  sampling and verification, so every rank drafts and verifies on identical logits.

FP8 block-scaled weights live inside SGLang's linear layers through a linear method of ours
(``FP8BlockMethod``); a shard that does not start on a 128 x 128 block boundary keeps every block its rows touch
and its offset inside the first one. ``shard_model`` also records, per parameter, which slice of the checkpoint
tensor this rank holds (``model.shard_plan``), so the loader reads only that slice from disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import Parameter

from sgl_kernel_ext.fp8_linear import fp8_block_linear
from sgl_kernel_ext.weight_formats import FP8_BLOCK, FP8_DTYPE

from ..dsv4.attention import Attention
from ..dsv4.config import ConfigError
from ..dsv4.moe import MoE
from .quantized_modules import FP8BlockLinear


@dataclass(frozen=True)
class Shard:
    """This rank's part of a checkpoint tensor: indices ``[start, stop)`` of its ``full`` length along ``dim``
    (the local tensor may be longer: vocabulary padding, left zero)."""

    dim: int
    start: int
    stop: int
    full: int


def tp_rank_size() -> tuple[int, int]:
    """(rank, size) of SGLang's TP group as the current construction scope sees it (the real group in a server;
    ``get_parallel().override(tp_rank=..., tp_size=...)`` without one, e.g. for the footprint report)."""
    from sglang.srt.layers.linear import resolve_linear_parallel_group
    return resolve_linear_parallel_group("tp")


def _blocks(start: int, n: int) -> tuple[int, int]:
    """First and one-past-last 128-block touched by indices ``[start, start + n)``."""
    return start // FP8_BLOCK, (start + n - 1) // FP8_BLOCK + 1


def _fp8_method():
    from sglang.srt.layers.quantization.base_config import LinearMethodBase

    class FP8BlockMethod(LinearMethodBase):
        """Our FP8 e4m3 weights with 128 x 128 power-of-two block scales inside SGLang's linear layers; the matmul
        is one ``sgl_kernel_ext.fp8_block_linear`` call with the shard's block offsets (the Triton kernel on a GPU,
        the block-by-block reference on the CPU)."""

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                           params_dtype, **extra):
            from sglang.srt.distributed.utils import get_group_rank_size
            rank, _ = get_group_rank_size(layer.tp_group)
            out = sum(output_partition_sizes)
            row0 = rank * out if out != output_size else 0
            col0 = rank * input_size_per_partition if input_size_per_partition != input_size else 0
            (r_lo, r_hi), (c_lo, c_hi) = _blocks(row0, out), _blocks(col0, input_size_per_partition)
            layer.offsets = (row0 % FP8_BLOCK, col0 % FP8_BLOCK)
            layer.register_parameter("weight", Parameter(
                torch.empty(out, input_size_per_partition, dtype=FP8_DTYPE), requires_grad=False))
            layer.register_parameter("scale", Parameter(
                torch.empty(r_hi - r_lo, c_hi - c_lo, dtype=torch.float32), requires_grad=False))

        def apply(self, layer, x, bias=None):
            y = fp8_block_linear(x, layer.weight, layer.scale, layer.offsets)
            return y if bias is None else y + bias

    return FP8BlockMethod


class _FP8Blocks:
    """The quantization config SGLang's linear layers ask for their weights' method."""

    def get_quant_method(self, layer, prefix: str = ""):
        return _fp8_method()()


def _layers():
    """SGLang's parallel layers, returning only the output (our model calls its linears like ``nn.Linear``)."""
    from sglang.srt.distributed import tensor_model_parallel_all_gather
    from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    class ColumnLinear(ColumnParallelLinear):
        def forward(self, x):
            return super().forward(x)[0]

    class RowLinear(RowParallelLinear):
        def forward(self, x):
            return super().forward(x)[0]

    class LMHead(ParallelLMHead):
        """Vocabulary-parallel head that also answers ``head(x)`` with the full logits (all-gathered)."""

        def forward(self, x):
            logits = x @ self.weight.t().to(x.dtype)
            if self.tp_size > 1:
                logits = tensor_model_parallel_all_gather(logits.contiguous())
            return logits[..., : self.org_vocab_size]

    return ColumnLinear, RowLinear, LMHead


def _all_reduce_output(module, args, out):
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    return tensor_model_parallel_all_reduce(out)


class _Sharder:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.plan: dict[str, Shard] = {}
        self.column, self.row, self.lm_head = _layers()

    def _quant(self, linear: nn.Module):
        return _FP8Blocks() if isinstance(linear, FP8BlockLinear) else None

    def column_parallel(self, linear: nn.Module, name: str) -> nn.Module:
        layer = self.column(linear.in_features, linear.out_features, bias=False, quant_config=self._quant(linear))
        return self._record(linear, layer, name, 0, layer.output_size_per_partition, linear.out_features)

    def row_parallel(self, linear: nn.Module, name: str, reduce: bool) -> nn.Module:
        layer = self.row(linear.in_features, linear.out_features, bias=False, input_is_parallel=True,
                         reduce_results=reduce, quant_config=self._quant(linear))
        return self._record(linear, layer, name, 1, layer.input_size_per_partition, linear.in_features)

    def _record(self, linear: nn.Module, layer: nn.Module, name: str, dim: int, part: int, full: int) -> nn.Module:
        """The checkpoint slices ``layer`` holds: ``part`` of ``full`` along ``dim``, and the scale blocks they
        touch."""
        start = self.rank * part
        self.plan[name + ".weight"] = Shard(dim, start, start + part, full)
        if isinstance(linear, FP8BlockLinear):
            lo, hi = _blocks(start, part)
            self.plan[name + ".scale"] = Shard(dim, lo, hi, -(-full // FP8_BLOCK))
        return layer

    def attention(self, attn: Attention, name: str) -> None:
        heads = attn.n_heads // self.size
        attn.wq_b = self.column_parallel(attn.wq_b, name + ".wq_b")
        attn.wo_a = self.column_parallel(attn.wo_a, name + ".wo_a")
        attn.wo_b = self.row_parallel(attn.wo_b, name + ".wo_b", reduce=True)
        self.plan[name + ".attn_sink"] = Shard(0, self.rank * heads, (self.rank + 1) * heads, attn.n_heads)
        attn.attn_sink = Parameter(torch.empty(heads))
        attn.n_heads, attn.o_groups = heads, attn.o_groups // self.size

    def moe(self, moe: MoE, name: str) -> None:
        ex = moe.experts
        held = ex.w1.shape[0] // self.size
        first = self.rank * held
        dim, inter = ex.w2.shape[1], ex.w1.shape[1]
        moe.experts = type(ex)(held, dim, inter, ex.limit, first=first)
        for key in dict(moe.experts.named_buffers()) | dict(moe.experts.named_parameters()):
            self.plan[f"{name}.experts.{key}"] = Shard(0, first, first + held, ex.w1.shape[0])
        sh = moe.shared_experts
        sh.w1 = self.column_parallel(sh.w1, name + ".shared_experts.w1")
        sh.w3 = self.column_parallel(sh.w3, name + ".shared_experts.w3")
        sh.w2 = self.row_parallel(sh.w2, name + ".shared_experts.w2", reduce=False)
        if self.size > 1:
            moe.register_forward_hook(_all_reduce_output)  # routed + shared shares of every rank

    def vocabulary(self, model: nn.Module) -> None:
        from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
        vocab, dim = model.embed.weight.shape
        model.embed = VocabParallelEmbedding(vocab, dim)
        model.head = self.lm_head(vocab, dim)
        for name, layer in (("embed", model.embed), ("head", model.head)):
            idx = layer.shard_indices
            self.plan[name + ".weight"] = Shard(0, idx.org_vocab_start_index, idx.org_vocab_end_index, vocab)


def check_divisible(cfg, size: int) -> None:
    """What ``--tp`` must divide; the error names the flag and the config key."""
    for key, value in (("num_attention_heads", cfg.num_heads), ("o_groups", cfg.o_groups),
                       ("n_routed_experts", cfg.n_routed_experts), ("moe_intermediate_size (shared expert)",
                                                                     cfg.moe_intermediate_size * cfg.n_shared_experts)):
        if value % size:
            raise ConfigError(f"--tp {size}: DeepSeek-V4 is split by {key} ({value}), which {size} does not divide")


def shard_model(model: nn.Module) -> nn.Module:
    """Swap ``model``'s (meta) modules for this rank's share of them, in place; records ``model.shard_plan``."""
    rank, size = tp_rank_size()
    check_divisible(model.cfg, size)
    sharder = _Sharder(rank, size)
    with torch.device("meta"):
        for name, module in list(model.named_modules()):
            if isinstance(module, Attention):
                sharder.attention(module, name)
            elif isinstance(module, MoE):
                sharder.moe(module, name)
        sharder.vocabulary(model)
    model.shard_plan = sharder.plan
    model.tp_rank_size = (rank, size)
    return model
