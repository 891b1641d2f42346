"""Cheap checks of a structured-output grammar against the bounds in :mod:`pocketllm.limits`, before llguidance
compiles it.

llguidance compiles a grammar by recursion: along a chain of rules, and along a JSON schema's subschemas through
every ``$ref`` into its target. A chain deep enough overflows the compiling thread's stack, and that kills the
process (SIGSEGV) instead of raising. Its own parser guards nesting in the text (brackets, JSON), not chains, so
the chains are measured here: in one linear, iterative pass over the text or the schema, so that a spec that
breaks a bound costs next to nothing to refuse. Each error is a ConfigError naming ``structured_outputs`` and the
limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from pocketllm.errors import ConfigError
from pocketllm.limits import (
    MAX_GBNF_CHARS,
    MAX_GRAMMAR_ALTERNATIVES,
    MAX_GRAMMAR_REPEAT,
    MAX_GRAMMAR_RULES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_OBJECT_PROPERTIES,
)

_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_COUNT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_LARK_RULE = re.compile(r"[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?\d+)?[ \t]*:(?!:)")
_GBNF_RULE = re.compile(r"^[ \t]*([A-Za-z0-9_-]+)[ \t]*::=", re.MULTILINE)
_JSON = json.JSONDecoder()


def refuse(message: str) -> ConfigError:
    return ConfigError("structured_outputs", message)


def check_schema(schema: Any) -> None:
    """A JSON schema: subschemas nested at most MAX_SCHEMA_DEPTH deep, counting each ``$ref`` as its target's
    depth; no cycle of ``$ref`` (or ``allOf``) that never reaches a value; regex patterns within their bounds;
    objects within MAX_SCHEMA_OBJECT_PROPERTIES."""
    _check_ref_cycles(schema)
    # Depth-first, iteratively; a finished node's depth is kept (a $defs entry reached from many places is
    # walked once), and a reference back into the current path is a recursive schema, compiled as a rule.
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    objects: list[dict] = []  # every subschema, for the width check once the depth is known to be bounded
    stack: list[tuple[Any, Iterator[Any], list[int]]] = []

    def enter(node: Any, path_depth: int) -> bool:
        """True if ``node`` must be walked; else its depth is known (or it adds none)."""
        if not isinstance(node, dict | list) or id(node) in on_path:
            return False
        known = depths.get(id(node))
        if known is not None:
            if path_depth + known > MAX_SCHEMA_DEPTH:
                raise _too_deep()
            return False
        if isinstance(node, dict):
            if path_depth + 1 > MAX_SCHEMA_DEPTH:
                raise _too_deep()
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"])
            objects.append(node)
        on_path.add(id(node))
        stack.append((node, iter(_children(node, schema)), [0]))
        return True

    enter(schema, 0)
    path_depth = 1 if isinstance(schema, dict) else 0
    while stack:
        node, children, deepest = stack[-1]
        child = next(children, _DONE)
        if child is _DONE:
            stack.pop()
            on_path.discard(id(node))
            own = deepest[0] + (1 if isinstance(node, dict) else 0)
            depths[id(node)] = own
            path_depth -= 1 if isinstance(node, dict) else 0
            if stack:
                stack[-1][2][0] = max(stack[-1][2][0], own)
            continue
        if enter(child, path_depth):
            path_depth += 1 if isinstance(child, dict) else 0
        elif id(child) in depths:
            deepest[0] = max(deepest[0], depths[id(child)])
    widths: dict[int, int] = {}
    for node in objects:
        if _width(node, schema, widths) > MAX_SCHEMA_OBJECT_PROPERTIES:
            raise refuse(f"a JSON schema object has {widths[id(node)]} properties, counting those its allOf, anyOf "
                         f"and oneOf branches add; at most {MAX_SCHEMA_OBJECT_PROPERTIES} (the limit)")


_DONE = object()


def _width(node: dict, root: Any, widths: dict[int, int]) -> int:
    """The properties llguidance may offer at one point of the object ``node`` describes: its own, and those of
    the branches (allOf, anyOf, oneOf, a $ref beside them) that describe the same object. Recursion is bounded by
    MAX_SCHEMA_DEPTH, checked before; a branch back into its own path adds nothing."""
    known = widths.get(id(node))
    if known is not None:
        return known
    widths[id(node)] = 0  # while its branches are counted: a cycle through them adds nothing
    properties = node.get("properties")
    width = len(properties) if isinstance(properties, dict) else 0
    branches = [b for key in ("allOf", "anyOf", "oneOf") if isinstance(node.get(key), list) for b in node[key]]
    for branch in [*branches, _resolve(root, node.get("$ref"))]:
        if isinstance(branch, dict):
            width += _width(branch, root, widths)
    widths[id(node)] = width
    return width


def _too_deep() -> ConfigError:
    return refuse(f"the JSON schema nests objects more than {MAX_SCHEMA_DEPTH} deep, each $ref counted as the "
                  "depth of what it points to (the limit)")


def _children(node: dict | list, root: Any) -> Iterable[Any]:
    if isinstance(node, list):
        return node
    values = list(node.values())
    target = _resolve(root, node.get("$ref"))
    return [*values, target] if target is not None else values


def _resolve(root: Any, ref: object) -> Any:
    """The node a local ``$ref`` (``#``, ``#/$defs/x``) points to; None for any other reference."""
    if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node = root
    for part in ref[2:].split("/") if len(ref) > 1 else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_ref_cycles(root: Any) -> None:
    """A schema that is only a reference (or an allOf of one) to itself, however many hops round: it matches
    nothing, and llguidance would fail on it only once a request ran."""
    done: set[int] = set()
    for start in _dicts(root):
        seen: dict[int, int] = {}  # node id: hops from start
        node: Any = start
        while isinstance(node, dict) and id(node) not in done:
            if id(node) in seen:
                raise refuse("the JSON schema has a $ref cycle: a schema that is a reference to itself "
                             f"({len(seen) - seen[id(node)]} hop(s) round) matches no value")
            seen[id(node)] = len(seen)
            hops = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            parts = node.get("allOf")
            if not hops and isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], dict):
                node = parts[0]
                continue
            node = _resolve(root, hops[0]) if hops else None
        done.update(seen)


def _dicts(root: Any) -> Iterator[dict]:
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def check_regex(regex: str) -> int:
    """Refuse repetition counts whose nested product passes MAX_GRAMMAR_REPEAT; returns that product."""
    frames = [1]  # per open group: the largest repetition product inside it
    last, i = 1, 0  # the repetition factor of the atom just read
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            last, i = 1, i + 2
        elif c == "[":
            last, i = 1, _class_end(regex, i)
        elif c == "(":
            frames.append(1)
            last, i = 1, i + 1
        elif c == ")":
            last = frames.pop() if len(frames) > 1 else 1
            frames[-1] = max(frames[-1], last)
            i += 1
        elif (count := _COUNT.match(regex, i)) is not None:
            last = _repeat(last, count)
            frames[-1] = max(frames[-1], last)
            i = count.end()
        else:
            last, i = 1, i + 1
    return max(frames)


def _class_end(regex: str, i: int) -> int:
    """The index after the character class opening at ``regex[i]``."""
    i += 1
    if regex.startswith("^", i):
        i += 1
    if regex.startswith("]", i):
        i += 1
    while i < len(regex) and regex[i] != "]":
        i += 2 if regex[i] == "\\" else 1
    return i + 1


def _repeat(factor: int, count: re.Match[str]) -> int:
    upper = count[2] if count.lastindex == 2 and count[2] else count[1]
    product = factor * int(upper)
    if product > MAX_GRAMMAR_REPEAT:
        raise refuse(f"a repetition count of {product} (nested counts multiplied) is more than "
                     f"{MAX_GRAMMAR_REPEAT} (the limit)")
    return product


@dataclass(slots=True)
class _Group:
    alternatives: int = 1
    repeat: int = 1


def check_lark(text: str, special_tokens: Iterable[str] = ()) -> None:
    """A Lark grammar (llguidance's, with ``%json``): at most MAX_GRAMMAR_RULES rules, each bracketed group counted
    as the rule it becomes; at most MAX_GRAMMAR_ALTERNATIVES alternatives in a rule or group; repetition counts
    within MAX_GRAMMAR_REPEAT; each ``%json`` schema as :func:`check_schema`; no string literal holding the text of
    one of ``special_tokens``, which a model writes only as that special token, never as text."""
    specials = [s for s in special_tokens if s]
    rules, groups, last, i, n = 0, [_Group()], 1, 0, len(text)
    while i < n:
        c = text[i]
        if (i == 0 or text[i - 1] == "\n") and (rule := _LARK_RULE.match(text, i)) is not None:
            rules += 1
            groups, last, i = [_Group()], 1, rule.end()
        elif c == '"':
            end = _string_end(text, i)
            _check_literal(text[i + 1:end - 1], specials)
            last, i = 1, end
        elif c == "/" and text.startswith("//", i):
            i = _line_end(text, i)
        elif c == "/":
            end = _regex_end(text, i)
            last, i = check_regex(text[i + 1:end - 1]), end
        elif c == "%" and (block := re.compile(r"%(json|regex|llguidance)\s*(?=\{)").match(text, i)) is not None:
            try:
                value, i = _JSON.raw_decode(text, block.end())
            except ValueError:
                return  # llguidance names what is wrong with it
            if block[1] == "json":
                check_schema(value)
            last = 1
        elif c in "([":
            rules += 1
            groups.append(_Group())
            last, i = 1, i + 1
        elif c in ")]":
            last = groups.pop().repeat if len(groups) > 1 else 1
            groups[-1].repeat = max(groups[-1].repeat, last)
            i += 1
        elif c == "|":
            groups[-1].alternatives += 1
            if groups[-1].alternatives > MAX_GRAMMAR_ALTERNATIVES:
                raise refuse(f"a rule of the grammar has more than {MAX_GRAMMAR_ALTERNATIVES} alternatives "
                             "(the limit)")
            last, i = 1, i + 1
        elif (count := _COUNT.match(text, i) or _LARK_COUNT.match(text, i)) is not None:
            last = _repeat(last, count)
            groups[-1].repeat = max(groups[-1].repeat, last)
            i = count.end()
        else:
            i += 1
        if rules > MAX_GRAMMAR_RULES:
            raise refuse(f"the grammar has more than {MAX_GRAMMAR_RULES} rules, counting each bracketed group "
                         "(the limit)")


def _check_literal(literal: str, specials: list[str]) -> None:
    for special in specials:
        if special in literal:
            raise refuse(f"the grammar needs the text {special!r}, which the model writes only as a special "
                         "token: it can never produce it")


def check_choice(choice: list[str], special_tokens: Iterable[str]) -> None:
    for i, option in enumerate(choice):
        for special in special_tokens:
            if special and special in option:
                raise refuse(f"choice {i} holds {special!r}, which the model writes only as a special token: it "
                             "can never produce it")


def _string_end(text: str, i: int) -> int:
    i += 1
    while i < len(text) and text[i] not in '"\n':
        i += 2 if text[i] == "\\" else 1
    return min(i + 1, len(text))


def _regex_end(text: str, i: int) -> int:
    i += 1
    while i < len(text) and text[i] not in "/\n":
        i += 2 if text[i] == "\\" else 1
    return min(i + 1, len(text))


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end


def gbnf_in_dependency_order(text: str) -> str:
    """A GBNF grammar with each rule moved after the rules it refers to (at most MAX_GRAMMAR_RULES rules and
    MAX_GBNF_CHARS characters).

    llguidance's GBNF converter finds the rules that are terminals by passing over all of them until nothing
    changes, one more rule settled per pass along a chain: rules times size (a 1,000-rule chain took 2.4 s, a
    100-rule chain beside a 160 KB rule 7.6 s, all of it Python holding the GIL). With each rule after the rules
    it uses, its first pass settles them all. The order of rules does not change the grammar."""
    starts = list(_GBNF_RULE.finditer(text))
    if len(starts) > MAX_GRAMMAR_RULES:
        raise refuse(f"the grammar has more than {MAX_GRAMMAR_RULES} rules (the limit)")
    if len(text) > MAX_GBNF_CHARS:
        raise refuse(f"the GBNF grammar is longer than {MAX_GBNF_CHARS} characters (the limit; a Lark grammar may "
                     "be longer)")
    if not starts:
        return text
    blocks = {m[1]: text[m.start():(starts[k + 1].start() if k + 1 < len(starts) else len(text))]
              for k, m in enumerate(starts)}
    if len(blocks) < len(starts):
        return text  # a rule defined twice: the converter reports it
    uses = {name: [u for u in dict.fromkeys(_gbnf_names(block)) if u in blocks and u != name]
            for name, block in blocks.items()}
    ordered: list[str] = []
    placed: set[str] = set()
    for root in blocks:
        stack = [(root, iter(uses[root]))]
        placed.add(root)
        while stack:
            name, pending = stack[-1]
            child = next(pending, None)
            if child is None:
                stack.pop()
                ordered.append(name)
            elif child not in placed:
                placed.add(child)
                stack.append((child, iter(uses[child])))
    body = "".join(blocks[name] if blocks[name].endswith("\n") else blocks[name] + "\n" for name in ordered)
    return text[:starts[0].start()] + body


def _gbnf_names(block: str) -> Iterator[str]:
    """The rule names a GBNF rule's text uses (outside its literals, character classes and comments)."""
    i, n = block.index("::=") + 3, len(block)
    while i < n:
        c = block[i]
        if c == '"':
            i = _string_end(block, i)
        elif c == "[":
            i = _class_end(block, i)
        elif c == "#":
            i = _line_end(block, i)
        elif c.isalnum() or c in "_-":
            j = i
            while j < n and (block[j].isalnum() or block[j] in "_-"):
                j += 1
            yield block[i:j]
            i = j
        else:
            i += 1
