r"""Exact models of the data-parallel reduction's own rounding: ring, tree, NCCL's AVG, gloo.

A data-parallel step reduces one gradient element held by ``N`` ranks.  The backends do not add
exactly: every hop of a collective is an addition *in the data type* ``T``, rounded once
(``round_T``, semantics §2).  Which values meet at which hop (the association order) is fixed by
the algorithm; this module states each order exactly and evaluates it with
:func:`wacc_ref.arith.add_rounded` / :func:`wacc_ref.arith.mul_rounded` (each a correctly rounded
``round_T(a op b)``), so every model here is exact, not a float simulation.

Inputs are ``values[r, e]``: rank ``r``'s value of element ``e``, a float64 array whose entries
are values of ``T`` (float64, float32, float16 or bfloat16).  Every model returns the reduced
element values (float64 arrays holding values of ``T``).

Ring all-reduce (NCCL)
----------------------
NCCL's ring all-reduce is a reduce-scatter followed by an all-gather (``src/device/all_reduce.h``,
``runRing``).  Each loop step splits the data into ``N`` chunks; the rank at ring position
``ringIx`` first *sends* chunk ``ringIx - 1`` (``chunk = modRanks(ringIx + nranks - 1);
prims.directSend``), then for ``j = 2 .. N-1`` receives, reduces with its own and sends chunk
``ringIx - j`` (``directRecvReduceDirectSend``), and finally receives chunk ``ringIx`` and adds its
own value, which is the result (``directRecvReduceCopyDirectSend(..., postOp=true)``); the
all-gather only copies.  So the partial sum of chunk ``c`` starts at ring position ``c + 1`` and
travels ``c + 2, ..., c + N = c``: for ``N`` ranks, with ``x_p`` the value at ring position ``p``,

    s = x_{c+1};   s = round_T(s + x_{c+2});   ...;   s = round_T(s + x_c)     (indices mod N)

(a hop computes ``round_T(own + received)``: ``reduceCopy`` applies ``FuncSum`` to the user
input and the received buffer, ``__hadd``/``__hadd2`` for half and, on sm_80+, bfloat16,
``src/device/reduce_kernel.h``; IEEE addition is commutative, so the operand order within a hop
does not matter).  Which chunk an element is in depends on the channel count, the protocol's
chunk size and the loop (``chunkCount``), which NCCL tunes per call: it is the parameter
``chunks`` (per element); :func:`ring_chunks` gives the one-channel, one-loop layout
(contiguous chunks of ``ceil(E / N)`` elements).  The ring's rank order (``ring->userRanks``,
from the topology search) is the parameter ``ring``.

Tree all-reduce (NCCL)
----------------------
NCCL's tree all-reduce reduces up a tree and broadcasts down (``runTreeUpDown``); a node adds its
children's partial sums to its own value in the order of its ``down[]`` array: ``reduceCopy`` loads
source 0 (the user input) and then adds the receive buffers one by one,
``acc = applyReduce(acc, src_i)``, so a node with children ``d0, d1`` computes
``round_T(round_T(x + s_d0) + s_d1)``.  The tree is a parameter (:class:`Tree`):
:func:`nccl_btree` is ``ncclGetBtree`` (``src/graph/trees.cc``; NCCL builds it over nodes, one
rank per node here), :func:`nccl_dtree_second` the second tree of the double binary tree
(``ncclGetDtree``: mirrored for even, shifted for odd ``N``; NCCL gives each tree a half of the
channels, so an element goes through one of them), :func:`chain` the intra-node chain.

AVG (NCCL)
----------
``ncclAvg`` on floating types is ``ncclDevPreMulSum`` (``src/enqueue.cc``, ``hostToDevRedOp``):
the factor is ``__float2half(float(1.0/nRanks))`` for float16, ``__float2bfloat16(float(1.0/
nRanks))`` for bfloat16, ``float(1.0/nRanks)`` for float32 and ``1.0/nRanks`` for float64 — the
double ``1/N`` rounded to float32 and then to ``T`` (:func:`nccl_avg_factor`).  Every rank's
*own* value is multiplied by it in ``T`` before it enters a hop (``Apply_PreOp<FuncPreMulSum>``:
``__hmul`` for half, ``fromPack<T>(a) * fn.scalar`` for float/double: one rounding), the partial
sums received are not, and the hops are ``FuncSum`` as above.  There is no division after.  For
bfloat16 and ``N = 3`` the factor is ``0.333984375 = (1 + 2**-9) / 3``: every AVG is biased by
``+0.195 %`` before any hop rounds; float16's ``0.333251953125`` is ``-0.024 %``.  For ``N`` a
power of two the factor is exact.

gloo (torch.distributed on CPU)
-------------------------------
gloo's ring (``gloo/allreduce.cc``, ``ring``) splits the data into ``numSegments`` segments (at
least ``2 N``, rounded up to a multiple of ``N``; ``numSegmentsPerRank`` per rank); rank ``r``
sends segment ``(r + 1) spr + i`` to rank ``r - 1`` and receives segment ``(r + 2) spr + i`` from
rank ``r + 1`` ("send to rank - 1, receive from rank + 1"), reducing ``out = out + tmp``.  So
chunk ``c`` (segments ``c spr .. c spr + spr - 1``) starts at rank ``c - 1`` and travels
``c - 2, ..., c - N = c``: the ring model with ``direction=-1``; :func:`gloo_ring_chunks` gives
the layout while no segment reaches gloo's maximum segment size (2 segments per rank).  Two
ranks: ``round_T(a + b)``, whatever the order.  Measured with torch 2.13's gloo on a CPU:
bit for bit this model for 2, 3, 4 and 5 ranks, float16/bfloat16/float32, 7 to 100003
elements (tests/wacc_torch/distributed/test_reduction_models.py pins 2, 3 and 4 ranks).

Errors and bounds
-----------------
:func:`exact_sums` is the exact per-element ``Σ_r values[r, e]`` (a ``Fraction`` per element).
:func:`reduction_errors` returns ``result - exact`` (SUM) or ``result - exact / N`` (a mean),
computed exactly and rounded once to float64.  :func:`sum_error_bound` and
:func:`avg_error_bound` are the derived bounds (Higham, *Accuracy and Stability*, §2.1 and
(4.4)): any association of ``N`` terms of ``T``, each term passing at most ``N - 1`` roundings,

    ŝ = Σ y_r (1 + θ_r),  |θ_r| <= γ_{N-1}       (sums of T values: no underflow term, E2)

so ``|ŝ - Σ x_r| <= γ_{N-1} Σ |x_r|`` for SUM.  For NCCL's AVG, ``y_r = round_T(x_r f)
= x_r f (1 + δ_r) + ε_r`` with ``|δ_r| <= u``, ``|ε_r| <= η = min_subnormal / 2``, and
``f = (1 + α) / N`` with ``α = f N - 1`` known exactly (:func:`avg_factor_relative_error`):

    |ŝ - Σ x_r / N| <= κ Σ |x_r| / N + N η (1 + γ_{N-1}),
    κ = max((1 + α)(1 + u)(1 + γ_{N-1}) - 1,  1 - (1 + α)(1 - u)(1 - γ_{N-1})).

The "sum then divide" mean (wacc_torch's reduction, semantics §7 + §8 with ``S = 1`` and
``W = N``): ``out = round_T(round_op(ŝ / N))`` adds ``(1 + u_op)(1 + u)`` and ``η_op (1 + u)
+ η`` (:func:`sum_then_divide_error_bound`).  Every constant is exact (``Fraction``) and each
per-element bound is rounded *up* to a float64.  Where an intermediate could overflow (``Σ |x_r|
(1 + γ) >= max_T``) or an input is NaN or ±inf, the bound is ``+inf`` (not applicable).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import numpy.typing as npt

from wacc_ref.arith import add_rounded, div_rounded, mul_rounded, round_array
from wacc_ref.bounds import TOLERANCES, gamma
from wacc_ref.formats import (
    FORMATS,
    WORK_DTYPES,
    Format,
    NotRepresentableError,
    get_format,
    op_format,
    round_to,
)

__all__ = [
    "ReductionError",
    "Tree",
    "avg_error_bound",
    "avg_factor_relative_error",
    "chain",
    "exact_sums",
    "gloo_ring_chunks",
    "nccl_avg",
    "nccl_avg_factor",
    "nccl_btree",
    "nccl_dtree_second",
    "ordered_sum",
    "reduction_errors",
    "ring_chunks",
    "ring_order",
    "ring_sum",
    "sum_error_bound",
    "sum_then_divide",
    "sum_then_divide_error_bound",
    "tree_sum",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]


class ReductionError(ValueError):
    """A bad argument of a reduction model (shape, order, tree, chunk layout)."""


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _format(dtype: str | Format) -> Format:
    fmt = get_format(dtype)
    if fmt.name not in WORK_DTYPES:
        raise ReductionError(
            f"dtype {fmt.name!r} is not a reduction data type; use one of {', '.join(WORK_DTYPES)}"
        )
    return fmt


def _values(values: npt.ArrayLike, fmt: Format) -> FloatArray:
    """``values`` as a 2-D float64 array (ranks x elements) of values of ``fmt`` (a copy)."""
    array = np.array(values, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 1:
        raise ReductionError(
            f"values must be a 2-D array (ranks x elements) with at least one rank, "
            f"got shape {array.shape}"
        )
    rounded = round_array(array, fmt)
    differs = ~((rounded == array) | (np.isnan(rounded) & np.isnan(array)))
    if differs.any():
        rank, element = (int(i) for i in np.argwhere(differs)[0])
        value = float(array[rank, element])
        raise NotRepresentableError(
            f"values[{rank}, {element}] = {value!r} ({value.hex()}) is not a {fmt.name} value"
        )
    return array


# --------------------------------------------------------------------------------------------
# Orders
# --------------------------------------------------------------------------------------------


def ring_chunks(elements: int, world_size: int, chunk_elements: int | None = None) -> IntArray:
    """Chunk index of each element in NCCL's ring: ``(e // chunk_elements) mod N``.

    ``chunk_elements`` defaults to ``ceil(elements / N)`` (one channel, one loop: the data split
    into ``N`` contiguous chunks).  NCCL's real ``chunkCount`` depends on the channels, the
    protocol and the size; pass it when known.
    """
    if elements < 0 or world_size < 1:
        raise ReductionError(
            f"need elements >= 0 and world_size >= 1, got {elements}, {world_size}"
        )
    size = chunk_elements if chunk_elements is not None else max(1, -(-elements // world_size))
    if size < 1:
        raise ReductionError(f"chunk_elements must be >= 1, got {chunk_elements}")
    return (np.arange(elements, dtype=np.intp) // size) % world_size


def gloo_ring_chunks(elements: int, world_size: int, segments_per_rank: int = 2) -> IntArray:
    """Chunk (= owning rank) of each element in gloo's ring (``gloo/allreduce.cc``).

    ``numSegments = N * segments_per_rank`` (2 per rank unless a segment would exceed gloo's
    maximum segment size), ``segmentBytes = roundUp(ceil(bytes / numSegments), elementSize)``,
    i.e. ``ceil(elements / numSegments)`` elements; chunk ``c`` is segments
    ``c spr .. c spr + spr - 1``.
    """
    if elements < 0 or world_size < 1 or segments_per_rank < 2:
        raise ReductionError(
            f"need elements >= 0, world_size >= 1, segments_per_rank >= 2, got "
            f"{elements}, {world_size}, {segments_per_rank}"
        )
    segment = max(1, -(-elements // (world_size * segments_per_rank)))
    return (np.arange(elements, dtype=np.intp) // segment) // segments_per_rank


def ring_order(
    chunks: npt.ArrayLike,
    world_size: int,
    *,
    direction: int = 1,
    ring: Sequence[int] | None = None,
) -> IntArray:
    """The rank added at each hop of each element: ``order[k, e]``, ``k = 0 .. N-1``.

    The partial sum of chunk ``c`` starts at ring position ``c + direction`` and ends at ``c``
    (positions mod ``N``; ``direction=1``: NCCL, ``-1``: gloo).  ``ring[p]`` is the rank at ring
    position ``p`` (default: rank ``p``).
    """
    if direction not in (1, -1):
        raise ReductionError(f"direction must be 1 or -1, got {direction!r}")
    positions = np.asarray(chunks, dtype=np.intp)
    if positions.ndim != 1 or ((positions < 0) | (positions >= world_size)).any():
        raise ReductionError(f"chunks must be a 1-D array of integers in [0, {world_size})")
    ranks = np.arange(world_size, dtype=np.intp) if ring is None else np.asarray(ring, np.intp)
    if sorted(ranks.tolist()) != list(range(world_size)):
        raise ReductionError(f"ring must be a permutation of range({world_size}), got {ring!r}")
    steps = np.arange(1, world_size + 1, dtype=np.intp)[:, None]
    result: IntArray = ranks[(positions[None, :] + direction * steps) % world_size]
    return result


def ordered_sum(values: npt.ArrayLike, dtype: str | Format, order: npt.ArrayLike) -> FloatArray:
    """Recursive summation in ``T`` in a given order per element.

    ``order[k, e]`` is the rank whose value is added at hop ``k`` (a permutation of the ranks for
    every ``e``): ``s = x[order[0]]``, then ``s = round_T(s + x[order[k]])`` for ``k = 1..N-1``.
    """
    fmt = _format(dtype)
    x = _values(values, fmt)
    ranks, elements = x.shape
    hops = np.asarray(order, dtype=np.intp)
    if hops.shape != x.shape:
        raise ReductionError(f"order has shape {hops.shape}, values {x.shape}")
    if not (np.sort(hops, axis=0) == np.arange(ranks)[:, None]).all():
        raise ReductionError("every column of order must be a permutation of the ranks")
    columns = np.arange(elements)
    total = x[hops[0], columns]
    for k in range(1, ranks):
        total = add_rounded(total, x[hops[k], columns], fmt)
    return total


def ring_sum(
    values: npt.ArrayLike,
    dtype: str | Format,
    *,
    chunks: npt.ArrayLike | None = None,
    direction: int = 1,
    ring: Sequence[int] | None = None,
) -> FloatArray:
    """A ring all-reduce SUM in ``T`` (module docstring): NCCL's by default, gloo's with
    ``direction=-1`` and ``chunks=gloo_ring_chunks(...)``."""
    fmt = _format(dtype)
    x = _values(values, fmt)
    ranks, elements = x.shape
    layout = ring_chunks(elements, ranks) if chunks is None else chunks
    return ordered_sum(x, fmt, ring_order(layout, ranks, direction=direction, ring=ring))


@dataclass(frozen=True)
class Tree:
    """A reduction tree over ranks ``0 .. N-1``: ``children[r]`` in the order they are added."""

    root: int
    children: tuple[tuple[int, ...], ...]

    def check(self, world_size: int) -> None:
        """Raise :class:`ReductionError` unless this is a tree spanning ``world_size`` ranks."""
        if len(self.children) != world_size:
            raise ReductionError(f"tree has {len(self.children)} nodes, expected {world_size}")
        seen: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not 0 <= node < world_size or node in seen:
                raise ReductionError(f"tree {self} is not a tree over range({world_size})")
            seen.append(node)
            stack.extend(self.children[node])
        if len(seen) != world_size:
            raise ReductionError(f"tree {self} does not reach every rank of range({world_size})")


def _tree_from_parents(parents: Sequence[int], downs: Sequence[Sequence[int]]) -> Tree:
    roots = [r for r, p in enumerate(parents) if p == -1]
    assert len(roots) == 1, parents
    return Tree(roots[0], tuple(tuple(d for d in down if d != -1) for down in downs))


def _nccl_btree_node(nranks: int, rank: int) -> tuple[int, int, int]:
    """``ncclGetBtree(nranks, rank)``'s ``(u, d0, d1)``, transcribed from src/graph/trees.cc."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1 if nranks > 1 else -1)
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:  # as NCCL: recompute, then halve
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, down0, down1


def nccl_btree(world_size: int) -> Tree:
    """NCCL's binary tree (``ncclGetBtree``): root 0, children ``[d0, d1]`` per rank."""
    if world_size < 1:
        raise ReductionError(f"world_size must be >= 1, got {world_size}")
    nodes = [_nccl_btree_node(world_size, r) for r in range(world_size)]
    return _tree_from_parents([n[0] for n in nodes], [n[1:] for n in nodes])


def nccl_dtree_second(world_size: int) -> Tree:
    """The second tree of NCCL's double binary tree (``ncclGetDtree``): the btree shifted by one
    rank for odd ``N``, mirrored (``r -> N-1-r``) for even ``N``."""
    if world_size < 1:
        raise ReductionError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    parents, downs = [], []
    for rank in range(n):
        if n % 2 == 1:
            up, d0, d1 = _nccl_btree_node(n, (rank - 1 + n) % n)
            parents.append(-1 if up == -1 else (up + 1) % n)
            downs.append([-1 if d == -1 else (d + 1) % n for d in (d0, d1)])
        else:
            up, d0, d1 = _nccl_btree_node(n, n - 1 - rank)
            parents.append(-1 if up == -1 else n - 1 - up)
            downs.append([-1 if d == -1 else n - 1 - d for d in (d0, d1)])
    return _tree_from_parents(parents, downs)


def chain(world_size: int) -> Tree:
    """A chain ``0 <- 1 <- ... <- N-1`` (NCCL's intra-node tree): recursive summation from
    rank ``N - 1`` down to rank 0."""
    if world_size < 1:
        raise ReductionError(f"world_size must be >= 1, got {world_size}")
    return Tree(0, tuple((r + 1,) if r + 1 < world_size else () for r in range(world_size)))


def tree_sum(values: npt.ArrayLike, dtype: str | Format, tree: Tree) -> FloatArray:
    """A tree reduction in ``T``: each node computes ``round_T(... round_T(x + s_c0) + s_c1 ...)``
    over its children in order (module docstring)."""
    fmt = _format(dtype)
    x = _values(values, fmt)
    tree.check(x.shape[0])

    def reduce(node: int) -> FloatArray:
        total = x[node]
        for child in tree.children[node]:
            total = add_rounded(total, reduce(child), fmt)
        return total

    return np.array(reduce(tree.root), dtype=np.float64)


# --------------------------------------------------------------------------------------------
# AVG and the mean after a SUM
# --------------------------------------------------------------------------------------------


def nccl_avg_factor(world_size: int, dtype: str | Format) -> float:
    """NCCL's ``ncclAvg`` factor: ``round_T(round_32(round_64(1 / N)))`` (float64: ``round_64``)."""
    fmt = _format(dtype)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ReductionError(f"world_size must be an int >= 1, got {world_size!r}")
    factor = 1.0 / world_size  # the C double 1.0/nRanks: IEEE division, round_64
    if fmt.name == "float64":
        return factor
    return round_to(round_to(factor, FORMATS["float32"]), fmt)


def avg_factor_relative_error(world_size: int, dtype: str | Format) -> Fraction:
    """``α = round_T(1/N) · N - 1`` exactly: the bias of every NCCL AVG with ``N`` ranks."""
    return Fraction(nccl_avg_factor(world_size, dtype)) * world_size - 1


def nccl_avg(
    values: npt.ArrayLike,
    dtype: str | Format,
    *,
    tree: Tree | None = None,
    chunks: npt.ArrayLike | None = None,
    ring: Sequence[int] | None = None,
) -> FloatArray:
    """NCCL's ``ncclAvg``: every value times :func:`nccl_avg_factor` in ``T`` (one rounding),
    then the ring SUM (default) or, with ``tree``, the tree SUM; no division after."""
    fmt = _format(dtype)
    x = _values(values, fmt)
    scaled = mul_rounded(x, nccl_avg_factor(x.shape[0], fmt), fmt)
    if tree is not None:
        return tree_sum(scaled, fmt, tree)
    return ring_sum(scaled, fmt, chunks=chunks, ring=ring)


def sum_then_divide(summed: npt.ArrayLike, world_size: int, dtype: str | Format) -> FloatArray:
    """The mean after a SUM in ``T``, as wacc_torch's ``all_reduce_mean`` divides (semantics §8
    with ``S = 1``, ``W = N``): ``round_T(round_op(s / N))``."""
    fmt = _format(dtype)
    s = _values(np.asarray(summed, dtype=np.float64)[None, :], fmt)[0]
    if world_size < 1:
        raise ReductionError(f"world_size must be >= 1, got {world_size}")
    op = op_format(fmt)
    return round_array(div_rounded(s, float(world_size), op), fmt)


# --------------------------------------------------------------------------------------------
# Exact sums, errors and bounds
# --------------------------------------------------------------------------------------------

_QUANTUM_EXPONENT = 1074  # every finite float64 is an integer multiple of 2**-1074


def _scaled_integers(x: FloatArray) -> npt.NDArray[np.object_]:
    """Every finite value as the exact integer ``value * 2**1074`` (Python ints; 0 elsewhere)."""
    flat = np.where(np.isfinite(x), x, 0.0).reshape(-1)
    mantissa, exponent = np.frexp(flat)  # flat = mantissa * 2**exponent, |mantissa| < 1
    integers = np.ldexp(mantissa, 53).astype(np.int64)  # exact: 53 bits
    shifts = (exponent.astype(np.int64) - 53 + _QUANTUM_EXPONENT).tolist()
    scaled = [
        int(m) << s if s >= 0 else int(m) >> -s
        for m, s in zip(integers.tolist(), shifts, strict=True)
    ]
    return np.array(scaled, dtype=np.object_).reshape(x.shape)


def _finite_columns(x: FloatArray) -> list[bool]:
    """Per element (column): whether every rank's value is finite."""
    mask: npt.NDArray[np.bool_] = np.asarray(np.isfinite(x).all(axis=0))
    return [bool(ok) for ok in mask.tolist()]


def exact_sums(values: npt.ArrayLike, dtype: str | Format) -> npt.NDArray[np.object_]:
    """The exact ``Σ_r values[r, e]`` per element (``Fraction``; ``None`` where an input is NaN
    or ±inf)."""
    fmt = _format(dtype)
    x = _values(values, fmt)
    integers = _scaled_integers(x).sum(axis=0)
    finite = _finite_columns(x)
    denominator = 1 << _QUANTUM_EXPONENT
    exact = [
        Fraction(int(k), denominator) if ok else None
        for k, ok in zip(integers, finite, strict=True)
    ]
    return np.array(exact, dtype=np.object_)


def reduction_errors(
    result: npt.ArrayLike, values: npt.ArrayLike, dtype: str | Format, *, mean: bool
) -> FloatArray:
    """``result - Σ x`` (``mean=False``) or ``result - Σ x / N`` (``mean=True``) per element,
    exact and then rounded once to float64 (NaN where an input or the result is not finite)."""
    fmt = _format(dtype)
    x = _values(values, fmt)
    out = np.asarray(result, dtype=np.float64)
    if out.shape != (x.shape[1],):
        raise ReductionError(f"result has shape {out.shape}, expected ({x.shape[1]},)")
    sums = exact_sums(x, fmt)
    divisor = x.shape[0] if mean else 1
    errors = np.full(out.shape, math.nan)
    for e, (value, exact) in enumerate(zip(out.tolist(), sums, strict=True)):
        if exact is not None and math.isfinite(value):
            errors[e] = float(Fraction(value) - exact / divisor)  # correctly rounded
    return errors


def _round_up(value: Fraction) -> float:
    nearest = float(value)
    return math.nextafter(nearest, math.inf) if value > nearest else nearest


@dataclass(frozen=True)
class _Affine:
    """A per-element bound ``slope · Σ|x_r| + offset`` and its overflow threshold on Σ|x_r|."""

    slope: Fraction
    offset: Fraction
    threshold: Fraction  # Σ|x_r| at or above which an intermediate may overflow

    def evaluate(self, x: FloatArray) -> FloatArray:
        magnitudes = _scaled_integers(np.abs(x)).sum(axis=0)
        finite = _finite_columns(x)
        denominator = 1 << _QUANTUM_EXPONENT
        bound = np.full(x.shape[1], math.inf)
        for e, (k, ok) in enumerate(zip(magnitudes, finite, strict=True)):
            total = Fraction(int(k), denominator)
            if ok and total < self.threshold:
                bound[e] = _round_up(self.slope * total + self.offset)
        return bound


def _sum_gamma(world_size: int, fmt: Format) -> Fraction:
    return Fraction(gamma(world_size - 1, fmt.name))


def sum_error_bound(values: npt.ArrayLike, dtype: str | Format) -> FloatArray:
    """``γ_{N-1} Σ_r |x_r|`` per element: a bound on ``|ŝ - Σ x_r|`` for a SUM in ``T`` in any
    association order (ring, tree, gloo); ``+inf`` where it does not apply."""
    fmt = _format(dtype)
    x = _values(values, fmt)
    g = _sum_gamma(x.shape[0], fmt)
    return _Affine(g, Fraction(0), Fraction(fmt.max_finite) / (1 + g)).evaluate(x)


def avg_error_bound(values: npt.ArrayLike, dtype: str | Format) -> FloatArray:
    """A bound on ``|NCCL AVG - Σ x_r / N|`` per element (module docstring)."""
    fmt = _format(dtype)
    x = _values(values, fmt)
    n = x.shape[0]
    tol = TOLERANCES[fmt.name]
    g, u, eta = _sum_gamma(n, fmt), Fraction(tol.unit_roundoff), tol.underflow_unit_exact
    one_alpha = 1 + avg_factor_relative_error(n, fmt)
    kappa = max(one_alpha * (1 + u) * (1 + g) - 1, 1 - one_alpha * (1 - u) * (1 - g))
    # |ŝ| <= (Σ|x| (1+α)(1+u)/N + N η)(1 + γ): below max_T, nothing overflows.
    threshold = (Fraction(fmt.max_finite) / (1 + g) - n * eta) * n / (one_alpha * (1 + u))
    return _Affine(kappa / n, n * eta * (1 + g), threshold).evaluate(x)


def sum_then_divide_error_bound(values: npt.ArrayLike, dtype: str | Format) -> FloatArray:
    """A bound on ``|round_T(round_op(ŝ / N)) - Σ x_r / N|`` (ŝ: a SUM in ``T``, any order)."""
    fmt = _format(dtype)
    x = _values(values, fmt)
    n = x.shape[0]
    tol = TOLERANCES[fmt.name]
    g = _sum_gamma(n, fmt)
    u_op, eta_op = Fraction(tol.op_unit_roundoff), tol.op_underflow_unit_exact
    same = tol.op_dtype == fmt.name  # round_D(round_op(q)) is one rounding when op(D) = D
    u_3 = Fraction(0) if same else Fraction(tol.unit_roundoff)
    eta_3 = Fraction(0) if same else tol.underflow_unit_exact
    upper = (1 + g) * (1 + u_op) * (1 + u_3)
    slope = (upper - 1) / n  # upper - 1 >= 1 - (1-g)(1-u_op)(1-u_3)
    return _Affine(slope, eta_op * (1 + u_3) + eta_3, Fraction(fmt.max_finite) / (1 + g)).evaluate(
        x
    )
