"""Einsum specs: parsing, validation errors, and NumPy-style normalization."""

from __future__ import annotations

import numpy as np
import pytest

from einpage.errors import ShapeError, SpecError
from taskgraph.einsum import EinsumSpec, normalize


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
