"""Tiny random-weight checkpoints built with numpy alone, for tests that must not need torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_MERGE_CHARS = "etaoinsh"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def make_tiny_llama(path: Path, *, seed: int = 0, num_layers: int = 2, hidden_size: int = 64) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into ``path``.

    Embedding weights are large enough that greedy choices have clear margins,
    so different backends (and batch compositions) agree on them.
    """
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(path)
    heads, kv_heads, inter = 4, 2, 2 * hidden_size
    head_dim = hidden_size // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": inter, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
        "bos_token_id": None, "eos_token_id": 0, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)

    def w(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab_size, hidden_size, std=1.0),
               "model.norm.weight": np.ones(hidden_size, np.float32)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden_size, std=0.1),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden_size, std=0.1),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden_size, std=0.1),
            p + "self_attn.o_proj.weight": w(hidden_size, heads * head_dim, std=0.1),
            p + "mlp.gate_proj.weight": w(inter, hidden_size, std=0.1),
            p + "mlp.up_proj.weight": w(inter, hidden_size, std=0.1),
            p + "mlp.down_proj.weight": w(hidden_size, inter, std=0.1),
        }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _write_tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # Specials come first in the id space so that id 0 is the EOS token.
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [(a, b) for a in _MERGE_CHARS for b in _MERGE_CHARS]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE,
        "add_bos_token": False, "model_max_length": 512,
    }, indent=2))
    return tokenizer.get_vocab_size()
