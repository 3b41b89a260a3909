"""The piecewise decoder of large bodies equals json.loads, errors included."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxq.server.json_pieces import loads_in_pieces

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=5)),
                      max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.text(max_size=8), values, max_size=6), indent=st.sampled_from([None, 1, "\t"]),
       ascii_only=st.booleans())
def test_equals_json_loads(body, indent, ascii_only):
    text = json.dumps(body, indent=indent, ensure_ascii=ascii_only)
    assert loads_in_pieces(text) == json.loads(text)
    assert loads_in_pieces(f" \n{text}\r\n ") == json.loads(text)


@pytest.mark.parametrize("text", ['{"a": 1, "a": 2}', '{"a": [1, 2, ], "b": 1}', '{"a": [1 2]}', '{"a": 1} x',
                                  '{"a": NaN, "b": [Infinity]}', '[1, 2]', '"s"', '{', '{"a": [', '{1: 2}', '{}',
                                  '{"m": []}', '{"m": [{"role": "user"}, {"role": "x"}], "n": 2}'])
def test_odd_documents_match_json_loads_or_its_error(text):
    try:
        expected = json.loads(text)
    except ValueError as exc:
        with pytest.raises(ValueError) as got:
            loads_in_pieces(text)
        assert str(got.value) == str(exc)
        return
    assert loads_in_pieces(text) == expected
