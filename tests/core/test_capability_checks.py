"""The one place that refuses: engine options and requests checked against a backend's Capabilities."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from pocketllm import LLM, Capabilities, ConfigError, EngineArgs, SamplingParams, UnsupportedOptionError
from pocketllm.backend import SAMPLING_OPTIONS
from pocketllm.backend_options import BackendOptions, OptionInfo, describe
from pocketllm.capability_checks import check_engine_args, check_request, sampling_options_in_use
from pocketllm.checkpoint import load_checkpoint

CAPS = Capabilities(architectures=("llama",), sampling_options=SAMPLING_OPTIONS)


def test_llm_takes_engine_args_positionally(pocketllm_tiny_llama: Path) -> None:
    args = EngineArgs(model=str(pocketllm_tiny_llama), backend="echo", max_model_len=64)
    for llm in (LLM(args), LLM(engine_args=args)):
        try:
            assert (llm.backend_name, llm.max_model_len) == ("echo", 64)
        finally:
            llm.shutdown()
    with pytest.raises(ConfigError, match="engine_args"):
        LLM(args, engine_args=args)
    with pytest.raises(ConfigError, match="engine_args"):
        LLM(args, dtype="float32")


def test_storage_types_outside_the_capabilities_are_refused(pocketllm_kit_checkpoint) -> None:
    checkpoint = load_checkpoint(str(pocketllm_kit_checkpoint("llama-gguf")))
    with pytest.raises(UnsupportedOptionError, match="Q8_0") as err:
        check_engine_args("b", CAPS, EngineArgs(), checkpoint)
    assert (err.value.option, err.value.backend) == ("quantization", "b")
    caps = Capabilities(architectures=("llama",), storage_types=("F32", "F16", "Q8_0", "Q4_0", "Q4_1"))
    check_engine_args("b", caps, EngineArgs(), checkpoint)


def test_max_batch_and_architecture_are_refused(pocketllm_tiny_llama: Path) -> None:
    checkpoint = load_checkpoint(str(pocketllm_tiny_llama))
    small = Capabilities(architectures=("llama",), max_num_seqs=8)
    check_engine_args("b", small, EngineArgs(max_num_seqs=8), checkpoint)
    with pytest.raises(UnsupportedOptionError, match="at most 8") as err:
        check_engine_args("b", small, EngineArgs(max_num_seqs=9), checkpoint)
    assert err.value.option == "max_num_seqs"
    with pytest.raises(UnsupportedOptionError, match="'llama' is not one of qwen3") as err:
        check_engine_args("b", Capabilities(architectures=("qwen3",)), EngineArgs(), checkpoint)
    assert err.value.option == "model"


class _Options(BackendOptions, kw_only=True):
    size: Annotated[int, msgspec.Meta(ge=1, le=64, description="how big")] = 8
    fast: Annotated[bool, msgspec.Meta(description="go faster")] = False
    limit: Annotated[int, msgspec.Meta(gt=0)] | None = None


OPTION_CAPS = Capabilities(architectures=("llama",), backend_options=_Options)


def test_backend_options_arrive_as_the_backend_s_class_with_its_defaults(pocketllm_tiny_llama: Path) -> None:
    checkpoint = load_checkpoint(str(pocketllm_tiny_llama))
    assert check_engine_args("b", OPTION_CAPS, EngineArgs(), checkpoint) == _Options()
    given = EngineArgs(backend_options={"size": 64, "fast": True, "limit": None})
    assert check_engine_args("b", OPTION_CAPS, given, checkpoint) == _Options(size=64, fast=True)
    assert check_engine_args("b", CAPS, EngineArgs(), checkpoint) == BackendOptions()
    assert describe(_Options) == [
        OptionInfo(name="size", expects="an integer from 1 to 64", default="8", help="how big"),
        OptionInfo(name="fast", expects="true or false", default="false", help="go faster"),
        OptionInfo(name="limit", expects="an integer > 0", default="chosen by the backend", help=""),
    ]


@pytest.mark.parametrize(("options", "message"), [
    ({"size": 0}, "backend 'b' takes an integer from 1 to 64, got 0"),
    ({"size": 65}, "backend 'b' takes an integer from 1 to 64, got 65"),
    ({"size": True}, "got True"),  # a bool is no integer, though Python says it is one
    ({"size": "8"}, "got '8'"),
    ({"size": 8.0}, "got 8.0"),
    ({"fast": 1}, "backend 'b' takes true or false, got 1"),
    ({"limit": 0}, "backend 'b' takes an integer > 0, got 0"),
    ({"size": 4, "limit": [1]}, "got [1]"),
])
def test_a_backend_option_of_a_wrong_type_or_out_of_range_is_a_config_error(
    pocketllm_tiny_llama: Path, options: dict[str, object], message: str
) -> None:
    checkpoint = load_checkpoint(str(pocketllm_tiny_llama))
    with pytest.raises(ConfigError) as err:
        check_engine_args("b", OPTION_CAPS, EngineArgs(backend_options=options), checkpoint)
    assert err.value.field == f"backend_options.{list(options)[-1]}" and message in str(err.value)


def test_a_huge_bad_backend_option_value_is_not_echoed_whole(pocketllm_tiny_llama: Path) -> None:
    checkpoint = load_checkpoint(str(pocketllm_tiny_llama))
    with pytest.raises(ConfigError) as err:
        check_engine_args("b", OPTION_CAPS, EngineArgs(backend_options={"size": "x" * 10**6}), checkpoint)
    assert len(str(err.value)) < 300


def test_an_unknown_backend_option_names_the_keys_the_backend_takes(pocketllm_tiny_llama: Path) -> None:
    checkpoint = load_checkpoint(str(pocketllm_tiny_llama))
    with pytest.raises(UnsupportedOptionError, match="accepted keys: size, fast, limit") as err:
        check_engine_args("b", OPTION_CAPS, EngineArgs(backend_options={"size": 4, "sise": 4}), checkpoint)
    assert (err.value.option, err.value.backend) == ("backend_options.sise", "b")
    with pytest.raises(UnsupportedOptionError, match="accepted keys: none"):
        check_engine_args("b", CAPS, EngineArgs(backend_options={"size": 4}), checkpoint)


class _Renamed(BackendOptions, kw_only=True, rename="camel"):
    block_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    num_threads: int = msgspec.field(default=1, name="num-threads")


def test_backend_options_are_keyed_as_their_struct_encodes_them(pocketllm_tiny_llama: Path) -> None:
    """A plugin's options class that renames its fields (rename="camel", msgspec.field(name=...)) takes the
    renamed keys; they used to fail the check with a bare KeyError."""
    checkpoint = load_checkpoint(str(pocketllm_tiny_llama))
    caps = Capabilities(architectures=("llama",), backend_options=_Renamed)
    given = EngineArgs(backend_options={"blockSize": 32, "num-threads": 2})
    assert check_engine_args("b", caps, given, checkpoint) == _Renamed(block_size=32, num_threads=2)
    with pytest.raises(ConfigError, match="backend 'b' takes an integer >= 1, got 0"):
        check_engine_args("b", caps, EngineArgs(backend_options={"blockSize": 0}), checkpoint)
    with pytest.raises(UnsupportedOptionError, match="accepted keys: blockSize, num-threads"):
        check_engine_args("b", caps, EngineArgs(backend_options={"block_size": 32}), checkpoint)


def test_max_model_len_beyond_the_model_is_refused(pocketllm_tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="exceeds the model's limit of 512"):
        LLM(str(pocketllm_tiny_llama), backend="echo", max_model_len=513)


@pytest.mark.parametrize(("params", "used"), [
    (SamplingParams(temperature=0.0), []),
    (SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, seed=4), []),  # greedy ignores them all
    (SamplingParams(temperature=0.7, top_k=-1, seed=1), ["temperature", "seed"]),
    (SamplingParams(temperature=0.0, repetition_penalty=1.1, logit_bias={1: 1.0}, min_tokens=1, logprobs=0),
     ["repetition_penalty", "logit_bias", "min_tokens", "logprobs"]),
])
def test_sampling_options_in_use(params: SamplingParams, used: list[str]) -> None:
    assert sampling_options_in_use(params) == used


def test_check_request_resolves_max_tokens_and_refuses_what_the_engine_must_not_see() -> None:
    def check(prompt: list[int], params: SamplingParams, caps: Capabilities = CAPS) -> SamplingParams:
        return check_request("b", caps, prompt, params, vocab_size=100, max_model_len=10)

    assert check([1, 2, 3], SamplingParams(max_tokens=None)).max_tokens == 7
    assert check([1, 2, 3], SamplingParams(max_tokens=50)).max_tokens == 7
    assert check([1, 2, 3], SamplingParams(max_tokens=2)).max_tokens == 2
    for field, params in [("stop_token_ids", SamplingParams(stop_token_ids=[100])),
                          ("logit_bias", SamplingParams(logit_bias={100: 1.0})),
                          ("top_k", SamplingParams(top_k=101))]:
        with pytest.raises(ConfigError, match=field):
            check([1], params)
    with pytest.raises(UnsupportedOptionError) as err:
        check([1], SamplingParams(temperature=0.5), Capabilities())
    assert err.value.option == "temperature"
    with pytest.raises(UnsupportedOptionError, match="at most 2 alternatives"):
        check([1], SamplingParams(logprobs=3), Capabilities(sampling_options=SAMPLING_OPTIONS, max_logprobs=2))
    with pytest.raises(UnsupportedOptionError, match="at most 2 choices"):
        check([1], SamplingParams(temperature=0.0, n=3), Capabilities(max_n=2))


def test_the_server_talks_only_to_the_public_client() -> None:
    spec = importlib.util.find_spec("pocketllm_server")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pocketllm-server is not installed")
    sources = Path(next(iter(spec.submodule_search_locations))).glob("*.py")
    offenders = [p.name for p in sources if ".driver" in p.read_text()]
    assert offenders == [], "the server must use LLM/AsyncLLM/EngineClient, not the engine driver"
