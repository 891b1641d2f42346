"""The cpp backend's matrix products on a GGUF file's own layer matrices, this build beside another, in one run.

    python -m pocketbench.gemm [--model FILE] [--rows 1 16 512] [--baseline DIR] [--passes 3] [--out results/]

For each distinct (storage type, role, shape) of the file's layer matrices and its LM head (``output.weight``, or the
tied embedding), and each activation-row count: one pass
multiplies every layer's matrix of that kind once (distinct weights, streamed from memory as a forward pass streams
them), timed as the least of ``--passes`` passes, in GOPS and milliseconds per forward pass (every layer's matrices
of that kind). ``--baseline DIR``: DIR holds another build's ``pocketllm_cpp`` (its Python files and ``_native``
module); each side runs in its own worker process, the sides taking turns pass by pass, and the table adds the
ratio and whether the two sides' products are the same bits. Threads: the kernels' pool (a thread per available
CPU; ``taskset`` sets how many). Writes ``<date>-<machine>-gemm-<model stem>.{md,json}``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pocketbench.machine import machine_name

DEFAULT = Path("/tmp/pocketbench-qwen3_5/qwen3_5-0.8b-Q4_K_M.gguf")


def measure(model: Path, rows: list[int]) -> list[dict[str, Any]]:
    """One pass per (kind, rows) in this process: seconds and a digest of the products."""
    import time

    import gguf
    import numpy as np
    from pocketllm_cpp import kernels

    reader = gguf.GGUFReader(str(model))
    kinds: dict[tuple[str, str, int, int], list[Any]] = collections.defaultdict(list)
    names = {t.name for t in reader.tensors}
    # The LM head too: output.weight, or the embedding where the head is tied to it.
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    for t in reader.tensors:
        quantized = len(t.shape) == 2 and t.tensor_type.name not in ("F32", "F16", "BF16")
        if quantized and t.name.startswith("blk."):
            kinds[(t.tensor_type.name, t.name.split(".", 2)[2], int(t.shape[1]), int(t.shape[0]))].append(t)
        elif quantized and t.name == head:
            kinds[(t.tensor_type.name, "lm_head", int(t.shape[1]), int(t.shape[0]))].append(t)
    x = np.random.default_rng(0).standard_normal((max(rows), max(k[3] for k in kinds))).astype(np.float32)
    out = []
    for (storage, role, m, k), tensors in sorted(kinds.items()):
        weights = [np.asarray(t.data).view(np.uint8).reshape(-1) for t in tensors]
        for w in weights:  # the pages mapped before any pass is timed
            kernels._native.matmul(w, storage, m, k, np.ascontiguousarray(x[:1, :k]))
        for n in rows:
            xs = np.ascontiguousarray(x[:n, :k])
            # Each product timed alone and freed once hashed: kept for the whole pass, every output would be fresh
            # memory faulted in inside the timing (29 MB an ffn_up product at 2,048 rows), as no engine's is.
            seconds, digest = 0.0, hashlib.sha256()
            for w in weights:
                start = time.perf_counter()
                y = kernels._native.matmul(w, storage, m, k, xs)
                seconds += time.perf_counter() - start
                digest.update(y.tobytes())
                del y
            out.append({"type": storage, "role": role, "shape": [m, k], "count": len(tensors), "rows": n,
                        "seconds": seconds, "digest": digest.hexdigest()})
    return out


def worker(model: Path, rows: list[int], baseline: Path | None) -> list[dict[str, Any]]:
    env = dict(os.environ)
    if baseline is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(baseline), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pocketbench.gemm", "--worker", "--model", str(model),
               "--rows", *map(str, rows)]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    return json.loads(done.stdout)


def table(sides: dict[str, list[list[dict[str, Any]]]]) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table and the records: per kind and rows the least seconds of each side."""
    names = list(sides)
    best: dict[str, dict[tuple, dict[str, Any]]] = {}
    for name, passes in sides.items():
        best[name] = {}
        for records in passes:
            for r in records:
                key = (r["type"], r["role"], tuple(r["shape"]), r["rows"])
                if key not in best[name] or r["seconds"] < best[name][key]["seconds"]:
                    best[name][key] = r
    head = ["type", "matrix", "rows x cols", "layers", "activation rows"]
    head += [f"{n} ms/pass" for n in names] + [f"{n} GOPS" for n in names]
    if len(names) == 2:
        head += [f"{names[0]} / {names[1]}", "same bits"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    records, totals = [], collections.defaultdict(float)
    for key, first in best[names[0]].items():
        storage, role, shape, n = key
        row = [storage, role, f"{shape[0]} x {shape[1]}", str(first["count"]), str(n)]
        rates, times = [], []
        for name in names:
            r = best[name][key]
            times.append(r["seconds"])
            totals[(name, n, storage)] += r["seconds"]
            rates.append(2 * shape[0] * shape[1] * n * r["count"] / r["seconds"] / 1e9)
        row += [f"{t * 1e3:.2f}" for t in times] + [f"{g:.0f}" for g in rates]
        record = {"type": storage, "role": role, "shape": list(shape), "layers": first["count"], "rows": n,
                  "seconds": dict(zip(names, times, strict=True))}
        if len(names) == 2:
            same = best[names[0]][key]["digest"] == best[names[1]][key]["digest"]
            row += [f"{times[1] / times[0]:.2f}x", "yes" if same else "no"]
            record["same_bits"] = same
        lines.append("| " + " | ".join(row) + " |")
        records.append(record)
    lines += ["", "Per forward pass, every matrix of a type, the LM head's too (ms):", ""]
    for n in sorted({k[3] for k in best[names[0]]}):
        for storage in sorted({k[0] for k in best[names[0]]}):
            cells = [f"{name} {totals[(name, n, storage)] * 1e3:.1f}" for name in names]
            lines.append(f"- {n} rows, {storage}: " + ", ".join(cells))
    return "\n".join(lines), records


def main() -> None:
    parser = argparse.ArgumentParser(description="the cpp backend's matrix products on a GGUF file's matrices")
    parser.add_argument("--model", type=Path, default=DEFAULT)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--baseline", type=Path, default=None, help="a directory holding another pocketllm_cpp")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.model, args.rows)))
        return
    sides: dict[str, list[list[dict[str, Any]]]] = {"this": []}
    if args.baseline is not None:
        sides["baseline"] = []
    for _ in range(args.passes):  # the sides take turns
        for name in sides:
            sides[name].append(worker(args.model, args.rows, args.baseline if name == "baseline" else None))
    text, records = table(sides)
    date, machine = datetime.date.today().isoformat(), machine_name()
    report = (f"# Matrix products of the cpp backend: {args.model.name}, {date}, {machine}\n\n"
              f"Least of {args.passes} passes per side"
              + (f"; baseline: {args.baseline}" if args.baseline else "") + ".\n\n" + text + "\n")
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{date}-{machine}-gemm-{args.model.stem}"
    Path(f"{stem}.md").write_text(report)
    Path(f"{stem}.json").write_text(json.dumps({"model": str(args.model), "machine": machine, "date": date,
                                                     "baseline": str(args.baseline) if args.baseline else None,
                                                     "records": records}, indent=1))


if __name__ == "__main__":
    main()
