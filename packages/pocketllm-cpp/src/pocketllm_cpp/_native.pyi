import enum

import numpy as np

def isa() -> str: ...
def best_isa() -> str: ...
def set_isa(name: str) -> None: ...
def available_isas() -> str: ...
def built_isas() -> str: ...
def num_threads() -> int: ...
def available_cpus() -> int: ...
def cgroup_cpu_quota(root: str = "") -> float: ...
def matmul(
    weight: np.ndarray, storage_type: str, rows: int, cols: int, x: np.ndarray, exact: bool = False,
    scales: np.ndarray | None = None,
) -> np.ndarray: ...
def dequantize(
    weight: np.ndarray, storage_type: str, rows: int, cols: int, scales: np.ndarray | None = None
) -> np.ndarray: ...
def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

class Pooling(enum.Enum):
    none = ...
    last = ...
    mean = ...
    cls = ...

class SequenceSlice:
    """One sequence's share of a forward pass."""
    start: int
    num_tokens: int
    block_table: list[int]
    num_logits: int
    pool: Pooling
    state_slot: int
    prompt_end: int
    def __init__(self, start: int, num_tokens: int, block_table: list[int], num_logits: int = 1, *,
                 pool: Pooling = ..., state_slot: int = -1, prompt_end: int = -1) -> None: ...

class Model:
    """A decoder over weights read in place, with its paged KV cache and state slots (llama_model, qwen3_5_model)."""
    def forward(self, tokens: list[int], slices: list[SequenceSlice]) -> np.ndarray: ...
    @property
    def num_state_slots(self) -> int: ...
    @property
    def state_bytes(self) -> int: ...
    def save_state(self, slot: int) -> np.ndarray: ...
    def load_state(self, slot: int, state: np.ndarray) -> None: ...

class LlamaConfig:
    """Sizes and options of a Llama-family model (Llama, Qwen3)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_pairs_adjacent: bool
    qk_norm: bool
    exact_activations: bool
    inv_freq: list[float]
    rope_attention_factor: float
    kv_cache_dtype: str
    def __init__(self) -> None: ...

class LlamaLayer:
    """One Llama layer's tensors and norms."""
    q: Tensor | None
    k: Tensor | None
    v: Tensor | None
    o: Tensor | None
    gate: Tensor | None
    up: Tensor | None
    down: Tensor | None
    input_norm: list[float]
    post_attention_norm: list[float]
    q_norm: list[float]
    k_norm: list[float]
    def __init__(self) -> None: ...

def llama_model(config: LlamaConfig, embedding: Tensor, layers: list[LlamaLayer], final_norm: list[float],
                lm_head: Tensor, num_blocks: int, block_size: int, num_threads: int) -> Model: ...

class Tensor:
    """A tensor's raw bytes, storage type and shape ([rows, cols], or [experts, rows, cols] stacked), and an F8_E4M3
    tensor's float32 scales (one per 32 columns of each row)."""
    def __init__(
        self, data: np.ndarray, storage_type: str, shape: list[int], scales: np.ndarray | None = None
    ) -> None: ...
    @property
    def data(self) -> np.ndarray: ...
    @property
    def storage_type(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def scales(self) -> np.ndarray | None: ...

def moe_forward(
    x: np.ndarray, router: Tensor, gate: Tensor, up: Tensor, down: Tensor, *, top_k: int,
    norm_topk_prob: bool = True, shared_gate: Tensor | None = None, shared_up: Tensor | None = None,
    shared_down: Tensor | None = None, shared_expert_gate: Tensor | None = None, exact: bool = False,
) -> np.ndarray: ...

class SamplingConfig:
    """How one request samples (the core has resolved and checked it)."""
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    stop_ids: list[int]
    request_stop_ids: list[int]
    logit_bias: dict[int, float]
    logprobs: int
    prompt_logprobs: int
    def __init__(self) -> None: ...

class Alternative:
    @property
    def token(self) -> int: ...
    @property
    def logprob(self) -> float: ...

class TokenLogprobs:
    @property
    def token(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def rank(self) -> int: ...
    @property
    def top(self) -> list[Alternative]: ...

class Finish(enum.Enum):
    none = ...
    stop = ...
    length = ...
    error = ...

class Delta:
    """What one step did for one request."""
    @property
    def request_id(self) -> str: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def finish(self) -> Finish: ...
    @property
    def stop_token_id(self) -> int | None: ...
    @property
    def logprobs(self) -> list[TokenLogprobs]: ...
    @property
    def prompt_logprobs(self) -> list[TokenLogprobs]: ...
    @property
    def embedding(self) -> list[float] | None: ...

class EngineStats:
    """The engine's counters now."""
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def blocks_total(self) -> int: ...
    @property
    def blocks_used(self) -> int: ...
    @property
    def preemptions(self) -> int: ...
    @property
    def prefix_queries(self) -> int: ...
    @property
    def prefix_hits(self) -> int: ...
    @property
    def state_snapshots(self) -> int: ...
    @property
    def state_snapshot_hits(self) -> int: ...
    @property
    def state_snapshot_evictions(self) -> int: ...
    @property
    def speculative(self) -> SpeculativeStats: ...

class SpeculativeConfig:
    """Speculative decoding's settings (ngram or MTP drafts)."""
    num_tokens: int  # most drafted per sequence and step; 0: off
    ngram_min: int
    ngram_max: int
    max_batch: int  # nobody drafts while more sequences than this run
    mtp: bool  # drafts from the model's multi-token-prediction head
    draft_model: bool  # drafts from the engine's draft model
    def __init__(self) -> None: ...

class SpeculativeStats:
    """Speculative decoding's counters, cumulative."""
    @property
    def drafts(self) -> int: ...
    @property
    def draft_tokens(self) -> int: ...
    @property
    def accepted_tokens(self) -> int: ...
    @property
    def accepted_per_position(self) -> list[int]: ...

class Profile:
    """Seconds per phase of the steps since reset_profile(), and their counts."""
    @property
    def step(self) -> float: ...
    @property
    def schedule(self) -> float: ...
    @property
    def forward(self) -> float: ...
    @property
    def matmul(self) -> float: ...
    @property
    def lm_head(self) -> float: ...
    @property
    def attention(self) -> float: ...
    @property
    def recurrence(self) -> float: ...
    @property
    def wait(self) -> float: ...
    @property
    def sample(self) -> float: ...
    @property
    def steps(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def regions(self) -> int: ...

class Engine:
    """Scheduler, KV block pool, state slots and sampler over a Model; one thread calls it."""
    def __init__(self, model: Model, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk_size: int,
                 seed: int, prefix_caching: bool = False, snapshot_bytes: int = 0,
                 speculative: SpeculativeConfig = ..., draft: Model | None = None) -> None: ...
    def add_request(self, request_id: str, prompt: list[int], sampling: SamplingConfig,
                    drafts: bool = True) -> None: ...
    def add_embedding_request(self, request_id: str, prompt: list[int], pooling: Pooling, normalize: bool) -> None: ...
    def step(self) -> list[Delta]: ...
    def set_allowed(self, request_id: str, words: np.ndarray) -> None: ...
    def abort(self, ids: list[str]) -> None: ...
    def has_unfinished(self) -> bool: ...
    def profile(self) -> Profile: ...
    def reset_profile(self) -> None: ...
    def stats(self) -> EngineStats: ...

class Qwen3_5Config:
    """Sizes and options of a Qwen3.5 model."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rms_norm_eps: float
    inv_freq: list[float]
    rope_attention_factor: float
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    tiled_heads: bool
    exact_activations: bool
    kv_cache_dtype: str
    def __init__(self) -> None: ...

class Qwen3_5Layer:
    """One layer's tensors: its mixer's (full_attention or linear_attention) and its feed-forward's."""
    kind: str
    input_norm: list[float]
    post_attention_norm: list[float]
    q_norm: list[float]
    k_norm: list[float]
    conv: list[float]
    decay: list[float]
    dt_bias: list[float]
    norm: list[float]
    q: Tensor | None
    k: Tensor | None
    v: Tensor | None
    o: Tensor | None
    qkv: Tensor | None
    z: Tensor | None
    b: Tensor | None
    a: Tensor | None
    out: Tensor | None
    gate: Tensor | None
    up: Tensor | None
    down: Tensor | None
    router: Tensor | None
    experts_gate: list[Tensor]
    experts_up: list[Tensor]
    experts_gate_up: Tensor | None
    experts_down: list[Tensor]
    shared_gate: Tensor | None
    shared_up: Tensor | None
    shared_down: Tensor | None
    shared_expert_gate: Tensor | None
    top_k: int
    norm_topk_prob: bool
    def __init__(self) -> None: ...

class Qwen3_5MTP:
    """The multi-token-prediction head's tensors."""
    embedding_norm: list[float]
    hidden_norm: list[float]
    norm: list[float]
    fc: Tensor | None
    layer: Qwen3_5Layer
    def __init__(self) -> None: ...

def qwen3_5_model(config: Qwen3_5Config, embedding: Tensor, layers: list[Qwen3_5Layer], final_norm: list[float],
                  lm_head: Tensor, num_blocks: int, block_size: int, num_state_slots: int,
                  num_threads: int, mtp: Qwen3_5MTP | None = None) -> Model: ...
