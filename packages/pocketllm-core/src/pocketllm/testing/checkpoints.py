"""The conformance kit's tiny deterministic checkpoints, written with numpy alone (no torch).

Each is a few hundred kilobytes: a Llama and a Qwen3 in safetensors fp32, and the Llama again as a GGUF with
8- and 4-bit quantized storage types (its q/k rows permuted as llama.cpp's converter does). Weights come from a fixed
numpy generator, so every machine writes the same bytes, and ``references.json`` holds what transformers
generates from them.

Random weights usually make a model that echoes its input (a tied embedding maps a token back to itself). These
are scaled so that attention and the MLP dominate the residual stream: the next token depends on the whole
context, so a KV cache mixed up between requests changes the output, and top-2 margins stay clear of fp32
noise (the reference script checks both).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_MERGE_CHARS = "etaoinsh"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = 0
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS, MAX_POSITIONS = 64, 4, 2, 128, 2, 512
QWEN3_HEAD_DIM = 32
# The GGUF's storage types: 8-bit attention and lm_head, 4-bit MLP, fp16 embedding, fp32 norms.
GGUF_STORAGE_TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1",
              "ffn_up": "Q4_1", "ffn_down": "Q4_0", "output": "Q8_0", "token_embd": "F16"}
KIT_CHECKPOINTS = ("llama", "qwen3", "llama-gguf")
# Checkpoints for ProtocolConformance only (references.json does not cover them): a hybrid Qwen3.5, three Gated
# DeltaNet layers to one gated attention layer, with twice as many value heads as key heads.
PROTOCOL_CHECKPOINTS = ("qwen3_5",)
QWEN3_5_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                  "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
QWEN3_5_LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
# Checkpoints for speculative decoding (SpeculativeConformance): the kit's models made to repeat themselves (see
# cyclic_weights), so that drafts copied from a sequence are often, not always, what the model says next.
SPECULATIVE_CHECKPOINTS = ("llama-cyclic", "qwen3-cyclic", "qwen3_5-cyclic", "qwen3_5-cyclic-mtp")
CYCLE_LENGTH = 6
CYCLIC_LAYER_SCALE = 0.05
_SEEDS = {"llama": 0, "qwen3": 1, "qwen3_5": 2}


def write_checkpoint(kind: str, path: Path) -> Path:
    """Write one of KIT_CHECKPOINTS into the directory ``path`` and return what ``LLM(model=...)`` takes."""
    path.mkdir(parents=True, exist_ok=True)
    if kind == "llama":
        return make_tiny_llama(path)
    if kind == "qwen3":
        return make_tiny_qwen3(path)
    if kind == "llama-gguf":
        return make_tiny_gguf(path / "tiny-llama.gguf")
    if kind == "qwen3_5":
        return _write_safetensors(path, "qwen3_5", seed=2)
    if kind in SPECULATIVE_CHECKPOINTS:
        arch = kind.removesuffix("-mtp").removesuffix("-cyclic")
        return _write_safetensors(path, arch, seed=_SEEDS[arch], cyclic=True, mtp=kind.endswith("-mtp"))
    raise ValueError(f"unknown kit checkpoint {kind!r}; choose from "
                     f"{KIT_CHECKPOINTS + PROTOCOL_CHECKPOINTS + SPECULATIVE_CHECKPOINTS}")


def make_tiny_llama(path: Path, *, seed: int = 0, max_positions: int = MAX_POSITIONS) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into ``path``.

    ``max_positions`` only changes the config (tests that need long contexts); the weights stay the kit's."""
    return _write_safetensors(path, "llama", seed=seed, max_positions=max_positions)


def make_tiny_qwen3(path: Path, *, seed: int = 1) -> Path:
    """A Qwen3 (per-head q/k RMSNorm, head_dim independent of the hidden size) in the same layout."""
    return _write_safetensors(path, "qwen3", seed=seed)


def tiny_weights(arch: str, seed: int) -> dict[str, np.ndarray]:
    """The float32 weights of a kit model, in Hugging Face names and layout."""
    rng = np.random.default_rng(seed)
    vocab = len(_vocab())
    head_dim = QWEN3_HEAD_DIM if arch == "qwen3" else HIDDEN // HEADS

    def w(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, HIDDEN, std=1.0)}
    if arch == "qwen3_5":
        return tensors | _qwen3_5_layers(w) | {"model.norm.weight": w(HIDDEN, std=0.1),
                                              "lm_head.weight": w(vocab, HIDDEN, std=0.5)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN, std=0.5),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN, std=0.5),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN, std=0.5),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim, std=0.5),
            p + "post_attention_layernorm.weight": norm(HIDDEN),
            p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN, std=0.3),
            p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN, std=0.3),
            p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE, std=0.3),
        }
        if arch == "qwen3":
            tensors |= {p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim)}
    tensors["model.norm.weight"] = norm(HIDDEN)
    tensors["lm_head.weight"] = w(vocab, HIDDEN, std=0.5)  # untied: a tied head would echo the last token
    return tensors


def cycle_order(vocab: int) -> np.ndarray:
    """The cyclic models' cycles, one after another: every CYCLE_LENGTH ids (the last cycle may be shorter) are
    a cycle, each id followed by the next and the last by the first."""
    return np.random.default_rng(7).permutation(vocab)


def cyclic_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A kit model that mostly repeats itself: its head maps each token's embedding to the next token of a fixed
    cycle of CYCLE_LENGTH tokens (the vocabulary split into such cycles), and every layer's output is scaled down
    so that the residual stream is mostly the last token's embedding. What the layers still add (the context)
    moves the output from one cycle to another now and then, so copied drafts are accepted in runs and sometimes
    rejected."""
    embedding = weights["model.embed_tokens.weight"]
    vocab = len(embedding)
    order = cycle_order(vocab)
    following = np.empty(vocab, dtype=np.int64)
    for start in range(0, vocab, CYCLE_LENGTH):
        cycle = order[start:start + CYCLE_LENGTH]
        following[cycle] = np.roll(cycle, -1)
    preceding = np.empty(vocab, dtype=np.int64)
    preceding[following] = np.arange(vocab)
    scaled = {name: w * np.float32(CYCLIC_LAYER_SCALE) if name.endswith(("o_proj.weight", "down_proj.weight",
                                                                         "out_proj.weight")) else w
              for name, w in weights.items()}
    # Logit j is the hidden state's product with the embedding of the token before j in its cycle.
    return scaled | {"lm_head.weight": np.ascontiguousarray(embedding[preceding] * np.float32(2.0))}


def cyclic_mtp_head(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A multi-token-prediction head (Qwen3.5's ``mtp.*``) for a cyclic qwen3_5 model that says what the cycle says:
    its projection passes the embedding of the token it reads through and drops the model's hidden state, its
    layer is a copy of the model's (scaled down likewise), so the shared head predicts the token after that one
    in its cycle. Where the model itself follows its cycle, the head's drafts are accepted."""
    full = f"model.layers.{QWEN3_5_LAYER_TYPES.index('full_attention')}."
    head = {"mtp.layers.0." + name.removeprefix(full): w for name, w in weights.items() if name.startswith(full)}
    head["mtp.fc.weight"] = np.concatenate([np.eye(HIDDEN), np.zeros((HIDDEN, HIDDEN))], axis=1).astype(np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # zero-centred: weights of 1
        head[f"mtp.{norm}.weight"] = np.zeros(HIDDEN, np.float32)
    return head


def _qwen3_5_layers(w: Callable[..., np.ndarray]) -> dict[str, np.ndarray]:
    """Qwen3.5's layers: zero-centred norms (applied as 1 + w, so small w), gated attention, Gated DeltaNet."""
    lin = QWEN3_5_LINEAR
    key, value = lin["linear_num_key_heads"] * lin["linear_key_head_dim"], lin["linear_num_value_heads"] * lin[
        "linear_value_head_dim"]
    heads = lin["linear_num_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for i, kind in enumerate(QWEN3_5_LAYER_TYPES):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": w(HIDDEN, std=0.1),
            p + "post_attention_layernorm.weight": w(HIDDEN, std=0.1),
            p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN, std=0.3),
            p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN, std=0.3),
            p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE, std=0.3),
        }
        if kind == "full_attention":
            a = p + "self_attn."
            tensors |= {
                a + "q_proj.weight": w(2 * HEADS * QWEN3_HEAD_DIM, HIDDEN, std=0.5),
                a + "k_proj.weight": w(KV_HEADS * QWEN3_HEAD_DIM, HIDDEN, std=0.5),
                a + "v_proj.weight": w(KV_HEADS * QWEN3_HEAD_DIM, HIDDEN, std=0.5),
                a + "o_proj.weight": w(HIDDEN, HEADS * QWEN3_HEAD_DIM, std=0.5),
                a + "q_norm.weight": w(QWEN3_HEAD_DIM, std=0.1),
                a + "k_norm.weight": w(QWEN3_HEAD_DIM, std=0.1),
            }
            continue
        a = p + "linear_attn."
        tensors |= {
            a + "in_proj_qkv.weight": w(2 * key + value, HIDDEN, std=0.3),
            a + "in_proj_z.weight": w(value, HIDDEN, std=0.3),
            a + "in_proj_b.weight": w(heads, HIDDEN, std=0.3),
            a + "in_proj_a.weight": w(heads, HIDDEN, std=0.3),
            a + "conv1d.weight": w(2 * key + value, 1, lin["linear_conv_kernel_dim"], std=0.5),
            a + "dt_bias": np.ones(heads, np.float32),
            a + "A_log": np.log(np.linspace(1, 8, heads, dtype=np.float32)),
            a + "norm.weight": (1 + w(lin["linear_value_head_dim"], std=0.1)).astype(np.float32),
            a + "out_proj.weight": w(HIDDEN, value, std=0.3),
        }
    return tensors


# What config.json says for each kit architecture: the config class, its model class, and the fields of its own
# beyond those every architecture writes (tests/core/test_checkpoint_configs.py checks both against transformers).
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")}
HF_WRITER_VERSION = "5.24.0"  # the transformers whose save_pretrained these configs reproduce


def hf_config(arch: str, max_positions: int = MAX_POSITIONS) -> dict:
    """config.json exactly as transformers writes it for the kit model (``XForCausalLM(XConfig(...))
    .save_pretrained``): every field its config class writes, and no other key."""
    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    config: dict[str, Any] = {
        "architectures": [HF_CLASSES[arch][1]], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": None, "dtype": "float32", "eos_token_id": EOS_TOKEN_ID, "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": max_positions, "model_type": arch, "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS, "pad_token_id": None, "rms_norm_eps": 1e-6,
        "rope_parameters": rope, "tie_word_embeddings": False, "transformers_version": HF_WRITER_VERSION,
        "use_cache": True, "vocab_size": len(_vocab()),
    }
    if arch == "llama":
        return config | {"mlp_bias": False, "pretraining_tp": 1}
    if arch == "qwen3":
        return config | {"head_dim": QWEN3_HEAD_DIM, "layer_types": ["full_attention"] * LAYERS,
                         "max_window_layers": 28, "sliding_window": None, "use_sliding_window": False}
    return config | {
        "model_type": "qwen3_5_text", "head_dim": QWEN3_HEAD_DIM, "num_hidden_layers": len(QWEN3_5_LAYER_TYPES),
        "layer_types": QWEN3_5_LAYER_TYPES, **QWEN3_5_LINEAR,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    }


def _write_safetensors(path: Path, arch: str, *, seed: int, max_positions: int = MAX_POSITIONS,
                       cyclic: bool = False, mtp: bool = False) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path)
    (path / "config.json").write_text(json.dumps(hf_config(arch, max_positions), indent=2, sort_keys=True) + "\n")
    weights = tiny_weights(arch, seed)
    if cyclic:
        weights = cyclic_weights(weights)
    if mtp:
        weights |= cyclic_mtp_head(weights)
    save_file(weights, str(path / "model.safetensors"))
    return path


def make_tiny_gguf(path: Path, *, seed: int = 0) -> Path:
    """The tiny Llama (same weights as make_tiny_llama with this seed) as a GGUF file at ``path``."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(MAX_POSITIONS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    vocab = _vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(vocab))
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in vocab])
    writer.add_token_merges([f"{a} {b}" for a, b in _merges()])
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_chat_template(CHATML_TEMPLATE)
    finish_gguf(writer, {name: (array, _gguf_storage_type(name, array)) for name, array in gguf_tensors(seed).items()})
    return path


def finish_gguf(writer: Any, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """Add each float32 array, stored as its storage type ("F32", "Q8_0", ...), then write and close the file."""
    import gguf

    for name, (array, type_name) in tensors.items():
        storage_type = gguf.GGMLQuantizationType[type_name]
        data = array if storage_type == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(array, storage_type)
        writer.add_tensor(name, data, raw_dtype=storage_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny Llama's float32 tensors under GGUF names, q/k rows permuted as llama.cpp's converter does."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    tensors = {}
    for name, array in tiny_weights("llama", seed).items():
        if name in names:
            tensors[names[name]] = array
            continue
        _, _, layer, rest = name.split(".", 3)  # model.layers.<i>.<module>.weight
        module = rest.removesuffix(".weight")
        gguf_name = f"blk.{layer}.{layer_names[module]}.weight"
        if module == "self_attn.q_proj":
            array = _permute(array, HEADS)
        elif module == "self_attn.k_proj":
            array = _permute(array, KV_HEADS)
        tensors[gguf_name] = array
    return tensors


def _gguf_storage_type(name: str, array: np.ndarray) -> str:
    base = name.rsplit(".", 1)[0].split(".")[-1]
    return GGUF_STORAGE_TYPES.get(base, "F32") if array.ndim == 2 else "F32"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _merges() -> list[tuple[str, str]]:
    return [(a, b) for a in _MERGE_CHARS for b in _MERGE_CHARS]


def _vocab() -> dict[str, int]:
    from tokenizers import pre_tokenizers

    # Specials come first in the id space so that id 0 is the EOS token.
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in _merges():
        vocab[a + b] = len(vocab)
    return vocab


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=_vocab(), merges=_merges()))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE,
        "add_bos_token": False, "model_max_length": MAX_POSITIONS,
    }, indent=2))
