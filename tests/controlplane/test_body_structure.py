"""api/body.check_structure: its fast path (C-speed decode and key count) decides exactly as the token scan does,
on generated documents with repeated keys, escapes and keys inside strings."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from controlplane.api.body import MAX_DEPTH, _plainly_fine, _scan, check_strings, check_structure
from controlplane.domain.errors import DomainError

# keys and strings that look like JSON structure: quotes, colons, braces, backslashes
TEXT = st.text(alphabet='ab":{}[]\\ ,é', max_size=6)


def refused(check, raw: bytes) -> str | None:
    try:
        check(raw, MAX_DEPTH)
    except DomainError as exc:
        return exc.message
    return None


def render(node, colon: str = ": ") -> str:
    """JSON where an object is a list of pairs, so that a key may be named twice (its colon spaced as asked)."""
    if isinstance(node, tuple):
        return "{" + ", ".join(f"{json.dumps(k)}{colon}{render(v, colon)}" for k, v in node) + "}"
    if isinstance(node, list):
        return "[" + ",".join(render(v, colon) for v in node) + "]"
    return json.dumps(node)


DOCS = st.recursive(
    st.none() | st.integers() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.lists(st.tuples(st.sampled_from(["a", "b", 'a":', "\\"]) | TEXT,
                                                                   inner), max_size=4).map(tuple),
    max_leaves=40)


@settings(max_examples=600, deadline=None)
@given(DOCS, st.sampled_from([": ", ":", " :", "\n:", " : "]))
def test_the_fast_path_decides_as_the_scan_does(doc, colon):
    raw = render(doc, colon).encode()
    scan = refused(_scan, raw)
    if _plainly_fine(raw, MAX_DEPTH):
        assert scan is None, raw  # never passes what the scan refuses
    assert refused(check_structure, raw) == scan  # and the answer (with its message) is the scan's


@pytest.mark.parametrize("raw", [b'{"a": 1, "a": 2}', b'{"x": {"k": "\\":", "k": 1}}', b'[{"a": 1}, {"b": {"c": 1, "c": 1}}]',
                                 b'{"a" : "b:", "a" :1}', b'{"a" :1,"a":2}', b'{"a"\n:1,"a":2}'])
def test_a_key_named_twice_is_refused_naming_it(raw):
    with pytest.raises(DomainError, match="appears twice"):
        check_structure(raw)


def test_keys_that_repeat_in_different_objects_or_inside_strings_are_fine():
    for raw in (b'[{"a": 1}, {"a": 1}]', b'{"a": "\\"a\\": 1", "b": "a:"}', b'{"a": {"a": {"a": 1}}}'):
        assert _plainly_fine(raw, MAX_DEPTH) and refused(check_structure, raw) is None


@pytest.mark.parametrize("raw, field", [(b'{"quoteId": "q\\u0000"}', "quoteId"),
                                        (b'{"reports": [{"reservationId": "rsv_\\u0000"}]}', "reports[0].reservationId"),
                                        (b'{"a\\u0000": 1}', "body")])
def test_a_nul_character_in_any_string_is_refused_naming_where(raw, field):
    with pytest.raises(DomainError) as err:
        check_strings(raw)
    assert field == err.value.details["field"]


def test_a_creates_idempotency_key_may_hold_a_nul_as_any_text():
    check_strings(b'{"idempotencyKey": "nul \\u0000 key", "poolId": "h100"}')  # stored in the document as sent
    with pytest.raises(DomainError):
        check_strings(b'{"idempotencyKey": "k", "poolId": "h\\u0000"}')


def test_an_escaped_backslash_before_u0000_is_no_nul():
    check_strings(b'{"a": "\\\\u0000"}')  # the text backslash-u-0-0-0-0


def test_nesting_past_the_limit_is_left_to_the_scan():
    raw = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    assert not _plainly_fine(raw, MAX_DEPTH)
    assert "nested deeper" in refused(check_structure, raw)
