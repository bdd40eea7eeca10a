"""Rule rewards, the reward registry and per-sample truncation reporting."""

import numpy as np
import pytest

from stepflash_jax.data import tasks
from stepflash_jax.rl import rewards


def _examples():
  return [
    tasks.generate("arithmetic", 0, 3, variant="+"),
    tasks.generate("arithmetic", 1, 2, variant="*"),
    tasks.generate("countdown", 2, 3),
    tasks.generate("countdown", 3, 4),
  ]


def test_rule_reward_every_family():
  fn = rewards.get_reward_fn("rule")
  assert fn is rewards.rule_reward
  for ex in _examples():
    kw = rewards.example_kwargs(ex)
    assert fn(ex["prompt"], ex["answer"], **kw) == 1.0
    think, final = ex["answer"].split("</think>")
    assert fn(ex["prompt"], think + "</think>" + final + "1", **kw) == 0.0  # wrong final answer
    assert fn(ex["prompt"], think, **kw) == 0.0  # reasoning cut off, no answer


def test_known_values():
  fn = rewards.get_reward_fn("rule")
  assert fn("Compute 347+285", "<think>...</think>632", family="arithmetic", op="+", a=347, b=285) == 1.0
  assert fn("Compute 347+285", "<think>...</think>623", family="arithmetic", op="+", a=347, b=285) == 0.0
  assert fn("Make 26 from 3 7 5", "</think>5+7*3", family="countdown", numbers=[3, 7, 5], target=26) == 1.0
  assert fn("Make 26 from 3 7 5", "</think>5+7*3+3", family="countdown", numbers=[3, 7, 5], target=26) == 0.0
  with pytest.raises(ValueError, match="unknown task family"):
    fn("x", "y", family="nope")


def test_score_batch_reports_truncation():
  exs = _examples()
  comps = [exs[0]["answer"], "<think>7+", exs[2]["answer"], "</think>0"]
  out = rewards.score_batch("rule", exs, comps, truncated=[True, True, False, False])
  np.testing.assert_array_equal(out["reward"], np.array([1, 0, 1, 0], np.float32))
  np.testing.assert_array_equal(out["truncated"], [True, True, False, False])
  np.testing.assert_array_equal(out["correct"], [True, False, True, False])
  assert out["reward"].dtype == np.float32
  seen = []

  def spy(prompt, completion, **meta):
    seen.append(meta["truncated"])
    return 0.5

  out = rewards.score_batch(spy, exs, comps, truncated=np.array([0, 1, 0, 1]))
  assert seen == [False, True, False, True] and np.all(out["reward"] == 0.5)
  assert rewards.score_batch("rule", exs, comps)["truncated"].sum() == 0
  with pytest.raises(ValueError, match="completions"):
    rewards.score_batch("rule", exs, comps[:2])
  with pytest.raises(ValueError, match="truncated"):
    rewards.score_batch("rule", exs, comps, truncated=[True])


def test_registry_decorator():
  @rewards.register_reward("test_length_penalty")
  def length_penalty(prompt, completion, *, family, truncated=False, **metadata):
    base = rewards.rule_reward(prompt, completion, family=family, **metadata)
    return base - 0.01 * len(completion)

  try:
    assert "test_length_penalty" in rewards.available_rewards()
    ex = _examples()[0]
    got = rewards.get_reward_fn("test_length_penalty")(ex["prompt"], ex["answer"], **rewards.example_kwargs(ex))
    assert got == pytest.approx(1.0 - 0.01 * len(ex["answer"]))
    with pytest.raises(ValueError, match="already"):
      rewards.register_reward("test_length_penalty")(length_penalty)
  finally:
    rewards._REWARDS.pop("test_length_penalty")
  with pytest.raises(ValueError, match="unknown reward"):
    rewards.get_reward_fn("test_length_penalty")


def test_reserved_metadata_keys():
  ex = dict(prompt="p", answer="a", family="arithmetic", difficulty=1, metadata=dict(truncated=1))
  with pytest.raises(ValueError, match="reserved"):
    rewards.example_kwargs(ex)
