"""Reading a request's JSON body: the one place every handler reads one, with the checks the wire schemas cannot make.

In order: the Content-Type must be JSON (415 otherwise); the body must
arrive within the request timeout (api/guard.py's Limits, `--request-timeout`;
408 otherwise); its structure is checked before it is
decoded: nesting at most MAX_DEPTH deep (deeper is refused rather than
recursed into), and no object may name a key twice (JSON leaves duplicates
undefined; taking the last silently would let two readers see two requests),
and no string holds U+0000 (PostgreSQL's text cannot);
then it is decoded strictly into its schema (schemas.decode: INVALID_INPUT
naming the field). Every refusal here is a 4xx naming `body` (or
`Content-Type`), answered in the error envelope (api/errors.py).
"""
from __future__ import annotations

import asyncio
import re
from typing import Any

import msgspec
from aiohttp import web

from controlplane import schemas
from controlplane.api.guard import LIMITS
from controlplane.domain.errors import INVALID_INPUT, DomainError

MAX_DEPTH = 32  # nested arrays and objects; the deepest document of the API (an inventory) is 6 deep
JSON_TYPES = frozenset({"application/json", ""})  # "" : no Content-Type with an empty body

# A JSON string (with its escapes), or one of the structural characters; everything else is skipped.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]')
# Every JSON string, and the colon after it if it is a key (in valid JSON the scan starts at each opening quote).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?')  # (unrolled: twice as fast as _TOKEN's form)


def check_structure(raw: bytes, max_depth: int = MAX_DEPTH) -> None:
    """INVALID_INPUT when the body nests deeper than max_depth or an object names a key twice."""
    if _plainly_fine(raw, max_depth):
        return
    _scan(raw, max_depth)


def _plainly_fine(raw: bytes, max_depth: int) -> bool:
    """The common case at C speed: valid JSON with fewer brackets than max_depth (so no deeper nesting), whose
    objects decoded hold as many keys as the text names (a key named twice leaves one fewer). False: _scan
    decides, and names what is wrong."""
    if raw.count(b"{") + raw.count(b"[") > max_depth:
        return False
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return False
    decoded, todo = 0, [doc]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            decoded += len(node)
            todo.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            todo.extend(v for v in node if isinstance(v, (dict, list)))
    if b"\\" not in raw and raw.count(b'":') == decoded == raw.count(b":"):
        # No escapes: every quote opens or closes a string, so '":' is a key's end and its colon; and no other
        # colon, so no key spaced from its colon (uncounted here, it would hide a key named twice: the count
        # below counts those)
        return True
    named = _STRING.findall(raw)
    return decoded == len(named) - named.count(b"")


# Fields whose value is any text, stored inside the reservation's document and never a statement's parameter: a
# create's idempotency key is replayed as sent, U+0000 included (docs/api.md).
ANY_TEXT = frozenset({"idempotencyKey"})


def check_strings(raw: bytes) -> None:
    """INVALID_INPUT naming the field where a string holds U+0000: PostgreSQL's text cannot hold it, and no name,
    id or token of the API has one (ANY_TEXT aside). (JSON writes it only as an escape, so most bodies are passed
    at a glance.)"""
    if b"\\u0000" not in raw:
        return
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return  # not JSON at all: the decoder says so, naming the body
    todo: list[tuple[str, Any]] = [("", doc)]
    while todo:
        path, node = todo.pop()
        if isinstance(node, str) and "\x00" in node:
            field = path or "body"
            raise DomainError(INVALID_INPUT, f"{field}: holds a NUL character (U+0000), which no value of the API "
                              "may hold", {"field": field, "rule": "no NUL character (U+0000) in a string"})
        if isinstance(node, dict):
            for key, value in node.items():
                if not path and key in ANY_TEXT:
                    continue
                if "\x00" in key:
                    raise DomainError(INVALID_INPUT, f"{path or 'body'}: a key holds a NUL character (U+0000)",
                                      {"field": path or "body", "rule": "no NUL character (U+0000) in a string"})
                todo.append((f"{path}.{key}" if path else key, value))
        elif isinstance(node, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(node))


def _scan(raw: bytes, max_depth: int) -> None:
    """check_structure token by token."""
    stack: list[set | None] = []  # per open container: the keys seen (object) or None (array)
    last = b""
    for m in _TOKEN.finditer(raw):
        tok = m.group()
        first = tok[0]
        if first == 0x7B or first == 0x5B:  # { [
            if len(stack) >= max_depth:
                raise DomainError(INVALID_INPUT, f"body: nested deeper than {max_depth} levels",
                                  {"field": "body", "rule": f"at most {max_depth} nested arrays and objects"})
            stack.append(set() if first == 0x7B else None)
        elif first == 0x7D or first == 0x5D:  # } ]
            if stack:
                stack.pop()
        elif first == 0x3A:  # ':' after a key
            keys = stack[-1] if stack else None
            if keys is not None and last[:1] == b'"':
                try:
                    key = msgspec.json.decode(last)
                except msgspec.DecodeError:
                    return  # not JSON at all: the decoder says so, naming the body
                if key in keys:
                    raise DomainError(INVALID_INPUT, f"body: the key {key[:64]!r} appears twice in one object",
                                      {"field": "body", "rule": "each key at most once per object", "key": key[:64]})
                keys.add(key)
        last = tok


async def read_json(request: web.Request, schema: type[msgspec.Struct]) -> Any:
    """The request's body decoded into schema, after the checks above."""
    return schemas.decode(await read_checked(request), schema)


async def read_checked(request: web.Request) -> bytes:
    """The request's raw body, once its media type, its arrival and its structure passed."""
    # aiohttp reads a missing Content-Type as application/octet-stream: said as none, as it was sent
    ctype = request.content_type if request.headers.get("Content-Type") else ""
    if ctype not in JSON_TYPES or (ctype == "" and request.can_read_body):
        raise web.HTTPUnsupportedMediaType(reason=f"Content-Type: {ctype or 'none'} is not application/json")
    # bodies are small (1 MiB at most): none is taken compressed (every header of the name: a proxy and the server
    # may read different ones)
    encodings = [e.strip().lower() for h in request.headers.getall("Content-Encoding", []) for e in h.split(",")]
    coded = [e for e in encodings if e not in ("identity", "")]
    if coded:
        raise web.HTTPUnsupportedMediaType(reason=f"Content-Encoding: {', '.join(coded)[:32]!r} is not taken; send "
                                                  "the body uncompressed, without the header")
    if request.content.is_eof():  # all of it came with the headers (no timer, no task: it is there)
        raw = await request.read()
    else:
        timeout = request.app[LIMITS].request_timeout_s  # the whole body, once the headers did
        try:
            raw = await asyncio.wait_for(request.read(), timeout)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(reason=f"body: not received within {timeout:g} s") from None
        except ConnectionError:  # the client went away mid-body: its refusal (nobody reads it), not our failure
            raise DomainError(INVALID_INPUT, "body: the connection closed before the body was whole",
                              {"field": "body", "rule": "the whole body, as Content-Length says"}) from None
    check_structure(raw)
    check_strings(raw)
    return raw

