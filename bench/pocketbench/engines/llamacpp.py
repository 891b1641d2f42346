"""llama.cpp through llama-cpp-python's low-level API: one context, one sequence id per concurrent prompt.

The high-level ``Llama`` class decodes one sequence at a time, so batches are driven here with
``llama_batch_init`` + ``llama_decode``: all prompts go in one batch, then one token per sequence per step.
Greedy sampling is an argmax over the logits of each sequence's last position.
"""

from __future__ import annotations

import time
from itertools import accumulate
from typing import Any

import llama_cpp
import numpy as np

from pocketbench.config import EngineSpec
from pocketbench.engines import Timing


class LlamaCppEngine:
    def __init__(self, spec: EngineSpec) -> None:
        if not spec.model_path.endswith(".gguf"):
            raise ValueError(f"llama.cpp needs a GGUF model, got {spec.model_path}")
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(spec.model_path.encode(), model_params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {spec.model_path}")
        self.n_batch = spec.max_seqs * spec.max_len  # every prompt of a run fits in one llama_decode call
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = spec.max_seqs * spec.max_len  # split evenly: each sequence gets max_len positions
        params.n_batch = self.n_batch
        params.n_seq_max = spec.max_seqs
        params.n_threads = spec.threads
        params.n_threads_batch = spec.threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.kv_unified = True  # one KV buffer shared by the sequences, as the bench README says
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.model = model
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.spec = spec

    def info(self) -> dict[str, Any]:
        return {"engine": f"llama-cpp-python {llama_cpp.__version__}", "threads": self.spec.threads,
                "flash_attn": True, "kv_unified": True, "system": llama_cpp.llama_print_system_info().decode().strip()}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._run(prompts, max_tokens)[0]

    def stream(self, prompts: list[list[int]], max_tokens: int) -> list[Timing]:
        outputs, first, last = self._run(prompts, max_tokens)
        return [Timing(first, last, len(ids)) for ids in outputs]

    def _run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:
        """Decode all sequences in lockstep; returns their tokens and the seconds to the first and last step."""
        start = time.perf_counter()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        self._fill([(s, pos, tok) for s, prompt in enumerate(prompts) for pos, tok in enumerate(prompt)],
                   outputs={end - 1 for end in accumulate(len(p) for p in prompts)})
        outputs: list[list[int]] = [[] for _ in prompts]
        first = 0.0
        for step in range(max_tokens):
            self._decode()
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=(len(prompts), self.n_vocab))
            next_tokens = logits.argmax(axis=1).tolist()
            for ids, tok in zip(outputs, next_tokens, strict=True):
                ids.append(tok)
            first = first or time.perf_counter() - start
            if step + 1 < max_tokens:
                self._fill([(s, len(p) + step, tok) for s, (p, tok) in enumerate(zip(prompts, next_tokens,
                                                                                   strict=True))],
                           outputs=set(range(len(prompts))))
        return outputs, first, time.perf_counter() - start

    def _fill(self, tokens: list[tuple[int, int, int]], outputs: set[int]) -> None:
        """Put (sequence id, position, token) triples in the batch; logits only at the indices in ``outputs``."""
        if len(tokens) > self.n_batch:
            raise ValueError(f"{len(tokens)} tokens exceed the batch of {self.n_batch}")
        batch = self.batch
        for i, (seq, pos, tok) in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i in outputs
        batch.n_tokens = len(tokens)

    def _decode(self) -> None:
        status = llama_cpp.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

