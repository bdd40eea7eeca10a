"""Reward functions (report §5: rule-based verifiable rewards; docs/rl.md §1) and the registry the RL config selects
from.

Interface:  reward_fn(prompt: str, completion: str, **metadata) -> float
  metadata = the example's checker metadata plus family=..., difficulty=... and truncated=bool
  (see `example_kwargs`). "rule": 1.0 iff the family's rule checker accepts the completion, else 0.0.

Truncation: a completion cut off by the generation length limit (truncated=True) still gets its rule reward
here (usually 0, since '<think>' without '</think>' has no answer); `score_batch` reports the flag per sample.
The RL trainer, when truncation-aware bootstrapping is on (report §5, docs/rl.md §7), REPLACES the reward of every
truncated sample by the critic's value V(s_T) of the final state instead of using this rule reward.

Registry: get_reward_fn("rule") / register_reward("name") decorator for new reward functions.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from stepflash_jax.data import tasks

RewardFn = Callable[..., float]
_REWARDS: dict[str, RewardFn] = {}
_RESERVED = ("family", "difficulty", "truncated")


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
  """Decorator: @register_reward("my_reward") def f(prompt, completion, **metadata) -> float."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"reward name must be a non-empty str, got {name!r}")

  def deco(fn: RewardFn) -> RewardFn:
    if name in _REWARDS and not overwrite:
      raise ValueError(f"reward {name!r} is already registered")
    _REWARDS[name] = fn
    return fn

  return deco


def get_reward_fn(name: str) -> RewardFn:
  if name not in _REWARDS:
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(_REWARDS)}")
  return _REWARDS[name]


def available_rewards() -> list[str]:
  return sorted(_REWARDS)


def verify(family: str, metadata: Mapping[str, Any], completion: str) -> bool:
  """The rule verifier of `family` (exact correctness of the final answer after '</think>')."""
  return bool(tasks.get_task(family).check(metadata, completion))


@register_reward("rule")
def rule_reward(
  prompt: str, completion: str, *, family: str, truncated: bool = False, difficulty: Any = None, **metadata
) -> float:
  """1.0 if the rule checker of `family` accepts `completion`, else 0.0 (truncated completions included)."""
  del prompt, truncated, difficulty
  return 1.0 if verify(family, metadata, completion) else 0.0


def example_kwargs(example: Mapping[str, Any], truncated: bool = False) -> dict:
  """The **metadata of reward_fn for a task example: its checker metadata, family, difficulty, truncated."""
  meta = dict(example["metadata"])
  clash = [k for k in _RESERVED if k in meta]
  if clash:
    raise ValueError(f"example metadata must not contain the reserved keys {clash}")
  return {**meta, "family": example["family"], "difficulty": example.get("difficulty"), "truncated": bool(truncated)}


def score_batch(
  reward_fn: RewardFn | str,
  examples: Sequence[Mapping[str, Any]],
  completions: Sequence[str],
  truncated: Sequence[bool] | np.ndarray | None = None,
) -> dict:
  """Rewards of a batch: dict(reward [N] float32 (the reward_fn value, truncated ones NOT replaced),
  truncated [N] bool, correct [N] bool (rule checker, independent of reward_fn))."""
  fn = get_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
  n = len(examples)
  if len(completions) != n:
    raise ValueError(f"completions has length {len(completions)}, examples has {n}")
  trunc = np.zeros((n,), bool) if truncated is None else np.asarray(truncated, bool)
  if trunc.shape != (n,):
    raise ValueError(f"truncated must have shape ({n},), got {trunc.shape}")
  reward = np.zeros((n,), np.float32)
  correct = np.zeros((n,), bool)
  for i, (ex, comp) in enumerate(zip(examples, completions)):
    reward[i] = float(fn(ex["prompt"], comp, **example_kwargs(ex, trunc[i])))
    correct[i] = verify(ex["family"], ex["metadata"], comp)
  return {"reward": reward, "truncated": trunc, "correct": correct}
