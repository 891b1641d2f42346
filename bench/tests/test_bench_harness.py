"""The harness's own logic; figures are never asserted. Run with ``pytest bench/tests``."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from pocketbench.cli import build_parser, config_from
from pocketbench.config import FULL, QUICK, Sizes
from pocketbench.engines import RequestTiming
from pocketbench.fidelity import FidelityCase, first_difference
from pocketbench.protocol import read_message, write_message
from pocketbench.report import markdown
from pocketbench.results import BenchResults
from pocketbench.serving import EventStream, ServeError, StreamTally, completion_body
from pocketbench.stats import Summary, percentile
from pocketbench.workloads import Figure, decode, serve, serve_values
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


def test_event_stream_splits_events_across_reads() -> None:
    events = EventStream()
    assert events.feed(b'data: {"a": 1}\n\nda') == [b'{"a": 1}']
    assert events.feed(b"ta: [DONE]") == []
    assert events.feed(b"\n\n: a comment\n\ndata:x\r\ndata: y\r\n\r\n") == [b"[DONE]", b"x\ny"]
    assert events.buffer == b""


def _chunk(text: str, usage: int | None = None, finish: str | None = None) -> bytes:
    choices = [{"index": 0, "text": text, "finish_reason": finish}] if usage is None else []
    body: dict[str, object] = {"object": "text_completion", "choices": choices}
    if usage is not None:
        body["usage"] = {"prompt_tokens": 4, "completion_tokens": usage, "total_tokens": 4 + usage}
    return json.dumps(body).encode()


def test_stream_tally_times_chunks_and_reads_usage() -> None:
    tally = StreamTally(sent_s=0.5)
    for payload, now in ((_chunk("a"), 1.0), (_chunk("b"), 1.5), (_chunk("c", finish="length"), 2.0),
                         (_chunk("", usage=3), 2.1), (b"[DONE]", 2.1)):
        tally.add(payload, now)
    assert tally.timing() == RequestTiming(sent_s=0.5, first_token_s=1.0, last_token_s=2.0, num_tokens=3,
                                           num_chunks=3)
    with pytest.raises(ServeError, match="incomplete"):
        StreamTally(sent_s=0.0).timing()
    with pytest.raises(ServeError, match="mid-stream"):
        StreamTally(sent_s=0.0).add(b'{"error": {"message": "engine died"}}', 1.0)
    assert completion_body([1, 2], 8) == {"prompt": [1, 2], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                          "stream": True, "stream_options": {"include_usage": True}}


def test_serve_figures_and_token_check() -> None:
    timings = [{"sent_s": 0.0, "first_token_s": 0.1, "last_token_s": 1.0, "num_tokens": 4, "num_chunks": 4},
               {"sent_s": 0.2, "first_token_s": 0.5, "last_token_s": 2.0, "num_tokens": 4, "num_chunks": 3}]
    tok_s, p50, p99 = serve_values(timings)
    assert tok_s == 4.0  # 8 tokens over 2 s: first send to the last token of any request
    assert (p50, p99) == (pytest.approx(200.0), pytest.approx(298.0))  # TTFTs 100 and 300 ms
    prompts_stub = type("Prompts", (), {"prompts": [[1] * 4] * 3})()
    m = serve(2, dataclasses.replace(QUICK, new_tokens=4), prompts_stub)  # type: ignore[arg-type]
    assert (m.key, m.op, len(m.prompts)) == ("serve2", "serve", 2)
    assert m.values({"timings": timings})["serve2_tok_s"] == 4.0
    with pytest.raises(RuntimeError, match="expected 4 tokens"):
        m.values({"timings": [timings[0], {**timings[1], "num_tokens": 3}]})


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


def test_markdown_reports_http_over_library_and_the_target() -> None:
    results = _results()
    results.engines.update({"pocketllm-torch-async": {"engine": "lib"}, "pocketllm-torch-http": {"engine": "srv"}})
    results.serving = [("pocketllm-torch-async", "pocketllm-torch-http")]
    results.meta["sizes"] = {**results.meta["sizes"], "serve_concurrency": [1, 16]}
    for n, (lib, http) in ((1, (10.0, 10.0)), (16, (100.0, 85.0))):
        figure = Figure(f"serve{n}_tok_s", f"serve {n}", "tok/s", True)
        results.figures.append(figure)
        results.record(f"serve{n}", "pocketllm-torch-async", {}, {figure.key: lib})
        results.record(f"serve{n}", "pocketllm-torch-http", {}, {figure.key: http})
    text = markdown(results)
    assert "| torch / llama.cpp | torch-http / torch-async |" in text
    assert "| serve 16 | tok/s ↑ | - | - | 100 (100-100) | 85.0 (85.0-85.0) | - | 0.85x |" in text
    assert "| decode | tok/s ↑ | 30.0 (20.0-40.0) | 15.0 (10.0-20.0) | - | - | 2.00x | - |" in text
    assert "torch-http / torch-async aggregate tok/s: 1 client 1.00x, 16 clients 0.85x; target **missed**" in text
    assert results.serving_ratios() == {"pocketllm-torch-http / pocketllm-torch-async": {
        "serve1_tok_s": 1.0, "serve16_tok_s": 0.85}}


def test_json_keeps_raw_figures_without_token_ids(tmp_path: Path) -> None:
    _results().write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["raw"]["decode"]["llama.cpp"] == [{"seconds": 1.0}, {"seconds": 1.0}]
    assert data["summaries"]["decode_tok_s"]["pocketllm-torch"] == {"median": 30.0, "min": 20.0, "max": 40.0}


def test_config_defaults_and_quick() -> None:
    parser = build_parser()
    full = config_from(parser.parse_args([]), installed=["echo", "torch"])
    assert (full.backends, full.runs, full.sizes) == (("torch",), 5, FULL)
    assert "serve" in full.workloads and FULL.serve_concurrency == (1, 8, 16)
    quick = config_from(parser.parse_args(["--quick", "--concurrency", "2", "3", "--serve-concurrency", "1", "5"]),
                        installed=["torch"])
    assert quick.runs == 1
    assert quick.sizes == dataclasses.replace(QUICK, concurrency=(2, 3), serve_concurrency=(1, 5))
    assert quick.sizes.max_seqs == 5  # every engine gets room for the most serve clients too
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
                  ttft_new_tokens=2, serve_concurrency=(2,), fidelity_prompts=1, fidelity_tokens=4)
    from pocketllm.testing import make_tiny_llama

    # float32: the echo backend declares float storage types only
    model = make_tiny_llama(tmp_path / "model", max_positions=2048)
    parser = build_parser()
    ns = parser.parse_args(["--backend", "echo", "--peers", "--runs", "2", "--out", str(tmp_path),
                            "--machine", "test", "--model", str(model)])
    config = dataclasses.replace(config_from(ns, installed=["echo"]), sizes=sizes)
    results = run(config)
    assert [len(runs) for runs in results.values["batch2_tok_s"].values()] == [2]
    # startup: fresh workers, cold and warm, two measured runs each after the warm-up.
    for key in ("startup_cold_s", "startup_warm_s"):
        assert [len(runs) for runs in results.values[key].values()] == [2]
        assert all(0 < value < 120 for value in results.values[key]["pocketllm-echo"])
    assert results.raw["startup_cold_s"]["pocketllm-echo"][0]["evicted"] in ("page cache", "model file")
    # The serve workload: AsyncLLM in a worker and a pocketllm-server process, interleaved, two runs each.
    assert results.serving == [("pocketllm-echo-async", "pocketllm-echo-http")]
    assert {label: len(runs) for label, runs in results.values["serve2_tok_s"].items()} == {
        "pocketllm-echo-async": 2, "pocketllm-echo-http": 2}
    http_runs = results.raw["serve2"]["pocketllm-echo-http"]
    assert [t["num_tokens"] for run_ in http_runs for t in run_["timings"]] == [4] * 4
    assert set(results.values["peak_rss_mb"]) == {"pocketllm-echo", "pocketllm-echo-async", "pocketllm-echo-http"}
    paths = write(results, config)
    assert [p.suffix for p in paths] == [".md", ".json", ".png"]
    text = paths[0].read_text()
    assert "aggregate end to end, 2 x (8 in + 4 out)" in text and "aggregate decode only, 2 x (8 in + 4 out)" in text
    assert "serve, 2 streaming clients x (8 in + 4 out), aggregate" in text
    assert "echo-http / echo-async aggregate tok/s: 2 clients " in text
    data = json.loads(paths[1].read_text())
    assert "serve2_tok_s" in data["serving_ratios"]["pocketllm-echo-http / pocketllm-echo-async"]


def test_serve_only_starts_no_other_engine(tmp_path: Path) -> None:
    pytest.importorskip("pocketllm_echo")
    pytest.importorskip("tqdm")
    from pocketbench.runner import run

    sizes = dataclasses.replace(QUICK, prompt_tokens=8, new_tokens=3, serve_concurrency=(1,))
    from pocketllm.testing import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", max_positions=2048)
    ns = build_parser().parse_args(["--backend", "echo", "--peers", "--runs", "1", "--workloads", "serve",
                                    "--out", str(tmp_path), "--model", str(model)])
    results = run(dataclasses.replace(config_from(ns, installed=["echo"]), sizes=sizes))
    assert list(results.engines) == ["pocketllm-echo-async", "pocketllm-echo-http"]
    assert (results.ours, results.peers) == ([], [])
    assert [f.key for f in results.figures] == ["serve1_tok_s", "serve1_ttft_p50_ms", "serve1_ttft_p99_ms",
                                                "peak_rss_mb"]


def test_a_baseline_version_runs_beside_ours(tmp_path: Path) -> None:
    """--baseline DIR: each PocketLLM engine (library, AsyncLLM, server) also runs from the packages in DIR, and
    the report gives this/baseline ratios. DIR here holds a copy of the core that says it is another version."""
    pytest.importorskip("pocketllm_echo")
    pytest.importorskip("tqdm")
    import shutil

    import pocketllm
    import pocketllm_server
    from pocketbench.runner import run

    baseline = tmp_path / "baseline"
    shutil.copytree(Path(pocketllm.__file__).parent, baseline / "pocketllm")
    shutil.copytree(Path(pocketllm_server.__file__).parent, baseline / "pocketllm_server")
    init = baseline / "pocketllm" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{pocketllm.__version__}"', '__version__ = "0.0.1"'))
    from pocketllm.testing import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", max_positions=2048)
    sizes = dataclasses.replace(QUICK, prompt_tokens=8, new_tokens=3, serve_concurrency=(2,))
    ns = build_parser().parse_args(["--backend", "echo", "--peers", "--runs", "1", "--workloads", "decode", "serve",
                                    "--out", str(tmp_path), "--model", str(model), "--baseline", str(baseline)])
    results = run(dataclasses.replace(config_from(ns, installed=["echo"]), sizes=sizes))
    assert results.baselines == [("pocketllm-echo", "pocketllm-echo@baseline"),
                                 ("pocketllm-echo-async", "pocketllm-echo-async@baseline"),
                                 ("pocketllm-echo-http", "pocketllm-echo-http@baseline")]
    assert "PocketLLM 0.0.1" in results.engines["pocketllm-echo@baseline"]["engine"]
    assert "PocketLLM 0.0.1" not in results.engines["pocketllm-echo"]["engine"]
    assert results.ours == ["pocketllm-echo"] and results.ratio("serve2_tok_s", *results.baselines[2]) is not None
    assert "echo-http / echo-http@baseline" in markdown(results)
    with pytest.raises(SystemExit, match="holds no pocketllm"):
        config_from(build_parser().parse_args(["--baseline", str(tmp_path / "model")]), installed=["echo"])


def test_gemm_table_takes_each_sides_least_time_and_compares_bits() -> None:
    from pocketbench.gemm import table

    def record(seconds: float, digest: str) -> dict:
        return {"type": "Q4_K", "role": "ffn_up.weight", "shape": [3584, 1024], "count": 2, "rows": 16,
                "seconds": seconds, "digest": digest}

    text, records = table({"this": [[record(0.004, "a")], [record(0.002, "a")]],
                           "baseline": [[record(0.006, "a")], [record(0.008, "a")]]})
    assert records == [{"type": "Q4_K", "role": "ffn_up.weight", "shape": [3584, 1024], "layers": 2, "rows": 16,
                        "seconds": {"this": 0.002, "baseline": 0.006}, "same_bits": True}]
    assert "| 3.00x | yes |" in text and "| 117 | 39 |" in text  # GOPS: 2 * 3584 * 1024 * 16 * 2 / seconds
    _, records = table({"this": [[record(0.002, "a")]], "baseline": [[record(0.002, "b")]]})
    assert records[0]["same_bits"] is False


def test_a_worker_s_peak_rss_is_its_own_not_its_parent_s() -> None:
    import subprocess
    import sys

    import numpy as np

    held = np.ones(300 << 20, dtype=np.uint8)  # 300 MiB resident in this process before the child starts
    child = subprocess.run([sys.executable, "-c", "from pocketbench.worker import peak_rss_mb; print(peak_rss_mb())"],
                           check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    assert held.sum() == 300 << 20
    assert float(child.stdout) < 200


def test_amx_table_gives_ratios_and_says_whether_tokens_matched(tmp_path: Path) -> None:
    from pocketbench import amx
    from pocketbench.report import write_tables

    row = {"file": "m.gguf", "storage_types": ["Q4_K", "Q6_K"], "same_tokens": False}
    for figure, (slow, fast) in {"prefill": (100.0, 150.0), "e2e": (10.0, 11.0), "decode": (20.0, 20.0)}.items():
        row |= {f"{figure}_avx512": slow, f"{figure}_amx": fast, f"{figure}_ratio": fast / slow}
    host = {"cpu": "x", "cpu_family": 6, "cpu_model": 207, "simd": "avx512", "logical_cpus": 2, "memory_gib": 8,
            "python": "3.11"}
    meta = {"date": "2026-12-05", "machine": "m", "host": host, "threads": 2, "runs": 3, "warmup": 1}
    text = amx.report([row], meta)
    assert "| m.gguf | Q4_K, Q6_K | 100 | 150 | 1.50x | 10 | 11 | 1.10x | 20 | 20 | 1.00x | NO |" in text
    path = write_tables(tmp_path, "2026-12-05-m-amx", text, meta, [row])
    assert path.read_text() == text and json.loads(path.with_suffix(".json").read_text())["rows"] == [row]


def test_amx_bench_runs_both_paths_to_the_same_tokens() -> None:
    from pocketllm_cpp import kernels

    if "amx" not in kernels.available_isas().split():
        pytest.skip(f"this CPU or build has no AMX (available: {kernels.available_isas()})")
    from pocketbench import amx
    from pocketllm.args import DEFAULT_MODEL

    row = amx.measure(DEFAULT_MODEL, amx.parser().parse_args(["--runs", "1", "--warmup", "0"]))
    assert row["same_tokens"] and row["prefill_amx"] > 0 and row["prefill_avx512"] > 0
    assert kernels.isa() == kernels.best_isa()  # set back to auto
