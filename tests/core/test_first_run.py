"""The first ten minutes: help that teaches, progress where a person watches, the model's own sampling defaults."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pocketllm import LLM, EngineArgs
from pocketllm.cli import CLI_SAMPLING, main
from pocketllm.cli_args import add_engine_args
from pocketllm.progress import LoadProgress
from tests.conftest import requires_default_model


def test_every_engine_flag_has_help_and_its_default() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineArgs):
        text = actions[f.name].help or ""
        assert len(text) > 20 and "(default: " in text and f"$POCKETLLM_{f.name.upper()}" in text, f.name
    assert "(default: 32;" in actions["max_num_seqs"].help
    assert "a request's `seed` wins" in actions["seed"].help


@pytest.mark.parametrize("command", [["generate", "--help"], ["chat", "--help"]])
def test_cli_help_explains_sampling_and_seeds(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(command)
    out = " ".join(capsys.readouterr().out.split())
    assert f"(default: {CLI_SAMPLING['temperature']})" in out and "--sampling-seed" in out and "--seed N" in out
    assert "repeatable output" in out and "model's recommended settings" in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for stream, expected in ((_Terminal(), True), (io.StringIO(), False)):
        progress = LoadProgress(stream=stream)
        with progress.stage("reading x"):
            pass
        progress.done("model")
        assert ("pocketllm: reading x ..." in stream.getvalue()) == expected
        assert ("pocketllm: ready in " in stream.getvalue()) == expected
    monkeypatch.setenv("POCKETLLM_QUIET", "1")
    assert not LoadProgress(stream=_Terminal()).show


def test_llm_load_reports_its_stages(pocketllm_tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    LLM(str(pocketllm_tiny_llama), backend="echo", show_progress=True).shutdown()
    err = capsys.readouterr().err
    assert "pocketllm: starting backend echo ..." in err and "loading the weights on backend echo" in err
    assert "pocketllm: ready in " in err
    LLM(str(pocketllm_tiny_llama), backend="echo").shutdown()  # stderr is no terminal under pytest
    assert "pocketllm:" not in capsys.readouterr().err


def _with_generation_config(model: Path, tmp_path: Path, config: dict) -> Path:
    target = tmp_path / "model"
    shutil.copytree(model, target)
    (target / "generation_config.json").write_text(json.dumps(config))
    return target


def test_the_model_recommendation_fills_what_flags_leave_out(pocketllm_tiny_llama: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = _with_generation_config(pocketllm_tiny_llama, tmp_path, {
        "temperature": 0.0, "max_new_tokens": 3, "top_k": "not a number", "eos_token_id": 0})
    llm = LLM(str(model), backend="echo")
    try:
        assert llm.sampling_defaults == {"temperature": 0.0, "max_tokens": 3}  # the bad top_k is left out
    finally:
        llm.shutdown()
    # echo is greedy only: it works with the model's temperature 0, and refuses the CLI's own 0.2.
    assert main(["generate", "hello", "--model", str(model), "--backend", "echo"]) == 0
    assert capsys.readouterr().out == "hell\n"  # 3 tokens: "he", "l", "l"
    assert main(["generate", "hello", "--model", str(model), "--backend", "echo", "--generation-config", "none"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_testing_kit_without_pytest_says_what_to_install() -> None:
    code = "import sys; sys.modules['pytest'] = None; import pocketllm.testing"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "pip install 'pocketllm-core[testing]'" in result.stderr


def test_help_texts_are_plain_text_and_every_server_flag_has_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "The pocketllm command" in out and "``" not in out
    server_cli = pytest.importorskip("pocketllm_server.cli")
    parser = server_cli.build_parser()
    for action in parser._actions:
        assert action.help and "``" not in action.help, action.option_strings
    log_level = next(a for a in parser._actions if a.dest == "log_level")
    assert "(default: %(default)s)" in log_level.help


def test_backends_command_lists_each_backend_s_options_with_type_default_and_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--backend-options' help sends people to `pocketllm backends`, which lists each key with what it takes."""
    from pocketllm.backend_options import describe
    from pocketllm.plugins import BackendRegistry

    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.split("\n")
    for entry in BackendRegistry().entries():
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{entry.name}  ("))
        heading = next(i for i in range(start + 1, start + 6) if "backend options" in lines[i])
        options = describe(entry.capabilities.backend_options)
        if not options:
            assert lines[heading].endswith(": none"), lines[heading]
        for i, option in enumerate(options, heading + 1):
            assert lines[i].split() == (f"{option.name} ({option.expects}; default {option.default})"
                                        f"{': ' if option.help else ''}{option.help}").split(), lines[i]
    assert "see `pocketllm backends`" in next(
        f.metadata["help"] for f in dataclasses.fields(EngineArgs) if f.name == "backend_options")


@requires_default_model
def test_the_readme_library_snippet_runs_and_exits_quietly(tmp_path: Path) -> None:
    """The README's library example, run as a newcomer runs it: a script that never calls shutdown. It prints its
    answer and a streamed line that ends with a newline, and exits 0 with nothing on stderr (no nanobind leak
    report, no traceback from a thread at teardown)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    snippet = next(block.split("\n", 1)[1] for block in readme.split("```python")[1:]
                   if block.lstrip().startswith("from pocketllm import LLM")).split("```")[0]
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "POCKETLLM_QUIET": "1"})
    assert done.returncode == 0, done.stderr
    # (This environment has the test suite's own broken plugin installed, which is reported when it loads.)
    assert [line for line in done.stderr.splitlines() if "pocketllm-broken" not in line] == []
    # (What the model answers is not checked: its top two first tokens here lie within 0.2 nats in the fp32
    # reference, so the quantized backends may pick either.)
    assert "Usage(" in done.stdout and done.stdout.endswith("\n")
