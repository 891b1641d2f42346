"""The load-time warm-up: one short forward through a new engine, so that a model whose weights make NaN is refused
at load rather than answering every request with garbage (a corrupt tensor passes every shape check)."""

from __future__ import annotations

import math
from pathlib import Path

from pocketllm.backend import Capabilities, EmbeddingEngine, Engine
from pocketllm.errors import CheckpointError
from pocketllm.model_config import ModelConfig
from pocketllm.pooling import PoolingParams
from pocketllm.sampling_params import SamplingParams

REQUEST_ID = "pocketllm-warm-up"
MAX_STEPS = 16  # one prefill step and one token; a bound, so that a broken engine cannot hold the load


def warm_up(engine: Engine, capabilities: Capabilities, config: ModelConfig, path: Path) -> None:
    """Run one token (BOS, else id 0) through ``engine`` and refuse the model with CheckpointError when what comes
    out is not finite: the sampled token's logprob where the backend reports logprobs (NaN anywhere in the logits
    makes it NaN), else the token's embedding; a backend with neither is not checked.

    The request is seeded and a single token, so that it neither draws from the engine's seed stream nor leaves a
    full block in the prefix cache."""
    prompt = [config.bos_token_id if config.bos_token_id is not None else 0]
    if capabilities.logprobs:
        seed = 0 if "seed" in capabilities.sampling_options else None
        engine.add_request(REQUEST_ID, prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, seed=seed))
        what = "logits"
    elif capabilities.pooling_types and isinstance(engine, EmbeddingEngine):
        engine.add_embedding_request(REQUEST_ID, prompt,
                                     PoolingParams(pooling_type=capabilities.pooling_types[0], normalize=False))
        what = "hidden states"
    else:
        return
    values: list[float] = []
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            if delta.request_id != REQUEST_ID:
                continue
            if delta.finish_reason == "error":
                raise CheckpointError(f"{path}: the load-time warm-up forward failed: {delta.error}")
            values += [entry.logprob for entry in delta.logprobs or ()] + list(delta.embedding or ())
    else:
        engine.abort([REQUEST_ID])
        raise CheckpointError(f"{path}: the load-time warm-up forward did not finish in {MAX_STEPS} steps")
    if not all(math.isfinite(v) for v in values):
        raise CheckpointError(f"{path}: the model's first forward (the load-time warm-up, one token) made NaN or "
                              f"infinite {what}: its weights are corrupt")
