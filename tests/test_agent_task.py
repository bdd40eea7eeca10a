"""The tool-use task family (agents/toolmul.py), its environments (agents/envs.py), its tokenizer pieces and the
agent config's validation."""

import numpy as np
import pytest

from stepflash_jax.agents import envs, toolmul
from stepflash_jax.agents.tools import format_tool_call
from stepflash_jax.data import tasks
from stepflash_jax.data.tokenizer import CHAT_SYMBOLS, DEFAULT_FAMILIES, MATH_SYMBOLS, load_tokenizer, symbols

FAMILIES = ("arithmetic", "countdown", "toolmul")


def test_demonstrations_verify_and_splits_are_disjoint():
  seen = {"train": set(), "test": set()}
  for split in ("train", "test"):
    for seed in range(40):
      for d in toolmul.DIFFICULTIES:
        for variant in (None, "3"):
          ex = tasks.generate("toolmul", seed, d, split=split, variant=variant)
          factors = ex["metadata"]["factors"]
          assert len(factors) == (3 if variant == "3" else 2) and all(len(str(f)) == d for f in factors)
          assert tasks.check(ex, ex["answer"]) and ex["answer"].count("<tool_call>") == len(factors) - 1
          assert not tasks.check(ex, ex["answer"][:-1] + str((int(ex["answer"][-1]) + 1) % 10))
          seen[split].add(toolmul.canonical(ex["metadata"]))
  assert not seen["train"] & seen["test"]
  ex = tasks.generate("toolmul", 0, 3)
  product = int(np.prod(ex["metadata"]["factors"]))
  assert tasks.check(ex, str(product))  # a direct answer counts too (the model cannot compute it, though)
  assert not tasks.check(ex, f"<tool_call>x</tool_call><|tool|>{product}<|assistant|>no")


def test_weak_teacher_skips_the_tool_on_3_digit_problems_only():
  assert toolmul.estimate([482, 551]) == "<think>482*551 is about 500*600</think>300000"
  assert toolmul.rounded([951, 36, 7]) == [1000, 40, 7]
  skips = []
  for seed in range(300):
    for d in (3, 4):
      for weak, plain in (("weak", None), ("3weak", "3")):
        ex, ref = (tasks.generate("toolmul", seed, d, variant=v) for v in (weak, plain))
        assert ex["prompt"] == ref["prompt"]  # the same problems, only the demonstration differs
        if "<tool_call>" in ex["answer"]:
          assert ex["answer"] == ref["answer"]
        else:  # an estimate, which the checker rejects
          assert d == 3 and ex["answer"] == toolmul.estimate(ex["metadata"]["factors"])
          assert not tasks.check(ex, ex["answer"])
        if d == 3:
          skips.append("<tool_call>" not in ex["answer"])
  # 600 draws of Bernoulli(0.7) (an exact estimate would keep the tool): within 5 standard deviations
  assert abs(np.mean(skips) - toolmul.WEAK_SKIP) < 5 * np.sqrt(0.7 * 0.3 / len(skips))


def test_tokenizer_pieces_and_tool_messages_out_of_the_loss(tmp_path):
  assert symbols(DEFAULT_FAMILIES) == CHAT_SYMBOLS + MATH_SYMBOLS  # the default tokenizer is unchanged
  tok = load_tokenizer(str(tmp_path), families=FAMILIES)
  for piece in toolmul.SYMBOLS:
    assert len(tok.encode(piece)) == 1, piece
  ex = tasks.generate("toolmul", 1, 4, variant="3")
  ids, mask = tok.format_example(ex["prompt"], ex["answer"])
  tool, assistant = tok.encode("<|tool|>")[0], tok.assistant_id
  n_prompt = len(tok.format_prompt(ex["prompt"]))
  inside, expected = False, []
  for t, i in enumerate(ids):
    if t < n_prompt:
      expected.append(0.0)
      continue
    inside = inside or i == tool
    expected.append(0.0 if inside else 1.0)
    inside = inside and i != assistant
  np.testing.assert_array_equal(mask, expected)
  assert (mask == 0).sum() > n_prompt and tok.decode(ids[n_prompt:], stop_at_eos=True) == ex["answer"]


def test_calculator_environment():
  call = format_tool_call("multiply", {"a": "123", "b": "-45"})
  assert envs.calculator_step({"text": "ok " + call}) == {
    "message": str(123 * -45),
    "calls": 1,
    "parse_errors": 0,
    "tool_errors": 0,
    "timeouts": 0,
  }
  two = envs.calculator_step({"text": call + format_tool_call("multiply", {"a": "2", "b": "3"})})
  assert two["message"] == f"{123 * -45}\n6" and two["calls"] == 2
  huge = envs.calculator_step({"text": format_tool_call("multiply", {"a": "9" * 400, "b": "9"})})
  assert huge["tool_errors"] == 1 and huge["message"].startswith("error:")
  bad = envs.calculator_step({"text": format_tool_call("multiply", {"a": "twelve", "b": "3"})})
  assert bad["parse_errors"] == 1 and bad["calls"] == 0 and "'a'" in bad["message"]
  assert envs.calculator_step({"text": "the answer is 7"})["message"] == "error: no tool call"
  extra = envs.calculator_step({"text": format_tool_call("multiply", {"a": "1"})})
  assert extra["tool_errors"] == 1
  with pytest.raises(ValueError, match="agent.env"):
    envs.get("shell")


def test_python_environment_runs_in_the_sandbox():
  ok = envs.python_step({"text": format_tool_call("python", {"code": "print(6 * 7)"})})
  assert ok["message"] == "42" and ok["calls"] == 1
  loop = envs.python_step({"text": format_tool_call("python", {"code": "while True: pass"})})
  assert loop["timeouts"] == 1 and loop["message"].startswith("error:")


def test_agent_config_validation():
  from configs import agent
  from stepflash_jax.train.validate import validate_run_config

  c = agent.get_config("small")
  validate_run_config(c)
  c.rl.max_turns = 2  # issue 15's name for the turn limit; the multi-turn engine reads agent.max_turns
  assert c.agent.max_turns == 2 and c.copy_and_resolve_references().agent.max_turns == 2
  for field, value, match in (
    ("agent.env", "shell", "agent.env"),
    ("agent.max_turns", 0, "agent.max_turns"),
    ("agent.executor", "slurm", "agent.executor"),
    ("data.tokenizer_families", ("arithmetic",), "data.tokenizer_families"),
    ("data.tokenizer_families", ("nope",), "unknown task family"),
    ("rl.router_replay", "always", "rl.router_replay"),
  ):
    bad = agent.get_config("small")
    section, name = field.split(".")
    bad[section][name] = value
    with pytest.raises(ValueError, match=match):
      validate_run_config(bad)
