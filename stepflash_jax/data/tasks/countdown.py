"""Countdown: reach a target from given numbers with +, -, * (each given number used at most once).

difficulty n = how many numbers are given (2..5); numbers are drawn from 1..10 for n <= 3 and from 1..20 for
n >= 4 (small numbers keep the inline arithmetic learnable for a toy model). The target is built by a random
left-deep expression over all n numbers (random order and operators) whose intermediate values stay in 1..1000,
so a solution using every number exists; any solution using a sub-multiset of the numbers is accepted.

  prompt:  "Make 26 from 3 7 5"
  answer:  "<think>7*3=21,21+5=26</think>(7*3)+5"    (steps in the think span, then the expression)
Checker: the text after '</think>' is tokenised and parsed by a small recursive-descent parser (no eval):
  expr := term (('+' | '-') term)* ; term := factor ('*' factor)* ; factor := NUMBER | '(' expr ')'
Numbers must be written canonically (no sign, no leading zeros) and form a sub-multiset of the given numbers;
the value must equal the target. Anything else (division, unary minus, '=', text) is wrong.
"""

from __future__ import annotations

import collections
import re
from typing import Any, Mapping

from stepflash_jax.data.tasks import base

FAMILY = "countdown"
DIFFICULTIES = (2, 3, 4, 5)
VARIANTS = (None,)


def max_number(n: int) -> int:
  return 10 if n <= 3 else 20


MAX_VALUE = 1000
MAX_EXPR_TOKENS = 64
_TOKEN_RE = re.compile(r"\s*(?:(\d+)|(.))")


def canonical(metadata: Mapping[str, Any]) -> str:
  nums = ",".join(str(int(n)) for n in sorted(metadata["numbers"]))
  return f"{FAMILY}:{nums}:{int(metadata['target'])}"


def _apply(x: int, op: str, y: int) -> int:
  return x + y if op == "+" else x - y if op == "-" else x * y


def random_chain(rng, numbers: list[int]) -> tuple[int, list[str], str] | None:
  """A left-deep chain over all `numbers` in a random order with random operators: (value, its steps "a op b = c",
  its expression), or None when an intermediate value leaves 1..MAX_VALUE."""
  n = len(numbers)
  order = rng.sample(range(n), n)
  value, expr, steps = numbers[order[0]], str(numbers[order[0]]), []
  for k, i in enumerate(order[1:]):
    op = rng.choice("+-*")
    new = _apply(value, op, numbers[i])
    if not 1 <= new <= MAX_VALUE:
      return None
    steps.append(f"{value}{op}{numbers[i]}={new}")
    expr = f"({expr}){op}{numbers[i]}" if k > 0 else f"{expr}{op}{numbers[i]}"
    value = new
  return value, steps, expr


def generate(seed: int, difficulty: int, split: str = "train", variant: str | None = None) -> dict:
  """A deterministic problem of `split` from `seed`; see the module docstring for the format."""
  n, rng = base.generator_rng(FAMILY, DIFFICULTIES, VARIANTS, seed, difficulty, split, variant)
  for _ in range(base.MAX_REJECTION_TRIES):
    numbers = [rng.randint(1, max_number(n)) for _ in range(n)]
    chain = random_chain(rng, numbers)
    if chain is None:
      continue
    value, steps, expr = chain
    metadata = dict(numbers=numbers, target=value)
    if base.split_of(canonical(metadata)) != split:
      continue
    return dict(
      prompt=f"Make {value} from {' '.join(map(str, numbers))}",
      answer=base.think(",".join(steps), expr),
      family=FAMILY,
      difficulty=n,
      metadata=metadata,
    )
  raise ValueError(f"no {split!r} countdown problem found for difficulty={n}")


class _Parser:
  """Recursive-descent parser of +, -, * expressions over non-negative integers; records the numbers used."""

  def __init__(self, text: str):
    self.toks: list[str] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
      m = _TOKEN_RE.match(text, pos)
      num, sym = m.group(1), m.group(2)
      if sym is not None and sym not in "+-*()":
        raise SyntaxError(f"bad character {sym!r}")
      if num is not None and (len(num) > 6 or (len(num) > 1 and num[0] == "0")):
        raise SyntaxError(f"bad number {num!r}")
      self.toks.append(num if num is not None else sym)
      pos = m.end()
    if not self.toks or len(self.toks) > MAX_EXPR_TOKENS:
      raise SyntaxError("empty or too long expression")
    self.i = 0
    self.used: list[int] = []

  def _peek(self) -> str | None:
    return self.toks[self.i] if self.i < len(self.toks) else None

  def _take(self) -> str:
    tok = self._peek()
    if tok is None:
      raise SyntaxError("unexpected end")
    self.i += 1
    return tok

  def parse(self) -> int:
    value = self._expr()
    if self._peek() is not None:
      raise SyntaxError(f"trailing token {self._peek()!r}")
    return value

  def _expr(self) -> int:
    value = self._term()
    while self._peek() in ("+", "-"):
      op = self._take()
      value = _apply(value, op, self._term())
    return value

  def _term(self) -> int:
    value = self._factor()
    while self._peek() == "*":
      self._take()
      value = value * self._factor()
    return value

  def _factor(self) -> int:
    tok = self._take()
    if tok == "(":
      value = self._expr()
      if self._take() != ")":
        raise SyntaxError("expected ')'")
      return value
    if not tok.isdigit():
      raise SyntaxError(f"unexpected token {tok!r}")
    self.used.append(int(tok))
    return int(tok)


def evaluate(expression: str) -> tuple[int, list[int]]:
  """(value, numbers used) of an expression; raises SyntaxError if it is not a valid +,-,* expression."""
  parser = _Parser(expression)
  return parser.parse(), parser.used


def check(example_or_metadata: Mapping[str, Any], completion: str) -> bool:
  """True iff the final answer is an expression over a sub-multiset of the numbers that equals the target."""
  meta = base.metadata_of(example_or_metadata)
  try:
    numbers, target = [int(n) for n in meta["numbers"]], int(meta["target"])
  except (KeyError, TypeError) as e:
    raise ValueError(f"countdown metadata needs 'numbers' (list of int) and 'target', got {dict(meta)!r}") from e
  answer = base.extract_answer(completion)
  if answer is None:
    return False
  try:
    value, used = evaluate(answer)
  except SyntaxError:
    return False
  available = collections.Counter(numbers)
  if any(c > available[n] for n, c in collections.Counter(used).items()):
    return False
  return value == target
