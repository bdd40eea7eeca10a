"""Multiplication with a calculator tool: the task family of agentic RL (configs/agent.py, docs/agents.md §4).

difficulty d = digits of every factor (3..6); variant None: a*b (one tool call), "3": a*b*c (two calls, the
second on the first's result). The tiny model cannot multiply 3+ digit numbers itself; with the `multiply` tool it
only has to copy digits into the calls and the final result out of the last tool message:

  prompt  "Use multiply: 482*551*77"
  answer  <tool_call>..multiply(a=482, b=551)..</tool_call><|tool|>265582<|assistant|>
          <tool_call>..multiply(a=265582, b=77)..</tool_call><|tool|>20449814<|assistant|>20449814

The demonstration is made like the report's tool-use data (atomic intents as a finite-state machine, sample ->
execute -> verify): the state is (running product, factors left); the intent "multiply" is executed by the real
environment (envs.calculator_step on the formatted call), the intent "answer" ends; the finished demonstration is
kept only if its answer verifies (rejection on deterministic feedback). Tool messages are context: the SFT loss
and the RL objectives skip them (tokenizer.format_example, agents/rollout.py). The checker reads the text after
the last <|assistant|> marker (the final turn).
"""

from __future__ import annotations

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
VARIANTS = (None, "3")
# one token each in a tokenizer whose families include this one (tokenizer.symbols)
SYMBOLS = (CALL_OPEN, CALL_CLOSE, "<function=", "</function>", "<parameter=", "</parameter>", TOOL)
_INT_RE = re.compile(r"^\d{1,64}$")


def canonical(metadata: Mapping[str, Any]) -> str:
  return f"{FAMILY}:" + "*".join(str(int(f)) for f in metadata["factors"])


def demonstrate(factors) -> str:
  """The tool-use trajectory for factors (module docstring): execute each intent, verify the answer."""
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
  d, rng = base.generator_rng(FAMILY, DIFFICULTIES, VARIANTS, seed, difficulty, split, variant)
  n = 3 if variant == "3" else 2
  for _ in range(base.MAX_REJECTION_TRIES):
    factors = [operand(rng, d) for _ in range(n)]
    if base.split_of(canonical({"factors": factors})) == split:
      prompt = "Use multiply: " + "*".join(map(str, factors))
      meta = {"factors": factors}
      return dict(prompt=prompt, answer=demonstrate(factors), family=FAMILY, difficulty=d, metadata=meta)
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
