"""Multi-turn conversations with tool calls as text in the project's chat template (docs/agents.md §1).

Messages are dicts: {"role": "system" | "user" | "assistant" | "tool", "content": str}, an assistant message may
carry "reasoning" (the text inside <think>...</think>) and "tool_calls" (ToolCall objects or {"name",
"arguments"} dicts). Rendered without separators:

    <|system|>S <|user|>U <|assistant|><think>R</think>C<tool_call>...</tool_call> <|tool|>RESULT <|assistant|>...

(spaces above only for reading). Selective reasoning retention (the report's rule): when the context is built,
the reasoning of assistant turns *before the latest user message* is dropped; the reasoning of the assistant turns
after it - the current instruction's tool trajectory - is kept.
"""

from __future__ import annotations

from stepflash_jax.agents.tools import ToolCall, format_tool_calls
from stepflash_jax.data.tokenizer import ASSISTANT, SYSTEM, THINK_CLOSE, THINK_OPEN, TOOL, USER

ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}


def _calls(message) -> list:
  return [
    c if isinstance(c, ToolCall) else ToolCall(c["name"], dict(c["arguments"])) for c in message.get("tool_calls") or ()
  ]


def render_assistant(message, keep_reasoning: bool) -> str:
  """One assistant turn's text (without the role marker)."""
  think = f"{THINK_OPEN}{message['reasoning']}{THINK_CLOSE}" if keep_reasoning and message.get("reasoning") else ""
  content = message.get("content") or ""
  calls = _calls(message)
  return think + content + ("\n" if content and calls else "") + (format_tool_calls(calls) if calls else "")


def render(messages, add_generation_prompt: bool = True) -> str:
  """The context text of a conversation; ends with the assistant marker when `add_generation_prompt`."""
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ValueError(f"messages[{i}]: expected a dict with role in {tuple(ROLES)}, got {m!r:.80}")
  users = [i for i, m in enumerate(messages) if m["role"] == "user"]
  last_user = users[-1] if users else -1
  out = []
  for i, m in enumerate(messages):
    body = render_assistant(m, keep_reasoning=i > last_user) if m["role"] == "assistant" else m.get("content", "")
    out.append(ROLES[m["role"]] + body)
  return "".join(out) + (ASSISTANT if add_generation_prompt else "")
