"""transformers ``generate()`` on the same checkpoint (a GGUF is dequantized to float32 at load)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from pocketbench.config import EngineSpec
from pocketbench.engines import Timing

PAD_ID = 0  # any id will do: padded positions are masked out, and equal-length batches need no padding


class _StepClock(BaseStreamer):
    """Records when each decoding step's tokens arrive (``generate`` first puts the prompt, then each step)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.steps: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.steps.append(time.perf_counter() - self.start)
        self.prompt_seen = True

    def end(self) -> None:
        pass


class TransformersEngine:
    def __init__(self, spec: EngineSpec) -> None:
        torch.set_num_threads(spec.threads)
        path = Path(spec.model_path)
        if path.is_file():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        # EOS is ignored as in the other engines: generate() would otherwise stop at the model's EOS id.
        model.generation_config.eos_token_id = None
        self.model = model.eval()
        self.spec = spec

    def info(self) -> dict[str, Any]:
        return {"engine": f"transformers {transformers.__version__}, torch {torch.__version__}",
                "dtype": str(self.model.dtype), "attention": self.model.config._attn_implementation,
                "threads": torch.get_num_threads()}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._generate(prompts, max_tokens, None)

    def stream(self, prompts: list[list[int]], max_tokens: int) -> list[Timing]:
        clock = _StepClock(time.perf_counter())
        outputs = self._generate(prompts, max_tokens, clock)
        return [Timing(clock.steps[0], clock.steps[-1], len(ids)) for ids in outputs]

    def _generate(self, prompts: list[list[int]], max_tokens: int, streamer: BaseStreamer | None) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        # Left padding, so that every sequence's next token follows its last prompt token.
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=PAD_ID)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=config, streamer=streamer)
        return out[:, width:].tolist()
