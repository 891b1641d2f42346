"""Backend options: the typed settings a backend declares, and the one check of what a user asked for.

A backend declares its options as a subclass of :class:`BackendOptions` (``Capabilities.backend_options``), one
field per option, typed with its range and help text, and with a default (None where the backend picks)::

    class EchoOptions(BackendOptions, kw_only=True):  # frozen, and unknown keys refused, as the base
        delay_ms: Annotated[int, msgspec.Meta(ge=0, le=1000, description="pause before each step")] = 0

The user's ``EngineArgs.backend_options`` (a dict: JSON from ``--backend-options``) is converted into that
class once, by :func:`resolve`, before ``create_engine``; the engine receives the instance and reads its fields.
"""

from __future__ import annotations

import json
import reprlib
import typing
from typing import Any

import msgspec
import msgspec.inspect as mi

from pocketllm.errors import ConfigError, UnsupportedOptionError


class BackendOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The options of a backend that has none; a backend's own options subclass it."""


class OptionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One declared option, in words: for ``pocketllm backends`` and error messages."""

    name: str
    expects: str
    """What a value must be: "an integer from 1 to 1024", "true or false", ..."""
    default: str
    """The default as JSON, or "chosen by the backend" for None."""
    help: str


def describe(spec: type[BackendOptions]) -> list[OptionInfo]:
    """Each option of ``spec``, in declaration order."""
    info = mi.type_info(spec)
    assert isinstance(info, mi.StructType)
    return [OptionInfo(name=f.encode_name, expects=_expects(f.type), default=_default(f), help=_help(f.type))
            for f in info.fields]


def resolve(backend: str, spec: type[BackendOptions], given: dict[str, Any]) -> BackendOptions:
    """``given`` as an instance of ``spec``, or the error that names the first key it refuses: an unknown key is
    an UnsupportedOptionError, a value of the wrong type or out of range a ConfigError."""
    options = {o.name: o for o in describe(spec)}
    hints = typing.get_type_hints(spec, include_extras=True)
    info = mi.type_info(spec)
    assert isinstance(info, mi.StructType)
    attribute = {f.encode_name: f.name for f in info.fields}  # a key is as the struct encodes it (rename=...)
    for key, value in given.items():
        if key not in options:
            raise UnsupportedOptionError(f"backend_options.{key}", backend,
                                         f"accepted keys: {', '.join(options) or 'none'}")
        try:
            msgspec.convert(value, hints[attribute[key]])  # strict: true is no integer, nor "8"
        except msgspec.ValidationError:
            raise ConfigError(f"backend_options.{key}", f"backend {backend!r} takes {options[key].expects}, "
                                                        f"got {reprlib.repr(value)}") from None
    try:
        return msgspec.convert(given, spec)
    except msgspec.ValidationError as e:  # a rule across options, in the backend's __post_init__
        raise ConfigError("backend_options", f"backend {backend!r}: {e}") from None


def _expects(t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return _expects(t.type)
    if isinstance(t, mi.UnionType):  # null, where it is the default, says "the backend picks": no value to give
        return " or ".join(_expects(member) for member in t.types if not isinstance(member, mi.NoneType))
    if isinstance(t, mi.NoneType):
        return "null"
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(json.dumps(v) for v in t.values)
    if isinstance(t, mi.IntType | mi.FloatType):
        return ("an integer" if isinstance(t, mi.IntType) else "a number") + _range(t)
    if isinstance(t, mi.StrType):
        return "a string"
    return "a " + type(t).__name__.removesuffix("Type").lower()  # a list, a dict, ...: as the JSON has it


def _range(t: mi.IntType | mi.FloatType) -> str:
    if t.ge is not None and t.le is not None:
        return f" from {t.ge} to {t.le}"
    bounds = [f"{op} {bound}" for op, bound in ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt))
              if bound is not None]
    return " " + " and ".join(bounds) if bounds else ""


def _default(f: mi.Field) -> str:
    if f.required:
        return "none: required"
    if f.default is None:
        return "chosen by the backend"
    value = f.default_factory() if f.default is mi.NODEFAULT else f.default
    return json.dumps(msgspec.to_builtins(value))


def _help(t: mi.Type) -> str:
    """The description of the field's type, or of the non-None member of an optional one."""
    if isinstance(t, mi.Metadata) and t.extra_json_schema and "description" in t.extra_json_schema:
        return t.extra_json_schema["description"]
    members = t.types if isinstance(t, mi.UnionType) else (t.type,) if isinstance(t, mi.Metadata) else ()
    return next((h for h in map(_help, members) if h), "")
