"""User prompt data: a JSONL file of prompts graded by named verifiers (data/verifiers.py); task family "jsonl".

One JSON object per line (blank lines are skipped; unknown extra keys are allowed and ignored):

    prompt     str, required, non-empty
    reference  str or number, required (a number becomes str(number)); what the verifier compares against
    verifier   str, optional, default "exact": a registered verifier (exact, numeric, contains, boxed, ...) or a
               Python entry point "package.module:function" taking (completion, reference) -> bool
    response   str, optional: the SFT target, "<think>reasoning</think>answer" or a plain answer; required for SFT
    split      "train" | "test", optional; default by hash of the prompt (tasks.base.split_of: ~10% test, the
               same rule as the built-in task families)

e.g.  {"prompt": "What is 6*7?", "reference": 42, "verifier": "numeric", "response": "<think>6*7=42</think>42"}

read_jsonl reports each bad record as "PATH:LINE: message" and keeps the good ones; load_examples caches a file's
parse and returns one split. Examples have the project's format: dict(prompt, answer (the response, else the
reference), family="jsonl", difficulty=0, metadata=dict(problem (the prompt), reference, verifier, split, line, path)).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Mapping

from stepflash_jax.checks import is_number
from stepflash_jax.data import tasks, verifiers
from stepflash_jax.data.tasks import base

FAMILY = "jsonl"
DIFFICULTIES = (0,)
VARIANTS = (None,)
DEFAULT_VERIFIER = "exact"
MAX_LOGGED_ERRORS = 20
MAX_RAISED_ERRORS = 5
_CACHE: dict[tuple, tuple[list[dict], list[str], Any]] = {}  # + the tokenizer: keeps its id() from being reused


def generate(seed: int, difficulty: int, split: str = "train", variant: Any = None) -> dict:
  raise ValueError("jsonl examples come from a file (config field data.jsonl), not a generator")


def check(example_or_metadata: Mapping[str, Any], completion: str) -> bool:
  m = base.metadata_of(example_or_metadata)
  return verifiers.verify(m["verifier"], completion, m["reference"])


def canonical(metadata: Mapping[str, Any]) -> str:
  return metadata["problem"]


class RecordError(ValueError):
  """One bad record; its message becomes 'PATH:LINE: message'."""


def _nonempty_str(record: Mapping[str, Any], key: str, what: str = "a non-empty string") -> str:
  if key not in record:
    raise RecordError(f"field {key!r} is required" + (" for SFT" if key == "response" else f" ({what})"))
  value = record[key]
  if not isinstance(value, str) or not value.strip():
    raise RecordError(f"field {key!r} must be {what}, got {json.dumps(value)[:40]}")
  return value


def _fields(record: Any, require_response: bool) -> dict[str, Any]:
  """The checked fields of one decoded record (RecordError naming the field otherwise)."""
  if not isinstance(record, dict):
    raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
  prompt = _nonempty_str(record, "prompt")
  reference = record.get("reference")
  if is_number(reference):
    record = {**record, "reference": str(reference)}  # numbers become str
  reference = _nonempty_str(record, "reference", "a non-empty string or a number")
  verifier = _nonempty_str(record, "verifier") if "verifier" in record else DEFAULT_VERIFIER
  try:
    verifiers.get_verifier(verifier)
  except ValueError as e:
    raise RecordError(f"field 'verifier': {e}") from e
  if verifier == "numeric":
    try:
      verifiers.reference_number(reference)
    except ValueError as e:
      raise RecordError(f"field 'reference': {reference!r} is not a number (verifier 'numeric')") from e
  response = _nonempty_str(record, "response") if record.get("response") is not None or require_response else None
  split = record.get("split", base.split_of(prompt))
  if split not in base.SPLITS:
    raise RecordError(f"field 'split' must be one of {base.SPLITS}, got {json.dumps(split)[:40]}")
  return dict(prompt=prompt, reference=reference, verifier=verifier, response=response, split=split)


def _check_lengths(f: dict[str, Any], tokenizer, max_prompt_len: int | None, seq_len: int | None, sft: bool):
  if max_prompt_len is not None:
    n = len(tokenizer.format_prompt(f["prompt"]))
    if n > max_prompt_len:
      raise RecordError(f"prompt has {n} tokens > data.max_prompt_len={max_prompt_len}")
  if seq_len is not None and sft:
    ids, _ = tokenizer.format_example(f["prompt"], f["response"])
    if len(ids) - 1 > seq_len:
      raise RecordError(f"prompt + response has {len(ids) - 1} tokens (after the shift) > data.seq_len={seq_len}")


def _record(raw: bytes, tokenizer, max_prompt_len, seq_len, require_response: bool) -> dict[str, Any] | None:
  """The checked fields of one line (None for a blank line); RecordError for a bad one."""
  try:
    text = raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise RecordError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from e
  if not text.strip():
    return None
  try:
    record = json.loads(text.rstrip("\r\n"))
  except json.JSONDecodeError as e:
    raise RecordError(f"not valid JSON ({e.msg} at column {e.colno})") from e
  f = _fields(record, require_response)
  if tokenizer is not None:
    _check_lengths(f, tokenizer, max_prompt_len, seq_len, require_response)
  return f


def _example(f: dict[str, Any], line: int, path: str) -> dict:
  meta = dict(problem=f["prompt"], reference=f["reference"], verifier=f["verifier"], split=f["split"])
  meta.update(line=line, path=path)
  answer = f["reference"] if f["response"] is None else f["response"]
  return dict(prompt=f["prompt"], answer=answer, family=FAMILY, difficulty=0, metadata=meta)


def read_jsonl(
  path: str,
  tokenizer=None,
  *,
  max_prompt_len: int | None = None,
  seq_len: int | None = None,
  require_response: bool = False,
) -> tuple[list[dict], list[str]]:
  """(valid examples in file order, one 'PATH:LINE: message' per bad record). Bad records never raise; a missing
  file or one without any valid record raises ValueError naming the path. Length limits apply with a tokenizer
  (format_prompt / format_example): prompts up to max_prompt_len tokens, SFT examples up to seq_len + 1."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file (data.jsonl)")
  examples, errors = [], []
  with open(path, "rb") as fh:
    for line, raw in enumerate(fh, start=1):
      try:
        f = _record(raw, tokenizer, max_prompt_len, seq_len, require_response)
      except RecordError as e:
        errors.append(f"{path}:{line}: {e}")
        continue
      if f is not None:
        examples.append(_example(f, line, path))
  if not examples:
    shown = "".join(f"\n  {e}" for e in errors[:MAX_RAISED_ERRORS])
    more = f"\n  ... and {len(errors) - MAX_RAISED_ERRORS} more" if len(errors) > MAX_RAISED_ERRORS else ""
    raise ValueError(f"{path}: no valid record ({len(errors)} skipped){shown}{more}")
  return examples, errors


def _summary(path: str, examples: list[dict], errors: list[str]) -> list[str]:
  n_test = sum(ex["metadata"]["split"] == "test" for ex in examples)
  lines = [
    f"{path}: {len(examples)} valid records (train {len(examples) - n_test}, test {n_test}), {len(errors)} skipped"
  ]
  lines += errors[:MAX_LOGGED_ERRORS]
  if len(errors) > MAX_LOGGED_ERRORS:
    lines.append(f"... and {len(errors) - MAX_LOGGED_ERRORS} more")
  return lines


def load_examples(
  path: str,
  tokenizer,
  split: str,
  *,
  max_prompt_len: int | None,
  seq_len: int | None = None,
  require_response: bool = False,
  log: Callable[[str], Any] = print,
) -> list[dict]:
  """The examples of `split` in file order. The file is read once per (path, mtime, size, tokenizer, limits,
  require_response); the first read logs a summary and up to MAX_LOGGED_ERRORS bad records."""
  base.check_split(split)
  path = os.fspath(path)
  try:
    st = os.stat(path)
  except OSError as e:
    raise ValueError(f"{path}: no such file (data.jsonl)") from e
  key = (os.path.abspath(path), st.st_mtime_ns, st.st_size, id(tokenizer), max_prompt_len, seq_len, require_response)
  if key not in _CACHE:
    examples, errors = read_jsonl(
      path, tokenizer, max_prompt_len=max_prompt_len, seq_len=seq_len, require_response=require_response
    )
    _CACHE[key] = (examples, errors, tokenizer)
    for line in _summary(path, examples, errors):
      log(line)
  out = [ex for ex in _CACHE[key][0] if ex["metadata"]["split"] == split]
  if not out:
    raise ValueError(f'{path}: no {split!r} records: add records with "split": "{split}" or more data')
  return out


def config_examples(config, tokenizer, split: str, log=print, require_response: bool = False) -> list[dict] | None:
  """The `split` examples of the file in config field data.jsonl, checked against data.max_prompt_len (and, for SFT
  with require_response, data.seq_len); None when the field is empty (the task mixture is used)."""
  path = config.data.get("jsonl", "")
  if not path:
    return None
  seq_len = config.data.seq_len if require_response else None
  return load_examples(
    path,
    tokenizer,
    split,
    max_prompt_len=config.data.max_prompt_len,
    seq_len=seq_len,
    require_response=require_response,
    log=log,
  )


if FAMILY not in tasks.families():
  tasks.register_task(sys.modules[__name__])

__all__ = ["FAMILY", "canonical", "check", "config_examples", "generate", "load_examples", "read_jsonl"]
