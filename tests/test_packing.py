"""Sequence packing of the RL passes (rl.pack, rl/packing.py): the placement, and every program's outputs on a
packed batch equal the unpacked ones (logp, entropy, routing stats, values, both updates, router replay)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stepflash_jax as sfj
from stepflash_jax import model as M
from stepflash_jax.config import load_config_file
from stepflash_jax.model.replay import moe_layer_names
from stepflash_jax.rl import batches, packing, programs
from stepflash_jax.rl.critic import critic_from_actor
from stepflash_jax.train.step import frozen_mask
from conftest import ROOT, toy_generation

P, R, N = 6, 8, 4


def test_plan_places_every_span_once_and_is_its_own_inverse():
  seg = np.zeros((7, 10), np.int32)
  for i, (a, b) in enumerate([(2, 9), (0, 10), (5, 6), (3, 7), (9, 10), (4, 10), (6, 8)]):
    seg[i, a:b] = 1
  seg[1, 4] = 0  # a hole inside a span travels with it
  p = packing.plan(seg, 2)  # 33 tokens in 2 rows of 4 x 10 slots
  src, pseg, dest = p["pack_src"], p["pack_seg"], p["pack_dest"]
  assert src.shape == pseg.shape == (2, 40) and dest.shape == (7, 10)
  flat_src = src.reshape(-1)
  for i in range(7):
    cols = np.nonzero(seg[i])[0]
    span = np.arange(cols[0], cols[-1] + 1)
    assert (flat_src[dest[i, span]] == i * 10 + span).all()  # dest and src are inverse on the span
    assert (dest[i, np.setdiff1d(np.arange(10), span)] == 2 * 40).all()  # outside it: nowhere
    slots = dest[i, span]
    assert (np.diff(slots) == 1).all() and len(np.unique(slots // 40)) == 1  # contiguous, in one row
    row_seg = pseg.reshape(-1)[slots]
    assert (row_seg[seg[i, span] > 0] > 0).all() and len(np.unique(row_seg[row_seg > 0])) == 1
    assert (row_seg[seg[i, span] == 0] == 0).all()
  assert (np.bincount(flat_src[flat_src < 70], minlength=70) <= 1).all()  # no slot used twice
  for r in range(2):  # sequences sharing a row have different segment ids
    ids = [np.unique(pseg[r][src[r] // 10 == i]) for i in np.unique(src[r][src[r] < 70] // 10)]
    assert len({int(x[x > 0][0]) for x in ids}) == len(ids)
  two = np.concatenate([seg, seg])
  assert packing.plan(two, 1) is None  # 66 tokens do not fit 40 slots
  assert packing.add({"segment_ids": seg}, 0.0) == {"segment_ids": seg}
  assert "pack_src" not in packing.add({"segment_ids": two}, 0.01)  # does not fit: the batch as it is


@pytest.fixture(scope="module")
def setup():
  cfg = load_config_file(os.path.join(ROOT, "configs", "mispo.py"), "small")  # 4 layers: every layer kind
  args = M.as_args(cfg.model)
  v = sfj.init(cfg.model, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts, gen = toy_generation(rng, P, R)
  k, E = args.top_k, args.num_experts
  gen["expert_ids"] = {
    name: np.argsort(rng.random((N, P + R, E)), -1)[..., :k].astype(np.int32) for name in moe_layer_names(args)
  }
  batch = batches.sequences(prompts, gen)
  packed = packing.add(batch, 0.75)  # spans of 7 + 14 + 10 + 7 tokens share one row of 4 x 14 slots
  assert packed["pack_src"].shape == (1, 56)
  as_j = lambda b: {k: jnp.asarray(x) for k, x in b.items()}
  return cfg, args, v, as_j(batch), as_j(packed), gen["response_mask"]


def test_packed_programs_equal_unpacked(setup):
  cfg, args, v, jb, jp, mask = setup
  rc = cfg.rl.copy_and_resolve_references()
  tx = optax.sgd(1.0)  # parameters after a step linear in the gradient (see test_micro_batch.py)
  fns = programs.Programs(args, rc, tx, tx, P, frozen_mask(v["params"], True))
  cv = critic_from_actor(v)
  valid_v = np.concatenate([np.ones((N, 1), np.float32), mask], 1)  # V(s_0) .. V(s_T) of real states
  out = {}
  for name, b in (("plain", jb), ("packed", jp)):
    logp, ent, conf, flips = fns.score(v["params"], v["router"], b)
    replayed = fns.score(v["params"], v["router"], b, replay=True)[0]
    values = fns.values(cv["params"], cv["router"], b)
    adv = jnp.asarray(np.random.default_rng(2).normal(0, 1, logp.shape), jnp.float32) * mask
    mb = {**b, "logp_old": logp * mask, "logp_ref": (logp - 0.1) * mask, "adv": adv, "returns": adv}
    mb["logp_rollout"] = mb["logp_old"] - 0.2 * mask
    critic, mc = fns.critic_step({**cv, "opt": tx.init(cv["params"])}, mb)
    actor, ma = fns.actor_step({**v, "opt": tx.init(v["params"])}, mb, jnp.float32(0.5))
    actor_r, _ = fns.actor_step({**v, "opt": tx.init(v["params"])}, mb, jnp.float32(0.5), replay=True)
    out[name] = dict(logp=logp * mask, replayed=replayed * mask, ent=ent, conf=conf, flips=flips)
    out[name].update(values=values * valid_v, critic=critic["params"], mc=mc, actor=actor["params"], ma=ma)
    out[name]["actor_replay"] = actor_r["params"]
  assert set(out["packed"]["flips"]) and float(sum(out["plain"]["flips"].values())) > 0  # flips are measured
  assert float(out["plain"]["ma"]["actor_loss"]) != 0.0
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  for key in out["plain"]:
    jax.tree.map(close, out["packed"][key], out["plain"][key])


def test_pack_is_validated(setup):
  from stepflash_jax.train.validate import validate_run_config

  cfg = setup[0].copy_and_resolve_references()
  cfg.rl.pack = 0.75
  validate_run_config(cfg, num_devices=1)
  for bad in (-0.1, 1.5):
    cfg.rl.pack = bad
    with pytest.raises(ValueError, match="rl.pack"):
      validate_run_config(cfg)
  cfg.rl.pack, cfg.rl.micro_batch = 0.75, 4
  with pytest.raises(ValueError, match="rl.pack.*micro_batch"):
    validate_run_config(cfg)
  cfg.rl.micro_batch, cfg.mesh.data = 0, 2
  with pytest.raises(ValueError, match="rl.pack.*one device"):
    validate_run_config(cfg, num_devices=2)


def test_run_turns_packing_off_where_it_cannot_run(setup):
  """run.py's resolve_pack: a default rl.pack does not stop a run with micro-batches or on a mesh (issue 6's and 14's
  commands); it is set to 0 with a note naming why, and the config then validates."""
  from stepflash_jax.train.validate import resolve_pack, validate_run_config

  cfg = setup[0].copy_and_resolve_references()
  cfg.rl.pack = 0.75
  assert resolve_pack(cfg, 1) == "" and cfg.rl.pack == 0.75  # one device, whole batches: packing stays
  cfg.rl.micro_batch = 4
  assert "rl.micro_batch=4" in resolve_pack(cfg, 1) and cfg.rl.pack == 0.0
  validate_run_config(cfg, num_devices=1)
  cfg.rl.pack, cfg.rl.micro_batch, cfg.mesh.data = 0.75, 0, 2
  assert "a mesh of 2 devices" in resolve_pack(cfg, 2) and cfg.rl.pack == 0.0
  validate_run_config(cfg, num_devices=2)
