"""Learned reward models on the project's backbone (docs/rewards.md §2-3; report §5, "non-verifiable rewards").

BT     r(x, y) = the value head at the last token of [bos <|user|> x <|assistant|> y eos] (the critic's architecture)
       loss    = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))
GenRM  the language model reads the user turn "Judge x Reference y_ref Candidate y" and answers one token, "better"
       or "worse"; loss = cross-entropy of the label's token (full vocabulary, fp32).
       confidence c = p(better) / (p(better) + p(worse)) at the answer position.
Both turn a candidate into the Bradley-Terry win rate against the task's fixed reference answer (the pairwise
reading of the report: BT: c = sigmoid(r(x, y) - r(x, y_ref)); GenRM: c as above), with the length penalty entering
the confidence's logit:

  reward = sigmoid(logit(c) - length_penalty * max(0, |y| - |y_ref|) / |y_ref|)      |.| in tokens

A candidate the judge cannot read (longer than max_len tokens with the template) or, for the GenRM, a verdict whose
mass p(better) + p(worse) is below min_verdict_mass is `unparsed` (reward 0, counted by rl/rewards.score_batch).
Scoring is batched: fixed [batch_size, max_len] chunks, one jitted forward each (one compilation per shape).
Numerics: the model in its config dtype, the value head, logits, softmax and losses in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import model as model_lib
from stepflash_jax.data import padded_chunk, tasks

KINDS = ("bt", "genrm")
VERDICTS = ("better", "worse")  # the GenRM's answer tokens (tasks/pref.py SYMBOLS): candidate vs reference
EPS = 1e-6


def judge_text(prompt: str, reference: str, candidate: str) -> str:
  """The GenRM's user turn."""
  return f"Judge {prompt} Reference {reference} Candidate {candidate}"


def verdict_ids(tok) -> np.ndarray:
  """Token ids of VERDICTS; a tokenizer without them as single pieces is a clear error."""
  ids = [tok.encode(v) for v in VERDICTS]
  if any(len(i) != 1 for i in ids):
    raise ValueError(f"the tokenizer must hold {VERDICTS} as single pieces (add 'pref' to data.tokenizer_families)")
  return np.array([i[0] for i in ids], np.int32)


def reference_answer(example) -> str:
  """The fixed reference a candidate is judged against: the task's `reference` if it has one, else its answer."""
  ref = getattr(tasks.get_task(example["family"]), "reference", None)
  return ref(example["metadata"]) if ref else example["answer"]


def bt_row(tok, prompt: str, response: str) -> list[int]:
  return tok.format_prompt(prompt) + tok.encode(response) + [tok.eos_id]


def genrm_row(tok, prompt: str, reference: str, candidate: str) -> list[int]:
  return tok.format_prompt(judge_text(prompt, reference, candidate))


def pad_rows(rows, width: int, pad_id: int):
  """Right-padded int32 [N, width] and lengths [N]; rows longer than width are cut (the caller flags them)."""
  tokens = np.full((len(rows), width), pad_id, np.int32)
  lengths = np.zeros((len(rows),), np.int32)
  for i, r in enumerate(rows):
    r = r[:width]
    tokens[i, : len(r)], lengths[i] = r, len(r)
  return tokens, lengths


def _last(x, lengths):
  """x [N, T, ...] -> x[n, lengths[n] - 1]."""
  idx = (lengths - 1).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def bt_scores(args, variables, tokens, lengths):
  """tokens [N, T] right-padded, lengths [N] -> r [N] float32: the value head at each row's last token."""
  values = model_lib.apply(args, variables, tokens, head="value")["values"]
  return _last(values, lengths).astype(jnp.float32)


def verdict_logprobs(args, variables, tokens, lengths, ids):
  """tokens [N, T] right-padded (each row a judge prompt), ids [2] -> log p(better), log p(worse) [N, 2] float32 at
  the last prompt token (full-vocabulary softmax; only that position's logits are formed)."""
  normed, w = model_lib.apply(args, variables, tokens, logits=False)["heads"][0]
  logits = _last(normed, lengths).astype(jnp.float32) @ w.astype(jnp.float32)  # [N, V]
  return jax.nn.log_softmax(logits, axis=-1)[:, ids]


def bt_loss(params, router, batch, args):
  """batch: tokens [2n, T] (n chosen rows, then their n rejected rows), lengths [2n] -> (mean -log sigmoid(r_c - r_r),
  metrics)."""
  r = bt_scores(args, {"params": params, "router": router}, batch["tokens"], batch["lengths"])
  rc, rr = jnp.split(r, 2)
  loss = -jnp.mean(jax.nn.log_sigmoid(rc - rr))
  return loss, {"loss": loss, "accuracy": jnp.mean((rc > rr).astype(jnp.float32))}


def genrm_loss(params, router, batch, args, ids):
  """batch: tokens [n, T] judge prompts, lengths [n], label [n] (0 = better, 1 = worse) -> (mean CE, metrics)."""
  lp = verdict_logprobs(args, {"params": params, "router": router}, batch["tokens"], batch["lengths"], ids)
  picked = jnp.take_along_axis(lp, batch["label"][:, None], axis=1)[:, 0]
  loss = -jnp.mean(picked)
  pred = (lp[:, 1] > lp[:, 0]).astype(jnp.int32)
  return loss, {"loss": loss, "accuracy": jnp.mean((pred == batch["label"]).astype(jnp.float32))}


@functools.lru_cache(maxsize=None)
def _programs(args):
  return {
    "bt": jax.jit(functools.partial(bt_scores, args)),
    "genrm": jax.jit(functools.partial(verdict_logprobs, args)),
  }


def sigmoid(x):
  """1 / (1 + exp(-x)) in float64 (NumPy: host-side rewards and labels)."""
  return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def win_rate(confidence, length, ref_length, length_penalty: float):
  """sigmoid(logit(c) - length_penalty * max(0, length - ref_length) / ref_length), all float arrays [N]."""
  c = np.clip(np.asarray(confidence, np.float64), EPS, 1 - EPS)
  excess = np.maximum(0.0, np.asarray(length, np.float64) - ref_length) / np.maximum(ref_length, 1)
  return sigmoid(np.log(c / (1 - c)) - length_penalty * excess)


class LearnedReward:
  """The batched reward of a trained BT model or GenRM (module docstring); an object rl/rewards.score_batch accepts.

  variables: the reward model's {"params", "router"} (BT: the critic layout with a value head; GenRM: the LM)."""

  def __init__(self, kind, args, variables, tok, *, max_len, batch_size, length_penalty, min_verdict_mass=0.5):
    if kind not in KINDS:
      raise ValueError(f"reward model kind must be one of {KINDS}, got {kind!r}")
    if length_penalty < 0:
      raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")
    self.kind, self.args, self.variables, self.tok = kind, model_lib.as_args(args), variables, tok
    self.max_len, self.batch_size, self.length_penalty = int(max_len), int(batch_size), float(length_penalty)
    self.min_verdict_mass = float(min_verdict_mass)
    self.ids = verdict_ids(tok) if kind == "genrm" else None

  def _forward(self, rows) -> np.ndarray:
    """One jitted call per chunk of batch_size rows (the last chunk padded with copies) -> [len(rows), ...]."""
    fn, out = _programs(self.args)[self.kind], []
    for i in range(0, len(rows), self.batch_size):
      chunk = rows[i : i + self.batch_size]
      tokens, lengths = pad_rows(padded_chunk(chunk, self.batch_size), self.max_len, self.tok.pad_id)
      extra = (jnp.asarray(self.ids),) if self.kind == "genrm" else ()
      out.append(np.asarray(fn(self.variables, jnp.asarray(tokens), jnp.asarray(lengths), *extra))[: len(chunk)])
    return np.concatenate(out)

  def confidence(self, prompts, references, candidates) -> tuple[np.ndarray, np.ndarray]:
    """P(candidate better than reference) [N] and unparsed [N] bool (too long, or the verdict mass too small)."""
    enc = self.tok
    if self.kind == "genrm":
      rows = [genrm_row(enc, p, r, c) for p, r, c in zip(prompts, references, candidates)]
      lp = self._forward(rows)
      p = np.exp(lp.astype(np.float64))
      conf = p[:, 0] / np.maximum(p.sum(1), 1e-30)
      unparsed = np.array([len(r) > self.max_len for r in rows]) | (p.sum(1) < self.min_verdict_mass)
      return conf, unparsed
    cand = [bt_row(enc, p, c) for p, c in zip(prompts, candidates)]
    refs = {(p, r): bt_row(enc, p, r) for p, r in zip(prompts, references)}  # each prompt's reference once
    scores = self._forward(cand + list(refs.values()))
    ref_score = dict(zip(refs, scores[len(cand) :]))
    r_ref = np.array([ref_score[(p, r)] for p, r in zip(prompts, references)], np.float64)
    conf = sigmoid(scores[: len(cand)].astype(np.float64) - r_ref)
    return conf, np.array([len(r) > self.max_len for r in cand])

  def score_batch(self, examples, completions) -> dict:
    """Rewards of candidates against their examples' references: dict(reward [N], unparsed [N] bool,
    confidence [N])."""
    refs = [reference_answer(ex) for ex in examples]
    conf, unparsed = self.confidence([ex["prompt"] for ex in examples], refs, completions)
    length = [len(self.tok.encode(c)) for c in completions]
    ref_len = np.array([len(self.tok.encode(r)) for r in refs], np.float64)
    reward = win_rate(conf, length, ref_len, self.length_penalty)
    return {"reward": np.where(unparsed, 0.0, reward).astype(np.float32), "unparsed": unparsed, "confidence": conf}
