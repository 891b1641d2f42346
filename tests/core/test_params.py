from __future__ import annotations

import pytest

from pocketllm import ConfigError, EngineArgs, SamplingParams


@pytest.mark.parametrize(("field", "value"), [
    ("n", 0), ("max_tokens", 0), ("max_tokens", -3), ("min_tokens", -1), ("temperature", -0.1), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("logprobs", -1), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logit_bias", {5: 200.0}), ("seed", 2**63),
    # Overflow, NaN, infinities, wrong types and huge sizes, as a request can spell them.
    ("top_k", 2**63), ("top_k", 2**64 - 1), ("max_tokens", 2**64), ("min_tokens", 2**63), ("seed", -(2**63) - 1),
    ("n", 10**9), ("logprobs", 2**64), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", float("nan")), ("top_p", 1e-400), ("min_p", float("nan")), ("presence_penalty", float("inf")),
    ("repetition_penalty", 1e-300), ("repetition_penalty", float("nan")), ("logit_bias", {5: float("nan")}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {2**64: 1.0}), ("logit_bias", {5: "high"}),
    ("stop_token_ids", [2**64]), ("stop_token_ids", list(range(5000))), ("stop", ["x"] * 1000), ("stop", ["x" * 5000]),
    ("stop", [3]), ("top_k", "5"), ("temperature", "0.5"), ("n", True), ("max_tokens", 2.5), ("ignore_eos", "yes"),
])
def test_sampling_params_reject_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field and field in str(err.value)


def test_sampling_params_accept_vllm_spellings() -> None:
    params = SamplingParams(stop="###", top_k=-1, temperature=0.0)
    assert params.stop == ["###"] and params.effective_top_k == 0 and params.is_greedy
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize(("field", "value"), [
    ("model", ""), ("model_format", "onnx"), ("device", "tpu"), ("dtype", "int8"), ("tensor_parallel_size", 0),
    # device indices torch.device would misread ("cuda:128" is -128) or refuse with an error of its own
    ("device", "cuda:128"), ("device", "npu:99999999999999999999"), ("device", "cuda:01"), ("device", "npu:-1"),
    ("device", 5),
    ("max_model_len", 0), ("max_num_seqs", 0), ("max_num_batched_tokens", -1),
    ("prefill_chunk_size", 0), ("num_speculative_tokens", 2), ("seed", "x"), ("backend_options", []),
    ("enable_prefix_caching", "yes"),
])
def test_engine_args_reject_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        EngineArgs(**{field: value})
    assert err.value.field == field


NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize(("given", "field"), [
    ({"speculative_method": "medusa", "num_speculative_tokens": 2}, "speculative_method"),
    ({"speculative_method": "ngram"}, "num_speculative_tokens"),  # a method drafts at least one token
    ({**NGRAM, "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({**NGRAM, "ngram_min": 0}, "ngram_min"),
    ({**NGRAM, "ngram_max": 65}, "ngram_max"),
    ({**NGRAM, "ngram_min": 5, "ngram_max": 3}, "ngram_min"),
    # A method's own settings are refused without it, never ignored.
    ({"ngram_max": 4}, "ngram_max"),
    ({"speculative_method": "mtp", "num_speculative_tokens": 1, "ngram_min": 2}, "ngram_min"),
    ({"draft_model": "tiny"}, "draft_model"),
    ({"speculative_method": "draft_model", "num_speculative_tokens": 2}, "draft_model"),
    ({"speculative_disable_by_batch_size": 4}, "speculative_disable_by_batch_size"),
    ({**NGRAM, "speculative_disable_by_batch_size": 0}, "speculative_disable_by_batch_size"),
    ({**NGRAM, "speculative_disable_by_batch_size": 2.5}, "speculative_disable_by_batch_size"),
])
def test_speculative_settings_are_checked_naming_the_field(given: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        EngineArgs(**given)
    assert err.value.field == field


def test_ngram_settings_default_with_the_ngram_method() -> None:
    args = EngineArgs(**NGRAM)
    assert (args.ngram_min, args.ngram_max) == (1, 4)
    assert (EngineArgs(**NGRAM, ngram_min=6).ngram_max, EngineArgs(**NGRAM, ngram_max=2).ngram_min) == (6, 1)
    assert EngineArgs(speculative_method="draft_model", num_speculative_tokens=4, draft_model="d").draft_model == "d"


def test_engine_args_from_env_and_explicit_values_win() -> None:
    env = {"POCKETLLM_MAX_MODEL_LEN": "256", "POCKETLLM_BACKEND": "echo", "POCKETLLM_ENABLE_PREFIX_CACHING": "true",
           "POCKETLLM_BACKEND_OPTIONS": '{"block_size": 8}', "POCKETLLM_SPECULATIVE_METHOD": "none"}
    args = EngineArgs.from_env(env, backend="torch")
    assert args.max_model_len == 256 and args.backend == "torch" and args.enable_prefix_caching
    assert args.backend_options == {"block_size": 8} and args.speculative_method is None
    with pytest.raises(ConfigError) as err:
        EngineArgs.from_env({"POCKETLLM_MAX_NUM_SEQS": "many"})
    assert err.value.field == "max_num_seqs"
