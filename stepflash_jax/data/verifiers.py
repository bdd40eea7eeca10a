"""Answer verifiers for user prompt data (data/jsonl.py): `fn(completion: str, reference: str) -> bool`.

Built-ins, all graded on `final_answer(completion)` (a cut-off reasoning, i.e. an unclosed <think>, is always wrong):

    exact     the final answer == reference.strip()
    numeric   the last number of the final answer (signs, decimals, 1,234-style thousands, 1e-3) equals the
              reference as a float within rel 1e-6 / abs 1e-9
    contains  reference.strip() is a substring of the final answer
    boxed     the content of the last \\boxed{...} of the completion (balanced braces) == reference.strip()

get_verifier(spec) resolves a registered name or a Python entry point "package.module:function" (cached).
verify(spec, completion, reference) never raises on model output: a verifier that raises counts as wrong.
"""

from __future__ import annotations

import importlib
import math
import re
import warnings
from typing import Callable

from stepflash_jax.data.tasks.base import THINK_CLOSE, THINK_OPEN

Verifier = Callable[[str, str], bool]

_VERIFIERS: dict[str, Verifier] = {}
_ENTRY_POINTS: dict[str, Verifier] = {}
_WARNED: set[str] = set()
# a sign only where it cannot be a binary operator ("3-5" holds 3 and 5); thousands groups of exactly 3 digits
_NUMBER_RE = re.compile(
  r"(?:(?<![\w)])[-+])?(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d*)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
REL_TOL, ABS_TOL = 1e-6, 1e-9


def final_answer(completion: str) -> str | None:
  """The text after the last '</think>', stripped (multi-line kept); the whole text without a think span.

  None when the last '<think>' is never closed (the reasoning was cut off) or the answer is empty.
  """
  if not isinstance(completion, str):
    raise ValueError(f"completion must be a str, got {type(completion).__name__}")
  if completion.rfind(THINK_OPEN) > completion.rfind(THINK_CLOSE):
    return None
  text = completion.rsplit(THINK_CLOSE, 1)[-1].strip()
  return text or None


def parse_number(text: str) -> float | None:
  """`text` (stripped) as a float if it is exactly one number in the `numeric` syntax, else None."""
  text = text.strip()
  return float(text.replace(",", "")) if _NUMBER_RE.fullmatch(text) else None


def last_number(text: str) -> float | None:
  """The last number in `text` (the `numeric` syntax), or None."""
  matches = list(_NUMBER_RE.finditer(text))
  return float(matches[-1].group(0).replace(",", "")) if matches else None


def reference_number(reference: str) -> float:
  """The reference of a `numeric` record as a float; ValueError when it is not a number."""
  value = parse_number(reference)
  if value is None:
    value = float(reference)  # also "inf", "1_000"; raises ValueError on anything else
  return value


def boxed_content(text: str) -> str | None:
  """The stripped content of the last '\\boxed{...}' of `text` (nested braces balanced), or None when there is
  none or it is never closed."""
  starts = [m.end() for m in _BOXED_RE.finditer(text)]
  if not starts:
    return None
  depth = 1
  for i in range(starts[-1], len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[starts[-1] : i].strip()
  return None


def exact(completion: str, reference: str) -> bool:
  return final_answer(completion) == reference.strip()


def numeric(completion: str, reference: str) -> bool:
  answer = final_answer(completion)
  value = None if answer is None else last_number(answer)
  return value is not None and math.isclose(value, reference_number(reference), rel_tol=REL_TOL, abs_tol=ABS_TOL)


def contains(completion: str, reference: str) -> bool:
  answer = final_answer(completion)
  return answer is not None and bool(reference.strip()) and reference.strip() in answer


def boxed(completion: str, reference: str) -> bool:
  if final_answer(completion) is None:
    return False
  content = boxed_content(completion)
  return content is not None and content == reference.strip()


def register_verifier(name: str, fn: Verifier, overwrite: bool = False) -> Verifier:
  """Registers `fn(completion, reference) -> bool` under `name` (no ':'; that marks entry points)."""
  if not isinstance(name, str) or not name or ":" in name:
    raise ValueError(f"verifier name must be a non-empty str without ':', got {name!r}")
  if not callable(fn):
    raise ValueError(f"verifier {name!r} must be callable, got {type(fn).__name__}")
  if name in _VERIFIERS and not overwrite:
    raise ValueError(f"verifier {name!r} already registered (pass overwrite=True to replace it)")
  _VERIFIERS[name] = fn
  return fn


def available_verifiers() -> list[str]:
  return sorted(_VERIFIERS)


def _resolve_entry_point(spec: str) -> Verifier:
  module_name, _, attr = spec.partition(":")
  if not module_name or not attr:
    raise ValueError(f"verifier entry point {spec!r} must be 'package.module:function'")
  try:
    obj = importlib.import_module(module_name)
  except Exception as e:  # ImportError, or anything the module raises while it is imported
    raise ValueError(f"verifier entry point {spec!r}: cannot import module {module_name!r} ({e!r})") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"verifier entry point {spec!r}: {module_name!r} has no attribute {attr!r}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ValueError(f"verifier entry point {spec!r} is not callable ({type(obj).__name__})")
  return obj


def get_verifier(spec: str) -> Verifier:
  """The verifier named `spec`, or the function of the entry point "package.module:function" (cached)."""
  if not isinstance(spec, str) or not spec:
    raise ValueError(f"verifier must be a non-empty str, got {spec!r}")
  if spec in _VERIFIERS:
    return _VERIFIERS[spec]
  if ":" not in spec:
    raise ValueError(
      f"unknown verifier {spec!r} (registered: {', '.join(available_verifiers())}; or 'module:function')"
    )
  if spec not in _ENTRY_POINTS:
    _ENTRY_POINTS[spec] = _resolve_entry_point(spec)
  return _ENTRY_POINTS[spec]


def verify(spec: str, completion: str, reference: str) -> bool:
  """bool(verifier(completion, reference)); a verifier that raises counts as False (warned once per spec)."""
  fn = get_verifier(spec)
  try:
    return bool(fn(completion, reference))
  except Exception as e:  # model output is hostile input: a crashing verifier grades it wrong, not the run
    if spec not in _WARNED:
      _WARNED.add(spec)
      warnings.warn(f"verifier {spec!r} raised {e!r}; counted as a wrong answer (warned once)", stacklevel=2)
    return False


for _name, _fn in (("exact", exact), ("numeric", numeric), ("contains", contains), ("boxed", boxed)):
  register_verifier(_name, _fn)

__all__ = [
  "available_verifiers",
  "boxed_content",
  "final_answer",
  "get_verifier",
  "last_number",
  "parse_number",
  "reference_number",
  "register_verifier",
  "verify",
]
