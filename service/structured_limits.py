"""What one request's structured-output constraints may cost, checked before the engine sees them.

A constraint (a JSON schema, regex, EBNF/Lark grammar, choice list or structural tag; the tools'
parameter schemas when `tool_choice` is `required` or names a tool) becomes a grammar the engine
compiles against the whole vocabulary before the request's first token. Per request, read from
the raw JSON body before vLLM's own validators (some of which already run xgrammar):

1. size: each constraint's bytes <= --max-structured-output-bytes, its enum values (summed over
   the schema) or choices <= --max-structured-output-choices (cheap, here);
2. conversion: the checker process (moe_serve.service.grammar_checker) converts it as vLLM's xgrammar backend
   does, within --structured-output-compile-budget seconds of CPU time (a 30-byte
   `"pattern": "^[a-z]{1,10000}$"` takes 30 s), and rejects grammars with rules that can never
   finish (`{"$ref": "#"}`, `$ref` cycles).
Each refusal is a 400 naming the field and the limit. The compile for the vocabulary is the
engine's (1,000 optional properties, 32 KB, took 4.4 s): what `vllm serve` serves is served, the
request waiting for it within its own timeout.
"""

from __future__ import annotations

import json
from typing import Any

from moe_serve.service.errors import APIError
from moe_serve.service.grammar_checker import CheckFailed, GrammarChecker
from moe_serve.service.settings import Settings

Spec = tuple[str, str, str]  # (param, kind, text); kind: json | regex | grammar | choice | structural_tag
_STRUCTURED_OUTPUT_KINDS = ("json", "regex", "grammar", "choice", "structural_tag")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tool_specs(body: dict) -> list[Spec]:
    """Parameter schemas the engine constrains decoding to: every tool for `required`, the named
    one for a named choice (chat: {"function": {"name"}}; Responses API: {"name"})."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not isinstance(tools, list) or not (choice == "required" or isinstance(choice, dict)):
        return []
    wanted = None
    if isinstance(choice, dict):
        named = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        wanted = named.get("name")
    specs = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            continue
        function, prefix = (tool["function"], f"tools.{i}.function") if isinstance(tool.get("function"), dict) \
            else (tool, f"tools.{i}")
        if (wanted is None or function.get("name") == wanted) and _well_typed("json", function.get("parameters")):
            specs.append((f"{prefix}.parameters", "json", _text(function["parameters"])))
    return specs


def _well_typed(kind: str, value: Any) -> bool:
    """Values of the type vLLM's models accept (others are pydantic's 400 to give, after this)."""
    if kind == "json":
        return isinstance(value, (str, dict))
    if kind == "choice":
        return isinstance(value, list) and all(isinstance(c, str) for c in value)
    return isinstance(value, str)


def constraint_specs(body: Any) -> list[Spec]:
    """Every grammar the engine would compile for this raw request body."""
    if not isinstance(body, dict):
        return []
    specs: list[Spec] = []
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        specs += [(f"structured_outputs.{kind}", kind, _text(so[kind])) for kind in _STRUCTURED_OUTPUT_KINDS
                  if _well_typed(kind, so.get(kind))]
    rf = body.get("response_format")
    if isinstance(rf, dict):
        schema = rf.get("json_schema")
        if rf.get("type") == "json_schema" and isinstance(schema, dict) and _well_typed("json", schema.get("schema")):
            specs.append(("response_format.json_schema.schema", "json", _text(schema["schema"])))
        elif rf.get("type") == "structural_tag":
            specs.append(("response_format", "structural_tag", _text(rf)))
    text_format = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema" and \
            _well_typed("json", text_format.get("schema")):  # the Responses API
        specs.append(("text.format.schema", "json", _text(text_format["schema"])))
    return specs + _tool_specs(body)


def _enum_values(schema: Any) -> int:
    """Enum values in a JSON schema, summed over every subschema (iterative: any depth)."""
    count, stack = 0, [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("enum"), list):
                count += len(item["enum"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _entries(kind: str, text: str) -> int:
    if kind not in ("json", "choice"):
        return 0
    try:
        value = json.loads(text)
    except ValueError:
        return 0  # not JSON: the checker says why
    if kind == "choice":
        return len(value) if isinstance(value, list) else 0
    return _enum_values(value)


def check_sizes(specs: list[Spec], settings: Settings) -> None:
    """400 for the first constraint over the size or entry limit."""
    for param, kind, text in specs:
        size = len(text.encode())
        if size > settings.max_structured_output_bytes:
            raise APIError(400, f"'{param}' is {size} bytes; this server accepts at most "
                           f"{settings.max_structured_output_bytes} bytes per structured-output constraint "
                           "(--max-structured-output-bytes)", param=param, code="structured_output_too_large")
        entries = _entries(kind, text)
        if entries > settings.max_structured_output_choices:
            what = "choices" if kind == "choice" else "enum values"
            raise APIError(400, f"'{param}' has {entries} {what}; this server accepts at most "
                           f"{settings.max_structured_output_choices} (--max-structured-output-choices)",
                           param=param, code="structured_output_too_large")


def _refusal(failed: CheckFailed, specs: list[Spec], settings: Settings) -> APIError:
    """The 400 for a refused check, naming the constraint (all of them when the budget ran out on several)."""
    if failed.index is not None:
        param = specs[failed.index][0]
    else:
        param = specs[0][0] if len(specs) == 1 else specs[0][0].split(".")[0]
    if failed.reason is None:
        return APIError(400, f"'{param}' takes longer than {settings.structured_output_compile_budget_s:g} s of "
                        "CPU time to convert into a grammar (--structured-output-compile-budget); simplify it",
                        param=param, code="structured_output_too_complex")
    return APIError(400, f"'{param}': {failed.reason}", param=param, code="invalid_value")


async def check_constraints(specs: list[Spec], settings: Settings, checker: GrammarChecker) -> None:
    """Sizes here, then conversion and soundness in the checker: a 400 on the first failure."""
    check_sizes(specs, settings)
    try:
        await checker.check([(kind, text) for _, kind, text in specs])
    except CheckFailed as failed:
        raise _refusal(failed, specs, settings) from None
