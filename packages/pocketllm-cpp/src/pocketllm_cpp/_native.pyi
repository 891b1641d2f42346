import numpy as np

def isa() -> str: ...
def best_isa() -> str: ...
def set_isa(name: str) -> None: ...
def num_threads() -> int: ...
def available_cpus() -> int: ...
def cgroup_cpu_quota(root: str = "") -> float: ...
def matmul(
    weight: np.ndarray, storage_type: str, rows: int, cols: int, x: np.ndarray, exact: bool = False
) -> np.ndarray: ...
def dequantize(weight: np.ndarray, storage_type: str, rows: int, cols: int) -> np.ndarray: ...
def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

class Model:
    def __init__(self, config: dict, embedding: tuple, layers: list[dict], final_norm: np.ndarray, lm_head: tuple,
                 num_blocks: int, block_size: int, num_threads: int) -> None: ...
    def forward(self, tokens: list[int], slices: list[tuple[int, int, list[int], int]],
                state_slots: list[int] = ...) -> np.ndarray: ...
    @property
    def num_state_slots(self) -> int: ...
    @property
    def state_bytes(self) -> int: ...
    def save_state(self, slot: int) -> np.ndarray: ...
    def load_state(self, slot: int, state: np.ndarray) -> None: ...

class MoeTensor:
    """A tensor's raw bytes, storage type and shape ([rows, cols], or [experts, rows, cols] stacked)."""
    def __init__(self, data: np.ndarray, storage_type: str, shape: list[int]) -> None: ...
    @property
    def data(self) -> np.ndarray: ...
    @property
    def storage_type(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...

def moe_forward(
    x: np.ndarray, router: MoeTensor, gate: MoeTensor, up: MoeTensor, down: MoeTensor, *, top_k: int,
    norm_topk_prob: bool = True, shared_gate: MoeTensor | None = None, shared_up: MoeTensor | None = None,
    shared_down: MoeTensor | None = None, shared_expert_gate: MoeTensor | None = None, exact: bool = False,
) -> np.ndarray: ...

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
    q: MoeTensor | None
    k: MoeTensor | None
    v: MoeTensor | None
    o: MoeTensor | None
    qkv: MoeTensor | None
    z: MoeTensor | None
    b: MoeTensor | None
    a: MoeTensor | None
    out: MoeTensor | None
    gate: MoeTensor | None
    up: MoeTensor | None
    down: MoeTensor | None
    router: MoeTensor | None
    experts_gate: list[MoeTensor]
    experts_up: list[MoeTensor]
    experts_gate_up: MoeTensor | None
    experts_down: list[MoeTensor]
    shared_gate: MoeTensor | None
    shared_up: MoeTensor | None
    shared_down: MoeTensor | None
    shared_expert_gate: MoeTensor | None
    top_k: int
    norm_topk_prob: bool
    def __init__(self) -> None: ...

def qwen3_5_model(config: Qwen3_5Config, embedding: MoeTensor, layers: list[Qwen3_5Layer], final_norm: list[float],
                  lm_head: MoeTensor, num_blocks: int, block_size: int, num_state_slots: int,
                  num_threads: int) -> Model: ...
