"""Bytes and launches of every op a step runs, counted on the meta device (no values, no kernels).

Each op is charged what a device kernel for it would move: a custom op of ``sgl_kernel_ext`` what it declares
(``sgl_kernel_ext.traffic``); an indexing op the rows it reads or writes (a gather from a pool reads the gathered
rows, not the pool); a view nothing; anything else each input read once and each output written once, an expanded
(stride-0) input counted once. Bytes are split by what they belong to: ``weights`` (the model's parameters and
buffers), ``state`` (the KV pools and request tables), ``activations`` (the rest). Each op counts one launch unless
it is a view, an allocation without a fill, or declares otherwise.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sgl_kernel_ext.traffic import declared

aten = torch.ops.aten
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
         aten.new_empty_strided.default, aten.detach.default, aten.lift_fresh.default, aten.alias.default,
         aten._unsafe_view.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default}
# op -> (index of the source tensor, index of the index tensor): reads the rows it gathers
_GATHERS = {aten.index.Tensor: (0, 1), aten.index_select.default: (0, 2), aten.gather.default: (0, 2),
            aten.embedding.default: (0, 1), aten.take_along_dim.default: (0, 1)}
# op -> (destination, index, values): writes (and reads) only the rows it scatters
_SCATTERS = {aten.index_put_.default: (0, 1, 2), aten.index_put.default: (0, 1, 2),
             aten._index_put_impl_.default: (0, 1, 2), aten.index_copy_.default: (0, 2, 3),
             aten.index_copy.default: (0, 2, 3), aten.scatter_.src: (0, 2, 3), aten.scatter.src: (0, 2, 3),
             aten.index_add_.default: (0, 2, 3), aten.index_add.default: (0, 2, 3),
             aten.scatter_add_.default: (0, 2, 3), aten.scatter_add.default: (0, 2, 3),
             aten.masked_scatter_.default: (0, 1, 2)}


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads of ``t``: its elements, a broadcast (stride-0) dimension once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class OpCount:
    op: str
    phase: str
    layer: int | str | None  # a decoder layer, "metadata" (``StepCounter.owner``) or None
    read: dict[str, int]
    written: dict[str, int]
    launches: int
    largest_write: int


@dataclass
class StepCounter(TorchDispatchMode):
    """Counts every op under it. ``weights`` / ``state``: tensors whose storages belong to those classes."""

    weights: list[torch.Tensor] = field(default_factory=list)
    state: list[torch.Tensor] = field(default_factory=list)
    phase: str = "round"
    layer: int | None = None
    ops: list[OpCount] = field(default_factory=list)
    # > 0 while the forward computes its per-forward metadata (``round.forward_metadata``): charged to the forward,
    # not to the layer that first needs it.
    metadata: int = 0

    def __post_init__(self):
        super().__init__()
        self._class = {_storage_key(t): "weights" for t in self.weights}
        self._class.update({_storage_key(t): "state" for t in self.state})

    def klass(self, t: torch.Tensor) -> str:
        return self._class.get(_storage_key(t), "activations")

    def add_state(self, tensors) -> None:
        self._class.update({_storage_key(t): "state" for t in tensors})

    def _charge(self, kind: dict[str, int], t: torch.Tensor, nbytes: int) -> None:
        kind[self.klass(t)] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FREE or getattr(func, "is_view", False):
            return out
        read, written = defaultdict(int), defaultdict(int)
        launches = 1
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        decl = declared(func.name(), args, kwargs)
        if decl is not None:
            # Inputs read in part are charged what the declaration says, other non-weight inputs whole; the rest of
            # the declared read is weights (a kernel reads only the routed experts' of a stack).
            plain = 0
            partial = dict(decl.partial)
            for i, a in enumerate(args):
                for t in _tensors(a):
                    if i in partial:
                        self._charge(read, t, partial[i])
                        plain += partial[i]
                    elif self.klass(t) != "weights":
                        self._charge(read, t, touched_bytes(t))
                        plain += touched_bytes(t)
            read["weights"] += max(decl.read - plain, 0)
            extra = decl.written - sum(touched_bytes(t) for t in outputs)
            for t in outputs:
                self._charge(written, t, touched_bytes(t))
            written["activations"] += max(extra, 0)
            launches = decl.launches
        elif func in _GATHERS:
            src, idx = _GATHERS[func]
            rows = touched_bytes(outputs[0])
            self._charge(read, args[src], rows)
            for t in _tensors(args[idx]):
                self._charge(read, t, touched_bytes(t))
            written[self.klass(outputs[0])] += rows
        elif func in _SCATTERS:
            dst, idx, val = _SCATTERS[func]
            values = args[val]
            moved = touched_bytes(values) if isinstance(values, torch.Tensor) else 0
            if isinstance(values, torch.Tensor):
                self._charge(read, values, moved)
            for t in _tensors(args[idx]):
                self._charge(read, t, touched_bytes(t))
            if func in (aten.index_add_.default, aten.index_add.default, aten.scatter_add_.default,
                        aten.scatter_add.default):
                self._charge(read, args[dst], moved)  # the rows added to
            self._charge(written, args[dst], moved)
        elif func in (aten.copy_.default,):
            self._charge(read, args[1], touched_bytes(args[1]))
            self._charge(written, args[0], touched_bytes(args[0]))
        elif func in (aten.zeros.default, aten.full.default, aten.fill_.Scalar, aten.zero_.default, aten.ones.default,
                      aten.arange.default, aten.arange.start, aten.arange.start_step):
            for t in outputs:
                self._charge(written, t, touched_bytes(t))
        else:
            for t in inputs:
                self._charge(read, t, touched_bytes(t))
            for t in outputs:  # an in-place op's output is the input it writes
                self._charge(written, t, touched_bytes(t))
        if func in _SCATTERS:  # an in-place scatter returns its destination but writes only the rows it moves
            largest = sum(written.values())
        else:
            largest = max((touched_bytes(t) for t in outputs), default=0)
        self.ops.append(OpCount(func.name(), self.phase, self.owner, dict(read), dict(written), launches, largest))
        return out

    def record(self, name: str, read: int, written: int, launches: int = 1) -> None:
        """An op the mode cannot see (a collective): its bytes as activations."""
        self.ops.append(OpCount(name, self.phase, self.owner, {"activations": read}, {"activations": written},
                                launches, written))

    @property
    def owner(self) -> int | str | None:
        """What an op is charged to: the decoder layer running it, or ``"metadata"``."""
        return "metadata" if self.metadata else self.layer

    def summary(self) -> dict:
        by_class: dict[str, int] = defaultdict(int)
        by_phase: dict[str, int] = defaultdict(int)
        launches_by_phase: dict[str, int] = defaultdict(int)
        per_layer: dict[int, int] = defaultdict(int)
        for op in self.ops:
            moved = sum(op.read.values()) + sum(op.written.values())
            for k, v in op.read.items():
                by_class[k] += v
            for k, v in op.written.items():
                by_class[k] += v
            by_phase[op.phase] += moved
            launches_by_phase[op.phase] += op.launches
            if op.phase == "verify" and isinstance(op.layer, int):
                per_layer[op.layer] += op.launches
        heaviest: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        for op in self.ops:
            entry = heaviest[(op.phase, op.op)]
            entry[0] += sum(op.read.values()) + sum(op.written.values())
            entry[1] += op.read.get("state", 0) + op.written.get("state", 0)
            entry[2] += op.launches
        top = sorted(heaviest.items(), key=lambda kv: -kv[1][0])[:12]
        return {
            "top_ops": [{"phase": ph, "op": name, "bytes": b, "state_bytes": s, "launches": n}
                        for (ph, name), (b, s, n) in top],
            "bytes_total": sum(by_class.values()),
            "bytes_by_class": {k: by_class.get(k, 0) for k in ("weights", "state", "activations")},
            "bytes_by_phase": dict(by_phase),
            "launches_total": sum(op.launches for op in self.ops),
            "launches_by_phase": dict(launches_by_phase),
            "launches_per_layer": max(per_layer.values(), default=0),
            "launches_metadata": sum(op.launches for op in self.ops if op.phase == "verify" and op.layer == "metadata"),
            "largest_write_bytes": max((op.largest_write for op in self.ops), default=0),
        }
