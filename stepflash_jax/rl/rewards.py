"""Reward functions (report §5: rule-based verifiable rewards; docs/rl.md §1), zero-reward filters and the
registries the RL config selects from.

Interface:  reward_fn(prompt: str, completion: str, **metadata) -> float
  metadata = the example's checker metadata plus family=..., difficulty=... and truncated=bool
  (see `example_kwargs`). Built-ins:
  "rule"    1.0 iff the family's rule checker accepts the completion, else 0.0.
  "rubric"  the family's rubric judge verdict ("satisfied" | "partially satisfied" | "unsatisfied") mapped by
            DEFAULT_RUBRIC (only "satisfied" earns 1.0); `make_rubric_reward(mapping)` builds other mappings.
  "gold"    the family's hidden gold score (the oracle baseline; tasks/pref.py).
A batched reward (e.g. a learned reward model) is any object with a method
  score_batch(examples, completions) -> dict(reward=[N] float, unparsed=[N] bool)
that `score_batch` calls once for the whole batch. `ByFamily(default, {family: reward})` is one: it gives each
sample its task family's reward (rl.family_rewards: a learned judge for preference rows among rule-rewarded ones).

Filters:  filter_fn(prompt: str, completion: str, **metadata) -> bool   (True = force this reward to 0)
  "format"        no final answer ('<think>' never closed, or empty) or more than one '</think>'.
  "mixed_script"  letters from two or more writing systems (language mixing; see `scripts`).

Registries: register_reward / get_reward_fn / available_rewards and register_filter / get_filter /
available_filters (decorators take name and overwrite=False).

Zeroing in `score_batch`: each sample is counted under the FIRST reason that applies, in the order
  empty (completion.strip() == "")  ->  each filter, in the given order  ->  unparsed (batched reward's mask)
  ->  nonfinite (NaN / inf / not convertible to float, e.g. an unknown rubric verdict)
so the masks in out["zeroed"] are disjoint; every zeroed sample gets reward exactly 0.0.

Truncation: a completion cut off by the generation length limit (truncated=True) still gets its reward here
(usually 0 for "rule", since '<think>' without '</think>' has no answer); `score_batch` reports the flag per sample.
The RL trainer, when truncation-aware bootstrapping is on (report §5, docs/rl.md §7), REPLACES the reward of every
truncated sample by the critic's value V(s_T) of the final state instead of using this reward.
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from stepflash_jax.data import tasks
from stepflash_jax.data.tasks import base as task_base

RewardFn = Callable[..., float]
FilterFn = Callable[..., bool]
_REWARDS: dict[str, RewardFn] = {}
_FILTERS: dict[str, FilterFn] = {}
_RESERVED = ("family", "difficulty", "truncated")
_BUILTIN_ZERO_REASONS = ("empty", "unparsed", "nonfinite")

RUBRIC_VERDICTS = ("satisfied", "partially satisfied", "unsatisfied")
# The report's asymmetric binary reading: only a fully satisfied rubric earns the reward; partial counts as failure.
DEFAULT_RUBRIC = {"satisfied": 1.0, "partially satisfied": 0.0, "unsatisfied": 0.0}


def _register(registry: dict, kind: str, name: str, overwrite: bool) -> Callable:
  if not isinstance(name, str) or not name:
    raise ValueError(f"{kind} name must be a non-empty str, got {name!r}")

  def deco(fn):
    if name in registry and not overwrite:
      raise ValueError(f"{kind} {name!r} is already registered")
    registry[name] = fn
    return fn

  return deco


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
  """Decorator: @register_reward("my_reward") def f(prompt, completion, **metadata) -> float."""
  return _register(_REWARDS, "reward", name, overwrite)


def _lookup(registry: dict, kind: str, name: str) -> Callable:
  if name not in registry:
    raise ValueError(f"unknown {kind} {name!r}; registered: {sorted(registry)}")
  return registry[name]


def get_reward_fn(name: str) -> RewardFn:
  return _lookup(_REWARDS, "reward", name)


def available_rewards() -> list[str]:
  return sorted(_REWARDS)


def register_filter(name: str, *, overwrite: bool = False) -> Callable[[FilterFn], FilterFn]:
  """Decorator: @register_filter("my_filter") def f(prompt, completion, **metadata) -> bool (True = zero it)."""
  if name in _BUILTIN_ZERO_REASONS:
    raise ValueError(f"filter name {name!r} is reserved for a built-in zeroing reason {_BUILTIN_ZERO_REASONS}")
  return _register(_FILTERS, "filter", name, overwrite)


def get_filter(name: str) -> FilterFn:
  return _lookup(_FILTERS, "filter", name)


def available_filters() -> list[str]:
  return sorted(_FILTERS)


# ---------------------------------------------------------------------------------------------------- rewards


def verify(family: str, metadata: Mapping[str, Any], completion: str) -> bool:
  """The rule verifier of `family` (exact correctness of the final answer after '</think>')."""
  return bool(tasks.get_task(family).check(metadata, completion))


def _task_fn(family: str, attr: str) -> Callable:
  fn = getattr(tasks.get_task(family), attr, None)
  if fn is None:
    raise ValueError(f"task family {family!r} has no {attr}() scorer")
  return fn


@register_reward("rule")
def rule_reward(
  prompt: str, completion: str, *, family: str, truncated: bool = False, difficulty: Any = None, **metadata
) -> float:
  """1.0 if the rule checker of `family` accepts `completion`, else 0.0 (truncated completions included)."""
  del prompt, truncated, difficulty
  return 1.0 if verify(family, metadata, completion) else 0.0


@register_reward("gold")
def gold_reward(
  prompt: str, completion: str, *, family: str, truncated: bool = False, difficulty: Any = None, **metadata
) -> float:
  """The family's hidden gold score gold(metadata, completion): the oracle baseline (ValueError if none)."""
  del prompt, truncated, difficulty
  return float(_task_fn(family, "gold")(metadata, completion))


def _check_rubric(mapping: Mapping[str, Any]) -> dict[str, float]:
  if not isinstance(mapping, Mapping):
    raise ValueError(f"rubric mapping must be a dict, got {type(mapping).__name__}")
  missing = [v for v in RUBRIC_VERDICTS if v not in mapping]
  if missing:
    raise ValueError(f"rubric mapping misses the verdicts {missing}; it needs exactly {list(RUBRIC_VERDICTS)}")
  extra = [k for k in mapping if k not in RUBRIC_VERDICTS]
  if extra:
    raise ValueError(f"rubric mapping has unknown verdicts {extra}; it needs exactly {list(RUBRIC_VERDICTS)}")
  out = {}
  for v in RUBRIC_VERDICTS:
    try:
      out[v] = float(mapping[v])
    except (TypeError, ValueError):
      out[v] = math.nan
    if not math.isfinite(out[v]):
      raise ValueError(f"rubric mapping value for {v!r} must be a finite number, got {mapping[v]!r}")
  return out


def rubric_reward(verdict: str, mapping: Mapping[str, float] | None = None) -> float:
  """The reward of a rubric verdict (matched after .strip().lower()); NaN for an unknown verdict."""
  table = _check_rubric(DEFAULT_RUBRIC if mapping is None else mapping)
  key = verdict.strip().lower() if isinstance(verdict, str) else None
  return table.get(key, math.nan)


def make_rubric_reward(mapping: Mapping[str, float] | None = None) -> RewardFn:
  """A reward fn(prompt, completion, *, family, **metadata) mapping the family's rubric(metadata, completion)."""
  table = _check_rubric(DEFAULT_RUBRIC if mapping is None else mapping)

  def rubric_fn(
    prompt: str, completion: str, *, family: str, truncated: bool = False, difficulty: Any = None, **metadata
  ) -> float:
    del prompt, truncated, difficulty
    return rubric_reward(_task_fn(family, "rubric")(metadata, completion), table)

  return rubric_fn


register_reward("rubric")(make_rubric_reward())


# ---------------------------------------------------------------------------------------------------- filters

_CJK = ("CJK", "HIRAGANA", "KATAKANA", "IDEOGRAPHIC")
_WIDTH = ("HALFWIDTH", "FULLWIDTH")


def scripts(text: str) -> set[str]:
  """The writing systems of the letters (ch.isalpha()) of `text`: the first word of unicodedata.name, with
  CJK / HIRAGANA / KATAKANA as one script "CJK" (HALFWIDTH / FULLWIDTH forms count as their base script)."""
  out = set()
  for ch in text:
    if not ch.isalpha():
      continue
    words = unicodedata.name(ch, "").replace("-", " ").split()
    if words and words[0] in _WIDTH:
      words = words[1:]
    if words:
      out.add("CJK" if words[0] in _CJK else words[0])
  return out


@register_filter("format")
def format_filter(prompt: str, completion: str, **metadata) -> bool:
  """True when the completion has no final answer (empty, '<think>' never closed) or several '</think>'."""
  del prompt, metadata
  return tasks.extract_answer(completion) is None or completion.count(task_base.THINK_CLOSE) > 1


@register_filter("mixed_script")
def mixed_script_filter(prompt: str, completion: str, **metadata) -> bool:
  """True when the completion's letters come from two or more writing systems (language mixing)."""
  del prompt, metadata
  return len(scripts(completion)) >= 2


# ---------------------------------------------------------------------------------------------------- batches


def example_kwargs(example: Mapping[str, Any], truncated: bool = False) -> dict:
  """The **metadata of reward_fn for a task example: its checker metadata, family, difficulty, truncated."""
  meta = dict(example["metadata"])
  clash = [k for k in _RESERVED if k in meta]
  if clash:
    raise ValueError(f"example metadata must not contain the reserved keys {clash}")
  return {**meta, "family": example["family"], "difficulty": example.get("difficulty"), "truncated": bool(truncated)}


def _resolve_filters(filters: Sequence[str | FilterFn]) -> list[tuple[str, FilterFn]]:
  if isinstance(filters, str) or callable(filters):
    filters = (filters,)
  out = []
  for f in filters:
    if isinstance(f, str):
      if f not in _FILTERS:
        raise ValueError(f"unknown filter {f!r}; registered: {sorted(_FILTERS)}")
      out.append((f, _FILTERS[f]))
    elif callable(f):
      out.append((getattr(f, "__name__", type(f).__name__), f))
    else:
      raise ValueError(f"filters must be names or callables, got {f!r}")
  names = [name for name, _ in out]
  bad = sorted({x for x in names if names.count(x) > 1 or x in _BUILTIN_ZERO_REASONS})
  if bad:
    raise ValueError(f"filter names must be unique and not one of {_BUILTIN_ZERO_REASONS}, got {bad}")
  return out


def _batched_rewards(model: Any, examples: Sequence, completions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """One call of model.score_batch(examples, completions); validated (reward [N] float64, unparsed [N] bool)."""
  n = len(examples)
  out = model.score_batch(examples, completions)
  if not isinstance(out, Mapping):
    raise ValueError(f"batched reward must return a dict(reward=, unparsed=), got {type(out).__name__}")
  arrays = []
  for field, dtype in (("reward", np.float64), ("unparsed", bool)):
    if field not in out:
      raise ValueError(f"batched reward result lacks the field {field!r}")
    try:
      arr = np.asarray(out[field], dtype)
    except (TypeError, ValueError) as e:
      raise ValueError(f"batched reward field {field!r} is not convertible to {np.dtype(dtype)}") from e
    if arr.shape != (n,):
      raise ValueError(f"batched reward field {field!r} has shape {arr.shape}, expected ({n},)")
    arrays.append(arr)
  return arrays[0], arrays[1]


class ByFamily:
  """A batched reward that routes each sample by its task family: rewards[family] where given, else `default`
  (each a registered name, a per-sample fn or a batched reward; a batched one is called once on its rows). The
  post-training student's RL uses it: rule rewards on verifiable domains, a learned judge on the preference one."""

  def __init__(self, default, rewards: Mapping[str, Any]):
    resolve = lambda r: get_reward_fn(r) if isinstance(r, str) else r
    self.default, self.rewards = resolve(default), {f: resolve(r) for f, r in rewards.items()}

  def score_batch(self, examples, completions) -> dict:
    n = len(examples)
    reward, unparsed = np.zeros((n,), np.float64), np.zeros((n,), bool)
    groups: dict[Any, list[int]] = {}  # reward -> its rows
    for i, ex in enumerate(examples):
      groups.setdefault(self.rewards.get(ex["family"], self.default), []).append(i)
    for fn, rows in groups.items():
      if hasattr(fn, "score_batch"):
        r, u = _batched_rewards(fn, [examples[i] for i in rows], [completions[i] for i in rows])
      else:
        kw = [example_kwargs(examples[i]) for i in rows]
        r = np.array([_to_float(fn(examples[i]["prompt"], completions[i], **k)) for i, k in zip(rows, kw)])
        u = np.zeros((len(rows),), bool)
      reward[rows], unparsed[rows] = r, u
    return {"reward": reward, "unparsed": unparsed}


def _to_float(x: Any) -> float:
  try:
    return float(x)
  except (TypeError, ValueError):
    return math.nan


def _gold_scores(examples: Sequence[Mapping[str, Any]], completions: Sequence[str]) -> np.ndarray:
  gold = np.full((len(examples),), np.nan, np.float32)
  for i, (ex, comp) in enumerate(zip(examples, completions)):
    fn = getattr(tasks.get_task(ex["family"]), "gold", None)
    if fn is not None:
      gold[i] = float(fn(ex["metadata"], comp))
  return gold


def score_batch(
  reward_fn: RewardFn | str | Any,
  examples: Sequence[Mapping[str, Any]],
  completions: Sequence[str],
  truncated: Sequence[bool] | np.ndarray | None = None,
  filters: Sequence[str | FilterFn] = (),
) -> dict:
  """Rewards of a batch: dict(reward [N] float32 (zeroed samples 0.0, truncated ones NOT replaced),
  truncated [N] bool, correct [N] bool (rule checker, independent of reward_fn), gold [N] float32 (NaN where the
  family has no gold score), zeroed {reason: [N] bool}, disjoint, reasons in the module docstring's order).

  reward_fn: a registered name, a per-sample fn(prompt, completion, **metadata), or an object with
  score_batch(examples, completions) (called once). filters: registered names or filter callables."""
  fn = get_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
  n = len(examples)
  if len(completions) != n:
    raise ValueError(f"completions has length {len(completions)}, examples has {n}")
  trunc = np.zeros((n,), bool) if truncated is None else np.asarray(truncated, bool)
  if trunc.shape != (n,):
    raise ValueError(f"truncated must have shape ({n},), got {trunc.shape}")
  filter_fns = _resolve_filters(filters)
  kwargs = [example_kwargs(ex, trunc[i]) for i, ex in enumerate(examples)]
  batched = hasattr(fn, "score_batch")
  raw, unparsed = _batched_rewards(fn, examples, completions) if batched else (None, np.zeros((n,), bool))

  zeroed = {"empty": np.array([c.strip() == "" for c in completions], bool)}
  taken = zeroed["empty"].copy()
  for name, f in filter_fns:
    zeroed[name] = np.array(
      [not taken[i] and bool(f(ex["prompt"], completions[i], **kwargs[i])) for i, ex in enumerate(examples)], bool
    )
    taken |= zeroed[name]
  if raw is None:  # per-sample reward: not called for samples already zeroed
    raw = np.array(
      [0.0 if taken[i] else _to_float(fn(ex["prompt"], completions[i], **kwargs[i])) for i, ex in enumerate(examples)],
      np.float64,
    )
  zeroed["unparsed"] = unparsed & ~taken
  taken |= unparsed
  with np.errstate(over="ignore", invalid="ignore"):
    reward = raw.astype(np.float32)  # a finite float64 beyond the float32 range becomes inf: nonfinite
  zeroed["nonfinite"] = ~np.isfinite(reward) & ~taken
  reward[taken | zeroed["nonfinite"]] = 0.0
  correct = np.array([verify(ex["family"], ex["metadata"], c) for ex, c in zip(examples, completions)], bool)
  gold = _gold_scores(examples, completions)
  return {"reward": reward, "truncated": trunc, "correct": correct, "gold": gold, "zeroed": zeroed}
