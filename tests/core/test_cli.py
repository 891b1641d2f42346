from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pocketllm.cli import main


def test_backends_lists_name_distribution_score_and_failures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "echo  (pocketllm-echo 0.1.0, score 1)" in out
    assert "broken  (pocketllm-broken 0.1.0, FAILED TO LOAD: ModuleNotFoundError" in out
    assert "architectures: llama" in out
    assert "quantization formats: -" in out  # echo loads float tensors only


def test_quantization_formats_are_the_quantized_storage_types() -> None:
    from pocketllm.backend import Capabilities

    caps = Capabilities(storage_types=("F32", "F16", "BF16", "F64", "Q8_0", "Q4_K"))
    assert caps.quantization_formats == ("Q8_0", "Q4_K")
    assert Capabilities().quantization_formats == ()


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


def test_serve_runs_the_servers_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as help_exit:
        main(["serve", "--help"])
    assert help_exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pocketllm serve") and "--host" in out and "--max-queue-len" in out
    with pytest.raises(SystemExit) as bad_exit:  # arguments reach the server's parser as given
        main(["serve", "--port", "eighty"])
    assert bad_exit.value.code == 2
    assert "pocketllm serve: error: argument --port: invalid int value: 'eighty'" in capsys.readouterr().err


def test_serve_without_the_server_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("pocketllm.cli.entry_points", lambda **selection: ())  # no pocketllm-server console script
    assert main(["serve", "--port", "8001"]) == 2
    assert "error: `pocketllm serve` needs the server: pip install pocketllm-server" in capsys.readouterr().err


def test_bench_runs_the_harness_in_its_own_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    harness = tmp_path / "bench" / "pocketbench"
    harness.mkdir(parents=True)
    (harness / "__init__.py").write_text("")
    (harness / "__main__.py").write_text("import os, sys\nprint(sys.argv[1:], os.getcwd())\nsys.exit(3)\n")
    monkeypatch.setenv("POCKETLLM_BENCH_DIR", str(tmp_path / "bench"))
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    assert main(["bench", "--runs", "1", "--out", "results/"]) == 3  # its exit status is the command's
    assert capfd.readouterr().out == f"['--runs', '1', '--out', 'results/'] {tmp_path}\n"  # where it was typed
    in_process = sys.modules.get("pocketbench")  # bench/tests import the real harness, never this one
    assert sys.path == path_before and not str(getattr(in_process, "__file__", "")).startswith(str(tmp_path))


def test_bench_outside_a_checkout_says_where_to_run_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POCKETLLM_BENCH_DIR", str(tmp_path))
    assert main(["bench", "--help"]) == 2
    assert "runs from a PocketLLM checkout" in capsys.readouterr().err


def test_bench_help_comes_from_the_checkouts_harness(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    assert capfd.readouterr().out.startswith("usage: pocketllm bench")


@pytest.mark.parametrize(("backend", "options", "key", "why"), [
    ("torch", '{"block_size": 0}', "block_size", "an integer >= 1, got 0"),
    ("torch", '{"decode_graphs": 1}', "decode_graphs", "true or false, got 1"),
    ("cpp", '{"num_threads": true}', "num_threads", "an integer from 1 to 1024, got True"),
    ("cpp", '{"no_such_knob": 1}', "no_such_knob", "accepted keys: block_size, exact_activations, num_kv_blocks"),
])
def test_bad_backend_options_are_reported_with_the_key_and_the_backend(
    backend: str, options: str, key: str, why: str, pocketllm_tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server refuses them before it binds its port or reads the model (there is none at /no/such/model)."""
    pytest.importorskip(f"pocketllm_{backend}")
    pytest.importorskip("pocketllm_server")
    for command in (["serve", "--port", "1", "--model", "/no/such/model"],
                    ["generate", "hi", "--model", str(pocketllm_tiny_llama)]):
        assert main([*command, "--backend", backend, "--backend-options", options]) == 2
        err = capsys.readouterr().err
        assert f"backend_options.{key}" in err and f"{backend!r}" in err and why in err, err


@pytest.mark.parametrize("command", [["generate", "--help"], ["serve", "--help"]])
def test_help_lists_each_installed_backend_s_options(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(command)
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "echo: tokens_per_step (an integer from 1 to 16, default 1): tokens each step gives a request" in out
    assert "cpp: block_size (" in out and "exact_activations (" in out and "torch: " in out
