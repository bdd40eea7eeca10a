"""Self-distillation data (report §5, docs/rl.md §12): domain experts re-roll the SFT prompts and rejection sampling
keeps what a student should learn from.

For each prompt, `samples` responses at the rollout temperature; a response is removed by the FIRST predicate of
`filters` that rejects it (counted under that name, so the counts are disjoint):
    correct        the task's rule checker rejects it (wrong, or cut off by the length limit)
    <filter>       any zero-reward filter of rl/rewards.py, e.g. "mixed_script" (language mixing), "format"
    length         more response tokens than length_budget x the shortest correct response to the same prompt
                   (over-long thinking)
    duplicate      the same text as a response already kept for this prompt (always applied last)
then at most `keep` responses per prompt are kept.

The dataset is JSON Lines (one example per line, the project's example format plus provenance), readable with
    grain.MapDataset.source(read_examples(path))
    {"prompt", "answer" (the kept response: the SFT target), "family", "difficulty", "metadata" (the checker's),
     "domain", "expert", "response_tokens"}
"""

from __future__ import annotations

import json

import jax
import numpy as np

from stepflash_jax.data import padded_chunk, tasks
from stepflash_jax.files import atomic_write
from stepflash_jax.rl import rewards
from stepflash_jax.train import evaluate

BUILTIN = ("correct", "length")


def check_filters(filters) -> tuple[str, ...]:
  """The predicate names, validated (ValueError naming the field distill.filters)."""
  filters = tuple(filters)
  for f in filters:
    if f not in BUILTIN and f not in rewards.available_filters():
      raise ValueError(
        f"config field 'distill.filters': unknown predicate {f!r}; known: {list(BUILTIN) + rewards.available_filters()}"
      )
  return filters


def sample_responses(config, variables, tok, examples, samples: int, seed: int):
  """`samples` responses per example at rl.temperature with the eval engine (fixed batch shape, one compile), or
  multi-turn trajectories with the tool environment for a config with an `agent` section (the text then holds
  the tool messages, "A1<|tool|>R1<|assistant|>A2", the SFT answer format of tokenizer.format_example):
  -> (texts [N][samples] str, lengths [N, samples] int (all tokens), truncated [N, samples] bool)."""
  rows = config.eval.batch_size
  if "agent" in config:
    agent = evaluate.eval_agent(config, tok, config.rl.temperature)
    generate = lambda p, chunk, key: agent.sample(variables, p, padded_chunk(chunk, rows), key)
    close = agent.close
  else:
    engine = evaluate.eval_engine(config, tok, config.rl.temperature)
    generate = lambda p, chunk, key: engine.generate(variables, p["tokens"], p["lengths"], key)
    close = lambda: None
  flat = [ex for ex in examples for _ in range(samples)]
  texts, lengths, truncated = [], [], []
  try:
    for i in range(0, len(flat), rows):
      chunk = flat[i : i + rows]
      p = evaluate.padded_prompts(config, tok, chunk, rows)
      _collect(
        tok, generate(p, chunk, jax.random.fold_in(jax.random.key(seed), i)), len(chunk), texts, lengths, truncated
      )
  finally:
    close()
  shape = (len(examples), samples)
  texts = [texts[k * samples : (k + 1) * samples] for k in range(len(examples))]
  return texts, np.reshape(lengths, shape), np.reshape(truncated, shape)


def _collect(tok, out, n, texts, lengths, truncated):
  """Appends the first n rows of a generation's output (decoded text, token count, truncated flag)."""
  resp, lens, trunc = (np.asarray(out[k]) for k in ("response", "lengths", "truncated"))
  for b in range(n):
    texts.append(tok.decode(resp[b], stop_at_eos=True))
    lengths.append(int(lens[b]))
    truncated.append(bool(trunc[b]))


def select(examples, texts, lengths, truncated, filters, length_budget: float, keep: int):
  """Rejection sampling over sampled responses -> (kept [(example index, text, tokens)], counts by reason)."""
  counts = {"sampled": int(lengths.size), **{f: 0 for f in filters}, "duplicate": 0, "over_keep": 0, "kept": 0}
  kept = []
  for n, ex in enumerate(examples):
    ok = [not truncated[n, s] and tasks.check(ex, t) for s, t in enumerate(texts[n])]
    shortest = min((int(lengths[n, s]) for s in range(len(ok)) if ok[s]), default=None)
    seen = set()
    for s, text in enumerate(texts[n]):
      reason = _first_rejection(ex, text, int(lengths[n, s]), ok[s], shortest, filters, length_budget)
      if reason is None and text in seen:
        reason = "duplicate"
      elif reason is None and len(seen) >= keep:
        reason = "over_keep"
      if reason is not None:
        counts[reason] += 1
        continue
      seen.add(text)
      kept.append((n, text, int(lengths[n, s])))
  counts["kept"] = len(kept)
  return kept, counts


def _first_rejection(ex, text, length, correct, shortest, filters, length_budget):
  for f in filters:
    if f == "correct":
      bad = not correct
    elif f == "length":
      bad = shortest is not None and length > length_budget * shortest
    else:
      bad = rewards.get_filter(f)(ex["prompt"], text, **rewards.example_kwargs(ex))
    if bad:
      return f
  return None


def distill_domain(config, variables, tok, examples, *, domain: str, expert: str, seed: int):
  """One expert's rejection-sampled examples (module docstring format) and the counts, from config.distill."""
  d = config.distill
  texts, lengths, truncated = sample_responses(config, variables, tok, examples, d.samples, seed)
  kept, counts = select(examples, texts, lengths, truncated, check_filters(d.filters), d.length_budget, d.keep)
  records = [
    {**examples[n], "answer": text, "domain": domain, "expert": expert, "response_tokens": length}
    for n, text, length in kept
  ]
  return records, counts


def write_examples(path: str, records) -> str:
  return atomic_write(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def read_examples(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
