"""Reading the small JSON files that travel with a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pocketllm.errors import CheckpointError


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse ``path`` as a JSON object, raising CheckpointError that names the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value
