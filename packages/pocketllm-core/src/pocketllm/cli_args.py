"""Every EngineArgs field as a command-line flag; shared by ``pocketllm`` and ``pocketllm-server``."""

from __future__ import annotations

import argparse
import dataclasses
import json

from pocketllm.args import ENV_PREFIX, EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--<field>`` for each EngineArgs field. Flags left out fall back to ``POCKETLLM_*``, then defaults."""
    group = parser.add_argument_group("engine", "engine options (each also read from POCKETLLM_<NAME>; a flag wins)")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        help_text = f"{f.metadata['help']} (default: {_default(f)}; ${ENV_PREFIX}{f.name.upper()})"
        if f.name == "backend_options":
            help_text += _installed_backend_options()
        help_text = help_text.replace("%", "%%")
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind.startswith("dict"):
            group.add_argument(flag, dest=f.name, type=json.loads, default=None, metavar="JSON", help=help_text)
        elif kind.startswith("int"):
            group.add_argument(flag, dest=f.name, type=int, default=None, metavar="N", help=help_text)
        else:
            group.add_argument(flag, dest=f.name, default=None, metavar=f.name.split("_")[-1].upper(), help=help_text)


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return json.dumps(f.default_factory())  # type: ignore[misc]
    return "none" if f.default is None else str(f.default)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    """Flags win over ``POCKETLLM_*`` variables, which win over EngineArgs' defaults."""
    explicit = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)
                if getattr(namespace, f.name, None) is not None}
    return EngineArgs.from_env(**explicit)


def _installed_backend_options() -> str:
    """Each installed backend's options, for --backend-options' help (``pocketllm backends`` says the same)."""
    from pocketllm.backend_options import describe
    from pocketllm.plugins import BackendRegistry

    lines = []
    for entry in BackendRegistry().entries():  # plugins' own modules only: no backend runtime is imported
        options = describe(entry.capabilities.backend_options)
        listed = "; ".join(f"{o.name} ({o.expects}, default {o.default}): {o.help}" for o in options)
        lines.append(f"{entry.name}: {listed or 'none'}")
    return ". Installed backends' keys: " + ". ".join(lines) if lines else ""
