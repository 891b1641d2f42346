"""What LLM and AsyncLLM share: engine start-up, prompt encoding, chat rendering, output assembly."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

from pocketllm.args import EngineArgs
from pocketllm.backend import BackendStats, Capabilities, Engine
from pocketllm.chat import ChatPromptBuilder
from pocketllm.driver import EngineDriver
from pocketllm.errors import ConfigError, PromptTooLongError, RequestCancelledError
from pocketllm.model_config import ModelConfig
from pocketllm.outputs import CompletionOutput, RequestOutput, StreamEvent, Usage
from pocketllm.plugins import BackendRegistry
from pocketllm.pooling import EmbeddingOutput
from pocketllm.progress import LoadProgress
from pocketllm.sampling_params import SamplingParams
from pocketllm.structured import GrammarCacheStats

Prompt = Union[str, list[int]]
Messages = list[dict[str, Any]]


class EngineClient:
    """Owns an EngineDriver; subclasses add the sync or async request API.

    Build it from a model (``LLM("smollm2-135m-instruct", dtype="float32")``), from an
    :class:`EngineArgs` (``LLM(EngineArgs(model=..., backend=...))``, also as ``engine_args=``), or from
    ``POCKETLLM_*`` variables alone (``LLM()``). This is the whole public surface a server needs.
    Loading shows its stages on a terminal's stderr unless ``show_progress=False`` or ``POCKETLLM_QUIET=1``.
    """

    def __init__(self, model: str | EngineArgs | None = None, *, engine_args: EngineArgs | None = None,
                 registry: BackendRegistry | None = None, show_progress: bool | None = None, **kwargs: Any) -> None:
        if isinstance(model, EngineArgs):
            model, engine_args = None, _one_of(model, engine_args)
        if engine_args is None:
            engine_args = EngineArgs.from_env(**({"model": model} if model else {}), **kwargs)
        elif model is not None or kwargs:
            raise ConfigError("engine_args", "pass either EngineArgs or keyword arguments, not both")
        # Private: what callers need of it is below; tests reach it through pocketllm.testing.engine_driver.
        self._driver = EngineDriver(engine_args, registry, LoadProgress(show_progress))
        self.tokenizer = self._driver.tokenizer
        self.chat_builder = ChatPromptBuilder(self.tokenizer)

    @property
    def args(self) -> EngineArgs:
        """The engine's arguments as resolved at start (``max_model_len`` is an int)."""
        return self._driver.args

    @property
    def max_model_len(self) -> int:
        return self._driver.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._driver.model_config.vocab_size

    @property
    def model_config(self) -> ModelConfig:
        return self._driver.model_config

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling settings the checkpoint recommends (generation_config.json, or GGUF's
        general.sampling.*), as SamplingParams fields: what the server and CLI use for fields a request leaves
        out, unless told not to. The library itself applies them only where asked: ``SamplingParams(**defaults)``."""
        return dict(self._driver.sampling_defaults)

    @property
    def backend_name(self) -> str:
        return self._driver.backend_name

    @property
    def capabilities(self) -> Capabilities:
        return self._driver.capabilities

    @property
    def checkpoint_path(self) -> Path:
        """Where the checkpoint was read from: a model name or alias resolved to its local file or directory."""
        return self._driver.checkpoint_path

    @property
    def backend_engine(self) -> Engine:
        """The backend's engine, for looking inside it (a backend's own thread count or profiler, as the bench
        does). Only the engine thread calls its methods: calling them from elsewhere races its steps."""
        return self._driver.engine

    @property
    def is_alive(self) -> bool:
        """False once the engine loop has died or been shut down: no request can run then."""
        return self._driver.is_alive

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine, once ``is_alive`` is False because it died (None after a shutdown)."""
        return self._driver.error

    def stats(self) -> BackendStats:
        """The backend's counters as of its latest step; ``num_waiting`` also counts requests handed over since
        then that will not find a free slot (``max_num_seqs``)."""
        return self._driver.stats()

    def grammar_cache_stats(self) -> GrammarCacheStats:
        """The compiled structured-output grammars kept for reuse: how many, and their estimated bytes."""
        return self._driver.grammars.cache_stats()

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step boundary; its stream ends with ``finish_reason="abort"``."""
        self._driver.abort(request_id)

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Return ``(text or None, token ids)`` for a text or token-id prompt."""
        if isinstance(prompt, str):
            self.check_text_length(prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ConfigError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")

    def render_chat(self, messages: Messages, *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> tuple[str, list[int]]:
        """Render a conversation with the checkpoint's chat template and tokenize it (the template adds BOS);
        ``continue_final_message``: the reply continues the last message (see ``ChatPromptBuilder.render``)."""
        text = self.chat_builder.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        chat_template_kwargs=chat_template_kwargs,
                                        continue_final_message=continue_final_message)
        self.check_text_length(text)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def check_text_length(self, text: str) -> None:
        """Refuse, before tokenizing it, a text longer than max_model_len tokens of the longest token could span:
        tokenizing megabytes only to refuse them would hold up everyone else."""
        limit = self.max_model_len * self.tokenizer.max_token_chars
        if len(text) > limit:
            raise PromptTooLongError(f"prompt has {len(text)} characters, more than {self.max_model_len} tokens "
                                     f"(max_model_len) of at most {self.tokenizer.max_token_chars} characters "
                                     "each can hold")

    def shutdown(self) -> None:
        self._driver.shutdown()


def _one_of(positional: EngineArgs, keyword: EngineArgs | None) -> EngineArgs:
    if keyword is not None:
        raise ConfigError("engine_args", "given twice: positionally and as engine_args=")
    return positional


def normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A string, token ids, or a list of either, as a list of single prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts:
        return list(prompts)
    raise ConfigError("prompts", "must be a string, token ids, or a non-empty list of them")


def normalize_conversations(messages: Messages | list[Messages]) -> list[Messages]:
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        return messages
    return [messages]


def per_prompt_params(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ConfigError("sampling_params", f"got {len(params)} for {count} prompts")
    return list(params)


def embedding_of(item: StreamEvent | EmbeddingOutput | BaseException) -> EmbeddingOutput:
    """What an embedding request's sink received, as its result or its error."""
    if isinstance(item, BaseException):
        raise item
    if isinstance(item, StreamEvent):  # only a cancelled embedding request gets one
        raise RequestCancelledError(f"embedding request {item.request_id} was cancelled")
    return item


class OutputCollector:
    """Folds a request's stream events into a RequestOutput."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], n: int) -> None:
        self.output = RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids,
                                    outputs=[CompletionOutput(index=i) for i in range(n)],
                                    usage=Usage(prompt_tokens=len(prompt_ids)))

    def add(self, event: StreamEvent) -> bool:
        """Fold one event in; True once the whole request finished."""
        choice = self.output.outputs[event.index]
        if event.prompt_logprobs is not None:
            self.output.prompt_logprobs = event.prompt_logprobs
        choice.text += event.text
        choice.token_ids.extend(event.token_ids)
        if event.logprobs is not None:  # extended in place: a long reply comes in as many events
            choice.logprobs = choice.logprobs if choice.logprobs is not None else []
            choice.logprobs.extend(event.logprobs)
        choice.finish_reason, choice.stop_reason = event.finish_reason, event.stop_reason
        if event.answer is not None:  # with SamplingParams.reasoning: the core's split of the reply
            choice.reasoning = (choice.reasoning or "") + (event.reasoning or "")
            choice.answer = (choice.answer or "") + event.answer
        if event.reasoning_tokens is not None:
            choice.reasoning_tokens = event.reasoning_tokens
            if not event.reasoning_tokens:  # the reply had no section
                choice.reasoning = None
        if event.usage is not None:
            self.output.usage = event.usage
            return True
        return False
