"""Multiplication with a calculator tool: the task family of agentic RL (configs/agent.py, docs/agents.md §4).

difficulty d = digits of every factor (3..6); variant None: a*b (one tool call), "3": a*b*c (two calls, the
second on the first's result). The tiny model cannot multiply 3+ digit numbers itself; with the `multiply` tool it
only has to copy digits into the calls and the final result out of the last tool message:

  prompt  "Use multiply: 482*551*77"
  answer  <tool_call>..multiply(a=482, b=551)..</tool_call><|tool|>265582<|assistant|>
          <tool_call>..multiply(a=265582, b=77)..</tool_call><|tool|>20449814<|assistant|>20449814

Variants "weak" / "3weak" are the same problems demonstrated by a weak teacher that over-trusts mental
arithmetic: on all-3-digit problems it skips the tool with probability WEAK_SKIP and answers a rounded estimate
("<think>482*551 is about 500*600</think>300000") - the under-calling of tools that agentic RL has to fix.
Prompts, checker and held-out problems are those of the plain variants; only the demonstrations (SFT data) differ.

The demonstration is made like the report's tool-use data (atomic intents as a finite-state machine, sample ->
execute -> verify): the state is (running product, factors left); the intent "multiply" is executed by the real
environment (envs.calculator_step on the formatted call), the intent "answer" ends; the finished demonstration is
kept only if its answer verifies (rejection on deterministic feedback). Tool messages are context: the SFT loss
and the RL objectives skip them (tokenizer.format_example, agents/rollout.py). The checker reads the text after
the last <|assistant|> marker (the final turn).
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any, Mapping

from stepflash_jax.agents import envs
from stepflash_jax.agents.tools import CALL_CLOSE, CALL_OPEN, format_tool_call
from stepflash_jax.data import tasks
from stepflash_jax.data.tasks import base
from stepflash_jax.data.tasks.arithmetic import operand
from stepflash_jax.data.tokenizer import ASSISTANT, TOOL

FAMILY = "toolmul"
DIFFICULTIES = (3, 4, 5, 6)
VARIANTS = (None, "3", "weak", "3weak")
_PLAIN = {"weak": None, "3weak": "3"}  # weak-teacher variant -> the plain variant whose problems it shares
WEAK_SKIP = 0.7  # the weak teacher's probability of answering an estimate on 3-digit problems (greedy SFT follows it)
# one token each in a tokenizer whose families include this one (tokenizer.symbols)
SYMBOLS = (CALL_OPEN, CALL_CLOSE, "<function=", "</function>", "<parameter=", "</parameter>", TOOL)
_INT_RE = re.compile(r"^\d{1,64}$")


def canonical(metadata: Mapping[str, Any]) -> str:
  return f"{FAMILY}:" + "*".join(str(int(f)) for f in metadata["factors"])


def rounded(factors) -> list:
  """Every factor rounded to one significant digit (482 -> 500, 974 -> 1000)."""
  return [round(f / 10 ** (len(str(f)) - 1)) * 10 ** (len(str(f)) - 1) for f in factors]


def estimate(factors) -> str:
  """The weak teacher's answer: a thought on the rounded factors, then their product
  ("<think>482*551 is about 500*600</think>300000"). Its first token, <think>, is shared by every such answer: at
  WEAK_SKIP = 0.7 it outweighs <tool_call> (0.3) under greedy decoding, where a bare number's first digit would
  not."""
  r = rounded(factors)
  return base.think("*".join(map(str, factors)) + " is about " + "*".join(map(str, r)), str(math.prod(r)))


def demonstrate(factors, skip_tool: bool = False) -> str:
  """The tool-use trajectory for factors (module docstring): execute each intent, verify the answer. skip_tool:
  the weak teacher's answer without any call (`estimate`; the tool when the estimate happens to be exact)."""
  guess = estimate(factors)
  if skip_tool and not check({"factors": list(factors)}, guess):
    return guess
  acc, text = factors[0], ""
  for nxt in factors[1:]:  # intent "multiply": the call, executed by the environment
    call = format_tool_call("multiply", {"a": str(acc), "b": str(nxt)})
    result = envs.calculator_step({"text": call})
    if result["tool_errors"] or result["parse_errors"] or result["message"] != str(acc * nxt):
      raise ValueError(f"the calculator rejected {call!r}: {result}")
    text += call + TOOL + result["message"] + ASSISTANT
    acc = int(result["message"])
  text += str(acc)  # intent "answer"
  if not check({"factors": list(factors)}, text):  # rejection on deterministic feedback
    raise ValueError(f"demonstration for {factors} does not verify")
  return text


def generate(seed: int, difficulty: int, split: str = "train", variant: str | None = None) -> dict:
  d, _ = base.generator_rng(FAMILY, DIFFICULTIES, VARIANTS, seed, difficulty, split, variant)
  plain = _PLAIN.get(variant, variant)
  rng = base.rng_for(FAMILY, seed, d, split, plain)  # the plain variant's stream: the same problems
  n = 3 if plain == "3" else 2
  for _ in range(base.MAX_REJECTION_TRIES):
    factors = [operand(rng, d) for _ in range(n)]
    if base.split_of(canonical({"factors": factors})) == split:
      prompt = "Use multiply: " + "*".join(map(str, factors))
      skip = variant in _PLAIN and d == 3 and rng.random() < WEAK_SKIP
      meta = {"factors": factors}
      return dict(prompt=prompt, answer=demonstrate(factors, skip), family=FAMILY, difficulty=d, metadata=meta)
  raise ValueError(f"no {split!r} problem found for difficulty={d}")


def check(example_or_metadata: Mapping[str, Any], completion: str) -> bool:
  """The final turn (after the last <|assistant|>) is exactly the product."""
  meta = base.metadata_of(example_or_metadata)
  try:
    product = 1
    for f in meta["factors"]:
      product *= int(f)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"toolmul metadata needs a list of int 'factors', got {dict(meta)!r}") from e
  answer = base.extract_answer(completion.rsplit(ASSISTANT, 1)[-1])
  return answer is not None and bool(_INT_RE.match(answer)) and int(answer) == product


tasks.register_task(sys.modules[__name__])
