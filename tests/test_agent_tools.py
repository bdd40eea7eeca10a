"""The XML tool-call format (stepflash_jax/agents/tools.py) and conversation rendering (agents/chat.py)."""

import random
import re
import string

import pytest

from stepflash_jax.agents import chat
from stepflash_jax.agents.tools import ToolCall, _tagged, format_tool_call, format_tool_calls, parse_tool_calls

TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "lookup",
      "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "n": {"type": "integer"}}},
    },
  },
  {
    "name": "calc",  # a bare function schema is accepted too
    "parameters": {
      "properties": {
        "x": {"type": "number"},
        "flag": {"type": "boolean"},
        "opts": {"type": "object"},
        "xs": {"type": "array"},
      }
    },
  },
]


def test_parses_the_template_exactly():
  text = (
    "Let me look.\n<tool_call>\n<function=lookup>\n<parameter=key>\n  indented\n\tline two\n</parameter>\n"
    "<parameter=n>\n 42 \n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=calc>\n"
    '<parameter=x>\n2.5\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n<parameter=opts>\n{"a": [1, 2]}\n'
    "</parameter>\n<parameter=xs>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
  )
  content, calls, errors = parse_tool_calls(text)
  assert content == "Let me look." and errors == []
  assert calls[0] == ToolCall("lookup", {"key": "  indented\n\tline two", "n": " 42 "})  # strings without tools
  _, typed, errors = parse_tool_calls(text, tools=TOOLS)
  assert errors == []
  assert typed[0].arguments == {"key": "  indented\n\tline two", "n": 42}
  assert typed[1].arguments == {"x": 2.5, "flag": True, "opts": {"a": [1, 2]}, "xs": [1, 2]}
  assert parse_tool_calls("no calls here") == ("no calls here", [], [])


@pytest.mark.parametrize(
  "text, fragment",
  [
    ("<tool_call>\n<function=lookup>\n<parameter=key>\nx\n</parameter>\n</function>", "no </tool_call>"),
    ("<tool_call>\n<function=lookup>\n<parameter=key>\nx\n</function>\n</tool_call>", "without its </parameter>"),
    ("<tool_call>\n<function=lookup>\n</tool_call>", "no complete <function"),
    ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", "unknown function 'nope'"),
    ("<tool_call>\n<function=lookup>\n<parameter=n>\nseven\n</parameter>\n</function>\n</tool_call>", "'n'"),
    ("<tool_call>\n<function=calc>\n<parameter=flag>\nmaybe\n</parameter>\n</function>\n</tool_call>", "boolean"),
    ("<tool_call>\n<function=calc>\n<parameter=opts>\n[1]\n</parameter>\n</function>\n</tool_call>", "object"),
  ],
)
def test_malformed_calls_are_errors_not_exceptions(text, fragment):
  good = format_tool_call("lookup", {"key": "k"})
  content, calls, errors = parse_tool_calls("pre " + text + "\n" + good, tools=TOOLS)
  assert content == "pre"
  assert len(errors) == 1 and fragment in errors[0], errors
  assert calls == [ToolCall("lookup", {"key": "k"})]  # the well-formed call after it still counts


def _random_value(rng):
  alphabet = string.printable + "äß中\t"
  return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))


def test_format_round_trips_exactly():
  rng = random.Random(0)
  for _ in range(300):
    args = {f"k{j}_{rng.randint(0, 9)}": _random_value(rng) for j in range(rng.randint(0, 4))}
    args = {k: v for k, v in args.items() if "</" not in v and "<tool_call>" not in v}
    calls = [ToolCall(f"fn{rng.randint(0, 3)}", args), ToolCall("other", {"v": _random_value(rng).replace("<", "")})]
    content, got, errors = parse_tool_calls("thinking done\n" + format_tool_calls(calls))
    assert (content, got, errors) == ("thinking done", calls, [])
  typed = {"key": "a b", "n": -3}
  assert parse_tool_calls(format_tool_call("lookup", typed), tools=TOOLS)[1] == [ToolCall("lookup", typed)]
  for bad in ({"k": "x</parameter>y"}, {"a>b": "x"}, {" k": "x"}, {"": "x"}):
    with pytest.raises(ValueError):
      format_tool_call("lookup", bad)


def test_parser_never_raises_on_random_and_mutated_text():
  """Property test: random strings over the template's own characters and mutations (deleted, duplicated,
  swapped spans) of valid texts always give (str, [ToolCall], [str])."""
  rng = random.Random(1)
  pieces = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">", "\n", "x"]
  valid = format_tool_calls([ToolCall("lookup", {"key": "k\n v", "n": "3"}), ToolCall("calc", {"x": "1"})])
  for i in range(3000):
    if i % 2:
      text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
    else:
      a, b = sorted(rng.randint(0, len(valid)) for _ in range(2))
      op = rng.randrange(3)
      text = [valid[:a] + valid[b:], valid[:b] + valid[a:], valid[b:] + valid[a:b] + valid[:a]][op]
    for tools in (None, TOOLS):
      content, calls, errors = parse_tool_calls(text, tools=tools)
      assert isinstance(content, str) and all(isinstance(e, str) for e in errors)
      assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in calls)
  assert parse_tool_calls(None)[2] and parse_tool_calls(b"<tool_call>")[2]  # not even a str: an error entry


def test_tag_scan_matches_the_regex_it_replaces():
  """`_tagged` finds exactly the matches of `<tag=([^>\\n]*)>(.*?)</tag>` (DOTALL) and removes them as re.sub does,
  on random strings over the pieces where the two could part (names running into newlines, nested or unclosed tags)."""
  regex = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
  rng = random.Random(2)
  pieces = ["<function=", "</function>", "</func", "a", ">", "<", "=", "\n", "x"]
  for _ in range(20000):
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 16)))
    assert _tagged(text, "function") == ([m.groups() for m in regex.finditer(text)], regex.sub("", text)), text


def test_hostile_repetition_parses_to_the_right_errors():
  """Hundreds of KB of unclosed openers (quadratic for a lazy regex or a rescan per opener) give one error per
  unclosed <tool_call>, and closed calls among them still count."""
  n = 20000
  content, calls, errors = parse_tool_calls("<tool_call>" * n)
  assert (content, calls, len(errors)) == ("", [], n)
  _, calls, errors = parse_tool_calls(
    "<tool_call>\n<function=lookup>\n" + "<parameter=key>" * n + "</function>\n</tool_call>"
  )
  assert calls == [] and len(errors) == 1 and "without its </parameter>" in errors[0]
  closed = format_tool_call("lookup", {"key": "k"})
  _, calls, errors = parse_tool_calls((closed + "<function=lookup>") * 1000)
  assert calls == [ToolCall("lookup", {"key": "k"})] * 1000 and errors == []


def test_render_keeps_reasoning_only_for_the_current_instruction():
  call = ToolCall("lookup", {"key": "a"})
  messages = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "first"},
    {"role": "assistant", "reasoning": "old thought", "content": "", "tool_calls": [call]},
    {"role": "tool", "content": "1"},
    {"role": "assistant", "reasoning": "old final thought", "content": "answer 1"},
    {"role": "user", "content": "second"},
    {
      "role": "assistant",
      "reasoning": "new thought",
      "content": "",
      "tool_calls": [{"name": "lookup", "arguments": {"key": "b"}}],
    },
    {"role": "tool", "content": "2"},
  ]
  text = chat.render(messages)
  assert "old thought" not in text and "old final thought" not in text
  assert "<think>new thought</think>" in text
  expected_tail = "<|user|>second<|assistant|><think>new thought</think>" + format_tool_call("lookup", {"key": "b"})
  assert text.endswith(expected_tail + "<|tool|>2<|assistant|>")
  assert text.startswith("<|system|>S<|user|>first<|assistant|>" + format_tool_call("lookup", {"key": "a"}))
  with pytest.raises(ValueError, match="messages\\[0\\]"):
    chat.render([{"role": "robot", "content": "x"}])


def test_one_unconvertible_value_drops_only_its_call():
  """A 400-digit number (OverflowError as a float) or JSON nested past the recursion limit is an error for its call;
  the turn's other calls still count."""
  huge = format_tool_call("calc", {"x": "9" * 400})
  deep = format_tool_call("calc", {"opts": "[" * 100_000 + "]" * 100_000})
  ok = format_tool_call("lookup", {"key": "a", "n": 2})
  content, calls, errors = parse_tool_calls(huge + "\n" + deep + "\n" + ok, TOOLS)
  assert [c.name for c in calls] == ["lookup"] and calls[0].arguments == {"key": "a", "n": 2}
  assert len(errors) == 2 and "OverflowError" in errors[0] and "RecursionError" in errors[1], errors
