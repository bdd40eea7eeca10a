"""Multi-digit arithmetic with a column-wise reasoning trace (incl. the report's synthetic large-number arithmetic).

difficulty d = number of digits of the operands (1..12):
  '+'  two d-digit numbers                         e.g. d=3: "Compute 347+285"
  '-'  two d-digit numbers, a >= b (result >= 0)   e.g. "Compute 512-298"
  '*'  a d-digit number times a one-digit number 2..9   e.g. "Compute 347*6"
variant = the operator; variant None draws '+', '-' or '*' uniformly for d <= 5 and '+' for d >= 6
(the "synthetic large-number arithmetic" of the SFT stage 2: 6-12 digit additions).

Reference answer: one column per digit of `a`, least significant first, every column written the same way
"x OP y OP c=kd" where c is the carry (borrow) coming in and "kd" two digits: k the carry (borrow) going out and
d the result digit. Then the final number:
  347+285 -> "<think>7+5+0=12,4+8+1=13,3+2+1=06</think>632"
  512-298 -> "<think>2-8-0=14,1-9-1=11,5-2-1=02</think>214"
  347*6   -> "<think>7*6+0=42,4*6+4=28,3*6+2=20</think>2082"
Checker: the text after '</think>' must be an integer (optional '-') equal to the true result.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from stepflash_jax.data.tasks import base

FAMILY = "arithmetic"
DIFFICULTIES = tuple(range(1, 13))
VARIANTS = (None, "+", "-", "*")
LARGE_NUMBER_MIN_DIGITS = 6
_INT_RE = re.compile(r"^-?\d{1,64}$")


def operand(rng, digits: int) -> int:
  lo = 0 if digits == 1 else 10 ** (digits - 1)
  return rng.randint(lo, 10**digits - 1)


def columns(a: int, b: int, op: str) -> list[str]:
  """The column trace of a OP b (a has the most digits), least significant column first."""
  cols, carry = [], 0
  for i, xc in enumerate(reversed(str(a))):
    x = int(xc)
    if op == "+":
      y = (b // 10**i) % 10
      s = x + y + carry
      out, digit = divmod(s, 10)
      cols.append(f"{x}+{y}+{carry}={out}{digit}")
    elif op == "-":
      y = (b // 10**i) % 10
      t = x - y - carry
      out = 1 if t < 0 else 0
      digit = t + 10 * out
      cols.append(f"{x}-{y}-{carry}={out}{digit}")
    else:  # "*", b is one digit
      p = x * b + carry
      out, digit = divmod(p, 10)
      cols.append(f"{x}*{b}+{carry}={out}{digit}")
    carry = out
  return cols


def _result(a: int, b: int, op: str) -> int:
  return a + b if op == "+" else a - b if op == "-" else a * b


def canonical(metadata: Mapping[str, Any]) -> str:
  return f"{FAMILY}:{int(metadata['a'])}{metadata['op']}{int(metadata['b'])}"


def make_example(a: int, b: int, op: str, difficulty: int) -> dict:
  """The example dict of a fixed problem (no split check; `generate` draws problems)."""
  if op not in ("+", "-", "*"):
    raise ValueError(f"op must be '+', '-' or '*', got {op!r}")
  result = _result(a, b, op)
  metadata = dict(op=op, a=a, b=b)
  return dict(
    prompt=f"Compute {a}{op}{b}",
    answer=base.think(",".join(columns(a, b, op)), str(result)),
    family=FAMILY,
    difficulty=difficulty,
    metadata=metadata,
  )


def generate(seed: int, difficulty: int, split: str = "train", variant: str | None = None) -> dict:
  """A deterministic problem of `split` from `seed`; see the module docstring for the format."""
  d, rng = base.generator_rng(FAMILY, DIFFICULTIES, VARIANTS, seed, difficulty, split, variant)
  for _ in range(base.MAX_REJECTION_TRIES):
    op = variant
    if op is None:
      op = "+" if d >= LARGE_NUMBER_MIN_DIGITS else rng.choice(("+", "-", "*"))
    a = operand(rng, d)
    b = rng.randint(2, 9) if op == "*" else operand(rng, d)
    if op == "-" and b > a:
      a, b = b, a
    if base.split_of(canonical(dict(op=op, a=a, b=b))) == split:
      return make_example(a, b, op, d)
  raise ValueError(f"no {split!r} problem found for difficulty={d}, variant={variant!r}")


def check(example_or_metadata: Mapping[str, Any], completion: str) -> bool:
  """Exact correctness of the final answer (the integer after '</think>')."""
  meta = base.metadata_of(example_or_metadata)
  try:
    a, b, op = int(meta["a"]), int(meta["b"]), meta["op"]
  except (KeyError, TypeError) as e:
    raise ValueError(f"arithmetic metadata needs int fields 'a', 'b' and 'op', got {dict(meta)!r}") from e
  if op not in ("+", "-", "*"):
    raise ValueError(f"metadata['op'] must be '+', '-' or '*', got {op!r}")
  answer = base.extract_answer(completion)
  if answer is None or not _INT_RE.match(answer):
    return False
  return int(answer) == _result(a, b, op)
