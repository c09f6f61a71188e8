"""The JSON files of a checkpoint directory, read with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, *, missing_ok: bool = False) -> dict:
    """The JSON object in `path` ({} for a missing file when `missing_ok`).

    Raises:
      ValueError: naming the file, when it is not JSON (or not UTF-8) or holds another
        JSON value than an object.
      FileNotFoundError: it is missing and not `missing_ok`.
    """
    if missing_ok and not path.is_file():
        return {}
    try:
        data = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(data).__name__}")
    return data
