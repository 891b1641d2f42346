"""Grammars deep but flat: chains that llguidance compiles by recursion (issue 31, item 1), shared by the core and
server tests. Each builder makes a chain of ``n`` links."""

from __future__ import annotations

import json
from typing import Any

from pocketllm.limits import MAX_GRAMMAR_RULES, MAX_SCHEMA_DEPTH


def ref_chain(n: int, via: str = "properties") -> dict[str, Any]:
    """``$defs`` d0 -> d1 -> ... -> d(n-1), each link a ``$ref`` inside ``via``."""
    defs: dict[str, Any] = {}
    for i in range(n):
        nxt: dict[str, Any] = {"$ref": f"#/$defs/d{i + 1}"} if i + 1 < n else {"type": "integer"}
        defs[f"d{i}"] = {"properties": {"type": "object", "properties": {"x": nxt}, "required": ["x"]},
                         "items": {"type": "array", "items": nxt},
                         "prefixItems": {"type": "array", "prefixItems": [nxt]},
                         "anyOf": {"anyOf": [nxt, {"type": "null"}]},
                         "allOf": {"allOf": [nxt]},
                         "ref": nxt}[via]
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "a"'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "a"'


def lark_chain_into_json(n: int, links: int) -> str:
    """A chain of ``n`` rules whose last one is a ``%json`` chain of ``links`` references."""
    lines = [f'r{i}: "a" r{i + 1}' for i in range(n)] + [f"r{n}: %json {json.dumps(ref_chain(links, 'ref'))}"]
    return "start: r0\n" + "\n".join(lines)


# Just inside the bounds: (name, StructuredOutputs fields). The levels of a chain: a "ref" link is one object,
# a "prefixItems" link two, a "properties" link three (the link, its properties, the property).
AT_THE_BOUNDS = [
    ("$ref chain", {"json": ref_chain(MAX_SCHEMA_DEPTH - 3, "ref")}),
    ("prefixItems chain", {"json": ref_chain(MAX_SCHEMA_DEPTH // 2 - 2, "prefixItems")}),
    ("properties chain", {"json": ref_chain(MAX_SCHEMA_DEPTH // 3 - 2, "properties")}),
    ("Lark chain", {"grammar": lark_chain(MAX_GRAMMAR_RULES - 2)}),
    ("GBNF chain", {"grammar": gbnf_chain(MAX_GRAMMAR_RULES - 2)}),
    ("Lark chain into a %json chain", {"grammar": lark_chain_into_json(MAX_GRAMMAR_RULES - 5,
                                                                       MAX_SCHEMA_DEPTH - 7)}),
]
# What crashed the process (the issue's sizes), and ten times each bound: (name, fields, the limit's words).
PAST_THE_BOUNDS = [
    *((f"1,000 $ref links through {via}", {"json": ref_chain(1000, via)}, f"more than {MAX_SCHEMA_DEPTH} deep")
      for via in ("properties", "items", "anyOf", "allOf")),
    ("3,000 chained Lark rules", {"grammar": lark_chain(3000)}, f"more than {MAX_GRAMMAR_RULES} rules"),
    ("10x the depth", {"json": ref_chain(10 * MAX_SCHEMA_DEPTH, "ref")}, f"more than {MAX_SCHEMA_DEPTH} deep"),
    ("10x the Lark rules", {"grammar": lark_chain(10 * MAX_GRAMMAR_RULES)}, f"more than {MAX_GRAMMAR_RULES} rules"),
    ("10x the GBNF rules", {"grammar": gbnf_chain(10 * MAX_GRAMMAR_RULES)}, f"more than {MAX_GRAMMAR_RULES} rules"),
    ("10x the depth inside Lark", {"grammar": lark_chain_into_json(10, 10 * MAX_SCHEMA_DEPTH)},
     f"more than {MAX_SCHEMA_DEPTH} deep"),
]
