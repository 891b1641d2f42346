"""A request's tools checked as OpenAI checks them, whatever its tool_choice: a schema for each function's parameters
and one function per name.

Under tool_choice auto or none a schema is only shown to the model, so what is checked is its shape, keyword by
keyword, not whether a grammar could enforce it: lookarounds in a pattern, remote ``$ref``s, ``not`` or
``uniqueItems`` are all served, as OpenAI serves them (a forced call's grammar says what it cannot enforce when one
is asked for). The schema's size is bounded as response_format's is (grammar_bounds.check_schema).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pocketllm.errors import ConfigError
from pocketllm.grammar_bounds import check_schema
from pocketllm_server.errors import invalid_request

_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# Keywords whose value is one schema, a map of names to schemas, or a list of schemas.
_ONE = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems", "additionalItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")


def check_tools(tools: list[dict[str, Any]] | None, parameters_param: str) -> None:
    """Raise a 400 for a tool that is not a named function, for two functions of one name (a reply's call could not
    say which it meant), or for a function whose parameters are no JSON schema. ``parameters_param`` is the field as
    the request's API spells it, with ``{i}`` for the tool's index."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise invalid_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                  '"parameters": ...}}', f"tools[{i}]")
        if name in seen:
            raise invalid_request(f"tools: more than one function is named {json.dumps(name)}; give each its own "
                                  "name", "tools")
        seen.add(name)
        problem = _schema_problem(function.get("parameters"))
        if problem is not None:
            param = parameters_param.format(i=i)
            raise invalid_request(f"{param} {problem}", param)


def _schema_problem(parameters: object) -> str | None:
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        return "must be a JSON schema object"
    try:
        check_schema(parameters)
    except ConfigError as e:
        return f"is refused: {str(e).removeprefix(f'{e.field}: ')}"
    for node in _subschemas(parameters):
        problem = _keyword_problem(node)
        if problem is not None:
            return f"is not a JSON schema: {problem}"
    return None


def _keyword_problem(node: dict) -> str | None:
    kind = node.get("type")
    if kind is not None and not (kind in _TYPES if isinstance(kind, str) else
                                 isinstance(kind, list) and kind and all(k in _TYPES for k in kind)):
        return f"type must be one of {', '.join(sorted(_TYPES))} or a list of them, got {json.dumps(kind)[:80]}"
    for key in _ONE:
        if key in node and not isinstance(node[key], dict | bool):
            return f"{key} must be a schema (an object or a boolean)"
    for key in _MAPS:
        if key in node and not (isinstance(node[key], dict) and all(isinstance(v, dict | bool)
                                                                     for v in node[key].values())):
            return f"{key} must map names to schemas"
    for key in _LISTS:
        if key in node and not (isinstance(node[key], list) and node[key]
                                and all(isinstance(v, dict | bool) for v in node[key])):
            return f"{key} must be a non-empty list of schemas"
    items = node.get("items")
    if items is not None and not isinstance(items, dict | bool | list):
        return "items must be a schema"
    required = node.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return "required must be a list of property names"
    if "enum" in node and not isinstance(node["enum"], list):
        return "enum must be a list"
    return None


def _subschemas(root: dict) -> Iterator[dict]:
    """Every schema object in ``root``, by the keywords that hold schemas (not the values of const, enum, default
    or examples, which are data). check_schema has bounded the walk."""
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        stack.extend(node[key] for key in _ONE if key in node)
        for key in _MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        items = node.get("items")
        stack.extend(items if isinstance(items, list) else [items])
