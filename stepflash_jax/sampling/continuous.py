"""Continuous batching: B decode slots serve a queue of Q prompts; a slot whose request ends (EOS or its length
limit) takes the next waiting prompt, so decode steps run with a full batch until the queue is empty.

One jitted program (a lax.while_loop). Each iteration:
  1. refill, once a quarter of the slots (or all) are free and prompts wait: one prefill call on [B, P] in which
     each free slot gets the next waiting prompt (its old cache entries marked empty, pos = -1; the prompt written
     at columns 0..P-1) and the other rows pass as padding and keep their caches; first tokens sampled;
  2. decode: one cached call on the B slots' last tokens, each row at its own column P + i - 1 (i = the row's next
     response index), then sample every active row.
Randomness is per request: token i of request q is drawn with key fold_in(fold_in(rng, q), i) exactly as the
plain engine draws it for a batch of one prompt given the key fold_in(rng, q), so every request's tokens and
log-probs equal decoding it alone (tests/test_continuous.py), whatever the slots and the order of completion.
Output: the plain engine's dict (engine.py) for the Q requests in queue order; `limits` [Q] caps each response.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from stepflash_jax.model.cache import init_cache
from stepflash_jax.sampling.calls import cast_variables, empty_expert_ids, model_call
from stepflash_jax.sampling.plain import Sampling, Shapes, accumulate, prefill_inputs, result
from stepflash_jax.sampling.sample import draw, is_stop, noisy, sampling_logprobs

# A refill is one [B, P] prefill call (~P decode steps of work on a CPU): it runs once 1 / REFILL_FRACTION of the
# slots are free, or all of them, not for every finished row.
REFILL_FRACTION = 4


def _rows(cache, take, new=None):
  """Per cache leaf, rows where take [B] is True: from `new` (a cache of the same shapes), or with new=None the
  entries marked empty (pos = -1). The batch axis is 1 under the scanned "blocks" (leading layer axis), else 0."""

  def f(path, x, *n):
    axis = 1 if any(getattr(p, "key", None) == "blocks" for p in path) else 0
    m = take.reshape([-1 if d == axis else 1 for d in range(x.ndim)])
    if n:
      return jnp.where(m, n[0], x)
    return jnp.where(m, -1, x) if getattr(path[-1], "key", None) == "pos" else x

  return jax.tree_util.tree_map_with_path(f, cache, *(() if new is None else (new,)))


def _sampler(rng, sampling):
  """(request ids [n], response indices [n], logits [n, V]) -> (tokens [n], log-probs [n]); each row drawn as the
  plain engine draws a batch of one (shape [1, V]) with the request's key fold_in(rng, q)."""
  temp, top_p, noise = sampling.temperature, sampling.top_p, sampling.noise

  def one(q, i, logits):
    kn, ks = jax.random.split(jax.random.fold_in(jax.random.fold_in(rng, q), i))
    tok, lp = draw(ks, sampling_logprobs(noisy(kn, logits[None], noise), temp, top_p), temp <= 0)
    return tok[0], lp[0]

  return jax.vmap(one)


def _initial_state(st: Shapes, v, prompts, pos_all, seg_all, B: int, pad_id):
  """The decode loop's carry: B empty slots with fresh caches, pad-filled responses of the Q requests, zero
  routing-confidence sums (one per MoE layer: the keys the model call reports)."""
  a, P, N, Q = st.args, st.max_prompt_len, st.max_new_tokens, prompts.shape[0]
  cache = init_cache(a, B, P + N)
  conf_keys = jax.eval_shape(lambda: model_call(a, v, prompts[:B], pos_all[:B], seg_all[:B], cache, 0))[3]
  zeros = {k: jnp.float32(0) for k in conf_keys}
  return dict(
    cache=cache,
    slot_req=jnp.full((B,), -1, jnp.int32),
    slot_i=jnp.zeros((B,), jnp.int32),
    next=jnp.int32(0),
    resp=jnp.full((Q, N), pad_id, jnp.int32),
    logp=jnp.zeros((Q, N), jnp.float32),
    mask=jnp.zeros((Q, N), jnp.float32),
    conf=zeros,
    ntok=jnp.float32(0),
    conf_p=zeros,
    ntok_p=jnp.float32(0),
    ids=empty_expert_ids(a, Q, P + N),
  )


def generate_continuous(st: Shapes, variables, prompts, lens, limits, sampling: Sampling, rng, slots: int):
  """prompts [Q, P] left-padded, lens [Q], limits [Q] (response tokens allowed, 1..N) -> the plain engine's dict."""
  a, P = st.args, st.max_prompt_len
  Q, B, eos, pad_id = prompts.shape[0], slots, sampling.eos_id, sampling.pad_id
  refill_at = max(1, B // REFILL_FRACTION)  # free slots that trigger a refill (or every slot free)
  v = cast_variables(variables, a.dtype, st.quantize)
  sample = _sampler(rng, sampling)
  _, pos_all, seg_all = prefill_inputs(st, lens)

  def write(buf, q, col, x):
    """buf [Q, C, ...] at rows q [n] (Q = dropped), columns col [n]."""
    return buf.at[q, col].set(x.astype(buf.dtype), mode="drop")

  def refill(s):
    """Prefill the next waiting prompts into the free slots (one [B, P] call; other rows pass as padding and keep
    their caches) and sample their first tokens."""
    free = s["slot_req"] < 0
    q = s["next"] + jnp.cumsum(free) - 1
    take = free & (q < Q)
    q = jnp.where(take, q, 0)
    seg = seg_all[q] * take[:, None]
    logits, _, cache, conf, ntok, ids = model_call(a, v, prompts[q], pos_all[q], seg, _rows(s["cache"], take), 0)
    tok, lp = sample(q, jnp.zeros_like(q), logits[:, -1])
    end = is_stop(tok, eos) | (limits[q] <= 1)
    dst = jnp.where(take, q, Q)  # rows not refilled write nowhere
    return {
      **s,
      "cache": _rows(s["cache"], take, cache),
      "slot_req": jnp.where(take & ~end, q, s["slot_req"]),
      "slot_i": jnp.where(take, 1, s["slot_i"]),
      "next": s["next"] + take.sum(),
      "resp": write(s["resp"], dst, 0, tok),
      "logp": write(s["logp"], dst, 0, lp),
      "mask": write(s["mask"], dst, 0, jnp.ones_like(lp)),
      "conf_p": accumulate(s["conf_p"], conf, ntok),
      "ntok_p": s["ntok_p"] + ntok,
      "ids": {k: s["ids"][k].at[dst, :P].set(ids[k], mode="drop") for k in s["ids"]},
    }

  def decode(s):
    """One cached step on every slot; active rows sample their next token and may end (EOS, limit)."""
    req, i = s["slot_req"], s["slot_i"]
    active = req >= 0
    q = jnp.where(active, req, 0)
    tok_in = s["resp"][q, i - 1][:, None]
    pos = (lens[q] + i - 1)[:, None]
    logits, _, cache, conf, ntok, ids = model_call(
      a, v, tok_in, pos, active[:, None].astype(jnp.int32), s["cache"], P + i - 1
    )
    tok, lp = sample(q, i, logits[:, 0])
    dst = jnp.where(active, req, Q)  # inactive rows write nowhere
    end = active & (is_stop(tok, eos) | (i + 1 >= limits[q]))
    return {
      **s,
      "cache": cache,
      "slot_req": jnp.where(end, -1, req),
      "slot_i": i + active,
      "resp": write(s["resp"], dst, i, tok),
      "logp": write(s["logp"], dst, i, lp),
      "mask": write(s["mask"], dst, i, jnp.ones_like(lp)),
      "conf": accumulate(s["conf"], conf, ntok),
      "ntok": s["ntok"] + ntok,
      "ids": {k: write(s["ids"][k], dst, P + i - 1, ids[k][:, 0]) for k in s["ids"]},
    }

  def body(s):
    n_free = jnp.sum(s["slot_req"] < 0)
    due = (s["next"] < Q) & ((n_free >= refill_at) | (n_free == B))
    s = lax.cond(due, refill, lambda s: s, s)
    return lax.cond(jnp.any(s["slot_req"] >= 0), decode, lambda s: s, s)

  s = _initial_state(st, v, prompts, pos_all, seg_all, B, pad_id)
  s = lax.while_loop(lambda s: (s["next"] < Q) | jnp.any(s["slot_req"] >= 0), body, s)
  conf_p = {k: c / jnp.maximum(s["ntok_p"], 1.0) for k, c in s["conf_p"].items()}
  return result(st, eos, prompts, s["resp"], s["logp"], s["mask"], s["conf"], s["ntok"], conf_p, s["ids"])
