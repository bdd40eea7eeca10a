"""The preference task: answers of graded quality with a hidden gold score (docs/rewards.md §1; issue "reward system").

difficulty d = number of one-digit addends (3..6): "Add 7 5 9". A correct answer can be written in three styles
the gold scorer ranks:

  short   "21"                                          no reasoning: a tiny model gets it wrong more often
  steps   "<think>7+5=12,12+9=21</think>21"              the running sums: the best answer
  padded  "<think>7+5=12,12+9=21,recheck 12+9=21</think>21"   the same, plus 1-3 redundant re-checks

gold(completion) = 0 if the final answer is wrong or missing, else
                   1 + 0.5 * [the think span starts with the exact chain of running sums] - 0.15 * (items after it)
floored at 0.5 (a right answer always beats a wrong one): short 1.0, steps 1.5, padded 1.35 / 1.2 / 1.05. The gold
score is what the policy should maximise and is never its reward: the RL job learns a reward model from noisy
preferences between SFT samples (train/reward_model.py) and logs the gold score beside it, so reward
over-optimisation - the proxy rising while gold falls - shows.

rubric(completion) is a rule-based rubric judge's ternary verdict for rewards.rubric_reward: "satisfied" (right, the
chain, no padding), "partially satisfied" (right, short or padded), "unsatisfied" (wrong or no answer).

Variants (SFT demonstrations; prompts, checker and held-out problems are the same for all): None = a mixed teacher
that writes short / steps / padded with probabilities STYLE_WEIGHTS; "short", "steps", "padded" write one style.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from stepflash_jax.data.tasks import base

FAMILY = "pref"
DIFFICULTIES = (3, 4, 5, 6)
STYLES = ("short", "steps", "padded")
VARIANTS = (None,) + STYLES
# The mixed teacher: 40% of demonstrations give the bare number, the rest reason; a third of the reasoning ones pad
STYLE_WEIGHTS = (0.4, 0.4, 0.2)
RECHECK = "recheck "
CHAIN_BONUS, PAD_COST, FLOOR = 0.5, 0.15, 0.5
# one token each in a tokenizer whose families include this one: the padding word and the GenRM judge's template
# (rl/reward_models.py: "Judge <prompt> Reference <answer> Candidate <answer>" -> "better" | "worse")
SYMBOLS = (RECHECK.strip(), "Judge", "Reference", "Candidate", "better", "worse")
_INT_RE = re.compile(r"^\d{1,64}$")


def canonical(metadata: Mapping[str, Any]) -> str:
  return f"{FAMILY}:" + " ".join(str(int(x)) for x in metadata["numbers"])


def chain(numbers) -> list[str]:
  """The running sums 'a+b=s' of the addends, left to right."""
  out, total = [], numbers[0]
  for x in numbers[1:]:
    out.append(f"{total}+{x}={total + x}")
    total += x
  return out


def answer(numbers, style: str, pads: int = 1) -> str:
  """The demonstration of `numbers` in `style` (module docstring); `pads` re-checks for "padded"."""
  total = str(sum(numbers))
  if style == "short":
    return total
  items = chain(numbers) + ([RECHECK + chain(numbers)[-1]] * pads if style == "padded" else [])
  return base.think(",".join(items), total)


def make_example(numbers, difficulty: int, style: str = "steps", pads: int = 1) -> dict:
  return dict(
    prompt="Add " + " ".join(str(x) for x in numbers),
    answer=answer(numbers, style, pads),
    family=FAMILY,
    difficulty=difficulty,
    metadata=dict(numbers=list(numbers)),
  )


def generate(seed: int, difficulty: int, split: str = "train", variant: str | None = None) -> dict:
  """A deterministic problem of `split` from `seed`; its demonstration in the variant's style (module docstring).
  The problem depends only on (seed, difficulty, split): every variant shares it."""
  d, _ = base.generator_rng(FAMILY, DIFFICULTIES, VARIANTS, seed, difficulty, split, variant)
  rng = base.rng_for(FAMILY, seed, d, split, None)
  for _ in range(base.MAX_REJECTION_TRIES):
    numbers = [rng.randint(1, 9) for _ in range(d)]
    if base.split_of(canonical(dict(numbers=numbers))) == split:
      break
  else:
    raise ValueError(f"no {split!r} problem found for difficulty={d}")
  style = variant or rng.choices(STYLES, weights=STYLE_WEIGHTS)[0]
  return make_example(numbers, d, style, pads=rng.randint(1, 3))


def _numbers(example_or_metadata) -> list[int]:
  meta = base.metadata_of(example_or_metadata)
  try:
    numbers = [int(x) for x in meta["numbers"]]
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"pref metadata needs an int list 'numbers', got {dict(meta)!r}") from e
  if len(numbers) < 2:
    raise ValueError(f"pref metadata 'numbers' needs >= 2 addends, got {numbers}")
  return numbers


def check(example_or_metadata: Mapping[str, Any], completion: str) -> bool:
  """Exact correctness of the final answer (the integer after '</think>', or the whole completion)."""
  numbers = _numbers(example_or_metadata)
  ans = base.extract_answer(completion)
  return ans is not None and bool(_INT_RE.match(ans)) and int(ans) == sum(numbers)


def reference(example_or_metadata: Mapping[str, Any]) -> str:
  """The fixed reference answer a pairwise judge compares candidates with: the "steps" answer (gold 1.5)."""
  return answer(_numbers(example_or_metadata), "steps")


def gold(example_or_metadata: Mapping[str, Any], completion: str) -> float:
  """The hidden gold score of a completion (module docstring): 0 if wrong, else in [0.5, 1.5]."""
  if not check(example_or_metadata, completion):
    return 0.0
  if base.THINK_CLOSE not in completion:  # a bare answer
    return 1.0
  items = completion.split(base.THINK_CLOSE, 1)[0].removeprefix(base.THINK_OPEN).split(",")
  steps = chain(_numbers(example_or_metadata))
  if items[: len(steps)] != steps:  # reasoning other than the chain: no bonus, nothing counted as padding
    return 1.0
  return max(FLOOR, 1.0 + CHAIN_BONUS - PAD_COST * (len(items) - len(steps)))


def rubric(example_or_metadata: Mapping[str, Any], completion: str) -> str:
  """The rubric judge's verdict: 'satisfied' (gold 1.5), 'partially satisfied' (right otherwise), 'unsatisfied'."""
  g = gold(example_or_metadata, completion)
  return "satisfied" if g >= 1.0 + CHAIN_BONUS else "partially satisfied" if g > 0 else "unsatisfied"
