"""The harness's own logic; figures are never asserted. Run with ``pytest bench/tests``."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from pocketbench.cli import build_parser, config_from
from pocketbench.config import FULL, QUICK, Sizes
from pocketbench.fidelity import FidelityCase, first_difference
from pocketbench.protocol import read_message, write_message
from pocketbench.report import markdown
from pocketbench.results import BenchResults
from pocketbench.stats import Summary, percentile
from pocketbench.workloads import Figure, decode
from pocketllm import bench as bench_command


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([float(i) for i in range(1, 9)], 99) == pytest.approx(7.93)
    assert Summary.of([3.0, 1.0, 2.0]) == Summary(2.0, 1.0, 3.0)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_protocol_round_trip() -> None:
    wire = io.StringIO()
    write_message(wire, {"op": "generate", "prompts": [[1, 2]], "max_tokens": 3})
    wire.seek(0)
    assert read_message(wire) == {"op": "generate", "prompts": [[1, 2]], "max_tokens": 3}
    assert read_message(wire) is None


def test_sizes_give_every_sequence_room() -> None:
    for sizes in (FULL, QUICK):
        assert sizes.max_len % 256 == 0
        assert sizes.max_len > max(sizes.prefill_tokens, sizes.prompt_tokens + sizes.new_tokens)
        assert sizes.max_seqs >= max(*sizes.concurrency, sizes.ttft_requests)


def test_measurement_checks_token_counts() -> None:
    prompts_stub = type("Prompts", (), {"prompts": [[1] * 4]})()
    m = decode(dataclasses.replace(QUICK, new_tokens=5), prompts_stub)  # type: ignore[arg-type]
    timing = {"first_token_s": 1.0, "last_token_s": 3.0, "num_tokens": 5}
    assert m.values({"timings": [timing]}) == {"decode_tok_s": 2.0}
    with pytest.raises(RuntimeError, match="expected 5 tokens"):
        m.values({"timings": [{**timing, "num_tokens": 4}]})


def _results() -> BenchResults:
    results = BenchResults(
        meta={"date": "2026-01-01", "machine": "test-2c", "model": "m", "model_file": "m.gguf", "threads": 2,
              "runs": 2, "warmup": 1, "quick": False, "sizes": dataclasses.asdict(FULL),
              "load_average_before": [0.1, 0.2, 0.3], "load_average_after": [2.0, 2.0, 2.0],
              "host": {"cpu": "CPU", "cpu_family": "1", "cpu_model": "2", "simd": "avx2", "logical_cpus": 2,
                       "memory_gib": 1.0, "python": "3.11"}},
        engines={"pocketllm-torch": {"engine": "ours"}, "llama.cpp": {"engine": "peer"}},
        ours=["pocketllm-torch"], peers=["llama.cpp"])
    figure = Figure("decode_tok_s", "decode", "tok/s", True)
    results.figures.append(figure)
    for label, values in (("pocketllm-torch", [20.0, 40.0]), ("llama.cpp", [10.0, 20.0])):
        for v in values:
            results.record("decode", label, {"seconds": 1.0, "token_ids": [[1]]}, {figure.key: v})
    results.fidelity.append(FidelityCase("q?", [1, 2], {"pocketllm-torch": [5, 6, 7], "llama.cpp": [5, 9, 7]}))
    return results


def test_markdown_reports_ratios_and_first_difference() -> None:
    text = markdown(_results())
    assert "| decode | tok/s ↑ | 30.0 (20.0-40.0) | 15.0 (10.0-20.0) | 2.00x |" in text
    assert "| llama.cpp | 5 9 7 | **differs from token 1** |" in text
    assert "| pocketllm-torch | 5 6 7 | - |" in text


def test_json_keeps_raw_figures_without_token_ids(tmp_path: Path) -> None:
    _results().write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["raw"]["decode"]["llama.cpp"] == [{"seconds": 1.0}, {"seconds": 1.0}]
    assert data["summaries"]["decode_tok_s"]["pocketllm-torch"] == {"median": 30.0, "min": 20.0, "max": 40.0}


def test_config_defaults_and_quick() -> None:
    parser = build_parser()
    full = config_from(parser.parse_args([]), installed=["echo", "torch"])
    assert (full.backends, full.runs, full.sizes) == (("torch",), 5, FULL)
    quick = config_from(parser.parse_args(["--quick", "--concurrency", "2", "3"]), installed=["torch"])
    assert quick.runs == 1
    assert quick.sizes == dataclasses.replace(QUICK, concurrency=(2, 3))
    with pytest.raises(SystemExit):
        config_from(parser.parse_args([]), installed=["echo"])


def test_command_finds_this_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_command.find_bench_dir() == Path(__file__).resolve().parents[1]
    monkeypatch.setenv(bench_command.BENCH_DIR_ENV, str(tmp_path))
    assert bench_command.main(["--help"]) == 2
    assert bench_command.BENCH_DIR_ENV in capsys.readouterr().err


def test_full_run_on_the_echo_backend(tmp_path: Path) -> None:
    """Workers, interleaving, report, JSON and plot, end to end, on the fake backend of the test fixtures."""
    pytest.importorskip("pocketllm_echo")
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    from pocketbench.runner import run, write

    sizes = Sizes(prefill_tokens=16, prompt_tokens=8, new_tokens=4, concurrency=(1, 2), ttft_requests=2,
                  ttft_new_tokens=2, fidelity_prompts=1, fidelity_tokens=4)
    parser = build_parser()
    ns = parser.parse_args(["--backend", "echo", "--peers", "--runs", "2", "--out", str(tmp_path),
                            "--machine", "test"])
    config = dataclasses.replace(config_from(ns, installed=["echo"]), sizes=sizes)
    results = run(config)
    assert [len(runs) for runs in results.values["batch2_tok_s"].values()] == [2]
    paths = write(results, config)
    assert [p.suffix for p in paths] == [".md", ".json", ".png"]
    assert "aggregate decode, 2 x (8 in + 4 out)" in paths[0].read_text()
