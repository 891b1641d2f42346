"""Where the Ascend backend cannot run, it says why (``pocketllm backends``), ``auto`` passes it by, and naming it
fails with that reason, not a traceback out of torch_npu."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pocketllm import LLM
from pocketllm.cli import main
from pocketllm.errors import UnsupportedOptionError
from pocketllm.plugins import BackendRegistry
from pocketllm_ascend import backend
from pocketllm_ascend.backend import AscendBackend

find_spec = importlib.util.find_spec


def without(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))


@pytest.fixture
def ascend_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """torch_npu found, a CANN toolkit where ASCEND_HOME_PATH says, an NPU device node: the probe's facts."""
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(backend.glob, "glob", lambda pattern: ["/dev/davinci0"] if "davinci" in pattern else [])
    return tmp_path


def test_probe_scores_an_ascend_machine(ascend_machine: Path) -> None:
    assert AscendBackend().probe() == 25  # an accelerator of its own: ahead of the CPU engines' 10-19


@pytest.mark.parametrize(("breakage", "reason"), [
    ("torch_npu", "torch_npu is not installed"),
    ("cann", "CANN runtime not found"),
    ("device", "no NPU visible"),
    ("hidden", "no NPU visible"),
])
def test_probe_says_why_not(ascend_machine: Path, monkeypatch: pytest.MonkeyPatch, breakage: str,
                            reason: str) -> None:
    if breakage == "torch_npu":
        without(monkeypatch, "torch_npu")
    elif breakage == "cann":
        monkeypatch.delenv("ASCEND_HOME_PATH")
        monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
        monkeypatch.setattr(backend, "_CANN_DEFAULT", str(ascend_machine / "missing"))
    elif breakage == "device":
        monkeypatch.setattr(backend.glob, "glob", lambda pattern: [])
    else:
        monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match=reason):
        AscendBackend().probe()


def test_an_auto_start_here_says_nothing_of_it(tmp_path: Path) -> None:
    """A machine without an NPU that has the package installed: an ``auto`` start is as quiet as without it (the
    reason is for ``pocketllm backends``)."""
    script = tmp_path / "start.py"
    script.write_text("from pocketllm.plugins import BackendRegistry\nfrom pocketllm.args import EngineArgs\n"
                      "print(BackendRegistry().select(EngineArgs()).name)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no stand-in torch_npu
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout.strip() != "ascend", done.stderr
    assert "ascend" not in done.stderr


def test_backends_command_shows_the_reason(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    without(monkeypatch, "torch_npu")
    assert main(["backends"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("ascend"))
    assert "unavailable here: torch_npu is not installed" in line


def test_auto_never_picks_it_without_cann(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch_npu (the stand-in) importable, but no CANN toolkit: score 0, and auto takes another backend."""
    from pocketllm.args import EngineArgs

    for variable in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(backend, "_CANN_DEFAULT", str(tmp_path / "missing"))
    registry = BackendRegistry()
    entry = next(e for e in registry.entries() if e.name == "ascend")
    assert entry.score == 0 and entry.unavailable is not None and "CANN runtime not found" in entry.unavailable
    assert registry.select(EngineArgs()).name != "ascend"


def test_naming_it_without_torch_npu_fails_with_the_reason(torch_npu: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                           pocketllm_kit_checkpoint: Any) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    with pytest.raises(UnsupportedOptionError, match="torch_npu cannot be imported") as e:
        LLM(model=str(pocketllm_kit_checkpoint("llama")), backend="ascend", device="npu")
    assert e.value.backend == "ascend" and e.value.option == "device"


def test_other_devices_are_refused_by_name(torch_npu: ModuleType, pocketllm_kit_checkpoint: Any) -> None:
    with pytest.raises(UnsupportedOptionError) as e:
        LLM(model=str(pocketllm_kit_checkpoint("llama")), backend="ascend", device="cpu")
    assert e.value.backend == "ascend" and e.value.option == "device"
