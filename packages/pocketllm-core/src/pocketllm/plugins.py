"""Backend discovery (entry points), registration and selection."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from typing import TYPE_CHECKING

import msgspec
import pluggy

from pocketllm import hookspecs
from pocketllm.backend import API_VERSION, BackendPlugin, Capabilities
from pocketllm.errors import BackendNotFoundError, UnsupportedOptionError
from pocketllm.support import check_engine_args

if TYPE_CHECKING:
    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint

ENTRY_POINT_GROUP = "pocketllm.backends"
ALLOW_ENV = "POCKETLLM_PLUGINS"
"""Comma-separated entry-point names allowed to load; unset loads all, empty loads none."""

log = logging.getLogger(__name__)


class PluginFailure(msgspec.Struct, frozen=True):
    entry_point: str
    distribution: str
    error: str


class BackendEntry(msgspec.Struct, frozen=True):
    """A registered backend and where it came from, as ``pocketllm backends`` shows it."""

    name: str
    distribution: str
    version: str
    score: int
    capabilities: Capabilities
    plugin: BackendPlugin
    unavailable: str | None = None  # why probe() found this machine unusable, when it said


class BackendRegistry:
    """The plugin manager plus the backends its plugins registered."""

    def __init__(self, *, load_entry_points: bool = True, allow: set[str] | None = None) -> None:
        self.pm = pluggy.PluginManager("pocketllm")
        self.pm.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self._backends: dict[str, tuple[BackendPlugin, str, str]] = {}
        if load_entry_points:
            self._load_entry_points(allow if allow is not None else _allow_from_env())

    def _load_entry_points(self, allow: set[str] | None) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow:
                continue
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            try:
                plugin = ep.load()
                self.register_plugin(plugin, name=ep.name, distribution=dist, version=version)
            except Exception as e:  # a broken plugin must never break the core
                failure = PluginFailure(ep.name, dist, f"{type(e).__name__}: {e}")
                self.failures.append(failure)
                log.warning("backend plugin %r from %s failed to load: %s", ep.name, dist, failure.error)

    def register_plugin(self, plugin: object, *, name: str | None = None, distribution: str = "?",
                        version: str = "?") -> None:
        """Register a module or object carrying ``@hookimpl`` functions and collect its backends."""
        self.pm.register(plugin, name=name)

        def register(backend: BackendPlugin) -> None:
            # A backend this core cannot drive is reported by `pocketllm backends`, and its siblings still load.
            problem = _incompatibility(backend)
            if problem is not None:
                failure = PluginFailure(f"{name or '?'}:{getattr(backend, 'name', '?')}", distribution, problem)
                self.failures.append(failure)
                log.warning("backend %s from %s not loaded: %s", failure.entry_point, distribution, problem)
                return
            self._backends[backend.name] = (backend, distribution, version)

        hook = getattr(plugin, "pocketllm_register_backends", None)
        if hook is not None:
            hook(register=register)

    def names(self) -> list[str]:
        return sorted(self._backends)

    def get(self, name: str) -> BackendPlugin:
        try:
            return self._backends[name][0]
        except KeyError:
            raise BackendNotFoundError(_not_found(name, self.names(), self.failures)) from None

    def entries(self) -> list[BackendEntry]:
        entries = []
        for name, (plugin, dist, version) in sorted(self._backends.items()):
            score, reason = _probe(plugin)
            entries.append(BackendEntry(name, dist, version, score, plugin.capabilities(), plugin, reason))
        return entries

    def select(self, args: EngineArgs, checkpoint: Checkpoint | None = None) -> BackendPlugin:
        """Resolve ``args.backend``: an explicit name, else a hook's choice, else the highest score above 0 among
        the backends whose Capabilities serve ``checkpoint`` with ``args`` (all of them without a checkpoint).
        When none does, the best-scored backend's refusal is raised: it names what is unsupported."""
        if args.backend != "auto":
            return self.get(args.backend)
        scores = {name: _probe(plugin)[0] for name, (plugin, _, _) in self._backends.items()}
        chosen = self.pm.hook.pocketllm_select_backend(args=args, scores=scores)
        if chosen is not None:
            return self.get(chosen)
        # The highest score first; on a tie, the name that sorts first.
        available = sorted((-score, name) for name, score in scores.items() if score > 0)
        if not available:
            raise BackendNotFoundError(_not_found("auto", self.names(), self.failures))
        refusals: list[UnsupportedOptionError] = []
        for _, name in available:
            plugin = self.get(name)
            if checkpoint is None:
                return plugin
            try:
                check_engine_args(name, plugin.capabilities(), args, checkpoint)
            except UnsupportedOptionError as e:
                refusals.append(e)
                continue
            return plugin
        raise refusals[0]


def _incompatibility(backend: object) -> str | None:
    """Why the core cannot drive ``backend``, or None when it can."""
    if not isinstance(backend, BackendPlugin):
        return f"{backend!r} does not implement pocketllm.backend.BackendPlugin"
    version = backend.api_version
    if not (isinstance(version, tuple) and len(version) == 2 and all(type(v) is int for v in version)):
        return (f"backend {backend.name!r} declares api_version {version!r}; expected (major, minor), "
                f"this pocketllm-core speaks {API_VERSION}")
    if version[0] != API_VERSION[0] or version[1] > API_VERSION[1]:
        return (f"backend {backend.name!r} targets contract {version[0]}.{version[1]}, this pocketllm-core speaks "
                f"{API_VERSION[0]}.{API_VERSION[1]} (same major and an older or equal minor are required)")
    return None


def _probe(plugin: BackendPlugin) -> tuple[int, str | None]:
    """The backend's score, and why it is 0 when its probe raised to say (see "Probe scores" in backend.py)."""
    try:
        return max(0, int(plugin.probe())), None
    except Exception as e:
        log.warning("backend %r is unavailable here: %s", plugin.name, e)
        return 0, str(e) or type(e).__name__


def _allow_from_env() -> set[str] | None:
    raw = os.environ.get(ALLOW_ENV)
    return None if raw is None else {p.strip() for p in raw.split(",") if p.strip()}


def _not_found(name: str, known: list[str], failures: list[PluginFailure]) -> str:
    what = "no backend is available" if name == "auto" else f"no backend named {name!r}"
    msg = f"{what}; registered: {', '.join(known) or 'none'}"
    if failures:
        msg += "; failed to load: " + "; ".join(f"{f.entry_point} ({f.distribution}): {f.error}" for f in failures)
    return msg + ". Install one, e.g. `pip install pocketllm-torch`."
