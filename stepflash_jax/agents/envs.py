"""Tool environments: execute the tool calls of one model turn and write the tool message (docs/agents.md §4).

An environment is a step function for the executors (module-level, so Ray can pickle it):

    step({"example": ..., "text": the turn's text}) -> {"message": str, "calls", "parse_errors", "tool_errors",
                                                        "timeouts": int}

  "calculator"  multiply(a: integer, b: integer): exact integer product, computed here from the parsed integers
                (|a|, |b| < 10**MAX_DIGITS, else a tool error). The tool of the toolmul family.
  "python"      python(code: string): the code runs in the sandbox (sandbox.run_python, 2 s, 128 MB); the message
                is its stdout (or the error), cut to MAX_MESSAGE characters.
Several calls in one turn give one message, their results on separate lines. A turn whose calls all fail to parse
gets the parser's first error as its message, so the policy sees what went wrong.
"""

from __future__ import annotations

from stepflash_jax.agents import sandbox
from stepflash_jax.agents.tools import parse_tool_calls

MAX_DIGITS = 40
MAX_MESSAGE = 200


def _schema(name: str, **params) -> dict:
  props = {k: {"type": t} for k, t in params.items()}
  return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


CALCULATOR_TOOLS = [_schema("multiply", a="integer", b="integer")]
PYTHON_TOOLS = [_schema("python", code="string")]


def multiply(arguments: dict) -> str:
  """The calculator's one tool; ValueError for missing or oversized arguments."""
  if set(arguments) != {"a", "b"}:
    raise ValueError(f"multiply takes a and b, got {sorted(arguments)}")
  a, b = arguments["a"], arguments["b"]
  if max(abs(a), abs(b)) >= 10**MAX_DIGITS:
    raise ValueError(f"operands must have fewer than {MAX_DIGITS} digits")
  return str(a * b)


def _step(text: str, tools: list, run) -> dict:
  _, calls, errors = parse_tool_calls(text, tools=tools)
  out = {"calls": len(calls), "parse_errors": len(errors), "tool_errors": 0, "timeouts": 0}
  lines = []
  for call in calls:
    try:
      result, timed_out = run(call)
      out["timeouts"] += int(timed_out)
    except (ValueError, TypeError, OverflowError) as e:
      result = f"error: {e}"
      out["tool_errors"] += 1
    lines.append(result[:MAX_MESSAGE])
  if not lines:
    lines = [f"error: {errors[0]}" if errors else "error: no tool call"]
  return {"message": "\n".join(lines), **out}


def calculator_step(item: dict) -> dict:
  return _step(item["text"], CALCULATOR_TOOLS, lambda call: (multiply(call.arguments), False))


def _python(call):
  if set(call.arguments) != {"code"}:
    raise ValueError(f"python takes code, got {sorted(call.arguments)}")
  r = sandbox.run_python(call.arguments["code"], timeout_s=2.0, memory_mb=128, max_output_bytes=4096)
  return (
    r.stdout.strip() if r.error is None and r.exit_code == 0 else f"error: {r.error or r.stderr[-120:]}"
  ), r.timed_out


def python_step(item: dict) -> dict:
  return _step(item["text"], PYTHON_TOOLS, _python)


ENVIRONMENTS = {"calculator": calculator_step, "python": python_step}


def get(name: str):
  if name not in ENVIRONMENTS:
    raise ValueError(f"agent.env must be one of {sorted(ENVIRONMENTS)}, got {name!r}")
  return ENVIRONMENTS[name]
