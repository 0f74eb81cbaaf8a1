"""Einsum specs: parsing, validation errors, and normalization equal to `numpy.einsum`
(implicit outputs, ellipses, broadcasting, diagonals)."""

from __future__ import annotations

import numpy as np
import pytest
from einsum_cases import numpy_einsum_cases
from hypothesis import given

from einpage.errors import ShapeError, SpecError
from taskgraph.einsum import EinsumSpec, normalize, take_diagonals


def test_parse_and_queries():
    spec = EinsumSpec.parse("bhqd, bhkd -> bhqk")
    assert spec.inputs == ("bhqd", "bhkd")
    assert spec.output == "bhqk"
    assert spec.reduced == "d"
    assert spec.indices == "bhqkd"
    assert str(spec) == "bhqd,bhkd->bhqk"
    shapes = [(2, 4, 8, 16), (2, 4, 8, 16)]
    assert spec.output_shape(shapes) == (2, 4, 8, 8)
    assert spec.iteration_size(shapes) == 2 * 4 * 8 * 8 * 16


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("ij,jk", SpecError, "exactly one '->'"),
        ("ij->i->j", SpecError, "exactly one '->'"),
        ("i1,jk->ik", SpecError, "operand 0 has '1'"),
        ("ij,jk->i_", SpecError, "the output has '_'"),
        ("ij,jk->ii", SpecError, "output index 'i' is repeated"),
        ("ij,jk->iz", SpecError, "output index 'z' appears in no operand"),
        ("ii->ii", SpecError, "output index 'i' is repeated"),
    ],
)
def test_structure_errors(spec, error, message):
    with pytest.raises(error, match=message):
        EinsumSpec.parse(spec)


def test_size_mismatch_names_index_operands_and_sizes():
    with pytest.raises(ShapeError) as info:
        EinsumSpec.parse("ij,jk->ik").index_sizes([(2, 3), (4, 5)])
    text = str(info.value)
    assert "index 'j'" in text and "size 3 in operand 0" in text and "4 in operand 1" in text


def test_operand_count_and_rank_errors():
    spec = EinsumSpec.parse("ij,jk->ik")
    with pytest.raises(SpecError, match="2 operand term"):
        spec.index_sizes([(2, 3)])
    with pytest.raises(SpecError, match=r"operand 1 has shape \(3,\) \(rank 1\)"):
        spec.index_sizes([(2, 3), (3,)])


@pytest.mark.parametrize(
    "spec, shapes",
    [
        ("ij,jk", [(2, 3), (3, 4)]),
        ("ij", [(2, 3)]),
        ("ji", [(2, 3)]),
        ("i,i", [(3,), (3,)]),
        ("...ij,...jk", [(2, 3, 4), (4, 5)]),
        ("...ij,...jk->...ik", [(5, 1, 3, 4), (2, 4, 6)]),
        ("i...->...", [(3, 2, 2)]),
        ("...,...->...", [(4, 1), (3,)]),
        ("...i,...i->...", [(1, 3), (2, 3)]),
        ("ab,->ab", [(2, 3), ()]),
    ],
)
def test_normalize_matches_numpy(spec, shapes):
    normalized = normalize(spec, shapes)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in shapes]
    squeezed = [
        np.squeeze(a, axis=drop) if drop else a
        for a, drop in zip(arrays, normalized.squeeze, strict=True)
    ]
    got = np.einsum(str(normalized.spec), *squeezed)
    np.testing.assert_allclose(got, np.einsum(spec, *arrays))


def test_normalize_errors():
    with pytest.raises(SpecError, match="2 operand term"):
        normalize("ij,jk", [(2, 3)])
    with pytest.raises(SpecError, match="malformed ellipsis"):
        normalize("..i", [(2,)])
    with pytest.raises(SpecError, match="names 2 indices"):
        normalize("ij", [(2, 3, 4)])
    with pytest.raises(ShapeError, match="do not broadcast: 2 against 3"):
        normalize("...,...->...", [(2,), (3,)])
    with pytest.raises(SpecError, match="must contain '...'"):
        normalize("...i->i", [(2, 3)])


# -- repeated indices, broadcasting, against numpy.einsum ---------------------------------


def test_an_index_repeated_in_an_operand_reads_its_diagonal():
    spec = EinsumSpec.parse("iij,jk->ik")
    assert spec.has_diagonal and not EinsumSpec.parse("ij,jk->ik").has_diagonal
    assert spec.reduced == "j" and spec.indices == "ikj"
    shapes = [(3, 3, 4), (4, 5)]
    assert spec.index_sizes(shapes) == {"i": 3, "j": 4, "k": 5}
    assert spec.output_shape(shapes) == (3, 5)
    assert spec.iteration_size(shapes) == 3 * 4 * 5  # i counts once
    assert EinsumSpec.parse("ii->").reduced == "i"


def test_a_diagonal_of_unequal_axes_names_both():
    with pytest.raises(ShapeError) as info:
        EinsumSpec.parse("iji->j").index_sizes([(2, 3, 4)])
    text = str(info.value)
    assert "index 'i' repeats in operand 0" in text and "axes 0 and 2 of sizes 2 and 4" in text
    with pytest.raises(ShapeError, match="repeats in operand 0"):
        normalize("ii->i", [(2, 1)])  # as numpy: no broadcasting inside one operand


@pytest.mark.parametrize(
    "spec, shapes",
    [
        ("ii->i", [(3, 3)]),
        ("ii", [(3, 3)]),
        ("iij->ij", [(2, 2, 3)]),
        ("iij", [(2, 2, 3)]),
        ("aab,bc->ac", [(2, 2, 3), (3, 4)]),
        ("dcc,fce,ea,dbf->ab", [(2, 3, 3), (4, 3, 5), (5, 2), (2, 3, 4)]),
        ("...ii->...i", [(4, 2, 2)]),
        ("i...i", [(2, 3, 2)]),
        ("ij,jk", [(2, 1), (3, 4)]),  # j broadcasts
        ("ij,ij->ij", [(2, 3), (1, 3)]),
        ("iij,i->j", [(1, 1, 3), (2,)]),  # a size-1 diagonal broadcasts
        ("bA", [(2, 3)]),  # implicit output sorts uppercase first: "Ab"
    ],
)
def test_full_numpy_semantics(spec, shapes):
    test_normalize_matches_numpy(spec, shapes)


@given(case=numpy_einsum_cases())
def test_normalize_matches_numpy_on_random_specs(case):
    test_normalize_matches_numpy(case.spec, case.shapes)


@given(case=numpy_einsum_cases())
def test_take_diagonals_matches_numpy(case):
    normalized = normalize(case.spec, case.shapes)
    for term, shape, drop in zip(
        normalized.spec.inputs, case.shapes, normalized.squeeze, strict=True
    ):
        shape = tuple(d for axis, d in enumerate(shape) if axis not in drop)
        array = np.arange(int(np.prod(shape))).reshape(shape)
        unique, view = take_diagonals(term, array)
        assert sorted(unique) == sorted(set(term)) and len(unique) == len(set(term))
        np.testing.assert_array_equal(view, np.einsum(f"{term}->{unique}", array))
