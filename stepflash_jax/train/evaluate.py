"""Held-out exact-match accuracy by greedy decoding with the rollout engine (same code path as RL sampling); with
an `agent` config section, greedy multi-turn trajectories with the tool environment (agents/rollout.py)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import jax

from stepflash_jax import parallel
from stepflash_jax.agents.rollout import Agent
from stepflash_jax.data import jsonl, pad_prompts, padded_chunk, tasks
from stepflash_jax.data.pipeline import example_dataset
from stepflash_jax.sampling import RolloutEngine


def heldout_examples(config, tok=None) -> list:
  """A fixed list of test-split problems (disjoint from training by construction): the first eval.num_examples of
  the task mixture's test split, or of the test records of config field data.jsonl (checked with `tok`)."""
  records = jsonl.config_examples(config, tok, "test")
  if records is not None:
    return records[: config.eval.num_examples]
  ds = example_dataset(
    mixture=config.data.mixture,
    split="test",
    seed=config.eval.seed,
    num_examples=config.eval.num_examples,
    num_epochs=1,
    shuffle=False,
  )
  return [ds[i] for i in range(config.eval.num_examples)]


def eval_engine(config, tok, temperature: float) -> RolloutEngine:
  """The eval engine: eval.dtype numerics, eval.max_new_tokens; the sampling settings are traced inputs, so engines
  differing only in temperature share one compiled program."""
  e = config.eval
  return RolloutEngine(
    config.model,
    max_prompt_len=config.data.max_prompt_len,
    max_new_tokens=e.max_new_tokens,
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    dtype=e.get("dtype", "float32"),
    temperature=temperature,
  )


def padded_prompts(config, tok, chunk, rows: int | None = None) -> dict:
  """A chunk of <= `rows` (default eval.batch_size) examples as left-padded prompts of exactly `rows` rows (the
  last example repeated): one batch shape, one compilation."""
  full = padded_chunk(chunk, rows or config.eval.batch_size)
  return pad_prompts([tok.format_prompt(x["prompt"]) for x in full], config.data.max_prompt_len, pad_id=tok.pad_id)


MEMO_MAX_BYTES = 2**30  # weights above this size (or not all on this host) are not hashed: never memoized
_memo = {}  # fingerprint -> accuracy(): this process's evaluations (see accuracy)


def fingerprint(config, variables, tok, examples) -> str | None:
  """sha256 of everything accuracy() depends on: the weights (paths, dtypes, shapes, values), the eval, model and
  agent sections and data.max_prompt_len, the tokenizer's pieces, the examples; None for weights too large or
  sharded over hosts."""
  leaves = jax.tree_util.tree_leaves_with_path(variables)
  size = sum(leaf.size * leaf.dtype.itemsize for _, leaf in leaves)
  if size > MEMO_MAX_BYTES or not all(getattr(leaf, "is_fully_addressable", True) for _, leaf in leaves):
    return None
  h = hashlib.sha256()
  for path, leaf in leaves:
    a = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}".encode())
    h.update(a.tobytes())
  settings = {s: config[s].to_dict() for s in ("eval", "model", "agent") if s in config}
  settings["max_prompt_len"] = config.data.max_prompt_len
  h.update(json.dumps(settings, sort_keys=True, default=str).encode())
  h.update("\0".join(tok.id_to_piece(i) for i in range(tok.vocab_size)).encode())
  h.update(json.dumps(examples, sort_keys=True, default=str).encode())
  return h.hexdigest()


def accuracy(config, variables, tok, examples, engine=None) -> dict:
  """Greedy (temperature 0) completions of `examples` in batches of eval.batch_size, in the engine numerics
  eval.dtype, checked by their task's rule checker. An engine with the rollout's dtype, prompt width, length limit
  and batch size runs the rollout's compiled program (the sampling settings are traced inputs). With an `agent`
  section: multi-turn trajectories, `engine` an open greedy Agent (eval_agent) to reuse, else one made here.
  Memoized in this process by fingerprint(): the pipeline's table row and an RL stage's evaluation of the same
  weights (its restored SFT policy, its final policy) run once."""
  key = fingerprint(config, variables, tok, examples)
  if key is None:
    return _accuracy(config, variables, tok, examples, engine)
  if key not in _memo:
    _memo[key] = _accuracy(config, variables, tok, examples, engine)
  return dict(_memo[key])


def _accuracy(config, variables, tok, examples, engine=None) -> dict:
  e = config.eval
  if "agent" in config:
    return _agent_accuracy(config, variables, tok, examples, engine)
  engine = engine or eval_engine(config, tok, temperature=0.0)

  def greedy(chunk):
    p = padded_prompts(config, tok, chunk)
    return engine.generate(variables, p["tokens"], p["lengths"], jax.random.key(0))

  return _scored_batches(tok, examples, e.batch_size, greedy)


def _scored_batches(tok, examples, batch_size: int, greedy) -> dict:
  """_score of greedy(chunk) over `examples` in chunks of batch_size: the first chunk alone (it may compile the
  program), then two at a time: on a small CPU much of a decode step runs on one thread (parallel/threads.py)."""
  chunks = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
  outs = [greedy(chunks[0])] + parallel.thread_map(greedy, chunks[1:])
  return _score(tok, chunks, outs)


def sampled_gold(config, variables, tok, examples, seed: int = 0):
  """The hidden gold score (tasks/pref.py) of one sample per example at the rollout temperature, in the eval
  engine's shapes and numerics: float [N], or None when a family of `examples` has no gold scorer. A fixed key:
  two policies are compared on common random numbers."""
  if "agent" in config or not all(hasattr(tasks.get_task(x["family"]), "gold") for x in examples):
    return None
  engine, n, gold = eval_engine(config, tok, config.rl.temperature), config.eval.batch_size, []
  for i in range(0, len(examples), n):
    chunk = examples[i : i + n]
    p = padded_prompts(config, tok, chunk)
    out = engine.generate(variables, p["tokens"], p["lengths"], jax.random.fold_in(jax.random.key(seed), i))
    resp = np.asarray(out["response"])
    gold += [tasks.get_task(x["family"]).gold(x, tok.decode(resp[b], stop_at_eos=True)) for b, x in enumerate(chunk)]
  return np.asarray(gold, np.float64)


def gold_metrics(gold, baseline) -> dict:
  """{"gold": mean gold score, "win_rate_vs_sft": P(gold > baseline's) + P(tie) / 2 per example} ({} if None)."""
  if gold is None or baseline is None:
    return {}
  win = np.mean((gold > baseline) + 0.5 * (gold == baseline))
  return {"gold": float(gold.mean()), "win_rate_vs_sft": float(win)}


def _score(tok, chunks, outs) -> dict:
  """{"accuracy", "truncated", "accuracy_<family>[_d<difficulty>]"} and, over the examples whose family has a hidden
  gold scorer (tasks/pref.py), "greedy_gold": their mean gold score."""
  correct, truncated, groups, gold = [], [], {}, []  # groups: per family and per family and difficulty
  for chunk, out in zip(chunks, outs):
    resp, trunc = np.asarray(out["response"]), np.asarray(out["truncated"])
    for b, ex in enumerate(chunk):
      text = tok.decode(resp[b], stop_at_eos=True)
      ok = tasks.check(ex, text)
      gold_fn = getattr(tasks.get_task(ex["family"]), "gold", None)
      if gold_fn is not None:
        gold.append(gold_fn(ex, text))
      correct.append(ok)
      truncated.append(bool(trunc[b]))
      groups.setdefault(ex["family"], []).append(ok)
      groups.setdefault(f"{ex['family']}_d{ex['difficulty']}", []).append(ok)
  out = {"accuracy": float(np.mean(correct)), "truncated": float(np.mean(truncated))}
  out.update({f"accuracy_{f}": float(np.mean(v)) for f, v in sorted(groups.items())})
  if gold:
    out["greedy_gold"] = float(np.mean(gold))
  return out


def eval_agent(config, tok, temperature: float = 0.0) -> Agent:
  """The multi-turn eval sampler of an agent config (eval.max_new_tokens per trajectory, eval.dtype; greedy by
  default); the caller closes it."""
  e = config.eval
  return Agent(config, tok, e.max_new_tokens, dtype=e.get("dtype", "float32"), temperature=temperature)


def _agent_accuracy(config, variables, tok, examples, agent=None) -> dict:
  """Greedy multi-turn trajectories (at most eval.max_new_tokens tokens each, tool messages included) in batches
  of eval.batch_size (_scored_batches), checked on their final turn."""
  e, own = config.eval, agent is None
  agent = agent or eval_agent(config, tok)

  def greedy(chunk):  # fixed batch shape (the last chunk padded with copies)
    full = padded_chunk(chunk, e.batch_size)
    return agent.sample(variables, padded_prompts(config, tok, chunk), full, jax.random.key(0))

  try:
    return _scored_batches(tok, examples, e.batch_size, greedy)
  finally:
    if own:
      agent.close()
