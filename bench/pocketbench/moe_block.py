"""The cpp backend's mixture-of-experts block alone: decode- and prefill-sized calls on a Qwen3.5 MoE layer's shape.

    python -m pocketbench.moe_block [--experts 256] [--types Q4_K Q8_0] [--prefill 256]

Random experts stored in the given block types (the router and the shared expert's sigmoid gate in float32, as
GGUF files keep them), called through ``pocketllm_cpp.kernels.moe_forward`` on the kernels' pool (a thread per
available CPU: ``taskset`` sets how many). Decode: one token a call, its experts varying call to call,
the bytes a call must read (router, its top-k experts, the shared expert) per second, beside the kernels' rate on
one large matrix of the same type (the stacked gate tensor, one activation row). Prefill: one call over the
prompt's tokens (each chosen expert's weights read once) against the same tokens one call each (every token
reading its own experts), bit-equal.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import gguf
import numpy as np
from pocketllm_cpp import kernels

# Qwen3.5-35B-A3B's MoE layer (its config.json): hidden 2048, 256 experts of 512, top 8, a shared expert of 512.
HIDDEN, FF, SHARED_FF, TOP_K = 2048, 512, 512, 8
LEADING_HALVES = {"Q4_0": 1, "Q8_0": 1, "Q4_1": 2, "Q4_K": 2, "Q5_K": 2}  # fp16 scale fields at each block's start


def random_blocks(storage_type: str, shape: list[int], rng: np.random.Generator) -> kernels.Tensor:
    """Random codes with small positive scales: the values' magnitudes, not a real model's, but the same bytes read."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[storage_type]]
    blocks = rng.integers(0, 256, (int(np.prod(shape)) // block_size, type_size), dtype=np.uint8)
    halves = 2 * LEADING_HALVES[storage_type]
    blocks[:, :halves] = (rng.random((len(blocks), halves // 2)) * 0.01 + 0.001).astype(np.float16).view(np.uint8)
    return kernels.Tensor(blocks.reshape(-1), storage_type, shape)


def float32(shape: list[int], rng: np.random.Generator) -> kernels.Tensor:
    values = rng.standard_normal(shape).astype(np.float32)
    return kernels.Tensor(values.view(np.uint8).reshape(-1), "F32", shape)


def nbytes(tensor: kernels.Tensor) -> int:
    return int(tensor.data.size)


def median_call(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench(storage_type: str, experts: int, prefill: int) -> str:
    rng = np.random.default_rng(0)
    router, shared_expert_gate = float32([experts, HIDDEN], rng), float32([1, HIDDEN], rng)
    gate, up = (random_blocks(storage_type, [experts, FF, HIDDEN], rng) for _ in range(2))
    down = random_blocks(storage_type, [experts, HIDDEN, FF], rng)
    shared = {"shared_gate": random_blocks(storage_type, [SHARED_FF, HIDDEN], rng),
              "shared_up": random_blocks(storage_type, [SHARED_FF, HIDDEN], rng),
              "shared_down": random_blocks(storage_type, [HIDDEN, SHARED_FF], rng)}

    def run(x: np.ndarray) -> np.ndarray:
        return kernels.moe_forward(x, router, gate, up, down, top_k=TOP_K, shared_expert_gate=shared_expert_gate,
                                   **shared)

    xs = (rng.standard_normal((max(prefill, 512), HIDDEN)) / 16).astype(np.float32)
    rows = iter(range(10**9))
    run(xs[:1])
    decode = min(median_call(lambda: run(xs[next(rows) % len(xs)][None]), 128) for _ in range(3))
    expert_bytes = (nbytes(gate) + nbytes(up) + nbytes(down)) // experts
    fixed = nbytes(router) + sum(nbytes(t) for t in shared.values()) + nbytes(shared_expert_gate)
    layer = fixed + experts * expert_bytes
    call = fixed + TOP_K * expert_bytes
    # The kernels' own streaming rate: the stacked gate tensor as one matrix, one activation row.
    one = np.ascontiguousarray(xs[:1])
    matrix = min(median_call(lambda: kernels._native.matmul(gate.data, storage_type, experts * FF, HIDDEN, one), 16)
                 for _ in range(3))

    prompt = xs[:prefill]
    batched = min(median_call(lambda: run(prompt), 1) for _ in range(3))
    alone = min(median_call(lambda: [run(row[None]) for row in prompt], 1) for _ in range(2))
    np.testing.assert_array_equal(run(prompt), np.vstack([run(row[None]) for row in prompt]))
    logits = prompt @ np.frombuffer(router.data, np.float32).reshape(experts, HIDDEN).T
    hit = len(np.unique(np.argsort(-logits, axis=-1)[:, :TOP_K]))  # distinct experts the prompt chose
    flops = 2 * prefill * (experts * HIDDEN + TOP_K * 3 * FF * HIDDEN + 3 * SHARED_FF * HIDDEN)
    return (f"| {storage_type} | {experts} | {decode * 1e6:.0f} | {call / 1e6:.1f} ({call / layer:.0%}) | "
            f"{call / decode / 1e9:.1f} | {nbytes(gate) / matrix / 1e9:.1f} | {prefill} | {batched * 1e3:.0f} | "
            f"{alone * 1e3:.0f} | {alone / batched:.1f}x | {hit} of {experts}: "
            f"{(fixed + hit * expert_bytes) / 1e6:.0f} vs {(prefill * call) / 1e6:.0f} | {flops / batched / 1e9:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description="the cpp backend's MoE block, decode and prefill")
    parser.add_argument("--experts", type=int, nargs="+", default=[256])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q8_0"], choices=sorted(LEADING_HALVES))
    parser.add_argument("--prefill", type=int, default=256)
    args = parser.parse_args()
    print(f"MoE block: hidden {HIDDEN}, expert ff {FF}, top {TOP_K}, shared ff {SHARED_FF}; isa {kernels.isa()}, "
          f"{kernels.num_threads()} threads\n")
    print("| type | experts | decode us/token | MB read/token (of the layer) | GB/s | one matrix GB/s | prefill tokens "
          "| batched ms | a call per token ms | speed-up | MB read: batched vs a call per token | batched GFLOP/s |")
    print("|---" * 12 + "|")
    for storage_type in args.types:
        for experts in args.experts:
            print(bench(storage_type, experts, args.prefill), flush=True)


if __name__ == "__main__":
    main()
