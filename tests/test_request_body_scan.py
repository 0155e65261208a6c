"""``parse_json_object`` refuses a lone surrogate wherever it hides, however the body is encoded,
while a body without one costs one scan of its bytes (no walk of every value)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.serving import request_body
from kvoffload.serving.errors import APIError
from kvoffload.serving.request_body import parse_json_object

# Letters, digits, spaces, a few non-ASCII code points and surrogates (category Cs).
TEXT = st.text(st.characters(categories=["Ll", "Nd", "Zs", "Lo", "Cs"]), max_size=6)
VALUES = st.recursive(
    st.integers(0, 2**32) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=12,
)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(TEXT, VALUES, max_size=4), st.sampled_from(["escaped", "raw", "utf-16"]))
def test_a_surrogate_is_refused_however_it_is_written(body: dict[str, Any], form: str) -> None:
    if form == "escaped":
        data = json.dumps(body).encode()
    else:
        text = json.dumps(body, ensure_ascii=False)
        data = text.encode("utf-8" if form == "raw" else "utf-16", "surrogatepass")
    if all(_valid(s) for s in _strings(body)):
        assert parse_json_object(data) == body
    else:
        with pytest.raises(APIError, match="surrogate"):
            parse_json_object(data)


def test_a_body_without_surrogates_is_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 MiB prompt of token ids: the walk (a Python call per value) is skipped."""
    walked: list[Any] = []
    monkeypatch.setattr(request_body, "_lone_surrogate", lambda v, p: walked.append(v))
    ids = list(range(500_000))
    assert parse_json_object(json.dumps({"prompt": ids, "text": "héllo"}).encode())["prompt"] == ids
    assert walked == []
    parse_json_object(json.dumps({"prompt": "\ud83d\ude00"}).encode())  # a pair: walked, valid
    assert len(walked) == 1
