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
from pocketllm.backend_options import BackendOptions, describe, resolve
from pocketllm.capability_checks import check_engine_args
from pocketllm.errors import BackendNotFoundError, BrokenBackendError, UnsupportedOptionError

if TYPE_CHECKING:
    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint

ENTRY_POINT_GROUP = "pocketllm.backends"
ALLOW_ENV = "POCKETLLM_PLUGINS"
"""Comma-separated entry-point names allowed to load; unset loads all, empty loads none."""

log = logging.getLogger(__name__)


class PluginFailure(msgspec.Struct, frozen=True):
    """A plugin that failed to load, or a backend that failed when the core called it (``broken``)."""

    entry_point: str  # the entry point's name, with ``:<backend>`` for one backend of it
    distribution: str
    error: str
    version: str = "?"
    broken: bool = False  # it registered, and one of its hooks raised when called


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
        self._origins: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self._plugin_of: dict[str, str] = {}  # backend name -> the plugin (entry point) that registered it
        self._capabilities: dict[str, Capabilities] = {}  # read once per backend, on first use
        self._broken: dict[str, BrokenBackendError] = {}
        self._failed_selectors: set[str] = set()  # plugins whose pocketllm_select_backend raised: not asked again
        self._failed_observers: set[str] = set()  # plugins whose pocketllm_request_finished raised: not called again
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
                failure = PluginFailure(ep.name, dist, f"{type(e).__name__}: {e}", version)
                self.failures.append(failure)
                log.warning("backend plugin %r from %s failed to load: %s", ep.name, dist, failure.error)

    def register_plugin(self, plugin: object, *, name: str | None = None, distribution: str = "?",
                        version: str = "?") -> None:
        """Register a module or object carrying ``@hookimpl`` functions and collect its backends.

        A plugin whose registration hook raises is recorded in ``failures`` with none of its backends."""
        name = self.pm.register(plugin, name=name) or name or "?"
        self._origins[name] = (distribution, version)
        collected: list[BackendPlugin] = []

        def register(backend: BackendPlugin) -> None:
            # A backend this core cannot drive is reported by `pocketllm backends`, and its siblings still load.
            problem = _incompatibility(backend)
            if problem is not None:
                failure = PluginFailure(f"{name}:{_attribute(backend, 'name')}", distribution, problem, version)
                self.failures.append(failure)
                log.warning("backend %s from %s not loaded: %s", failure.entry_point, distribution, problem)
                return
            collected.append(backend)

        hook = getattr(plugin, "pocketllm_register_backends", None)
        try:
            if hook is not None:
                hook(register=register)
        except Exception as e:  # a broken plugin must never break the core
            self.pm.unregister(plugin)
            self._fail(name, "", f"pocketllm_register_backends raised {type(e).__name__}: {e}", broken=False)
            return
        for backend in collected:
            taken = self._backends.get(backend.name)
            if taken is not None and "?" not in (taken[1], distribution) and taken[1] != distribution:
                # Two installed distributions claim one name: which one ran would depend on the order of sys.path.
                # Neither runs; both are named, so that one of them can be uninstalled.
                self._fail(name, backend.name, f"the backend name {backend.name!r} is claimed by both {taken[1]} and "
                                               f"{distribution}: uninstall one of them")
                continue
            # Registered again by the same distribution (or programmatically), it replaces the earlier one.
            self._backends[backend.name] = (backend, distribution, version)
            self._plugin_of[backend.name] = name
            self._capabilities.pop(backend.name, None)
            self._broken.pop(backend.name, None)

    def names(self) -> list[str]:
        return sorted(self._backends)

    def get(self, name: str) -> BackendPlugin:
        """The backend registered as ``name``, once its capabilities could be read (BrokenBackendError if not)."""
        if name not in self._backends:
            raise BackendNotFoundError(_not_found(name, self.names(), self.failures))
        self.capabilities(name)
        return self._backends[name][0]

    def capabilities(self, name: str) -> Capabilities:
        """``name``'s Capabilities, read once; a backend whose ``capabilities()`` raised, or returned something
        else, is broken from then on: it is listed in ``failures``, ``auto`` skips it, naming it raises."""
        if name in self._broken:
            raise self._broken[name]
        if name not in self._capabilities:
            plugin = self._backends[name][0]
            try:
                capabilities = plugin.capabilities()
                if not isinstance(capabilities, Capabilities):
                    raise TypeError(f"it returned {type(capabilities).__name__}, not pocketllm.backend.Capabilities")
                declared = capabilities.backend_options
                if not (isinstance(declared, type) and issubclass(declared, BackendOptions)):
                    raise TypeError(f"its backend_options is {declared!r}, not a pocketllm.backend_options."
                                    "BackendOptions subclass")
                describe(declared)  # raises for annotations that cannot be resolved: no user's option could pass
            except Exception as e:
                raise self._fail(self._plugin_of.get(name, "?"), name,
                                 f"capabilities() raised {type(e).__name__}: {e}", declared=plugin.api_version) from e
            self._capabilities[name] = capabilities
        return self._capabilities[name]

    def check_backend_options(self, args: EngineArgs) -> None:
        """Refuse ``args.backend_options`` that the backend ``args`` names does not take, before any model is read
        (the server checks them before it binds its port). Under ``backend="auto"`` the backend, and so this
        check, waits for the checkpoint: see ``select``."""
        if args.backend != "auto":
            self.get(args.backend)  # BackendNotFoundError, or BrokenBackendError, first
            resolve(args.backend, self.capabilities(args.backend).backend_options, args.backend_options)

    def entries(self) -> list[BackendEntry]:
        """Every working backend (the broken ones are in ``failures`` afterwards)."""
        entries = []
        for name, (plugin, dist, version) in sorted(self._backends.items()):
            try:
                capabilities = self.capabilities(name)
            except BrokenBackendError:
                continue
            score, reason = _probe(plugin)
            entries.append(BackendEntry(name, dist, version, score, capabilities, plugin, reason))
        return entries

    def select(self, args: EngineArgs, checkpoint: Checkpoint | None = None) -> BackendPlugin:
        """Resolve ``args.backend``: an explicit name, else a hook's choice, else the highest score above 0 among
        the backends whose Capabilities serve ``checkpoint`` with ``args`` (all of them without a checkpoint).
        When none does, the best-scored backend's refusal is raised: it names what is unsupported. Broken
        backends are skipped."""
        if args.backend != "auto":
            return self.get(args.backend)
        # Probes answer from cheap facts (see "Probe scores" in backend.py): only the chosen backend's
        # create_engine imports its runtime.
        scores = {name: _probe(plugin)[0] for name, (plugin, _, _) in self._backends.items()}
        chosen = self._hook_choice(args, scores)
        if chosen is not None:
            return self.get(chosen)
        # The highest score first; on a tie, the name that sorts first.
        available = sorted((-score, name) for name, score in scores.items() if score > 0)
        refusals: list[UnsupportedOptionError] = []
        for _, name in available:
            try:
                plugin = self.get(name)
            except BrokenBackendError:
                continue
            if checkpoint is None:
                return plugin
            try:
                check_engine_args(name, self.capabilities(name), args, checkpoint)
            except UnsupportedOptionError as e:
                refusals.append(e)
                continue
            return plugin
        if not refusals:
            raise BackendNotFoundError(_not_found("auto", self.names(), self.failures))
        raise refusals[0]

    def _hook_choice(self, args: EngineArgs, scores: dict[str, int]) -> str | None:
        """The first non-None answer of the ``pocketllm_select_backend`` hooks, called one by one in pluggy's
        order so that one that raises is recorded as broken and skipped, not fatal to every selection."""
        for impl in reversed(self.pm.hook.pocketllm_select_backend.get_hookimpls()):
            if impl.plugin_name in self._failed_selectors:
                continue
            values = {"args": args, "scores": dict(scores)}
            try:
                chosen = impl.function(**{arg: values[arg] for arg in impl.argnames})
            except Exception as e:
                self._failed_selectors.add(impl.plugin_name)
                self._fail(impl.plugin_name, "", f"pocketllm_select_backend raised {type(e).__name__}: {e}")
                continue
            if chosen is None:
                continue
            if chosen in self._backends and chosen not in self._broken:
                return chosen
            log.warning("ignoring plugin %r's choice of backend %r: no such working backend", impl.plugin_name,
                        chosen)
        return None

    def request_finished(self, *, request_id: str, finish_reason: str, num_prompt_tokens: int,
                         num_completion_tokens: int) -> None:
        """Call every ``pocketllm_request_finished`` observer, one by one: it runs on the engine thread, so an
        observer that raises is recorded as broken and not called again, never fatal to the engine's loop."""
        values = {"request_id": request_id, "finish_reason": finish_reason, "num_prompt_tokens": num_prompt_tokens,
                  "num_completion_tokens": num_completion_tokens}
        for impl in self.pm.hook.pocketllm_request_finished.get_hookimpls():
            if impl.plugin_name in self._failed_observers:
                continue
            try:
                impl.function(**{arg: values[arg] for arg in impl.argnames})
            except Exception as e:
                self._failed_observers.add(impl.plugin_name)
                self._fail(impl.plugin_name, "", f"pocketllm_request_finished raised {type(e).__name__}: {e}")

    def engine_failed(self, error: BrokenBackendError) -> None:
        """Record that ``error.backend``'s create_engine failed: it is broken from now on, and ``auto`` skips it."""
        self._fail(self._plugin_of.get(error.backend, "?"), error.backend, str(error))

    def _fail(self, plugin: str, backend: str, error: str, *, declared: object = None,
              broken: bool = True) -> BrokenBackendError:
        """Record a failed hook call of ``plugin`` (and of its backend ``backend``, which is broken from now on)."""
        distribution, version = self._origins.get(plugin, ("?", "?"))
        if declared is not None:
            error += f" (it declares contract {_version_text(declared)}; this pocketllm-core speaks " \
                     f"{_version_text(API_VERSION)})"
        self.failures.append(PluginFailure(f"{plugin}:{backend}" if backend else plugin, distribution, error,
                                           version, broken=broken))
        log.warning("backend plugin %r from %s is broken: %s", plugin, distribution, error)
        failure = BrokenBackendError(f"backend {backend or plugin!r} (plugin {plugin!r} from {distribution} "
                                     f"{version}) is broken: {error}", backend or plugin, distribution)
        if backend:
            self._broken[backend] = failure
        return failure


def _incompatibility(backend: object) -> str | None:
    """Why the core cannot drive ``backend``, or None when it can."""
    try:
        if not isinstance(backend, BackendPlugin) or not isinstance(backend.name, str) or not backend.name:
            return f"{backend!r} does not implement pocketllm.backend.BackendPlugin"
        version = backend.api_version
    except Exception as e:  # a property that raises
        return f"reading its name or api_version raised {type(e).__name__}: {e}"
    if not (isinstance(version, tuple) and len(version) == 2 and all(type(v) is int for v in version)):
        return (f"backend {backend.name!r} declares api_version {version!r}; expected (major, minor), "
                f"this pocketllm-core speaks {API_VERSION}")
    if version[0] != API_VERSION[0] or version[1] > API_VERSION[1]:
        return (f"backend {backend.name!r} targets contract {version[0]}.{version[1]}, this pocketllm-core speaks "
                f"{API_VERSION[0]}.{API_VERSION[1]} (same major and an older or equal minor are required)")
    return None


def _attribute(backend: object, name: str) -> str:
    try:
        return str(getattr(backend, name, "?"))
    except Exception:
        return "?"


def _version_text(version: object) -> str:
    if isinstance(version, tuple) and len(version) == 2:
        return f"{version[0]}.{version[1]}"
    return repr(version)


def _probe(plugin: BackendPlugin) -> tuple[int, str | None]:
    """The backend's score, and why it is 0 when its probe raised to say (see "Probe scores" in backend.py)."""
    try:
        return max(0, int(plugin.probe())), None
    except Exception as e:
        # Not a warning: a backend for hardware this machine lacks (an NPU's, a GPU's) is unavailable on every
        # start here, as it should be; `pocketllm backends` shows the reason.
        log.debug("backend %r is unavailable here: %s", plugin.name, e)
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
