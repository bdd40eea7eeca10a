"""Agentic RL pieces (docs/agents.md): the XML tool-call format (tools.py), conversations with tool messages and
selective reasoning retention (chat.py), the sandbox for model-written code (sandbox.py, launcher confine.py),
executors that run many environment calls at once, locally or on Ray (executor.py), multi-turn rollouts
(rollout.py), tool environments (envs.py) and the tool-use task family `toolmul` (toolmul.py, registered with
data.tasks on import)."""

from stepflash_jax.agents import chat, envs, executor, rollout, sandbox, tools, toolmul

__all__ = ["chat", "envs", "executor", "rollout", "sandbox", "tools", "toolmul"]
