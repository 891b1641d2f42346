from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pocketllm import BackendNotFoundError, EngineArgs, UnsupportedOptionError
from pocketllm.plugins import BackendRegistry


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


def test_auto_picks_the_highest_score() -> None:
    registry = BackendRegistry(load_entry_points=False)

    class Fake:
        api_version = 1

        def __init__(self, name: str, score: int) -> None:
            self.name, self.score = name, score

        def probe(self) -> int:
            return self.score

        def capabilities(self):
            from pocketllm import Capabilities

            return Capabilities()

        def create_engine(self, args, checkpoint):
            raise NotImplementedError

    class Plugin:
        @staticmethod
        def pocketllm_register_backends(register):
            register(Fake("low", 1))
            register(Fake("high", 5))
            register(Fake("absent", 0))

    registry.register_plugin(Plugin())
    assert registry.select(EngineArgs()).name == "high"
    assert registry.select(EngineArgs(backend="absent")).name == "absent"
    with pytest.raises(BackendNotFoundError, match="nope"):
        registry.select(EngineArgs(backend="nope"))


def test_import_pocketllm_does_not_import_torch_or_a_backend() -> None:
    code = ("import sys, pocketllm, pocketllm.llm, pocketllm.async_llm; "
            "print([m for m in ('torch', 'pocketllm_torch', 'transformers') if m in sys.modules]); "
            "pocketllm.plugins.BackendRegistry(); "  # discovery imports plugin modules, which must stay light
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "[]"]


def test_unsupported_option_names_option_and_backend(pocketllm_tiny_llama: Path) -> None:
    from pocketllm import LLM

    with pytest.raises(UnsupportedOptionError) as err:
        LLM(str(pocketllm_tiny_llama), backend="echo", dtype="bfloat16")
    assert (err.value.option, err.value.backend) == ("dtype", "echo")
    assert "dtype" in str(err.value) and "echo" in str(err.value)
