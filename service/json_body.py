"""Strict parsing of JSON request bodies: RFC 8259 JSON in UTF-8, every string valid Unicode.

Python's `json` accepts more than JSON: `NaN`, `Infinity` and `-Infinity` literals, and `\\ud800`
escapes that decode to lone UTF-16 surrogates. A lone surrogate is not a Unicode character: it
cannot be encoded as UTF-8, so it fails wherever the string is used later (tokenizer, the
engine's msgpack encoder, the echo in an error message), after work has started. Here such a
body is a 400 naming the field, before anything else reads it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from moe_serve.service.errors import APIError

# Any \uD800-\uDFFF escape (high or low half). Valid pairs decode to one character; only when
# one of these is present can the parsed body hold a lone surrogate, so only then is it walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _invalid_json(message: str) -> APIError:
    return APIError(400, f"request body is not valid JSON: {message}", code="invalid_json")


def parse_json_body(body: bytes) -> Any:
    """The JSON value of `body`; 400 if it is not UTF-8 JSON or holds a lone surrogate."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid_json(f"it is not UTF-8 (invalid byte at offset {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise _invalid_json(f"{exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except ValueError as exc:  # NaN / Infinity
        raise _invalid_json(str(exc)) from None
    except RecursionError:
        raise _invalid_json("it is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(text):
        path = _lone_surrogate_path(value)
        if path is not None:
            raise APIError(400, f"'{path or 'body'}' contains a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                           "without its pair), which is not a Unicode character", param=path or None,
                           code="invalid_value")
    return value


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate_path(value: Any) -> str | None:
    """Dotted path of the first string (key or value) holding a lone surrogate, else None.
    Iterative: the body may nest as deep as the JSON parser allowed."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _has_lone_surrogate(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else key
                if _has_lone_surrogate(key):
                    return path or ""
                stack.append((child_path, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item))
    return None
