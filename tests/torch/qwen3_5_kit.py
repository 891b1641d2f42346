"""Tiny random Qwen3.5 checkpoints (dense, MoE, and the multimodal wrapper's layout) written with transformers'
own classes, for the fidelity tests of the hybrid models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.torch.torch_testkit import EOS, VOCAB

HIDDEN = 64


def hf_config(moe: bool, layers: int, layer_types: list[str] | None = None, hidden: int = HIDDEN,
              shared_expert_ff: int = 48) -> Any:
    transformers = __import__("transformers")
    # Only what the config class takes: the file save_pretrained writes is then exactly the class's (the MoE one
    # has no intermediate_size, as published Qwen3.5 MoE configs have none).
    common = dict(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
        layer_types=layer_types or ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        # Hv > Hk: each key head serves two value heads.
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=EOS, bos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )
    if moe:
        return transformers.Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=shared_expert_ff, **common)
    return transformers.Qwen3_5TextConfig(intermediate_size=128, **common)


def tiny_qwen3_5(path: Path, *, moe: bool = False, wrapped: bool = False, layers: int = 4,
                 layer_types: list[str] | None = None, seed: int = 0, hidden: int = HIDDEN,
                 std: float = 0.15, shared_expert_ff: int = 48) -> tuple[Any, Path]:
    """A random fp32 transformers model and its checkpoint directory (``layers`` of them, every 4th full attention,
    or one per entry of ``layer_types``).

    Weights are drawn larger than transformers' init (normal, ``std``) so that greedy decoding does not collapse into
    one token; zero-centred norms (weight w, applied as 1 + w) get small w. ``wrapped`` rewrites the checkpoint in the
    layout of the multimodal release (``qwen3_5``/``qwen3_5_moe`` with ``text_config``, text weights under
    ``model.language_model.``, a vision tower beside them). ``shared_expert_ff``: the MoE shared expert's size
    (the cpp backend's kernels take multiples of 32).
    """
    transformers = __import__("transformers")
    config = hf_config(moe, len(layer_types) if layer_types else layers, layer_types, hidden, shared_expert_ff)
    model_cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif "norm" in name:
                param.copy_(0.1 * torch.randn_like(param))
            elif not name.endswith(("A_log", "dt_bias")):
                param.normal_(0, std)
    model.save_pretrained(path)
    if wrapped:
        _wrap(path, moe)
    return model, path


def _wrap(path: Path, moe: bool) -> None:
    """The multimodal release's layout, its config.json written by the wrapper's own config class."""
    transformers = __import__("transformers")
    text = json.loads((path / "config.json").read_text())
    for model_level in ("architectures", "dtype", "transformers_version"):  # the wrapper's, not the text model's
        text.pop(model_level)
    wrapper = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=text, vision_config={"hidden_size": 8}, tie_word_embeddings=text["tie_word_embeddings"])
    wrapper.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    wrapper.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    renamed = {name if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1): w
               for name, w in weights.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    hidden = text["hidden_size"]
    renamed["mtp.fc.weight"] = torch.zeros(hidden, 2 * hidden)
    save_file(renamed, path / "model.safetensors")


def to_gguf(hf: Any, path: Path, *, matrices: str = "F32", mtp_layers: int = 0) -> Path:
    """The model as llama.cpp's converter (convert_hf_to_gguf.py: Qwen3_5TextModel, Qwen3_5MoeTextModel and the
    Qwen3Next and V-reorder bases they build on) writes it: ``qwen35``/``qwen35moe`` metadata; every RMSNorm
    weight but the gated one stored as 1 + w; ``ssm_a = -exp(A_log)``; the convolution squeezed to [C, K]; with
    Hv > Hk the value heads reordered from grouped (head k * r + j) to tiled (head j * Hk + k) in in_proj_qkv's
    v rows, in_proj_z, in_proj_b/a, A_log, dt_bias, the convolution's v channels and out_proj's columns; the
    fused experts split into stacked gate/up/down. ``matrices`` is the GGML type of the 2-D weights; with
    ``mtp_layers`` the file also counts (random) multi-token-prediction layers, as newer converters do.
    """
    import gguf
    import numpy as np

    c = hf.config
    moe = hasattr(c, "num_experts")
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    arch = "qwen35moe" if moe else "qwen35"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers + mtp_layers)
    if mtp_layers:
        writer.add_uint32(f"{arch}.nextn_predict_layers", mtp_layers)
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    if not moe:  # as the converter writes it: only where the config has an intermediate_size
        writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(c.head_dim * rope["partial_rotary_factor"]))
    writer.add_rope_dimension_sections([*rope["mrope_section"], 0])
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(hk)
    writer.add_ssm_time_step_rank(hv)
    writer.add_ssm_inner_size(dv * hv)
    # One flag per layer, True for linear attention (the MTP layers' False), beside the interval, which llama.cpp
    # reads only where the flags are missing.
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [kind == "linear_attention" for kind in c.layer_types] + [False] * mtp_layers)
    writer.add_full_attention_interval(4)
    if moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_eos_token_id(c.eos_token_id)
    # The kit's byte-level tokenizer, its vocabulary padded with unused control tokens to the model's.
    from pocketllm.testing import checkpoints

    vocab = list(checkpoints._vocab())
    tokens = vocab + [f"<|unused_{i}|>" for i in range(c.vocab_size - len(vocab))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in checkpoints.SPECIAL_TOKENS or t not in vocab
                            else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([f"{a} {b}" for a, b in checkpoints._merges()])

    def tiled(t: np.ndarray, head_dim: int, axis: int = 0) -> np.ndarray:
        if hk == hv:
            return t
        t = np.moveaxis(t, axis, 0)
        t = t.reshape(hk, hv // hk, head_dim, *t.shape[1:]).swapaxes(0, 1).reshape(t.shape)
        return np.ascontiguousarray(np.moveaxis(t, 0, axis))

    tensors: dict[str, np.ndarray] = {}
    state = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    qk = 2 * hk * dk
    for name, t in state.items():
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = t
        elif name == "lm_head.weight":
            tensors["output.weight"] = t
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = t + 1
        else:
            _, _, i, part = name.split(".", 3)
            blk = f"blk.{i}"
            plain = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                     "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                     "linear_attn.norm.weight": "ssm_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                     "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
                     "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
                     "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
                     "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
                     "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
                     "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}
            norms = {"input_layernorm.weight": "attn_norm.weight",
                     "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
            if part in plain:
                tensors[f"{blk}.{plain[part]}"] = t
            elif part in norms:
                tensors[f"{blk}.{norms[part]}"] = t + 1
            elif part == "linear_attn.in_proj_qkv.weight":
                tensors[f"{blk}.attn_qkv.weight"] = np.concatenate([t[:qk], tiled(t[qk:], dv)])
            elif part == "linear_attn.in_proj_z.weight":
                tensors[f"{blk}.attn_gate.weight"] = tiled(t, dv)
            elif part == "linear_attn.in_proj_b.weight":
                tensors[f"{blk}.ssm_beta.weight"] = tiled(t, 1)
            elif part == "linear_attn.in_proj_a.weight":
                tensors[f"{blk}.ssm_alpha.weight"] = tiled(t, 1)
            elif part == "linear_attn.conv1d.weight":
                t = t.squeeze(1)
                tensors[f"{blk}.ssm_conv1d.weight"] = np.concatenate([t[:qk], tiled(t[qk:], dv)])
            elif part == "linear_attn.A_log":
                tensors[f"{blk}.ssm_a"] = tiled(-np.exp(t), 1)
            elif part == "linear_attn.dt_bias":
                tensors[f"{blk}.ssm_dt.bias"] = tiled(t, 1)
            elif part == "linear_attn.out_proj.weight":
                tensors[f"{blk}.ssm_out.weight"] = tiled(t, dv, axis=1)
            elif part == "mlp.experts.gate_up_proj":
                ff = t.shape[1] // 2
                tensors[f"{blk}.ffn_gate_exps.weight"] = np.ascontiguousarray(t[:, :ff])
                tensors[f"{blk}.ffn_up_exps.weight"] = np.ascontiguousarray(t[:, ff:])
            else:
                raise AssertionError(f"the converter has no rule for {name}")
    rng = np.random.default_rng(0)
    for j in range(mtp_layers):  # what the newer converter appends: blk.<n>.nextn.* and the layer's own tensors
        blk = f"blk.{c.num_hidden_layers + j}"
        tensors[f"{blk}.nextn.eh_proj.weight"] = rng.standard_normal((c.hidden_size, 2 * c.hidden_size), np.float32)
        tensors[f"{blk}.attn_norm.weight"] = np.ones(c.hidden_size, np.float32)
    # As the converter forces: norms, the convolution and the routers stay float32.
    checkpoints.finish_gguf(writer, {
        name: (np.ascontiguousarray(t, dtype=np.float32),
               matrices if t.ndim >= 2 and not any(part in name for part in ("norm", "ssm_conv1d", "gate_inp"))
               else "F32")
        for name, t in tensors.items()})
    return path


# A hybrid layer mix that is not "every 4th layer full attention" (what full_attention_interval says).
IRREGULAR_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
LLAMA_CPP_SDIST = "POCKETLLM_LLAMA_CPP_SDIST"
# llama.cpp's convert_hf_to_gguf.py as it is, but for its tokenizer check: it refuses a pre-tokenizer whose hash it
# does not list, which a test tokenizer's is not; the file says qwen35, as Qwen3.5's own tokenizer's would.
_CONVERT = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
def no_sentencepiece(self):  # the kit's tokenizer is BPE: what a converter with sentencepiece installed finds
    raise FileNotFoundError("tokenizer.model")
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_converter(unpack_to: Path) -> Path | None:
    """The llama.cpp folder (vendor/llama.cpp) of the llama-cpp-python sdist that $POCKETLLM_LLAMA_CPP_SDIST names
    (the .tar.gz, unpacked under ``unpack_to``, or the folder it unpacks to); None when it names none."""
    import os
    import tarfile

    source = os.environ.get(LLAMA_CPP_SDIST)
    if not source:
        return None
    path = Path(source)
    if path.is_file():
        with tarfile.open(path) as tar:
            wanted = ("conversion/", "gguf-py/", "convert_hf_to_gguf.py")
            members = [m for m in tar.getmembers()
                       if any(f"/vendor/llama.cpp/{part}" in m.name for part in wanted)]
            tar.extractall(unpack_to, members=members, filter="data")
        path = unpack_to
    found = sorted(path.glob("**/vendor/llama.cpp/conversion")) or sorted(path.glob("conversion"))
    if not found:
        raise AssertionError(f"${LLAMA_CPP_SDIST}={source} holds no llama.cpp converter (vendor/llama.cpp/conversion)")
    return found[0].parent


def convert_with_llama_cpp(llama_cpp: Path, model: Path, out: Path, *, add_mtp: bool = True) -> Path:
    """``model`` (a tiny_qwen3_5 directory, or another transformers checkpoint) converted to an F32 GGUF by llama.cpp's
    own convert_hf_to_gguf.py, with
    the kit's tokenizer and (``add_mtp``) a multi-token-prediction layer added first, as the published
    checkpoints have."""
    import subprocess
    import sys

    from pocketllm.testing.checkpoints import _write_tokenizer

    _write_tokenizer(model)
    if add_mtp:
        _add_mtp_layer(model)
    subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp), str(model), "--outfile", str(out), "--outtype",
                    "f32"], check=True, capture_output=True, timeout=300)
    return out


def _add_mtp_layer(path: Path) -> None:
    """mtp.* tensors as a Qwen3.5 release ships them: one full-attention layer (a copy of the model's first) and the
    head's projection and norms."""
    weights = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    types, hidden = config["layer_types"], config["hidden_size"]
    full = f"model.layers.{types.index('full_attention')}."
    for name, t in list(weights.items()):
        if name.startswith(full):
            weights["mtp.layers.0." + name.removeprefix(full)] = t.clone()
    weights["mtp.fc.weight"] = torch.zeros(hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.zeros(hidden)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def fit_mtp_head(hf: Any, path: Path, prompts: list[list[int]], *, new_tokens: int = 48, steps: int = 300,
                 seed: int = 0) -> None:
    """Train a multi-token-prediction head for the transformers model ``hf`` (saved at ``path``) and add it to the
    checkpoint as Qwen3.5 releases ship one (``mtp.*``): a full-attention decoder layer (transformers' own class)
    after a projection of the normed embedding of token i + 1 and the model's final hidden state at i, a norm,
    and the model's lm_head, fitted for ``steps`` Adam steps to the model's own greedy continuations of
    ``prompts``: token i + 2 from the model's state, and token i + 3 from the head's own output at i + 1, as
    drafting runs it."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    config = hf.config
    with torch.no_grad():
        ids = torch.stack([hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                       do_sample=False)[0] for p in prompts])
        hidden = hf.model(ids).last_hidden_state  # after the final norm
    torch.manual_seed(seed)
    head = torch.nn.ModuleDict({
        "fc": torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
        "pre_fc_norm_embedding": modeling.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
        "pre_fc_norm_hidden": modeling.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
        "layer": modeling.Qwen3_5DecoderLayer(config, layer_idx=config.layer_types.index("full_attention")),
        "norm": modeling.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
    })
    embed, lm_head, rotary = hf.model.embed_tokens, hf.lm_head, hf.model.rotary_emb

    def run(tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        positions = torch.arange(n)[None].expand(len(tokens), n)
        x = head["fc"](torch.cat([head["pre_fc_norm_embedding"](embed(tokens)), head["pre_fc_norm_hidden"](states)],
                                 dim=-1))
        x = head["layer"](x, position_embeddings=rotary(x, positions), position_ids=positions,
                          attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None])
        return head["norm"](x)

    def loss_of(states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(lm_head(states).flatten(0, 1), targets.flatten())

    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    n = ids.shape[1] - 3
    for _ in range(steps):
        # Token i + 2 from the model's state at i, and (as drafting runs on) token i + 3 from the head's own.
        first = run(ids[:, 1:n + 2], hidden[:, :n + 1])
        second = run(ids[:, 2:n + 2], first[:, :n])
        loss = loss_of(first, ids[:, 2:n + 3]) + loss_of(second, ids[:, 3:n + 3])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weights = load_file(path / "model.safetensors")
    for name, t in head.state_dict().items():
        weights["mtp." + name.replace("layer.", "layers.0.", 1)] = t.detach().clone().contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
