"""Held-out exact-match accuracy by greedy decoding with the rollout engine (same code path as RL sampling); with
an `agent` config section, greedy multi-turn trajectories with the tool environment (agents/rollout.py)."""

from __future__ import annotations

import numpy as np
import jax

from stepflash_jax import parallel
from stepflash_jax.agents.rollout import Agent
from stepflash_jax.data import pad_prompts, tasks
from stepflash_jax.data.pipeline import example_dataset
from stepflash_jax.sampling import RolloutEngine


def heldout_examples(config) -> list:
  """A fixed list of test-split problems (disjoint from training by construction)."""
  ds = example_dataset(
    mixture=config.data.mixture,
    split="test",
    seed=config.eval.seed,
    num_examples=config.eval.num_examples,
    num_epochs=1,
    shuffle=False,
  )
  return [ds[i] for i in range(config.eval.num_examples)]


def accuracy(config, variables, tok, examples, engine=None) -> dict:
  """Greedy (temperature 0) completions of `examples` in batches of eval.batch_size, in the engine numerics
  eval.dtype, checked by their task's rule checker. An engine with the rollout's dtype, prompt width, length limit
  and batch size runs the rollout's compiled program (the sampling settings are traced inputs)."""
  e = config.eval
  if "agent" in config:
    return _agent_accuracy(config, variables, tok, examples)
  engine = engine or RolloutEngine(
    config.model,
    max_prompt_len=config.data.max_prompt_len,
    max_new_tokens=e.max_new_tokens,
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    dtype=e.get("dtype", "float32"),
    temperature=0.0,
  )
  chunks = [examples[i : i + e.batch_size] for i in range(0, len(examples), e.batch_size)]

  def greedy(chunk):  # fixed batch shape (the last chunk padded with copies): one compilation
    chunk = chunk + [chunk[-1]] * (e.batch_size - len(chunk))
    p = pad_prompts([tok.format_prompt(x["prompt"]) for x in chunk], config.data.max_prompt_len, pad_id=tok.pad_id)
    return engine.generate(variables, p["tokens"], p["lengths"], jax.random.key(0))

  # the first batch alone (it may compile the program), then two at a time: on a small CPU much of a decode step
  # runs on one thread (parallel/threads.py)
  outs = [greedy(chunks[0])] + parallel.thread_map(greedy, chunks[1:])
  return _score(tok, chunks, outs)


def _score(tok, chunks, outs) -> dict:
  correct, truncated, groups = [], [], {}  # groups: per family and per family and difficulty
  for chunk, out in zip(chunks, outs):
    resp, trunc = np.asarray(out["response"]), np.asarray(out["truncated"])
    for b, ex in enumerate(chunk):
      ok = tasks.check(ex, tok.decode(resp[b], stop_at_eos=True))
      correct.append(ok)
      truncated.append(bool(trunc[b]))
      groups.setdefault(ex["family"], []).append(ok)
      groups.setdefault(f"{ex['family']}_d{ex['difficulty']}", []).append(ok)
  out = {"accuracy": float(np.mean(correct)), "truncated": float(np.mean(truncated))}
  out.update({f"accuracy_{f}": float(np.mean(v)) for f, v in sorted(groups.items())})
  return out


def _agent_accuracy(config, variables, tok, examples) -> dict:
  """Greedy multi-turn trajectories (at most eval.max_new_tokens tokens each, tool messages included) in batches
  of eval.batch_size, checked on their final turn."""
  e = config.eval
  agent = Agent(config, tok, e.max_new_tokens, dtype=e.get("dtype", "float32"), temperature=0.0)
  chunks = [examples[i : i + e.batch_size] for i in range(0, len(examples), e.batch_size)]
  try:
    outs = []
    for chunk in chunks:  # fixed batch shape (the last chunk padded with copies)
      full = chunk + [chunk[-1]] * (e.batch_size - len(chunk))
      p = pad_prompts([tok.format_prompt(x["prompt"]) for x in full], config.data.max_prompt_len, pad_id=tok.pad_id)
      outs.append(agent.sample(variables, p, full, jax.random.key(0)))
  finally:
    agent.close()
  return _score(tok, chunks, outs)
