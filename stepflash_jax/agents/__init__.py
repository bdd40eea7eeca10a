"""Agentic RL pieces (docs/agents.md): the XML tool-call format (tools.py), conversations with tool messages and
selective reasoning retention (chat.py), the sandbox for model-written code (sandbox.py, launcher confine.py) and
executors that run many environment calls at once, locally or on Ray (executor.py)."""

from stepflash_jax.agents import chat, executor, sandbox, tools

__all__ = ["chat", "executor", "sandbox", "tools"]
