"""The native module's stub (_native.pyi) declares exactly what the module holds, each class with its members."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

_native = pytest.importorskip("pocketllm_cpp._native")


def _declared() -> dict[str, set[str]]:
    tree = ast.parse(Path(_native.__file__).with_name("_native.pyi").read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)} | {
                t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return out


def test_the_stub_declares_every_name_and_member() -> None:
    declared = _declared()
    public = {name for name in dir(_native) if not name.startswith("_")}
    assert set(declared) == public
    for name, members in declared.items():
        value = getattr(_native, name)
        if inspect.isclass(value):
            own = {m for m in vars(value) if not m.startswith("_")} | ({"__init__"} & members)
            assert members == own, name
