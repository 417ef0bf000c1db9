"""Checks on the raw JSON body that pydantic's lax validation of vLLM's request models skips.

- Booleans are strict: pydantic reads `"yes"`, `"true"`, `"1"` and `1` as True in a `bool` field;
  here a bool-typed field (at any depth of the request model) must be `true`, `false` or `null`.
- Dataclass-typed fields (vLLM's `StructuredOutputsParams`, `RepetitionDetectionParams`) drop
  keys they do not know without a word (the models' own extra fields are caught afterwards by
  `moe_serve.service.protocol.reject_unknown_fields`): here an unknown key is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import lru_cache
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

from moe_serve.service.errors import APIError

_JSON_TYPE = {str: "a string", int: "a number", float: "a number", list: "an array", dict: "an object"}


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


@lru_cache(maxsize=512)
def _members(annotation: Any) -> tuple[Any, ...]:
    """The types a field accepts: Annotated stripped, Optional/Union flattened, None dropped."""
    if get_origin(annotation) is Annotated:
        return _members(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(m for arg in get_args(annotation) for m in _members(arg))
    return () if annotation is type(None) else (annotation,)


@lru_cache(maxsize=128)
def _dataclass_fields(cls: type) -> dict[str, Any]:
    """Init fields of a dataclass -> their resolved types (Any where a hint does not resolve)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable forward reference: no type checks below
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


@lru_cache(maxsize=512)
def _checked(annotation: Any) -> bool:
    """Whether a value read as `annotation` can hold a bool or a dataclass field; False for a prompt
    of token ids (list[int] | list[list[int]] | str | list[str]), whose ids are then not walked."""
    members = _members(annotation)
    if members and all(m is bool for m in members):
        return True
    for member in members:
        if get_origin(member) is list:
            if _checked((get_args(member) or (Any,))[0]):
                return True
        elif isinstance(member, type) and (issubclass(member, BaseModel) or dataclasses.is_dataclass(member)):
            return True
    return False


@lru_cache(maxsize=128)
def _model_fields_checked(model: type[BaseModel]) -> dict[str, Any]:
    """JSON key (alias, else name) -> annotation of the model's fields that can hold a bool or a
    dataclass field: the only ones the walk needs to look at."""
    return {field.alias or name: field.annotation for name, field in model.model_fields.items()
            if _checked(field.annotation)}


def check_strict_types(annotation: Any, value: Any, path: str = "") -> None:
    """400 for the first non-boolean JSON value in a bool field, or unknown key of a dataclass
    field, of `value` read as `annotation` (a request model class or a union of them)."""
    if not _checked(annotation):
        return
    members = _members(annotation)
    if members and all(m is bool for m in members):
        if value is not None and not isinstance(value, bool):
            got = _JSON_TYPE.get(type(value), type(value).__name__)
            raise APIError(400, f"'{path}' must be a boolean (true or false), got {got}", param=path,
                           code="invalid_type")
        return
    for member in members:
        origin = get_origin(member)
        if origin is list and isinstance(value, list):
            item_type = (get_args(member) or (Any,))[0]
            for i, item in enumerate(value):
                check_strict_types(item_type, item, _join(path, i))
        elif isinstance(member, type) and issubclass(member, BaseModel) and isinstance(value, dict):
            fields = _model_fields_checked(member)
            for key, item in value.items():
                if key in fields:
                    check_strict_types(fields[key], item, _join(path, key))
        elif dataclasses.is_dataclass(member) and isinstance(member, type) and isinstance(value, dict):
            fields = _dataclass_fields(member)
            unknown = next((key for key in value if key not in fields), None)
            if unknown is not None:
                name = _join(path, unknown)
                raise APIError(400, f"unknown field '{name}': this server does not support it", param=name,
                               code="unknown_parameter")
            for key, item in value.items():
                check_strict_types(fields[key], item, _join(path, key))
