"""Files written whole or not at all (a temporary file in the same directory, renamed into place), and JSON read
with the file's path in its error."""

from __future__ import annotations

import json
import os
import tempfile


def atomic_write(path: str, data: str | bytes) -> str:
  """Write `data` (text or bytes) to `path` atomically (a crash leaves the old file or none), mode 0644."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
  try:
    with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
      f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return path


def read_json(path: str):
  """json.load with the file's path in the error (a truncated / malformed file): ValueError."""
  try:
    with open(path) as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: malformed JSON ({e})") from e
