"""Micro-batched RL programs (rl.micro_batch): scoring maps over micro-batches and an update sums their gradients
before one optimizer step, so every output equals the whole-batch computation (issue 14: 1e-5 on losses and
parameters after a step)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest


import stepflash_jax as sfj
from stepflash_jax import model as M
from stepflash_jax.config import load_config_file
from stepflash_jax.rl import batches, programs
from stepflash_jax.rl.critic import critic_from_actor
from stepflash_jax.train.step import frozen_mask
from conftest import ROOT, toy_generation

P, R, N = 6, 8, 4


@pytest.fixture(scope="module")
def setup():
  cfg = load_config_file(os.path.join(ROOT, "configs", "mispo.py"), "small")  # 4 layers: every layer kind
  v = sfj.init(cfg.model, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts, gen = toy_generation(rng, P, R)
  jb = {k: jnp.asarray(x) for k, x in batches.sequences(prompts, gen).items()}
  return cfg, M.as_args(cfg.model), v, jb


def _programs(cfg, args, v, micro, normalizer):
  rc = cfg.rl.copy_and_resolve_references()
  rc.micro_batch, rc.normalizer = micro, normalizer
  # SGD: parameters after a step are linear in the summed gradient. (Muon orthogonalises the gradient in fp16: its
  # near-zero singular directions turn a 1e-7 change of summation order into a visible change of the step.)
  tx = optax.sgd(1.0)
  return programs.Programs(args, rc, tx, tx, P, frozen_mask(v["params"], True)), tx


def test_micro_batches_equal_the_whole_batch(setup):
  """Scoring, values and both updates (MIS-PO + KL, value loss) with micro-batches of 2 rows equal the whole
  batch of 4, for both normalizers (with "kept" the denominator comes from the whole mini-batch's MIS filter)."""
  cfg, args, v, jb = setup
  cv = critic_from_actor(v)
  log_x = np.zeros((N, R), np.float32)
  log_x[1, :2] = (0.8, -0.8)  # row 1: two tokens outside the token bounds [0.5, 2], the trajectory kept
  log_x[2] = 0.3  # row 2: the whole trajectory outside the trajectory bounds
  out = {}
  for micro in (0, 2):
    fns, tx = _programs(cfg, args, v, micro, "valid")
    logp, ent, conf, _ = fns.score(v["params"], v["router"], jb)
    values = fns.values(cv["params"], cv["router"], jb)
    adv = jnp.asarray(np.random.default_rng(2).normal(0, 1, logp.shape), jnp.float32)
    mb = {**jb, "logp_old": logp, "logp_ref": logp - 0.1, "adv": adv, "returns": adv, "logp_rollout": logp - log_x}
    critic, mc = fns.critic_step({**cv, "opt": tx.init(cv["params"])}, mb)
    out[micro] = [logp, ent, conf, values, critic["params"], mc]
    for normalizer in ("valid", "kept"):
      if normalizer == "kept":
        fns, tx = _programs(cfg, args, v, micro, normalizer)
      actor, m = fns.actor_step({**v, "opt": tx.init(v["params"])}, mb, jnp.float32(0.5))
      out[micro] += [actor["params"], m]
      assert 0 < float(m["kept_frac"]) < 1 and float(m["skipped"]) == 0  # the MIS filters are active
  assert float(out[0][-1]["denominator"]) < float(out[0][-3]["denominator"])  # kept < valid
  for got, want in zip(out[2], out[0]):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


def test_rl_batching_fields_are_validated(setup):
  """rl.micro_batch divides every batch larger than itself; rl.rollout_slots lies in [0, responses]."""
  from stepflash_jax.train.validate import validate_run_config

  cfg = setup[0].copy_and_resolve_references()
  cfg.rl.pack = 0.0  # packed batches run as one pass (tests/test_packing.py)
  n = cfg.rl.prompts_per_step * cfg.rl.samples_per_prompt  # 48 rows: 12 per actor and 4 per critic mini-batch
  cfg.rl.actor_minibatches, cfg.rl.critic_minibatches = n // 12, n // 4
  for ok in (0, 1, 2, 4, 16):  # 16: larger than both, each mini-batch is one pass
    cfg.rl.micro_batch = ok
    validate_run_config(cfg)
  for bad, why in ((3, "4-row mini-batches of rl.critic_minibatches"), (8, "12-row"), (-1, ">= 0")):
    cfg.rl.micro_batch = bad
    with pytest.raises(ValueError, match=f"rl.micro_batch.*{why}"):
      validate_run_config(cfg)
  cfg.rl.micro_batch = 0
  for bad in (-1, n + 1):
    cfg.rl.rollout_slots = bad
    with pytest.raises(ValueError, match=rf"rl.rollout_slots.*\[0, {n}\]"):
      validate_run_config(cfg)
  cfg.rl.rollout_slots = 0
  for bad in (0, -2):  # (a float or bool is a type error of the ConfigDict)
    cfg.rl.oversample = bad
    with pytest.raises(ValueError, match=r"rl.oversample.*integer >= 1"):
      validate_run_config(cfg)
