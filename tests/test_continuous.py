"""Continuous batching (sampling/continuous.py): every request's tokens, log-probs, mask and recorded experts equal
decoding it alone with the plain engine (key fold_in(rng, q)), whatever the number of slots; bad inputs are named.

A head that puts most mass on tokens 10..13 with EOS = 10 ends responses at random points, and per-request limits
end others, so slots are refilled at different steps; P + N = 52 > window 32, so the ring buffers of reused slots wrap.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stepflash_jax as sfj
from stepflash_jax.sampling import FAST_COMPILE, RolloutEngine

P, N, EOS, PAD = 12, 40, 10, 0
LENS = np.array([12, 5, 9, 1, 7, 3, 12, 10, 4, 11, 6, 2, 8, 12, 1, 9], np.int32)
LIMITS = np.array([40, 3, 40, 1, 25, 40, 7, 40, 40, 12, 40, 2, 40, 30, 40, 5], np.int32)


@pytest.fixture(scope="module")
def setup(tiny_cfg):
  v = sfj.init(tiny_cfg, jax.random.key(0))
  H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
  u, w = (x / np.linalg.norm(x) for x in np.random.RandomState(0).randn(2, H))
  W = np.zeros((H, V), np.float32)
  W[:, 10], W[:, 11], W[:, 12], W[:, 13] = 3 * u, -3 * u, 3 * w, -3 * w  # EOS (10) now and then
  v = {**v, "params": {**v["params"], "lm_head": {"kernel": jnp.asarray(W)}}}
  rs = np.random.RandomState(1)
  prompts = np.full((len(LENS), P), PAD, np.int32)
  for b, n in enumerate(LENS):
    prompts[b, P - n :] = rs.randint(20, 512, n)
  eng = RolloutEngine(
    tiny_cfg, max_prompt_len=P, max_new_tokens=N, eos_id=EOS, pad_id=PAD, dtype="float32", logit_noise=0.1,
    compiler_options=FAST_COMPILE,
  )  # fmt: skip
  rng = jax.random.key(3)
  alone = [
    jax.device_get(eng.generate(v, prompts[q : q + 1], LENS[q : q + 1], jax.random.fold_in(rng, q)))
    for q in range(len(LENS))
  ]
  return eng, v, prompts, rng, alone


@pytest.mark.parametrize("slots", [3, 8])  # 8: a refill waits for 2 free slots (a quarter)
def test_each_request_equals_decoding_it_alone(setup, slots):
  eng, v, prompts, rng, alone = setup
  out = jax.device_get(eng.generate_queue(v, prompts, LENS, rng, slots=slots, limits=LIMITS))
  ended_by_eos = 0
  for q, a in enumerate(alone):
    L = min(int(a["lengths"][0]), int(LIMITS[q]))  # alone: no limit but N; the queue stops at the request's limit
    assert int(out["lengths"][q]) == L, q
    np.testing.assert_array_equal(out["response"][q, :L], a["response"][0, :L])
    np.testing.assert_array_equal(out["response"][q, L:], PAD)
    np.testing.assert_allclose(out["logp"][q], np.where(np.arange(N) < L, a["logp"][0], 0.0), atol=1e-5)
    eos = bool(np.any(out["response"][q, :L] == EOS))
    ended_by_eos += eos
    assert bool(out["truncated"][q]) == (not eos)
    cols = slice(P - LENS[q], P + L - 1)  # real prompt tokens and fed response tokens
    for k in out["expert_ids"]:
      np.testing.assert_array_equal(out["expert_ids"][k][q, cols], a["expert_ids"][k][0, cols], err_msg=f"{q} {k}")
  assert 2 <= ended_by_eos < len(LENS)  # EOS and the limits both end requests: slots are refilled at many steps
  assert 0 < float(out["routing_confidence"]) <= 1


def test_bad_queue_inputs_name_the_field(setup):
  eng, v, prompts, rng, _ = setup
  for kw, msg in (
    (dict(slots=0), "slots must be an int in"),
    (dict(slots=17), r"slots must be an int in \[1, 16\]"),
    (dict(slots=2, limits=np.full(16, N + 1)), "limits must lie in"),
    (dict(slots=2, limits=np.ones(3, np.int32)), r"limits must be an integer array \[Q=16\]"),
  ):
    with pytest.raises(ValueError, match=msg):
      eng.generate_queue(v, prompts, LENS, rng, **kw)
