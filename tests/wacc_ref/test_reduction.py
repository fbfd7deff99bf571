"""Tests of wacc_ref.reduction: the data-parallel reductions' rounding, modelled exactly.

Hand-computed cases pin each model's association order (NCCL's ring, gloo's ring, NCCL's binary
tree, a chain) and NCCL's AVG factor; Hypothesis checks the properties every order must have:
exact when every partial sum is representable, ``round_T(a + b)`` for two ranks (against the
Fraction ground truth of wacc_ref.arith), and within the derived bounds.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wacc_ref import reduction as R
from wacc_ref.arith import exact_add
from wacc_ref.bounds import error_ratio
from wacc_ref.formats import NotRepresentableError, get_format
from wacc_ref.strategies import gradient_values

DATA_DTYPES = ("float16", "bfloat16", "float32")


def test_avg_factor_is_one_over_n_rounded_to_the_data_type() -> None:
    """NCCL's AVG factor is round_T(1/N): bfloat16 1/3 = 0.333984375 (+0.195 %), float16
    0.333251953125 (-0.024 %), exact for powers of two."""
    assert R.nccl_avg_factor(3, "bfloat16") == 0.333984375  # 171 / 512
    assert R.avg_factor_relative_error(3, "bfloat16") == Fraction(1, 512)  # +0.1953125 %
    assert R.nccl_avg_factor(3, "float16") == 0.333251953125  # 1365 / 4096
    assert R.avg_factor_relative_error(3, "float16") == Fraction(-1, 4096)  # -0.0244 %
    assert R.nccl_avg_factor(3, "float32") == float.fromhex("0x1.555556p-2")
    for n in (1, 2, 4, 64):
        for dtype in (*DATA_DTYPES, "float64"):
            assert R.avg_factor_relative_error(n, dtype) == 0


def test_nccl_avg_is_biased_by_the_factor_and_differs_from_sum_then_divide() -> None:
    """bfloat16, 3 ranks: AVG of (1, 0, 0) is 0.333984375 (+0.195 % off 1/3); of (5, 0, 0) it is
    round(5 * 171/512) = 1.671875 where the sum divided once gives round(5/3) = 1.6640625."""
    values = np.array([[1.0, 5.0], [0.0, 0.0], [0.0, 0.0]])
    avg = R.nccl_avg(values, "bfloat16")
    assert avg.tolist() == [0.333984375, 1.671875]
    divided = R.sum_then_divide(R.ring_sum(values, "bfloat16"), 3, "bfloat16")
    assert divided.tolist() == [0.333984375, 1.6640625]
    errors = R.reduction_errors(avg, values, "bfloat16", mean=True)
    assert errors.tolist() == [
        float(Fraction(171, 512) - Fraction(1, 3)),
        float(Fraction(1.671875) - Fraction(5, 3)),
    ]


def test_ring_order_per_chunk_nccl_and_gloo() -> None:
    """bfloat16, 4 ranks, ranks' values (0, 1, 2^-8, 2^-8) in chunk 0: NCCL adds ranks 1, 2, 3, 0
    ((1 + 2^-8) ties to 1: result 1), gloo adds 3, 2, 1, 0 (2^-7 + 1 = 1.0078125, exact)."""
    column = np.array([0.0, 1.0, 2.0**-8, 2.0**-8])
    values = np.tile(column[:, None], (1, 4))  # 4 elements: one per chunk
    nccl = R.ring_sum(values, "bfloat16")
    gloo = R.ring_sum(values, "bfloat16", chunks=R.gloo_ring_chunks(4, 4), direction=-1)
    assert R.ring_chunks(4, 4).tolist() == [0, 1, 2, 3]
    assert R.ring_order(R.ring_chunks(4, 4), 4)[:, 0].tolist() == [1, 2, 3, 0]
    assert R.ring_order(R.ring_chunks(4, 4), 4, direction=-1)[:, 0].tolist() == [3, 2, 1, 0]
    assert nccl[0] == 1.0
    # gloo: 4 elements in 8 segments of 1, two segments per chunk: elements 0, 1 are chunk 0.
    assert R.gloo_ring_chunks(4, 4).tolist() == [0, 0, 1, 1]
    assert gloo[0] == 1.0078125
    assert R.reduction_errors(nccl, values, "bfloat16", mean=False)[0] == -(2.0**-7)


def test_three_ranks_float16_chunk_decides_the_rounding() -> None:
    """float16, ranks (1, 2^-11, 2^-11): chunk 0 adds 2^-11 + 2^-11 first (exact 1 + 2^-10),
    chunk 1 adds 2^-11 to 1 first, a tie to the even 1, twice (result 1)."""
    values = np.tile(np.array([1.0, 2.0**-11, 2.0**-11])[:, None], (1, 2))
    assert R.ring_sum(values, "float16").tolist() == [1.0009765625, 1.0]
    assert R.exact_sums(values, "float16").tolist() == [Fraction(1025, 1024)] * 2


def test_nccl_btree_and_chain_orders() -> None:
    """ncclGetBtree(4): 0 <- 2 <- (1, 3), so node 2 computes (x2 + x1) + x3; the chain adds
    x2 + x3 first.  float16 (0, 2^-11, 2^-11, 1): tree 1 + 2^-10, chain 1."""
    assert R.nccl_btree(4) == R.Tree(0, ((2,), (), (1, 3), ()))
    # The 14-rank tree drawn in NCCL's src/graph/trees.cc.
    tree14 = R.nccl_btree(14)
    assert tree14.children[0] == (8,) and tree14.children[8] == (4, 12)
    assert tree14.children[12] == (10, 13) and tree14.children[13] == ()
    assert R.nccl_dtree_second(4) == R.Tree(3, ((), (2, 0), (), (1,)))  # mirrored
    values = np.array([[0.0], [2.0**-11], [2.0**-11], [1.0]])
    assert R.tree_sum(values, "float16", R.nccl_btree(4)).tolist() == [1.0009765625]
    assert R.tree_sum(values, "float16", R.chain(4)).tolist() == [1.0]


def test_bad_inputs_raise_naming_the_value() -> None:
    """A value that is not of T, a bad order or a bad tree raise before anything is computed."""
    with pytest.raises(NotRepresentableError, match=r"values\[1, 0\] = 0.1 .* bfloat16"):
        R.ring_sum([[1.0], [0.1]], "bfloat16")
    with pytest.raises(R.ReductionError, match="permutation"):
        R.ordered_sum([[1.0], [2.0]], "float32", [[0], [0]])
    with pytest.raises(R.ReductionError, match="tree"):
        R.tree_sum([[1.0], [2.0], [3.0]], "float32", R.Tree(0, ((1,), (), ())))
    with pytest.raises(R.ReductionError, match="float8_e4m3fn"):
        R.ring_sum([[1.0]], "float8_e4m3fn")


def _columns(dtype: str, ranks: int, elements: int) -> st.SearchStrategy[np.ndarray]:
    flat = st.lists(gradient_values(dtype), min_size=ranks * elements, max_size=ranks * elements)
    return flat.map(lambda v: np.array(v, dtype=np.float64).reshape(ranks, elements))


@st.composite
def _reductions(draw: st.DrawFn) -> tuple[str, np.ndarray, list[int], np.ndarray]:
    dtype = draw(st.sampled_from(DATA_DTYPES))
    ranks = draw(st.integers(2, 9))
    elements = draw(st.integers(1, 6))
    values = draw(_columns(dtype, ranks, elements))
    ring = draw(st.permutations(range(ranks)))
    chunks = np.array(draw(st.lists(st.integers(0, ranks - 1), min_size=elements,
                                    max_size=elements)))  # fmt: skip
    return dtype, values, list(ring), chunks


def _models(values: np.ndarray, dtype: str, ring: list[int], chunks: np.ndarray) -> dict:
    n = values.shape[0]
    return {
        "nccl_ring": R.ring_sum(values, dtype, chunks=chunks, ring=ring),
        "gloo_ring": R.ring_sum(values, dtype, chunks=chunks, direction=-1, ring=ring),
        "btree": R.tree_sum(values, dtype, R.nccl_btree(n)),
        "dtree": R.tree_sum(values, dtype, R.nccl_dtree_second(n)),
        "chain": R.tree_sum(values, dtype, R.chain(n)),
    }


@given(_reductions(), st.data())
def test_exact_when_every_partial_sum_is_representable(
    case: tuple[str, np.ndarray, list[int], np.ndarray], data: st.DataObject
) -> None:
    """Integers below 2**(p-4) on at most 9 ranks: every partial sum is a value of T, so every
    order gives the exact sum (and the error is 0)."""
    dtype, values, ring, chunks = case
    p = get_format(dtype).precision
    limit = 2 ** (p - 4)
    ints = data.draw(
        st.lists(st.integers(-limit, limit), min_size=values.size, max_size=values.size)
    )
    values = np.array(ints, dtype=np.float64).reshape(values.shape)
    exact = [float(s) for s in R.exact_sums(values, dtype)]
    for name, result in _models(values, dtype, ring, chunks).items():
        assert result.tolist() == exact, name
        assert not R.reduction_errors(result, values, dtype, mean=False).any(), name


@given(st.sampled_from(DATA_DTYPES), st.data())
def test_two_ranks_give_round_t_of_a_plus_b(dtype: str, data: st.DataObject) -> None:
    """With 2 ranks every order is round_T(a + b) (the Fraction ground truth of wacc_ref.arith)."""
    values = data.draw(_columns(dtype, 2, 4))
    expected = [exact_add(a, b, dtype) for a, b in zip(values[0], values[1], strict=True)]
    models = _models(values, dtype, [0, 1], R.ring_chunks(4, 2))
    for name, result in models.items():
        np.testing.assert_array_equal(result, expected, err_msg=name)


@given(_reductions())
def test_every_model_stays_within_its_derived_bound(
    case: tuple[str, np.ndarray, list[int], np.ndarray],
) -> None:
    """SUM in any modelled order within γ_{N-1} Σ|x|; NCCL's AVG (ring and tree) and the sum
    divided once within their bounds against the exact mean."""
    dtype, values, ring, chunks = case
    n = values.shape[0]
    sums = R.exact_sums(values, dtype)
    means = np.array([s / n for s in sums], dtype=object)
    bound = R.sum_error_bound(values, dtype)
    for name, result in _models(values, dtype, ring, chunks).items():
        assert error_ratio(result, sums, bound) <= 1, name
    avg_bound = R.avg_error_bound(values, dtype)
    avg_ring = R.nccl_avg(values, dtype, chunks=chunks, ring=ring)
    avg_tree = R.nccl_avg(values, dtype, tree=R.nccl_btree(n))
    assert error_ratio(avg_ring, means, avg_bound) <= 1
    assert error_ratio(avg_tree, means, avg_bound) <= 1
    divided = R.sum_then_divide(R.ring_sum(values, dtype, chunks=chunks), n, dtype)
    assert error_ratio(divided, means, R.sum_then_divide_error_bound(values, dtype)) <= 1


def test_avg_error_of_a_single_value_is_the_factor_bias() -> None:
    """bfloat16, 3 ranks (1, 0, 0): no hop rounds, so the AVG error is exactly α/3 = 1/1536
    (the factor's bias alone), within the bound."""
    values = np.array([[1.0], [0.0], [0.0]])
    error = R.reduction_errors(R.nccl_avg(values, "bfloat16"), values, "bfloat16", mean=True)
    assert error[0] == float(Fraction(1, 1536))
    assert error[0] <= R.avg_error_bound(values, "bfloat16")[0]
