"""Decode throughput of the torch backend on a GPU against the HBM bound, as bench/gpu/check.sh runs it.

    python bench/gpu/decode.py [--layers 16] [--new-tokens 128] [--batches 1 64] [--device cuda] [--out DIR]

A random Llama in the configuration of Llama-3.2-1B (bf16, written with safetensors and the conformance kit's
tokenizer), served by the torch backend on CUDA: single-stream and batch-64 decode tok/s (the time of N new tokens
less that of one, so prefill is left out), beside the bound: the bytes of weights a decoded token reads (every
matrix but the embedding table) over the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pocketllm import LLM, SamplingParams
from pocketllm.testing.checkpoints import _write_tokenizer

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
          "num_hidden_layers": 16, "vocab_size": 128256, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
          "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": True,
          "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": 2}


def write_model(folder: Path, layers: int) -> tuple[Path, int]:
    """The checkpoint, and the bytes of weights one decoded token reads."""
    c = CONFIG | {"num_hidden_layers": layers}
    hidden, inter, heads, kv, dim = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                                     c["num_key_value_heads"], c["head_dim"])
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (heads * dim, hidden),
                   p + "self_attn.k_proj.weight": (kv * dim, hidden),
                   p + "self_attn.v_proj.weight": (kv * dim, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * dim),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
    weights = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape) * 0.02).to(torch.bfloat16)
               for name, shape in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(c))
    _write_tokenizer(folder)
    # Tied: the embedding table is the output projection, read whole every token.
    return folder, sum(t.numel() * 2 for t in weights.values())


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Bytes per second read and written by a copy of ``size`` bytes on ``device``, counted once each way."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    src = torch.empty(size // 2, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    return 10 * 2 * size / (time.perf_counter() - start)


def decode_rate(llm: LLM, batch: int, new_tokens: int) -> float:
    prompts = [[5 + (i % 50), 9, 13] * 40 for i in range(batch)]
    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start
    run(2)  # warm-up
    return batch * (new_tokens - 1) / (run(new_tokens) - run(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="sequences decoding at once")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run of this script")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu"))
    args = p.parse_args()
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 2 << 30 if device.type == "cuda" else 256 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        path, per_token = write_model(Path(tmp) / "llama-3.2-1b-random", args.layers)
        llm = LLM(str(path), backend="torch", device=args.device, dtype="bfloat16", max_model_len=512,
                  max_num_seqs=64)
        rows = {f"batch {b}": decode_rate(llm, b, args.new_tokens) for b in args.batches}
        llm.shutdown()
    bound = bandwidth / per_token
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "bandwidth_bytes_s": bandwidth, "weight_bytes_per_token": per_token,
              "bound_tok_s": bound, "decode_tok_s": rows,
              "of_bound": {name: rate / bound for name, rate in rows.items()}}
    print(f"| workload | tok/s | of the bound ({bound:.0f} tok/s at {bandwidth / 1e12:.2f} TB/s) |\n|---|---|---|")
    for name, rate in rows.items():
        print(f"| decode, {name} | {rate:.0f} | {rate / bound:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
