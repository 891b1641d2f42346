"""Tool-call parsers (``--tool-call-parser``): the calls in a reply, in the formats the supported models use.

- ``hermes`` (Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``qwen3_xml`` (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=K>V</parameter>...</function>
  </tool_call>``; a value that parses as JSON is taken as JSON, else as a string;
- ``llama3_json`` (Llama 3.x): the reply, after an optional ``<|python_tag|>``, is ``{"name": ..., "parameters":
  {...}}``, several separated by ``;``;
- ``generic`` (llama.cpp's, for templates with no tool format of their own): the reply is one JSON object,
  ``{"tool_call": {"name": ..., "arguments": {...}}}``, ``{"tool_calls": [...]}`` or ``{"response": "..."}``.

``auto`` picks one from the chat template. A block that does not parse stays in the content as text: a model's
malformed attempt is shown, not dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pocketllm.structured import JSON_OPTIONS

TOOL_CALL_PARSERS = ("hermes", "qwen3_xml", "llama3_json", "generic")
OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_FUNCTION = re.compile(r"^\s*<function=([^>\s]+)>(.*?)(?:</function>\s*)?$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
_ARGUMENTS_KEY = {"hermes": "arguments", "llama3_json": "parameters", "generic": "arguments"}
# Formats whose call is the whole reply, and how such a reply may begin.
_WHOLE_REPLY = {"llama3_json": ("{", PYTHON_TAG), "generic": ("{",)}
_PARAMETERS_COPY = "pocketllm_parameters"  # where a qwen3_xml value's schema keeps the parameters it refers into
# JSON schema keywords whose value is a map of schemas, and those whose value is a schema or a list of schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"})
_SCHEMA_VALUES = frozenset({"items", "prefixItems", "additionalItems", "additionalProperties", "unevaluatedItems",
                            "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
                            "contains", "propertyNames"})


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's form)
    id: str


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's tool format calls for, or None when it shows no tool calls."""
    if not template:
        return None
    if OPEN in template and "<function=" in template:
        return "qwen3_xml"
    if OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return None


class ToolCallStream:
    """A reply's answer as it streams: content is passed on until a call begins, then held to the end, where
    :meth:`finish` parses it (a call marker split across pieces is held until the next piece settles it)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self._held = ""
        self._calling = False
        self._emitted = False

    def feed(self, text: str) -> str:
        buf = self._held + text
        if self._calling:
            self._held = buf
            return ""
        if self.parser in _WHOLE_REPLY:  # a call is the whole reply: its first visible characters decide
            openers = _WHOLE_REPLY[self.parser]
            stripped = buf.lstrip()
            if not self._emitted and stripped.startswith(openers):
                self._calling, self._held = True, buf
                return ""
            if not self._emitted and (not stripped or any(o.startswith(stripped) for o in openers)):
                self._held = buf
                return ""
            self._emitted, self._held = True, ""
            return buf
        at = buf.find(OPEN)
        if at >= 0:
            self._calling, self._held = True, buf[at:]
            return buf[:at]
        keep = next((size for size in range(min(len(OPEN) - 1, len(buf)), 0, -1) if OPEN.startswith(buf[-size:])), 0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held text's content and calls, once the reply has ended."""
        held, self._held = self._held, ""
        return parse(self.parser, held) if self._calling else (held, [])


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """The reply's content outside its tool calls, and the calls."""
    if parser == "llama3_json":
        return _llama3(text)
    if parser == "generic":
        return _generic(text)
    calls: list[ToolCall] = []
    content: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _hermes(match[1]) if parser == "hermes" else _qwen3_xml(match[1])
        if call is None:
            continue  # malformed: left in the content
        content.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    content.append(text[last:])
    return "".join(content) if calls else text, calls


def _new_call(name: object, arguments: object) -> ToolCall | None:
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False), id=f"call_{uuid.uuid4().hex[:24]}")


def _hermes(body: str) -> ToolCall | None:
    try:
        return _named_call(json.loads(body))
    except json.JSONDecodeError:
        return None


def _named_call(call: object) -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` (the arguments an object or its JSON text) as a call, or None."""
    if not isinstance(call, dict):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return _new_call(call.get("name"), arguments)


def _qwen3_xml(body: str) -> ToolCall | None:
    match = _FUNCTION.match(body.strip())
    if match is None:
        return None
    arguments: dict[str, object] = {}
    for key, raw in _PARAMETER.findall(match[2]):
        try:
            arguments[key] = json.loads(raw)
        except json.JSONDecodeError:
            arguments[key] = raw
    return _new_call(match[1], arguments)


def _llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            value, position = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(value, dict):
            return text, []
        call = _new_call(value.get("name"), value.get("parameters", value.get("arguments", {})))
        if call is None:
            return text, []
        calls.append(call)
        position = len(body) - len(body[position:].lstrip().removeprefix(";").lstrip())
    return "", calls


def _generic(text: str) -> tuple[str, list[ToolCall]]:
    """llama.cpp's generic format: the reply is one JSON object; any other reply is content."""
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    if not isinstance(reply, dict):
        return text, []
    if "tool_calls" in reply or "tool_call" in reply:
        items = reply["tool_calls"] if "tool_calls" in reply else [reply["tool_call"]]
        parsed = [_named_call(item) for item in items] if isinstance(items, list) else []
        calls = [call for call in parsed if call is not None]
        return ("", calls) if calls and len(calls) == len(parsed) else (text, [])  # all well-formed, or content
    if "response" in reply:
        response = reply["response"]
        return response if isinstance(response, str) else json.dumps(response, ensure_ascii=False), []
    return text, []


def forcing_grammar(parser: str, tools: list[dict], name: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's, with ``%json``) whose every string is a call in ``parser``'s format: to the
    tool ``name``, or to any of ``tools`` (tool_choice "required"), arguments valid under its parameters' schema."""
    functions = [t.get("function", {}) for t in tools
                 if isinstance(t, dict) and t.get("type", "function") == "function"]
    chosen = [f for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str)
              and (name is None or f["name"] == name)]
    if not chosen:
        raise ValueError(f"no tool named {name!r}" if name is not None else "tools has no function")
    rules = []
    for i, function in enumerate(chosen):
        parameters = function.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise ValueError(f"function {function['name']!r}: parameters must be a JSON schema object")
        if parser == "qwen3_xml":
            rules += _xml_call_rules(f"call_{i}", function["name"], parameters)
            continue
        rules.append(f"call_{i}: {_json_call(parser, function['name'], parameters)}")
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))
    if parser == "generic":
        start = (r'start: "{\"tool_calls\": [" call (", " call)* "]}"' if parallel
                 else r'start: "{\"tool_call\": " call "}"')
        return "\n".join([start, call, *rules])
    if parser == "llama3_json":
        block = "block: call"
        start = 'start: block ("; " block)*' if parallel else "start: block"
    else:
        block = 'block: "<tool_call>\\n" call "\\n</tool_call>"'
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
    return "\n".join([start, block, call, *rules])


def _json_call(parser: str, name: str, parameters: dict) -> str:
    """One call in a JSON format: fixed text around the arguments, a ``%json`` whose root is the parameters schema
    itself, so that its references (``#/$defs/X``, as pydantic writes them) resolve as the client meant them."""
    head = json.dumps({"name": name}, ensure_ascii=False)[:-1] + f', "{_ARGUMENTS_KEY[parser]}": '
    return f"{json.dumps(head)} %json {json.dumps(parameters | {'x-guidance': JSON_OPTIONS})} \"}}\""


def _xml_call_rules(rule: str, name: str, parameters: dict) -> list[str]:
    """One qwen3_xml call: its declared parameters in order (the required ones always), each value as JSON under
    its schema, which the parser reads back (a string in quotes stays a string whatever it holds)."""
    arguments = _arguments_schema(parameters)
    properties = arguments.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = arguments.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    if required - set(properties):
        raise ValueError(f"function {name!r} requires parameters its schema does not describe: "
                         f"{sorted(required - set(properties))}")
    parts, rules = [], []
    for label, text in (("function", name), *(("parameter", key) for key in properties)):
        if not re.fullmatch(r"[^<>\s]+", text):
            raise ValueError(f"the qwen3_xml format cannot carry the {label} name {text!r}")
    # Each value's schema becomes the root of its own %json: its references, written against the parameters
    # schema's root, are moved to point into a copy of that schema kept under the value's $defs.
    base = f"/$defs/{_PARAMETERS_COPY}"
    copy = _rebased(parameters, base)
    for k, (key, schema) in enumerate(properties.items()):
        value = _rebased(schema, base) if isinstance(schema, dict) else {}
        if '"$ref"' in json.dumps(value):
            value = value | {"$defs": {_PARAMETERS_COPY: copy}}
        value |= {"x-guidance": JSON_OPTIONS}
        open_tag, close_tag = json.dumps(f"<parameter={key}>\n"), json.dumps("\n</parameter>\n")
        rules.append(f"{rule}_p{k}: {open_tag} %json {json.dumps(value)} {close_tag}")
        parts.append(f"{rule}_p{k}" if key in required else f"{rule}_p{k}?")
    return [f"{rule}: {json.dumps(f'<function={name}>' + chr(10))} {' '.join(parts)} \"</function>\"", *rules]


def _arguments_schema(parameters: dict) -> dict:
    """The schema whose properties are the arguments: ``parameters``, or the schema it only refers to (pydantic
    writes a recursive model as ``{"$defs": {...}, "$ref": "#/$defs/Model"}``)."""
    schema, seen = parameters, set()
    while "properties" not in schema and isinstance(ref := schema.get("$ref"), str) and ref not in seen:
        seen.add(ref)
        target = _pointer(parameters, ref)
        if not isinstance(target, dict):
            break
        schema = target
    return schema


def _pointer(document: object, ref: str) -> object:
    """What a local reference (``#/a/b``, a JSON pointer) names in ``document``, or None."""
    if not ref.startswith("#/"):
        return None
    node = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _rebased(schema: object, base: str) -> object:
    """``schema`` with its local references (``#`` and ``#/...``) moved under the JSON pointer ``base``: the
    schema as it reads once its document sits at ``base`` in another. Only keywords that hold schemas are
    walked, so a ``$ref`` key inside ``const``, ``enum`` or ``default`` data stays as written."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(s, base) for name, s in value.items()}
        elif key in _SCHEMA_VALUES:
            out[key] = _rebased(value, base)
        else:
            out[key] = value
    return out
