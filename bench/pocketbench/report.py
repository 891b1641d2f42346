"""The markdown report: settings, the figures table with PocketLLM/peer and HTTP/library ratios, fidelity."""

from __future__ import annotations

import json
from pathlib import Path

from pocketbench.config import BASELINE_SUFFIX, SERVE_TARGET_CLIENTS, SERVE_TARGET_RATIO
from pocketbench.fidelity import differences
from pocketbench.results import BenchResults
from pocketbench.stats import Summary

HIDDEN_INFO = ("system",)  # long; kept in the JSON file


def markdown(results: BenchResults) -> str:
    meta = results.meta
    quick = " (quick run: reduced workloads, not comparable)" if meta["quick"] else ""
    lines = [
        f"# PocketLLM bench: {meta['date']}, {meta['machine']}{quick}",
        "",
        f"Machine: {host_line(meta['host'])}. Load average (1, 5, 15 min) before the run "
        f"{_loads(meta['load_average_before'])}, after {_loads(meta['load_average_after'])}: one engine runs at a "
        f"time, so loads well above {meta['threads']} mean other work shared the machine.",
        "",
        f"Model `{meta['model']}` (`{meta['model_file']}`), {meta['threads']} threads per engine, each engine in its "
        f"own process. Every figure is the median of {meta['runs']} runs after {meta['warmup']} warm-up "
        "(min-max in brackets), with the engines interleaved run by run. Ratios are PocketLLM / peer medians: "
        "above 1 is better for tok/s (↑), below 1 is better for ms and MB (↓).",
        "",
        *[f"- **{label}**: {_info(info)}" for label, info in results.engines.items()],
        "",
        *_figures_table(results),
    ]
    if results.serving:
        lines += ["", *_serving(results)]
    if results.fidelity:
        lines += ["", *_fidelity(results)]
    return "\n".join(lines) + "\n"


def write_tables(out: Path, stem: str, text: str, meta: dict, rows: list[dict]) -> Path:
    """A workload's table as ``<out>/<stem>.md`` and its figures as ``.json`` beside it; prints the table."""
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.md"
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def host_line(host: dict[str, object]) -> str:
    return (f"{host['cpu']} (family {host['cpu_family']} model {host['cpu_model']}, {host['simd'] or 'no AVX2'}), "
            f"{host['logical_cpus']} logical CPUs, {host['memory_gib']} GiB, Python {host['python']}")


def _loads(loads: list[float]) -> str:
    return "/".join(f"{x:.1f}" for x in loads)


def _info(info: dict[str, object]) -> str:
    return "; ".join(f"{k} {_number(v) if isinstance(v, float) else v}" for k, v in info.items()
                     if k not in HIDDEN_INFO)


def _figures_table(results: BenchResults) -> list[str]:
    labels = list(results.engines)
    # PocketLLM / peer, HTTP / library for the serve workload, then this version / the --baseline one.
    pairs = [*((o, p) for o in results.ours for p in results.peers), *((h, lib) for lib, h in results.serving
                                                                       if BASELINE_SUFFIX not in lib),
             *results.baselines]
    header = ["figure", "unit", *labels, *(f"{_short(a)} / {_short(b)}" for a, b in pairs)]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for figure in results.figures:
        cells = [figure.label, f"{figure.unit} {'↑' if figure.higher_is_better else '↓'}"]
        for label in labels:
            s = results.summary(figure.key, label)
            cells.append("-" if s is None else _summary(s))
        for a, b in pairs:
            ratio = results.ratio(figure.key, a, b)
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _serving(results: BenchResults) -> list[str]:
    clients = results.meta["sizes"]["serve_concurrency"]
    lines = [
        "## Serving: HTTP / library",
        "",
        "The serve rows: the same streamed requests (token-id prompts, greedy, EOS ignored) through "
        "`pocketllm-server` over HTTP (`-http`: `/v1/completions` with `stream: true`, httpx clients in the bench "
        "process) and through `AsyncLLM` in a worker process (`-async`), same engine settings, runs interleaved. "
        "Client and server share the machine's cores, as the library's consumer tasks share its worker's. "
        "Aggregate tok/s = tokens streamed / (last token of any request - first send); TTFT = send -> first "
        f"streamed token. Target: HTTP >= {SERVE_TARGET_RATIO:.2f}x library at {SERVE_TARGET_CLIENTS} clients.",
        "",
    ]
    for library, http in results.serving:
        ratios = {n: results.ratio(f"serve{n}_tok_s", http, library) for n in clients}
        shown = ", ".join(f"{n} client{'s' if n > 1 else ''} {'-' if r is None else f'{r:.2f}x'}"
                          for n, r in ratios.items())
        target = ratios.get(SERVE_TARGET_CLIENTS)
        verdict = ("not measured" if target is None else
                   "met" if target >= SERVE_TARGET_RATIO else "**missed**")
        lines.append(f"- {_short(http)} / {_short(library)} aggregate tok/s: {shown}; target {verdict}")
    return lines


def _fidelity(results: BenchResults) -> list[str]:
    n = len(next(iter(results.fidelity[0].outputs.values())))
    lines = [
        f"## Fidelity: first {n} greedy token ids (EOS ignored)",
        "",
        "Same prompt ids for every engine, rendered with PocketLLM's chat template; questions chosen so that the "
        "top two float32 logits stay well apart. llama.cpp computes with Q8 activations and an f16 KV cache, so "
        "near-ties (top-2 logits within ~0.1) may still legitimately differ.",
    ]
    for case in results.fidelity:
        header = ["engine", "token ids", *(f"vs {o}" for o in results.ours)]
        lines += ["", f"**{case.question}** ({len(case.prompt_ids)} prompt ids)", "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        diffs = {(d.ours, d.peer): d.index for d in differences(case, results.ours, list(case.outputs))}
        for label, ids in case.outputs.items():
            verdicts = ["-" if o == label else _verdict(diffs[(o, label)]) for o in results.ours]
            lines.append(f"| {label} | {' '.join(map(str, ids))} | {' | '.join(verdicts)} |")
    return lines


def _verdict(index: int | None) -> str:
    return "identical" if index is None else f"**differs from token {index}**"


def _summary(s: Summary) -> str:
    return f"{_number(s.median)} ({_number(s.min)}-{_number(s.max)})"


def _number(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _short(label: str) -> str:
    return label.removeprefix("pocketllm-")
