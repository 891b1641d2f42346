from __future__ import annotations

from pathlib import Path

import pytest

from pocketllm.cli import main


def test_backends_lists_name_distribution_score_and_failures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "echo  (pocketllm-echo 0.1.0, score 1)" in out
    assert "broken  (pocketllm-broken 0.1.0, FAILED TO LOAD: ModuleNotFoundError" in out
    assert "architectures: llama" in out


def test_generate_prints_streamed_text(pocketllm_tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "generate",
            "hello",
            "--model",
            str(pocketllm_tiny_llama),
            "--backend",
            "echo",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
        ]
    )
    assert code == 0
    assert capsys.readouterr().out.startswith("hellohello")


def test_chat_reads_turns_until_eof(
    pocketllm_tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = iter(["hi"])

    def fake_input(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    code = main(
        ["chat", "--model", str(pocketllm_tiny_llama), "--backend", "echo", "--temperature", "0", "--max-tokens", "4"]
    )
    assert code == 0
    assert capsys.readouterr().out == "user\n"  # <|im_start|> is skipped, then "u" "se" "r"


def test_errors_are_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "x", "--backend", "nope", "--model", "/nonexistent"]) == 2
    assert "error:" in capsys.readouterr().err
