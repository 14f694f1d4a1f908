"""What each kernel declares it moves: bytes read, bytes written and launches, as a function of its arguments.

A kernel that reads only part of its inputs (the routed experts of a weight stack, the listed rows of a pool) must
not be charged for whole tensors, so a byte count of a step cannot come from tensor sizes alone. Each custom op of
this package registers here how much it touches; the step-cost report (and tests) ask ``declared`` for an op call
and fall back to "every input read once, every output written once" for anything else. A test per kernel checks
that the declaration matches what the kernel really touches (poisoned unread inputs must not change its output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Traffic:
    read: int  # bytes read from device memory
    written: int  # bytes written to device memory
    launches: int  # kernel launches
    # (argument position, bytes read of it) for the arguments read only in part (a pool a kernel reads rows of);
    # the others are read whole, and whatever ``read`` holds beyond all that is weights read in part
    partial: tuple[tuple[int, int], ...] = ()

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.read + other.read, self.written + other.written, self.launches + other.launches,
                       self.partial + other.partial)


# custom op name ("sgl_kernel_ext::name") -> function of the op's (args, kwargs) giving its Traffic
_DECLARED: dict[str, Callable[..., Traffic]] = {}


def declare(op_name: str) -> Callable[[Callable[..., Traffic]], Callable[..., Traffic]]:
    """Decorator: ``fn(*args, **kwargs) -> Traffic`` is what a call of the custom op ``op_name`` moves."""

    def register(fn: Callable[..., Traffic]) -> Callable[..., Traffic]:
        _DECLARED[op_name] = fn
        return fn

    return register


def declared(op_name: str, args: tuple, kwargs: dict) -> Traffic | None:
    """The declared traffic of one call, or None for an op that declares nothing."""
    fn = _DECLARED.get(op_name)
    return None if fn is None else fn(*args, **kwargs)


def nbytes(t) -> int:
    return t.numel() * t.element_size() if t is not None else 0
