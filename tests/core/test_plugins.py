from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pocketllm import (
    API_VERSION,
    BackendNotFoundError,
    BrokenBackendError,
    Capabilities,
    EngineArgs,
    UnsupportedOptionError,
    hookimpl,
)
from pocketllm.plugins import BackendRegistry
from tests.conftest import requires_default_model


def test_third_party_backend_is_discovered_from_its_entry_point() -> None:
    registry = BackendRegistry()
    entry = next(e for e in registry.entries() if e.name == "echo")
    assert entry.distribution == "pocketllm-echo" and entry.version == "0.1.0" and entry.score == 1
    assert registry.select(EngineArgs(backend="echo")).name == "echo"


def test_broken_plugin_is_reported_with_its_distribution_and_does_not_break_the_core() -> None:
    registry = BackendRegistry()
    [failure] = [f for f in registry.failures if f.entry_point == "broken"]
    assert failure.distribution == "pocketllm-broken" and "pocketllm_missing_dependency" in failure.error
    with pytest.raises(BackendNotFoundError, match="pocketllm-broken"):
        registry.get("broken")


def test_allow_list_limits_which_plugins_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POCKETLLM_PLUGINS", "echo")
    registry = BackendRegistry()
    assert registry.names() == ["echo"] and registry.failures == []


class _Fake:
    def __init__(self, name: str, score: int, api_version: object = API_VERSION,
                 architectures: tuple[str, ...] = ("llama",), unavailable: str | None = None) -> None:
        self.name, self.score, self.api_version = name, score, api_version
        self.architectures, self.unavailable = architectures, unavailable

    def probe(self) -> int:
        if self.unavailable:
            raise RuntimeError(self.unavailable)
        return self.score

    def capabilities(self) -> Capabilities:
        return Capabilities(architectures=self.architectures)

    def create_engine(self, args, checkpoint, options):
        raise NotImplementedError


def _registry(*backends: _Fake) -> BackendRegistry:
    registry = BackendRegistry(load_entry_points=False)

    class Plugin:
        @staticmethod
        def pocketllm_register_backends(register):
            for backend in backends:
                register(backend)

    registry.register_plugin(Plugin(), name="fakes", distribution="fake-dist")
    return registry


def test_a_name_two_distributions_claim_runs_neither_and_names_both() -> None:
    """Which of two installed plugins registered last (and so ran) depended on the order of sys.path: a plugin
    could take over a built-in backend's name without a word."""
    registry = _registry(_Fake("shared", 5), _Fake("other", 1))

    class Impostor:
        @staticmethod
        def pocketllm_register_backends(register):
            register(_Fake("shared", 9))

    registry.register_plugin(Impostor(), name="impostor", distribution="impostor-dist")
    with pytest.raises(BrokenBackendError, match="claimed by both fake-dist and impostor-dist"):
        registry.get("shared")
    assert registry.select(EngineArgs()).name == "other"  # auto skips it
    assert [f.distribution for f in registry.failures] == ["impostor-dist"]
    registry.register_plugin(Impostor(), name="again", distribution="?")  # programmatic: replaces, as before
    assert registry.get("shared").probe() == 9


def test_auto_picks_the_highest_score_and_breaks_ties_by_name() -> None:
    registry = _registry(_Fake("low", 1), _Fake("high", 5), _Fake("absent", 0))
    assert registry.select(EngineArgs()).name == "high"
    assert registry.select(EngineArgs(backend="absent")).name == "absent"
    with pytest.raises(BackendNotFoundError, match="nope"):
        registry.select(EngineArgs(backend="nope"))
    assert _registry(_Fake("zeta", 5), _Fake("alpha", 5), _Fake("mid", 3)).select(EngineArgs()).name == "alpha"


def test_auto_skips_backends_that_cannot_serve_the_checkpoint(pocketllm_kit_checkpoint) -> None:
    from pocketllm.checkpoint import load_checkpoint

    llama = load_checkpoint(str(pocketllm_kit_checkpoint("llama")))
    registry = _registry(_Fake("best", 9, architectures=("qwen3",)), _Fake("second", 5))
    assert registry.select(EngineArgs(), llama).name == "second"  # the best one refuses Llama
    assert registry.select(EngineArgs()).name == "best"  # without a checkpoint: the score alone
    with pytest.raises(UnsupportedOptionError) as err:  # nobody serves it: the best-scored backend's refusal
        _registry(_Fake("best", 9, architectures=("qwen3",)), _Fake("other", 5, architectures=("qwen3",))).select(
            EngineArgs(), llama)
    assert (err.value.option, err.value.backend) == ("model", "best")
    with pytest.raises(UnsupportedOptionError, match="dtype"):  # options count too, not only the architecture
        _registry(_Fake("only", 9)).select(EngineArgs(dtype="bfloat16"), llama)


def test_a_probe_that_raises_is_unavailable_with_its_reason() -> None:
    registry = _registry(_Fake("needs-gpu", 20, unavailable="no CUDA device here"), _Fake("cpu", 10))
    [entry] = [e for e in registry.entries() if e.name == "needs-gpu"]
    assert (entry.score, entry.unavailable) == (0, "no CUDA device here")
    assert registry.select(EngineArgs()).name == "cpu"


def test_contract_version_compatibility_is_checked_and_reported() -> None:
    major, minor = API_VERSION
    registry = _registry(_Fake("same", 1), _Fake("older-minor", 1, (major, 0)),
                         _Fake("newer-minor", 1, (major, minor + 1)), _Fake("old-major", 1, (major - 1, 0)),
                         _Fake("bare-int", 1, major))
    assert registry.names() == ["older-minor", "same"]
    failures = {f.entry_point: f.error for f in registry.failures}
    assert set(failures) == {"fakes:newer-minor", "fakes:old-major", "fakes:bare-int"}
    assert f"contract {major}.{minor + 1}" in failures["fakes:newer-minor"]
    assert "(major, minor)" in failures["fakes:bare-int"]
    assert all(f.distribution == "fake-dist" for f in registry.failures)


def test_a_backend_whose_options_are_not_a_backend_options_class_is_broken() -> None:
    """Contract 2 declared the option keys as a tuple of names: a backend that still does is reported, and skipped."""
    from pocketllm.errors import BrokenBackendError

    class KeysOnly(_Fake):
        def capabilities(self) -> Capabilities:
            return Capabilities(architectures=self.architectures, backend_options=("block_size",))  # type: ignore

    registry = _registry(KeysOnly("keys-only", 5), _Fake("typed", 1))
    assert registry.select(EngineArgs()).name == "typed"
    with pytest.raises(BrokenBackendError, match=r"not a pocketllm\.backend_options\.BackendOptions subclass"):
        registry.get("keys-only")


def test_backends_command_shows_why_a_backend_did_not_load(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from pocketllm import cli, plugins

    monkeypatch.setattr(plugins, "BackendRegistry", lambda: _registry(_Fake("future", 1, (API_VERSION[0] + 1, 0))))
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "fakes:future" in out and "FAILED TO LOAD" in out and f"contract {API_VERSION[0] + 1}.0" in out


def test_import_pocketllm_does_not_import_torch_or_a_backend() -> None:
    code = ("import sys, pocketllm, pocketllm.llm, pocketllm.async_llm; "
            "print([m for m in ('torch', 'pocketllm_torch', 'transformers') if m in sys.modules]); "
            "pocketllm.plugins.BackendRegistry(); "  # discovery imports plugin modules, which must stay light
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "[]"]


@requires_default_model
def test_auto_imports_only_the_chosen_backend_s_runtime() -> None:
    """Probing scores torch from files: a start on the default model that cpp wins never imports torch (2.6-4.4 s
    of every start, before)."""
    pytest.importorskip("pocketllm_cpp")
    code = ("import sys; from pocketllm import LLM; llm = LLM(backend='auto', max_model_len=256); "
            "print(llm.backend_name, 'torch' in sys.modules); llm.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    backend, torch_imported = out.split()
    if backend != "cpp":
        pytest.skip(f"auto chose {backend} here (cpp wins on x86 CPUs with AVX2)")
    assert torch_imported == "False"


def test_unsupported_option_names_option_and_backend(pocketllm_tiny_llama: Path) -> None:
    from pocketllm import LLM

    with pytest.raises(UnsupportedOptionError) as err:
        LLM(str(pocketllm_tiny_llama), backend="echo", dtype="bfloat16")
    assert (err.value.option, err.value.backend) == ("dtype", "echo")
    assert "dtype" in str(err.value) and "echo" in str(err.value)


# A plugin written against contract 1.x that imports API_VERSION (so it declares the current contract) and still
# passes 1.x's `batching=` to Capabilities; and one whose selection hook raises. Both would win `auto` if they
# were not skipped.
_OLD_PLUGIN = '''
from pocketllm import API_VERSION, Capabilities, hookimpl


class OldBackend:
    name = "old"
    api_version = API_VERSION

    def probe(self):
        return 50

    def capabilities(self):
        return Capabilities(architectures=("llama",), batching=True)

    def create_engine(self, args, checkpoint, options):
        raise AssertionError("a broken backend must never be asked for an engine")


@hookimpl
def pocketllm_register_backends(register):
    register(OldBackend())


@hookimpl
def pocketllm_select_backend(args, scores):
    raise RuntimeError("selector crashed")
'''


@pytest.fixture
def old_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The plugin above installed as the distribution pocketllm-old 0.3.0 (a module and its dist-info on sys.path),
    next to the echo backend (POCKETLLM_PLUGINS keeps the others out)."""
    (tmp_path / "pocketllm_old.py").write_text(_OLD_PLUGIN)
    info = tmp_path / "pocketllm_old-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pocketllm-old\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text("[pocketllm.backends]\nold = pocketllm_old\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("POCKETLLM_PLUGINS", "old,echo")
    return tmp_path


def test_backends_command_lists_a_plugin_whose_hooks_raise_as_broken(old_plugin: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from pocketllm import cli

    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("old:old")]
    assert "pocketllm-old 0.3.0" in line and "BROKEN" in line and "TypeError" in line and "batching" in line
    assert f"declares contract {API_VERSION[0]}.{API_VERSION[1]}" in line
    assert "echo  (pocketllm-echo" in out


def test_auto_skips_a_broken_plugin_and_naming_it_is_a_typed_error(old_plugin: Path,
                                                                    pocketllm_tiny_llama: Path) -> None:
    from pocketllm import LLM
    from pocketllm.errors import BrokenBackendError

    llm = LLM(str(pocketllm_tiny_llama), backend="auto")
    try:
        assert llm.backend_name == "echo"  # not the broken one's 50, and its raising selector was skipped
    finally:
        llm.shutdown()
    with pytest.raises(BrokenBackendError) as err:
        LLM(str(pocketllm_tiny_llama), backend="old")
    assert (err.value.backend, err.value.distribution) == ("old", "pocketllm-old")
    assert "capabilities() raised TypeError" in str(err.value)
    assert f"declares contract {API_VERSION[0]}.{API_VERSION[1]}" in str(err.value)
    registry = BackendRegistry()
    assert registry.names() == ["echo", "old"] and [e.name for e in registry.entries()] == ["echo"]
    assert {(f.entry_point, f.broken) for f in registry.failures} == {("old:old", True)}


def test_a_registration_hook_that_raises_is_a_failure_without_backends() -> None:
    registry = BackendRegistry(load_entry_points=False)

    class Plugin:
        @staticmethod
        def pocketllm_register_backends(register):
            register(_Fake("half", 5))
            raise ValueError("registration crashed")

    registry.register_plugin(Plugin(), name="crashing", distribution="crash-dist", version="1.0")
    assert registry.names() == []
    [failure] = registry.failures
    assert (failure.entry_point, failure.distribution, failure.version) == ("crashing", "crash-dist", "1.0")
    assert "registration crashed" in failure.error


def test_an_observer_that_raises_is_isolated_from_the_engine(pocketllm_tiny_llama: Path) -> None:
    """pocketllm_request_finished runs on the engine thread: an observer that raises is recorded as broken and
    not called again, and requests go on finishing (before, the exception ended the engine's loop)."""
    from pocketllm import LLM, SamplingParams

    calls: list[str] = []

    class Observer:
        @staticmethod
        @hookimpl
        def pocketllm_request_finished(request_id: str) -> None:
            calls.append(request_id)
            raise RuntimeError("observer crashed")

    registry = BackendRegistry(allow={"echo"})
    registry.register_plugin(Observer(), name="observer", distribution="observer-dist", version="2.0")
    llm = LLM(str(pocketllm_tiny_llama), backend="echo", registry=registry)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for _ in range(2):
            [out] = llm.generate("hello", params)
            assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()
    assert len(calls) == 1
    [failure] = registry.failures
    assert (failure.entry_point, failure.distribution, failure.broken) == ("observer", "observer-dist", True)
    assert "pocketllm_request_finished raised RuntimeError: observer crashed" in failure.error


def test_auto_skips_a_backend_whose_engine_fails_to_start(pocketllm_tiny_llama: Path) -> None:
    """Under "auto", a backend whose create_engine raises (a bug, a runtime missing) is recorded as broken and
    the next backend serves: the best-scored plugin failing must not leave a user with no engine. Named, it is
    still an error (the test below)."""
    import gc
    import weakref

    from pocketllm import LLM, SamplingParams

    allocated: list[weakref.ref[object]] = []

    class Weights:
        pass

    class Crashing(_Fake):
        def create_engine(self, args, checkpoint, options):
            weights = Weights()  # what a build holds when it fails
            allocated.append(weakref.ref(weights))
            raise RuntimeError("its kernels are missing")

    class Plugin:
        @staticmethod
        def pocketllm_register_backends(register):
            register(Crashing("crashing", 5))

    registry = BackendRegistry(allow={"echo"})  # echo scores 1
    registry.register_plugin(Plugin(), name="crashing", distribution="crash-dist", version="1.0")
    gc.disable()  # the failed build's allocations are let go at once, not left to the cyclic collector
    try:
        llm = LLM(str(pocketllm_tiny_llama), registry=registry)
        assert [ref() for ref in allocated] == [None]
    finally:
        gc.enable()
    try:
        assert llm.backend_name == "echo"
        [out] = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    [failure] = registry.failures
    assert (failure.entry_point, failure.distribution, failure.broken) == ("crashing:crashing", "crash-dist", True)
    assert "failed to create its engine: RuntimeError: its kernels are missing" in failure.error
    with pytest.raises(BrokenBackendError, match="its kernels are missing"):
        registry.get("crashing")
    # With no backend left, the error says so, chained to why the last one tried failed.
    with pytest.raises(BackendNotFoundError) as err:
        LLM(str(pocketllm_tiny_llama), registry=_registry(Crashing("crashing", 5)))
    assert type(err.value) is BackendNotFoundError and isinstance(err.value.__cause__, BrokenBackendError)
    assert "its kernels are missing" in str(err.value.__cause__)


def test_an_engine_a_backend_fails_to_create_is_an_error_naming_the_backend(pocketllm_tiny_llama: Path) -> None:
    """A plugin's create_engine that raises (a runtime it imports lazily is missing, say), or returns nothing:
    a BrokenBackendError naming the backend and where it comes from, not a bare ModuleNotFoundError."""
    from pocketllm import LLM

    class Lazy(_Fake):
        def create_engine(self, args, checkpoint, options):
            import pocketllm_missing_runtime  # noqa: F401

    class Nothing(_Fake):
        def create_engine(self, args, checkpoint, options):
            return None

    registry = _registry(Lazy("lazy", 5), Nothing("nothing", 5))
    with pytest.raises(BrokenBackendError, match=r"backend 'lazy' \(from tests\) failed to create its engine: "
                                                 "ModuleNotFoundError"):
        LLM(str(pocketllm_tiny_llama), backend="lazy", registry=registry)
    with pytest.raises(BrokenBackendError, match="backend 'nothing' returned no engine"):
        LLM(str(pocketllm_tiny_llama), backend="nothing", registry=registry)
