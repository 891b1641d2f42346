"""Decode throughput of TorchEngine on a SmolLM2-135M-shaped model with random weights (not a test).

    PYTHONPATH=packages/pocketllm-core/src:packages/pocketllm-torch/src python tests/torch/bench_decode.py \
        [--dtype auto] [--tokens 128] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from pocketllm.args import EngineArgs
from pocketllm.model_config import ModelConfig
from pocketllm.sampling_params import SamplingParams
from pocketllm_torch.backend import TorchBackend

SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(2,),
)


@dataclass
class RandomCheckpoint:
    config: ModelConfig
    quantization: str | None = None

    def weights(self):
        c, rng = self.config, np.random.default_rng(0)
        kv = c.num_key_value_heads * c.head_dim

        def w(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape, dtype=np.float32) * 0.02

        yield "model.embed_tokens.weight", w(c.vocab_size, c.hidden_size)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            yield f"{p}.self_attn.q_proj.weight", w(c.num_attention_heads * c.head_dim, c.hidden_size)
            yield f"{p}.self_attn.k_proj.weight", w(kv, c.hidden_size)
            yield f"{p}.self_attn.v_proj.weight", w(kv, c.hidden_size)
            yield f"{p}.self_attn.o_proj.weight", w(c.hidden_size, c.num_attention_heads * c.head_dim)
            yield f"{p}.mlp.gate_proj.weight", w(c.intermediate_size, c.hidden_size)
            yield f"{p}.mlp.up_proj.weight", w(c.intermediate_size, c.hidden_size)
            yield f"{p}.mlp.down_proj.weight", w(c.hidden_size, c.intermediate_size)
            yield f"{p}.input_layernorm.weight", np.ones(c.hidden_size, np.float32)
            yield f"{p}.post_attention_layernorm.weight", np.ones(c.hidden_size, np.float32)
        yield "model.norm.weight", np.ones(c.hidden_size, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    engine = TorchBackend().create_engine(EngineArgs(dtype=args.dtype, max_model_len=2048, max_num_seqs=32),
                                          RandomCheckpoint(SMOLLM2_135M))
    print(f"dtype={engine.config.dtype} device={engine.config.device}")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for batch in args.batch:
        for run in range(2):  # the first run warms up oneDNN's kernels
            for i in range(batch):
                engine.add_request(f"{run}-{i}", [(7 * i + j) % 1000 + 1 for j in range(args.prompt)], params)
            while engine.stats().num_waiting:  # prefill everything first: only decode is timed
                engine.step()
            start, generated = time.perf_counter(), 0
            while engine.has_unfinished():
                generated += len(engine.step())
            elapsed = time.perf_counter() - start
        print(f"batch {batch}: {generated / elapsed:.1f} tok/s aggregate, {elapsed / (generated / batch) * 1e3:.2f} "
              f"ms/step over {generated // batch} steps")
    engine.shutdown()


if __name__ == "__main__":
    main()
