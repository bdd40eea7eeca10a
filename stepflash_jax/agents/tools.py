"""Step 3.5 Flash's XML tool-call format: parse model output, format calls (docs/agents.md §1).

One call (the shape vLLM's `step3p5` parser reads; flat strings, nothing is escaped):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

A turn may hold several calls; the text before the first one is the turn's content. A value loses exactly one
framing newline at each end (the ones the template puts around it); inner whitespace and indentation are kept.
With `tools` (OpenAI-style function schemas) values are converted to the parameter's JSON-schema type: integer,
number, boolean, null, object / array (JSON); strings stay as written. Everything that does not fit - a missing
closing tag, an unknown function or parameter type, a value that does not convert - becomes an entry of `errors`;
`parse_tool_calls` never raises.
"""

from __future__ import annotations

import dataclasses
import json
import re

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict


def _schemas(tools) -> dict:
  """{function name: {parameter: JSON-schema type or None}} of OpenAI-style tool entries ({"type": "function",
  "function": {...}}) or bare function schemas ({"name", "parameters"})."""
  out = {}
  for t in tools or ():
    fn = t.get("function", t) if isinstance(t, dict) else {}
    props = (fn.get("parameters") or {}).get("properties") or {}
    out[str(fn.get("name"))] = {k: (v or {}).get("type") if isinstance(v, dict) else None for k, v in props.items()}
  return out


def _tagged(text: str, tag: str) -> tuple[list[tuple[str, str]], str]:
  """The (name, body) pairs of `<tag=NAME>BODY</tag>` in `text`, and the text with them removed.

  The matches of the regex `<tag=([^>\\n]*)>(.*?)</tag>` (DOTALL), found in O(len(text)): the regex is quadratic on
  hostile input (every unclosed `<tag=` scans to the end), this scan looks at each character a bounded number of
  times: the name's end and the closing tag are found once and reused while the search moves forward."""
  opener, closer, n = f"<{tag}=", f"</{tag}>", len(text)
  pairs, kept, pos = [], [], 0
  gt = nl = close = -1  # the last `>`, newline and closing tag found (n: none further on)
  i = text.find(opener)
  while i >= 0:
    j = i + len(opener)
    if gt < j:
      gt = text.find(">", j) % (n + 1)  # -1 -> n
    if nl < j:
      nl = text.find("\n", j) % (n + 1)
    if nl < gt or gt == n:  # the name runs into a newline or the end: not a tag
      i = text.find(opener, i + 1)
      continue
    if close <= gt:
      close = text.find(closer, gt + 1)
    if close < 0:  # no closing tag after this opener, so none after any later one
      break
    pairs.append((text[j:gt], text[gt + 1 : close]))
    kept.append(text[pos:i])
    pos = close + len(closer)
    i = text.find(opener, pos)
  return pairs, "".join(kept) + text[pos:]


def _unframe(value: str) -> str:
  """Drop one leading and one trailing newline (the template's framing)."""
  value = value[1:] if value.startswith("\n") else value
  return value[:-1] if value.endswith("\n") else value


def _convert(value: str, kind):
  """A parameter's string -> its JSON-schema type (ValueError if it does not convert)."""
  kind = kind[0] if isinstance(kind, list) and kind else kind  # ["integer", "null"] -> the first
  if kind in (None, "string"):
    return value
  text = value.strip()
  if kind == "integer":
    return int(text)
  if kind == "number":
    out = float(text)
    return int(out) if re.fullmatch(r"[+-]?\d+", text) else out
  if kind == "boolean":
    if text.lower() not in ("true", "false"):
      raise ValueError(f"not a boolean: {text[:40]!r}")
    return text.lower() == "true"
  if kind == "null":
    if text.lower() not in ("null", "none", ""):
      raise ValueError(f"not null: {text[:40]!r}")
    return None
  if kind in ("object", "array"):
    out = json.loads(text)
    if not isinstance(out, dict if kind == "object" else list):
      raise ValueError(f"not an {kind}: {text[:40]!r}")
    return out
  raise ValueError(f"unknown schema type {kind!r}")


def _parse_function(name: str, body: str, schemas: dict | None, errors: list) -> ToolCall | None:
  name = name.strip()
  if schemas is not None and name not in schemas:
    errors.append(f"unknown function {name!r}")
    return None
  types = (schemas or {}).get(name, {})
  args = {}
  parameters, rest = _tagged(body, "parameter")
  for key, value in parameters:
    key, value = key.strip(), _unframe(value)
    try:
      args[key] = _convert(value, types.get(key))
    except (ValueError, TypeError, OverflowError, RecursionError) as e:  # e.g. a 400-digit number, deep JSON
      errors.append(f"function {name!r} parameter {key!r}: {type(e).__name__}: {str(e)[:200]}")
      return None
  if "<parameter=" in rest:
    errors.append(f"function {name!r}: a <parameter=...> without its </parameter>")
    return None
  return ToolCall(name, args)


def parse_tool_calls(text, tools=None):
  """text -> (content: str, calls: list[ToolCall], errors: list[str]). Never raises.

  content: the text before the first <tool_call> (stripped of trailing whitespace). tools: OpenAI-style function
  schemas (or None: every function accepted, every value a string)."""
  try:
    return _parse(text, tools)
  except Exception as e:  # noqa: BLE001 - the contract: malformed input is an error entry, never an exception
    return (text if isinstance(text, str) else "", [], [f"unparseable tool-call text: {type(e).__name__}: {e}"])


def _parse(text, tools):
  if not isinstance(text, str):
    return "", [], [f"expected str, got {type(text).__name__}"]
  schemas = _schemas(tools) if tools is not None else None
  start = text.find(CALL_OPEN)
  if start < 0:
    return text, [], []
  content, calls, errors = text[:start].rstrip(), [], []
  pos, end = start, -2
  while pos >= 0:
    if end != -1 and end < pos:  # the first </tool_call> from pos on (found once: a linear scan on hostile text)
      end = text.find(CALL_CLOSE, pos)
    nxt = text.find(CALL_OPEN, pos + len(CALL_OPEN))
    if end < 0 or (0 <= nxt < end):
      errors.append(f"a <tool_call> at character {pos} has no </tool_call>")
      pos = nxt
      continue
    block = text[pos + len(CALL_OPEN) : end]
    functions, _ = _tagged(block, "function")
    if not functions:
      errors.append(f"the <tool_call> at character {pos} holds no complete <function=...>...</function>")
    for name, body in functions:
      call = _parse_function(name, body, schemas, errors)
      if call is not None:
        calls.append(call)
    pos = text.find(CALL_OPEN, end)
  return content, calls, errors


def _as_text(value) -> str:
  return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def format_tool_call(name: str, arguments: dict) -> str:
  """One call in the XML template; `parse_tool_calls` reads it back exactly (non-string values as JSON, which
  converts back under a schema of that type). ValueError for what the flat format cannot carry: an empty name or
  key, one with '<', '>', a newline or surrounding spaces, a value containing a tag that closes the call."""
  bad = lambda s: not isinstance(s, str) or not s or s != s.strip() or re.search(r"[<>\n]", s)
  if bad(name):
    raise ValueError(f"tool name {name!r} cannot be written in the XML template")
  lines = [CALL_OPEN, f"<function={name}>"]
  for key, value in arguments.items():
    if bad(key):
      raise ValueError(f"parameter name {key!r} cannot be written in the XML template")
    text = _as_text(value)
    if any(tag in text for tag in ("</parameter>", "</function>", CALL_OPEN, CALL_CLOSE)):
      raise ValueError(f"the value of {key!r} contains a closing tag of the template")
    lines += [f"<parameter={key}>", text, "</parameter>"]
  return "\n".join(lines + ["</function>", CALL_CLOSE])


def format_tool_calls(calls) -> str:
  """Several calls, one after the other (a turn's tool calls)."""
  return "\n".join(format_tool_call(c.name, c.arguments) for c in calls)
