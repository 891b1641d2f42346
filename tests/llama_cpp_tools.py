"""llama.cpp as a test reference: llama-quantize's files and llama-cpp-python's greedy ids, from the libllama that
the noxfile builds out of the llama-cpp-python sdist ($LLAMA_CPP_LIB_PATH); a test that needs them skips, saying
why, where they are missing. Nothing is downloaded or built at test time.

llama-quantize's output comes from ``llama_model_quantize``, the library function the llama-quantize tool runs (with
its default parameters the files are byte-identical to the tool's), so no tool binary is built.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

# llama-quantize's type names (Q4_K is its alias of Q4_K_M) -> llama.cpp's file types.
QUANT_TYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
               "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
               "Q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "Q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
               "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL", "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
               "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K", "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
               "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M"}
THREADS = 2
CONTEXT = 1024  # positions of each llama.cpp context: the tests' prompts and continuations fit


def llama_cpp() -> ModuleType:
    """llama-cpp-python, or a skip that says why it cannot be imported."""
    try:
        import llama_cpp
    except ImportError as e:
        pytest.skip(f"llama-cpp-python is not installed ({e}); nox -s tests builds it from the llama-cpp-python sdist")
    except (OSError, RuntimeError) as e:  # its import loads libllama
        pytest.skip(f"llama-cpp-python cannot load libllama ($LLAMA_CPP_LIB_PATH="
                    f"{os.environ.get('LLAMA_CPP_LIB_PATH')}): {e}")
    return llama_cpp


def llama_quantize(src: Path, dst: Path, quant_type: str, *, requantize: bool = False) -> Path:
    """``src`` (a float GGUF) quantized to ``dst`` as ``llama-quantize src dst quant_type 2`` writes it: tensors whose
    rows do not divide into the type's blocks fall back per tensor (Q4_K -> Q5_0, Q6_K -> Q8_0 where rows are not a
    multiple of 256), as the tool does. ``requantize``: ``src`` may be quantized already (the tool's
    ``--allow-requantize``)."""
    lib = llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, QUANT_TYPES[quant_type])
    params.nthread = THREADS
    params.allow_requantize = requantize
    status = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if status != 0:
        raise AssertionError(f"llama_model_quantize({src}, {quant_type}) returned {status}")
    return dst


@functools.lru_cache(maxsize=4)
def _model(path: str) -> Any:
    return llama_cpp().Llama(path, n_ctx=CONTEXT, n_batch=CONTEXT, n_threads=THREADS, n_threads_batch=THREADS,
                             logits_all=False, verbose=False)


def llama_cpp_greedy(gguf_path: Path, prompt_ids: list[int], n: int) -> list[int]:
    """The ``n`` greedy token ids llama.cpp generates after ``prompt_ids``: the argmax of its logits at each step,
    so that no sampler setting of llama-cpp-python weighs in (EOS does not stop it)."""
    if len(prompt_ids) + n > CONTEXT:
        raise ValueError(f"{len(prompt_ids)} + {n} positions exceed the context of {CONTEXT}")
    lib, model = llama_cpp(), _model(str(gguf_path))
    model.reset()  # clears the recurrent states too: llama-cpp-python's prefix reuse cannot rewind them
    vocab = model.n_vocab()
    out: list[int] = []
    tokens = list(prompt_ids)
    while len(out) < n:
        model.eval(tokens)
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(model.ctx, -1), shape=(vocab,))
        tokens = [int(logits.argmax())]
        out += tokens
    return out


def llama_cpp_reference(gguf_path: Path, prompt_ids: list[int], n: int) -> Reference:
    """llama.cpp's greedy continuation of ``prompt_ids`` on ``gguf_path`` and its own top-2 logit margins: the
    reference where the file is quantized (no float model holds its exact weights)."""
    if len(prompt_ids) + n > CONTEXT:
        raise ValueError(f"{len(prompt_ids)} + {n} positions exceed the context of {CONTEXT}")
    lib, model = llama_cpp(), _model(str(gguf_path))
    model.reset()
    vocab = model.n_vocab()
    ids: list[int] = []
    margins: list[float] = []
    tokens = list(prompt_ids)
    while len(ids) < n:
        model.eval(tokens)
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(model.ctx, -1), shape=(vocab,))
        top2 = np.sort(logits)[-2:]
        tokens = [int(logits.argmax())]
        ids += tokens
        margins.append(float(top2[1] - top2[0]))
    return Reference(list(prompt_ids), ids, margins)


@dataclass(frozen=True)
class Reference:
    """The fp32 reference's greedy continuation and, at each of its positions, its top-2 logit margin."""

    prompt: list[int]
    ids: list[int]
    margins: list[float]

    def clear_positions(self, threshold: float) -> list[tuple[list[int], int]]:
        """(prompt + the first k reference tokens, the reference's next token) wherever its margin is clear."""
        return [(self.prompt + self.ids[:k], token) for k, (token, margin) in enumerate(zip(self.ids, self.margins,
                                                                                         strict=True))
                if margin >= threshold]

    def agreed_length(self, threshold: float, **outputs: list[int]) -> int:
        """How many tokens every output shares with the reference, asserting that the first difference (if any)
        falls where the reference's top-2 margin is below ``threshold``: past a near-tie, engines may part ways."""
        for k, (token, margin) in enumerate(zip(self.ids, self.margins, strict=True)):
            got = {name: ids[k] for name, ids in outputs.items()}
            if set(got.values()) != {token}:
                assert margin < threshold, (f"token {k}: the reference's {token} (top-2 margin {margin:.3f} >= "
                                            f"{threshold}) against {got}")
                return k
        return len(self.ids)


def reference_greedy(hf: Any, prompt_ids: list[int], n: int) -> Reference:
    """transformers' greedy continuation of ``prompt_ids`` and its margins (EOS does not stop it)."""
    import torch

    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    top2 = [step[0].topk(2).values for step in out.logits]
    return Reference(list(prompt_ids), out.sequences[0, len(prompt_ids):].tolist(),
                     [float(t[0] - t[1]) for t in top2])
