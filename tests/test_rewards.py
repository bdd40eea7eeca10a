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


# ------------------------------------------------------------------------ filters, rubric, gold, batch zeroing


def _pref(style, seed=0):
  return tasks.generate("pref", seed, 3, variant=style)


def _wrong(ex):
  """The example's answer with the final number off by one."""
  total = sum(ex["metadata"]["numbers"])
  return ex["answer"][: -len(str(total))] + str(total + 1)


def test_format_filter():
  f = rewards.get_filter("format")
  assert f is rewards.format_filter and "format" in rewards.available_filters()
  assert not f("p", "<think>1+1=2</think>2")
  assert not f("p", "42")  # a bare answer has a final answer
  assert f("p", "<think>1+1")  # reasoning never closed
  assert f("p", "")
  assert f("p", "   ")
  assert f("p", "<think>1+1=2</think>")  # closed but no answer after it
  assert f("p", "<think>1+1=2</think>2</think>2")  # two '</think>'
  assert f("p", "<think>a</think><think>b</think>2")


def test_scripts_and_mixed_script_filter():
  assert rewards.scripts("The answer is 42") == {"LATIN"}
  assert rewards.scripts("<think>1+1=2</think>2") == {"LATIN"}
  assert rewards.scripts("42 + 7 = 49 !") == set()
  assert rewards.scripts("answer 42 ответ") == {"LATIN", "CYRILLIC"}
  assert rewards.scripts("データ and data") == {"CJK", "LATIN"}
  assert rewards.scripts("データ 漢字 ひらがな") == {"CJK"}  # kana (incl. the 'ー' mark) and kanji: one script
  assert rewards.scripts("αβγ") == {"GREEK"}
  f = rewards.get_filter("mixed_script")
  assert not f("p", "The answer is 42")
  assert not f("p", "ответ 42")
  assert not f("p", "データ")
  assert f("p", "answer 42 ответ")
  assert f("p", "データ and data")
  assert f("p", "<think>حساب</think>5")  # markup letters count as LATIN


def test_filter_registry():
  @rewards.register_filter("test_long")
  def long_completion(prompt, completion, **metadata):
    return len(completion) > 5

  try:
    assert "test_long" in rewards.available_filters() and rewards.get_filter("test_long") is long_completion
    with pytest.raises(ValueError, match="already"):
      rewards.register_filter("test_long")(long_completion)
  finally:
    rewards._FILTERS.pop("test_long")
  with pytest.raises(ValueError, match="unknown filter"):
    rewards.get_filter("test_long")
  with pytest.raises(ValueError, match="reserved"):
    rewards.register_filter("nonfinite")


def test_rubric_reward_mapping():
  assert rewards.RUBRIC_VERDICTS == ("satisfied", "partially satisfied", "unsatisfied")
  assert rewards.rubric_reward("satisfied") == 1.0
  assert rewards.rubric_reward("  Partially Satisfied\n") == 0.0
  assert rewards.rubric_reward("unsatisfied") == 0.0
  custom = {"satisfied": 1.0, "partially satisfied": 0.5, "unsatisfied": -1.0}
  assert rewards.rubric_reward("PARTIALLY SATISFIED", custom) == 0.5
  assert rewards.rubric_reward("unsatisfied", custom) == -1.0
  assert np.isnan(rewards.rubric_reward("mostly satisfied"))
  assert np.isnan(rewards.rubric_reward(None))
  with pytest.raises(ValueError, match="partially satisfied"):
    rewards.rubric_reward("satisfied", {"satisfied": 1.0, "unsatisfied": 0.0})
  with pytest.raises(ValueError, match="nan"):
    rewards.rubric_reward("satisfied", {**custom, "unsatisfied": float("nan")})
  with pytest.raises(ValueError, match="inf"):
    rewards.make_rubric_reward({**custom, "satisfied": float("inf")})


def test_rubric_and_gold_rewards_on_pref():
  rubric, gold = rewards.get_reward_fn("rubric"), rewards.get_reward_fn("gold")
  soft = rewards.make_rubric_reward({"satisfied": 1.0, "partially satisfied": 0.5, "unsatisfied": 0.0})
  for seed in range(3):
    short, steps, padded = (_pref(s, seed) for s in ("short", "steps", "padded"))
    pads = padded["answer"].count("recheck")
    assert 1 <= pads <= 3
    for ex, want_gold, want_rubric, want_soft in (
      (short, 1.0, 0.0, 0.5),
      (steps, 1.5, 1.0, 1.0),
      (padded, 1.5 - 0.15 * pads, 0.0, 0.5),
    ):
      kw = rewards.example_kwargs(ex, truncated=True)
      assert gold(ex["prompt"], ex["answer"], **kw) == pytest.approx(want_gold)
      assert rubric(ex["prompt"], ex["answer"], **kw) == want_rubric
      assert soft(ex["prompt"], ex["answer"], **kw) == want_soft
      assert gold(ex["prompt"], _wrong(ex), **kw) == 0.0
      assert rubric(ex["prompt"], _wrong(ex), **kw) == 0.0
      assert soft(ex["prompt"], _wrong(ex), **kw) == 0.0
  ex = _examples()[0]  # arithmetic: neither gold nor rubric
  with pytest.raises(ValueError, match="arithmetic"):
    gold(ex["prompt"], ex["answer"], **rewards.example_kwargs(ex))
  with pytest.raises(ValueError, match="arithmetic"):
    rubric(ex["prompt"], ex["answer"], **rewards.example_kwargs(ex))


def test_score_batch_zeroes_nonfinite_and_empty():
  exs = _examples()
  comps = [exs[0]["answer"], exs[1]["answer"], "  ", exs[3]["answer"]]
  values = {comps[0]: 0.7, comps[1]: float("nan"), comps[3]: "oops"}  # "oops": float() fails
  calls = []

  def flaky(prompt, completion, **meta):
    calls.append(completion)
    return values[completion]

  out = rewards.score_batch(flaky, exs, comps)
  assert len(calls) == 3  # not called for the empty completion
  np.testing.assert_array_equal(out["reward"], np.array([0.7, 0, 0, 0], np.float32))
  np.testing.assert_array_equal(out["zeroed"]["empty"], [False, False, True, False])
  np.testing.assert_array_equal(out["zeroed"]["nonfinite"], [False, True, False, True])
  np.testing.assert_array_equal(out["zeroed"]["unparsed"], [False] * 4)
  assert list(out["zeroed"]) == ["empty", "unparsed", "nonfinite"]
  np.testing.assert_array_equal(out["correct"], [True, True, False, True])
  out = rewards.score_batch(lambda p, c, **m: 1e300, exs, comps)  # finite, but not in float32
  np.testing.assert_array_equal(out["zeroed"]["nonfinite"], [True, True, False, True])
  np.testing.assert_array_equal(out["reward"], np.zeros(4, np.float32))


def test_score_batch_filters_in_order():
  exs = _examples()
  comps = [exs[0]["answer"], "<think>1+", "", "ответ 5"]

  def cyrillic(prompt, completion, **meta):
    return "CYRILLIC" in rewards.scripts(completion)

  out = rewards.score_batch("rule", exs, comps, filters=("format", "mixed_script", cyrillic))
  assert list(out["zeroed"]) == ["empty", "format", "mixed_script", "cyrillic", "unparsed", "nonfinite"]
  np.testing.assert_array_equal(out["zeroed"]["empty"], [False, False, True, False])
  np.testing.assert_array_equal(out["zeroed"]["format"], [False, True, False, False])
  np.testing.assert_array_equal(out["zeroed"]["mixed_script"], [False, False, False, False])
  np.testing.assert_array_equal(out["zeroed"]["cyrillic"], [False, False, False, True])
  np.testing.assert_array_equal(out["reward"], np.array([1, 0, 0, 0], np.float32))
  out = rewards.score_batch(lambda p, c, **m: 2.0, exs, comps, filters=("format",))
  np.testing.assert_array_equal(out["reward"], np.array([2, 0, 0, 2], np.float32))  # '' counted as empty only
  np.testing.assert_array_equal(out["zeroed"]["format"], [False, True, False, False])
  with pytest.raises(ValueError, match="mixed_script"):
    rewards.score_batch("rule", exs, comps, filters=("format", "no_such_filter"))
  with pytest.raises(ValueError, match="unique"):
    rewards.score_batch("rule", exs, comps, filters=("format", "format"))


class _FakeRewardModel:
  """A batched reward: fixed scores, one unparsed sample and one NaN."""

  def __init__(self, reward, unparsed):
    self.reward, self.unparsed, self.calls = reward, unparsed, 0

  def score_batch(self, examples, completions):
    self.calls += 1
    return {"reward": np.asarray(self.reward), "unparsed": np.asarray(self.unparsed)}


def test_score_batch_batched_reward():
  exs = _examples() + [_pref("steps")]
  comps = [ex["answer"] for ex in exs]
  comps[1] = "<think>never closed"
  rm = _FakeRewardModel([0.25, -0.5, 3.0, np.nan, 0.75], [False, False, True, False, False])
  out = rewards.score_batch(rm, exs, comps)
  assert rm.calls == 1
  np.testing.assert_array_equal(out["reward"], np.array([0.25, -0.5, 0, 0, 0.75], np.float32))
  np.testing.assert_array_equal(out["zeroed"]["unparsed"], [False, False, True, False, False])
  np.testing.assert_array_equal(out["zeroed"]["nonfinite"], [False, False, False, True, False])
  out = rewards.score_batch(rm, exs, comps, filters=["format"])
  assert rm.calls == 2
  np.testing.assert_array_equal(out["reward"], np.array([0.25, 0, 0, 0, 0.75], np.float32))
  np.testing.assert_array_equal(out["zeroed"]["format"], [False, True, False, False, False])
  bad = _FakeRewardModel(np.zeros((5, 1)), np.zeros(5, bool))
  with pytest.raises(ValueError, match=r"'reward'.*\(5, 1\)"):
    rewards.score_batch(bad, exs, comps)
  bad = _FakeRewardModel(np.zeros(5), np.zeros(4, bool))
  with pytest.raises(ValueError, match=r"'unparsed'.*\(4,\)"):
    rewards.score_batch(bad, exs, comps)


def test_score_batch_gold():
  pref = [_pref("short"), _pref("steps"), _pref("padded")]
  pads = pref[2]["answer"].count("recheck")
  exs = _examples()[:2] + pref
  comps = [ex["answer"] for ex in exs[:4]] + [_wrong(exs[4])]
  out = rewards.score_batch("rule", exs, comps)
  assert out["gold"].dtype == np.float32
  assert np.isnan(out["gold"][:2]).all()
  np.testing.assert_allclose(out["gold"][2:], [1.0, 1.5, 0.0])
  out = rewards.score_batch("gold", pref, [ex["answer"] for ex in pref])
  np.testing.assert_allclose(out["reward"], [1.0, 1.5, 1.5 - 0.15 * pads], rtol=1e-6)
  np.testing.assert_array_equal(out["reward"], out["gold"])
  out = rewards.score_batch("rubric", pref, [ex["answer"] for ex in pref])
  np.testing.assert_array_equal(out["reward"], np.array([0, 1, 0], np.float32))


def test_by_family_routes_each_sample_to_its_familys_reward():
  """Arithmetic and countdown rows get the rule reward, pref rows a batched reward called once on its rows only (in
  order), through score_batch's zeroing as any batched reward."""
  pref = [_pref("steps", 0), _pref("short", 1)]
  exs = [_examples()[0], pref[0], _examples()[2], pref[1]]
  comps = [exs[0]["answer"], pref[0]["answer"], _examples()[3]["answer"], "<think>never closed"]
  seen = []

  class Judge(_FakeRewardModel):
    def score_batch(self, examples, completions):
      seen.append(([x["prompt"] for x in examples], list(completions)))
      return super().score_batch(examples, completions)

  judge = Judge([0.7, 0.2], [False, True])
  out = rewards.score_batch(rewards.ByFamily("rule", {"pref": judge}), exs, comps)
  assert seen == [([pref[0]["prompt"], pref[1]["prompt"]], [pref[0]["answer"], "<think>never closed"])]
  # arithmetic right (1), pref 0.7, countdown with another problem's answer (0), pref unparsed (0)
  np.testing.assert_array_equal(out["reward"], np.array([1.0, 0.7, 0.0, 0.0], np.float32))
  np.testing.assert_array_equal(out["zeroed"]["unparsed"], [False, False, False, True])
  out = rewards.score_batch(rewards.ByFamily("gold", {"arithmetic": "rule", "countdown": "rule"}), exs, comps)
  np.testing.assert_allclose(out["reward"], [1.0, 1.5, 0.0, 0.0])  # pref: the gold default (steps 1.5)
