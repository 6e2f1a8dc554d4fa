"""One-dimensional split arithmetic: which part of a dimension a rank holds, and where it sits locally.

May import: ``tenplex.errors`` and the standard library. Pure.

A split of a dimension of ``size`` elements over ``parts`` ranks gives each
rank a *local length* (the size of that dimension in the rank's local tensor,
padding included) and a list of :class:`Run` s: intervals that map local
positions to global ones. Positions of the local tensor that no run covers are
padding, which is not real state.

Split kinds:

* ``"even"``: every rank gets ``size / parts``; the size must divide.
* ``"chunk"``: ``torch.chunk`` semantics: chunks of ``ceil(size / parts)``,
  the last ones shorter or empty (``torch.chunk`` then returns fewer chunks).
* ``"pad"``: the dimension is padded up to a multiple of ``pad_multiple * parts``
  and split evenly; the padding lies at the end, in the last ranks' tensors.

``unit`` makes the split granular: the dimension is ``size / unit`` units (for
example attention heads of ``unit`` elements) and only whole units are split.
``blocks`` describes a fused dimension: logical blocks laid end to end (QKV,
gate/up), each split on its own; a rank's local tensor is its piece of every
block, concatenated in block order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .errors import ConfigError

SPLIT_KINDS = ("even", "chunk", "pad")


@dataclass(frozen=True)
class Run:
    """``length`` elements at local position ``local`` hold global positions ``start …``."""

    local: int
    start: int
    length: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_block(size: int, parts: int, index: int, kind: str, unit: int = 1,
                pad_multiple: int = 1) -> tuple[int, int, int]:
    """(local length, global start, real length) of part ``index`` of one block.

    Raises ConfigError when the block cannot be split ``kind``-wise; the caller
    adds the tensor's name.
    """
    if kind not in SPLIT_KINDS:
        raise ConfigError(f"unknown split kind {kind!r}; expected one of {', '.join(SPLIT_KINDS)}")
    if size % unit:
        raise ConfigError(f"size {size} is not a whole number of {unit}-element units")
    units = size // unit
    if kind == "even":
        if units % parts:
            shown = ", ".join(map(str, _divisors(units)[:12]))
            what = f"{units} units of {unit}" if unit > 1 else str(units)
            raise ConfigError(f"cannot split {what} evenly over {parts} ranks; the degree must divide {units} "
                              f"(valid: {shown}{', …' if len(_divisors(units)) > 12 else ''})")
        per = units // parts
        return per * unit, index * per * unit, per * unit
    if kind == "chunk":
        per = _ceil_div(units, parts)
        start = min(index * per, units)
        real = max(0, min(per, units - start))
        return real * unit, start * unit, real * unit
    # "pad": the padded dimension splits evenly; the real part of this rank's slice may be short or empty.
    step = pad_multiple * parts
    per = _ceil_div(units, step) * step // parts
    start = index * per
    real = max(0, min(per, units - start))
    return per * unit, min(start, units) * unit, real * unit


@lru_cache(maxsize=65536)
def split_dim(size: int, parts: int, index: int, kind: str = "even", unit: int = 1, pad_multiple: int = 1,
              blocks: tuple[int, ...] | None = None) -> tuple[int, tuple[Run, ...]]:
    """(local length, runs) of part ``index`` of a dimension split over ``parts`` ranks.

    Adjacent runs that are contiguous both locally and globally are merged,
    so a fused dimension held whole (parts == 1) is a single run.
    """
    if not 0 <= index < parts:
        raise ConfigError(f"part {index} is outside 0..{parts - 1}")
    if blocks is None:
        blocks = (size,)
    if sum(blocks) != size or any(b < 1 for b in blocks):
        raise ConfigError(f"fused blocks {list(blocks)} must be positive and sum to the dimension's size {size}")
    if kind == "pad" and len(blocks) > 1:
        raise ConfigError("padding a fused dimension is not supported; pad each block as its own tensor")
    runs: list[Run] = []
    local = block_start = 0
    for block in blocks:
        local_len, start, real = split_block(block, parts, index, kind, unit, pad_multiple)
        if real:
            run = Run(local, block_start + start, real)
            last = runs[-1] if runs else None
            if last and last.local + last.length == run.local and last.start + last.length == run.start:
                runs[-1] = Run(last.local, last.start, last.length + real)
            else:
                runs.append(run)
        local += local_len
        block_start += block
    return local, tuple(runs)


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of ``torch.chunk`` part ``index`` of ``size`` elements (empty when past the end)."""
    per = _ceil_div(size, parts) if size else 0
    start = min(index * per, size)
    return start, min(start + per, size)
