"""Countdown demonstrated as a search: the `countdown` problems, whose reference answers try, check and try again.

The problems, the train/test split and the checker are countdown's (tasks/countdown.py; the same seed gives the
same problem); only the SFT target differs. Its think span holds 0..MAX_MISSES tries that miss the target, each a
true left-deep chain over all the numbers (random order and operators, distinct from each other) closed by its
comparison with the target ('>' or '<', then the target), and then countdown's chain that hits it:

  prompt:  "Make 14 from 3 2 9"
  answer:  "<think>9*2=18,18+3=21>14;3*9=27,27+2=29>14;9+2=11,11+3=14</think>(9+2)+3"

Why (docs/training.md, the task families): countdown's demonstrations always reach the target on the first try,
so a model that cannot find the operators in its head learns to guess them and force the last step to the target
by a false equation (README: 589 of 615 of a student's wrong answers). Here every written step is true and a miss is
followed by another try, so the model learns to compute its try, compare it with the target and go on. Answers at
difficulty 3 take up to ~90 tokens with the main job's tokenizer instead of countdown's ~15-25, so its jobs need a
longer budget (configs/countdown_search.py: 96 tokens).
'>', '<' and ';' occur in no other family's text: the tokenizer writes them as byte pieces (one token each),
whether or not the family is in data.tokenizer_families.
"""

from __future__ import annotations

from stepflash_jax.data.tasks import base, countdown

FAMILY = "countdown_search"
DIFFICULTIES = countdown.DIFFICULTIES
VARIANTS = (None,)
MAX_MISSES = 3  # misses before the hit, drawn uniformly from 0..MAX_MISSES (repeats dropped)
MISS_TRIES = 20  # random chains drawn to find one miss (a miss is dropped when none of them misses)
check = countdown.check
canonical = countdown.canonical  # so a problem is held out in both families or in neither


def miss(rng, numbers: list[int], target: int) -> str | None:
  """One try that misses: a random chain's steps and its comparison with the target, e.g. '9*2=18,18+3=21>14'."""
  for _ in range(MISS_TRIES):
    chain = countdown.random_chain(rng, numbers)
    if chain is not None and chain[0] != target:
      value, steps, _ = chain
      return ",".join(steps) + (">" if value > target else "<") + str(target)
  return None


def generate(seed: int, difficulty: int, split: str = "train", variant: str | None = None) -> dict:
  """countdown.generate(seed, difficulty, split)'s problem with the search answer of the module docstring."""
  _, rng = base.generator_rng(FAMILY, DIFFICULTIES, VARIANTS, seed, difficulty, split, variant)
  ex = countdown.generate(seed, difficulty, split)
  meta, answer = ex["metadata"], ex["answer"]
  hit = answer[len(base.THINK_OPEN) : answer.index(base.THINK_CLOSE)]
  misses = [miss(rng, meta["numbers"], meta["target"]) for _ in range(rng.randint(0, MAX_MISSES))]
  tries = [m for m in dict.fromkeys(misses) if m is not None] + [hit]
  return dict(ex, answer=base.think(";".join(tries), base.extract_answer(answer)), family=FAMILY)
