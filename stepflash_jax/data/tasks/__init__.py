"""Registry of the verifiable task families and the difficulty mixture the data pipeline samples from.

generate(family, seed, difficulty, split="train", variant=None) -> example dict
check(example, completion) -> bool                  dispatch on example["family"]
register_task(module_or_namespace)                  add a family (needs FAMILY, DIFFICULTIES, VARIANTS,
                                                    generate, check, canonical; see tasks/base.py)
MixtureComponent(family, difficulties, weight, variant)
parse_mixture("arithmetic/+:2-3:2,countdown:3:1") -> tuple[MixtureComponent, ...]
sample_example(mixture, seed, index, split) -> example   deterministic in (seed, index)
"""

from __future__ import annotations

import dataclasses
import random
from types import ModuleType
from typing import Any, Mapping, Sequence

from stepflash_jax.data.tasks import arithmetic, base, countdown, countdown_search, longmul, pref
from stepflash_jax.data.tasks.base import SPLITS, TEST_FRACTION, extract_answer, split_of

_TASKS: dict[str, Any] = {}
_REQUIRED = ("FAMILY", "DIFFICULTIES", "VARIANTS", "generate", "check", "canonical")


def register_task(task: ModuleType | Any, *, overwrite: bool = False):
  """Registers a task family (a module or any object with the attributes listed in tasks/base.py)."""
  missing = [a for a in _REQUIRED if not hasattr(task, a)]
  if missing:
    raise ValueError(f"task {task!r} lacks {missing}")
  if task.FAMILY in _TASKS and not overwrite:
    raise ValueError(f"task family {task.FAMILY!r} already registered")
  _TASKS[task.FAMILY] = task
  return task


def get_task(family: str):
  if family not in _TASKS:
    raise ValueError(f"unknown task family {family!r}; registered: {sorted(_TASKS)}")
  return _TASKS[family]


def families() -> list[str]:
  return sorted(_TASKS)


register_task(arithmetic)
register_task(countdown)
register_task(countdown_search)
register_task(longmul)
register_task(pref)


def generate(family: str, seed: int, difficulty: int, split: str = "train", variant: Any = None) -> dict:
  return get_task(family).generate(seed, difficulty, split=split, variant=variant)


def check(example: Mapping[str, Any], completion: str) -> bool:
  """Exact correctness of `completion` for a full example (dispatches on example['family'])."""
  if not isinstance(example, Mapping) or "family" not in example:
    raise ValueError("example must be a dict with a 'family' field")
  return bool(get_task(example["family"]).check(example, completion))


@dataclasses.dataclass(frozen=True)
class MixtureComponent:
  """One entry of the sampling mixture: a family, its difficulties (drawn uniformly), a relative weight."""

  family: str
  difficulties: tuple[int, ...]
  weight: float = 1.0
  variant: Any = None

  def __post_init__(self):
    task = get_task(self.family)
    if not self.difficulties:
      raise ValueError(f"difficulties of {self.family!r} must be non-empty")
    for d in self.difficulties:
      base.check_difficulty(d, tuple(task.DIFFICULTIES), self.family)
    if self.variant not in task.VARIANTS:
      raise ValueError(f"variant for {self.family!r} must be one of {task.VARIANTS}, got {self.variant!r}")
    if not self.weight > 0:
      raise ValueError(f"weight of {self.family!r} must be > 0, got {self.weight}")


# The default SFT / RL mixture, from easy to hard for a tiny model: 2-3 and 3-4 digit addition, 2-3 digit
# subtraction, 2-3 digit x 1 digit multiplication, countdown with 3 numbers (weights 1 : 1 : 1.5 : 1.5 : 2).
DEFAULT_MIXTURE = (
  MixtureComponent("arithmetic", (2, 3), 1.0, "+"),
  MixtureComponent("arithmetic", (3, 4), 1.0, "+"),
  MixtureComponent("arithmetic", (2, 3), 1.5, "-"),
  MixtureComponent("arithmetic", (2, 3), 1.5, "*"),
  MixtureComponent("countdown", (3,), 2.0),
)
# Long reasoning (responses of ~200-220 tokens): 3-digit x 3-digit long multiplication with partial products.
LONG_MIXTURE = (MixtureComponent("longmul", (3,), 1.0),)
# SFT stage 2 of the report: out-of-distribution synthetic large-number arithmetic (6-12 digit additions).
LARGE_NUMBER_MIXTURE = (MixtureComponent("arithmetic", tuple(range(6, 13)), 1.0, "+"),)


def parse_mixture(spec: str | Sequence[MixtureComponent]) -> tuple[MixtureComponent, ...]:
  """Mixture from a config string 'family[/variant]:d|dlo-dhi[:weight],...' (or pass components through).

  "default", "long" and "large_number" name the presets above. Example: "arithmetic/+:2-4:3,countdown:3:1".
  """
  if not isinstance(spec, str):
    comps = tuple(spec)
    if not comps or not all(isinstance(c, MixtureComponent) for c in comps):
      raise ValueError("mixture must be a spec string or a non-empty sequence of MixtureComponent")
    return comps
  presets = {"default": DEFAULT_MIXTURE, "large_number": LARGE_NUMBER_MIXTURE, "long": LONG_MIXTURE}
  if spec.strip() in presets:
    return presets[spec.strip()]
  comps = []
  for item in spec.split(","):
    fields = item.strip().split(":")
    if len(fields) not in (2, 3) or not fields[0]:
      raise ValueError(f"mixture item {item!r} must be 'family[/variant]:difficulty[:weight]'")
    family, _, variant = fields[0].partition("/")
    lo, _, hi = fields[1].partition("-")
    try:
      diffs = tuple(range(int(lo), int(hi or lo) + 1))
      weight = float(fields[2]) if len(fields) == 3 else 1.0
    except ValueError as e:
      raise ValueError(f"mixture item {item!r}: bad difficulty or weight") from e
    comps.append(MixtureComponent(family, diffs, weight, variant or None))
  return tuple(comps)


def sample_example(mixture: Sequence[MixtureComponent], seed: int, index: int, split: str = "train") -> dict:
  """Example number `index` of the stream defined by (mixture, seed, split): component by weight, then a
  uniform difficulty, then the family generator seeded from (seed, index)."""
  rng = random.Random(base.derive_seed("mixture", seed, index, split))
  comp = rng.choices(mixture, weights=[c.weight for c in mixture])[0]
  difficulty = rng.choice(comp.difficulties)
  return generate(comp.family, rng.getrandbits(63), difficulty, split=split, variant=comp.variant)


__all__ = [
  "SPLITS",
  "TEST_FRACTION",
  "DEFAULT_MIXTURE",
  "LARGE_NUMBER_MIXTURE",
  "LONG_MIXTURE",
  "MixtureComponent",
  "check",
  "extract_answer",
  "families",
  "generate",
  "get_task",
  "parse_mixture",
  "register_task",
  "sample_example",
  "split_of",
]
