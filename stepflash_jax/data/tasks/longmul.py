"""Long multiplication with partial products: the long-reasoning family (correct responses of 150+ tokens).

difficulty d = digits of both operands (2..5): "Compute 347*286". The reference answer multiplies `a` by each digit
of `b` (least significant first) with the column trace of `arithmetic` ("x*y+c=kd"), closing each partial product
with ",=P"; then it adds the partial products one by one, each shifted by its place, again column by column
("x+y+c=kd", the larger number's digits first), closing each running sum with ",=S":

  12*34 -> "<think>2*4+0=08,1*4+0=04,=48,2*3+0=06,1*3+0=03,=36,0+8+0=08,6+4+0=10,3+0+1=04,=408</think>408"

Lengths with the tiny model's tokenizer (trained on arithmetic + countdown; the same characters): d=2 80-95
tokens, d=3 ~200-220, d=4 ~340-400, d=5 ~540-620. The checker reads only the final integer, so a wrong trace with the
right number counts as correct, as in every family here.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from stepflash_jax.data.tasks import base
from stepflash_jax.data.tasks.arithmetic import columns, operand

FAMILY = "longmul"
DIFFICULTIES = (2, 3, 4, 5)
VARIANTS = (None,)
_INT_RE = re.compile(r"^\d{1,64}$")


def canonical(metadata: Mapping[str, Any]) -> str:
  return f"{FAMILY}:{int(metadata['a'])}*{int(metadata['b'])}"


def trace(a: int, b: int) -> str:
  """The reasoning of a*b (module docstring): partial products, then their running sum."""
  parts, partials = [], []
  for j, digit in enumerate(reversed(str(b))):
    p = a * int(digit)
    parts += columns(a, int(digit), "*") + [f"={p}"]
    partials.append(p * 10**j)
  total = partials[0]
  for p in partials[1:]:
    hi, lo = max(total, p), min(total, p)
    total += p
    parts += columns(hi, lo, "+") + [f"={total}"]
  return ",".join(parts)


def make_example(a: int, b: int, difficulty: int) -> dict:
  return dict(
    prompt=f"Compute {a}*{b}",
    answer=base.think(trace(a, b), str(a * b)),
    family=FAMILY,
    difficulty=difficulty,
    metadata=dict(a=a, b=b),
  )


def generate(seed: int, difficulty: int, split: str = "train", variant: str | None = None) -> dict:
  """A deterministic d-digit x d-digit problem of `split` from `seed`."""
  d, rng = base.generator_rng(FAMILY, DIFFICULTIES, VARIANTS, seed, difficulty, split, variant)
  for _ in range(base.MAX_REJECTION_TRIES):
    a, b = operand(rng, d), operand(rng, d)
    if base.split_of(canonical(dict(a=a, b=b))) == split:
      return make_example(a, b, d)
  raise ValueError(f"no {split!r} problem found for difficulty={d}")


def check(example_or_metadata: Mapping[str, Any], completion: str) -> bool:
  """Exact correctness of the final answer (the integer after '</think>')."""
  meta = base.metadata_of(example_or_metadata)
  try:
    a, b = int(meta["a"]), int(meta["b"])
  except (KeyError, TypeError) as e:
    raise ValueError(f"longmul metadata needs int fields 'a' and 'b', got {dict(meta)!r}") from e
  answer = base.extract_answer(completion)
  return answer is not None and bool(_INT_RE.match(answer)) and int(answer) == a * b
