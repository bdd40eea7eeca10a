"""RL trainer wiring: sequence assembly, critic value alignment, one actor/critic update, mismatch statistics, and
resume (stop after 2 generations + rerun == 4 generations in one go)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stepflash_jax as sfj
from stepflash_jax import model as M
from stepflash_jax.train.step import frozen_mask, guarded_update, make_optimizer, warmup_constant
from stepflash_jax.config import load_config_file
from stepflash_jax.rl import batches, losses, programs
from stepflash_jax.rl.critic import critic_from_actor, response_values
from conftest import ROOT


@pytest.fixture(scope="module")
def setup():
  cfg = load_config_file(os.path.join(ROOT, "configs", "mispo.py"), "small")
  cfg.rl.max_new_tokens = 8
  args = M.as_args(cfg.model)
  v = sfj.init(cfg.model, jax.random.key(0))
  P, R = 6, 8
  prompts = {
    "tokens": np.array([[0, 0, 2, 4, 9, 5], [2, 4, 9, 9, 9, 5]], np.int32),
    "positions": np.array([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]], np.int32),
    "segment_ids": np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32),
    "lengths": np.array([4, 6], np.int32),
  }
  response = np.array([[11, 12, 3, 0, 0, 0, 0, 0], [13, 14, 15, 16, 17, 18, 19, 20]], np.int32)
  mask = np.array([[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8], np.float32)  # row 0 ends with EOS (3), row 1 truncated
  gen = {"response": response, "response_mask": mask, "logp": np.full((2, R), -1.0, np.float32)}
  return cfg, args, v, prompts, gen, P, R


def test_sequences_positions_and_segments(setup):
  _, _, _, prompts, gen, P, R = setup
  b = batches.sequences(prompts, gen)
  assert b["tokens"].shape == (2, P + R)
  np.testing.assert_array_equal(b["positions"][0, P : P + 3], [4, 5, 6])  # continues after the 4 prompt tokens
  np.testing.assert_array_equal(b["positions"][1, P : P + 3], [6, 7, 8])
  np.testing.assert_array_equal(b["segment_ids"][0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0])


def test_dynamic_sampling_keeps_the_groups_whose_rewards_vary_most():
  """informative_rows: groups of consecutive rows ranked by their rewards' variance (reward_spread: p(1 - p) for 0/1),
  ties at random, kept in order; take_rows picks those rows from every per-row leaf of a nested dict."""
  reward = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0.2, 0.8, 0.5], np.float32)  # 5 groups of 3
  spread = batches.reward_spread(reward, 3)
  np.testing.assert_allclose(spread, [0, 2 / 9, 0, 2 / 9, 0.06], atol=1e-7)  # groups 1 and 3, 4, then 0 or 2
  rng = lambda s: np.random.default_rng(s)
  np.testing.assert_array_equal(batches.informative_rows(spread, 3, 2, rng(0)), [3, 4, 5, 9, 10, 11])
  np.testing.assert_array_equal(batches.informative_rows(spread, 3, 3, rng(0)), [3, 4, 5, 9, 10, 11, 12, 13, 14])
  fourth = {tuple(batches.informative_rows(spread, 3, 4, rng(s))[:3]) for s in range(40)}
  assert fourth == {(0, 1, 2), (3, 4, 5)}  # group 0 or group 2 (then group 1 comes first), each at random
  np.testing.assert_array_equal(
    batches.informative_rows(spread, 3, 4, rng(7)), batches.informative_rows(spread, 3, 4, rng(7))
  )
  with pytest.raises(ValueError, match=r"keep must be in \[1, 5\]"):
    batches.informative_rows(spread, 3, 6, rng(0))
  tree = {"a": np.arange(15)[:, None] * [1, 1], "ex": list("abcdefghijklmno"), "s": 0.5, "d": {"b": np.arange(15.0)}}
  tree["other"] = np.zeros(4)
  got = batches.take_rows(tree, np.array([3, 4, 5]), 15)
  np.testing.assert_array_equal(got["a"], [[3, 3], [4, 4], [5, 5]])
  assert got["ex"] == ["d", "e", "f"] and got["s"] == 0.5 and got["other"].shape == (4,)
  np.testing.assert_array_equal(got["d"]["b"], [3.0, 4.0, 5.0])


def test_critic_values_are_aligned_with_states(setup):
  """values[:, t] = V(s_t) = critic output at the column of the token before response token t."""
  cfg, args, v, prompts, gen, P, R = setup
  b = batches.sequences(prompts, gen)
  cv = critic_from_actor(v)
  cv["params"]["value_head"]["kernel"] = jnp.ones_like(cv["params"]["value_head"]["kernel"])
  vals = response_values(args, cv, b, P)
  full = M.apply(args, cv, b["tokens"], positions=b["positions"], segment_ids=b["segment_ids"], head="value")["values"]
  assert vals.shape == (2, R + 1)
  np.testing.assert_allclose(vals[:, 0], full[:, P - 1])
  np.testing.assert_allclose(vals[:, R], full[:, P + R - 1])
  assert "lm_head" not in cv["params"] and not any(k.startswith("mtp_") for k in cv["params"])


def test_one_actor_and_critic_update(setup):
  cfg, args, v, prompts, gen, P, R = setup
  rc = cfg.rl
  tx_a = make_optimizer(cfg.optim, warmup_constant(1e-2, 1))
  tx_c = make_optimizer(cfg.optim, warmup_constant(1e-2, 1))

  fns = programs.Programs(args, rc, tx_a, tx_c, P, frozen_mask(v["params"], True))
  b = batches.sequences(prompts, gen)
  jb = {k: jnp.asarray(x) for k, x in b.items()}
  logp_old, ent, conf, flips = fns.score(v["params"], v["router"], jb)
  assert flips == {}  # hand-made rollouts record no experts
  assert logp_old.shape == (2, R) and float(ent) > 0
  assert sorted(conf) == sorted(f"layer_{i}" for i in cfg.model.moe_layers)  # Sigma_k per MoE layer
  assert all(0 < float(c) <= 1 for c in conf.values())
  cv = critic_from_actor(v)
  values = fns.values(cv["params"], cv["router"], jb)
  adv, ret = fns.advantages(values, jb["mask"], jnp.array([1.0, 0.0]), jnp.array([False, True]))
  # gamma = lambda = 1, zero-initialised value head: A = R on every valid token; the truncated row bootstraps
  # to V(s_T) = 0.
  np.testing.assert_allclose(adv[0, :3], 1.0, atol=1e-6)
  np.testing.assert_allclose(adv[1], 0.0, atol=1e-6)
  mb = {
    **jb,
    "logp_old": logp_old,
    "logp_ref": logp_old,
    "adv": adv,
    "returns": ret,
    "logp_rollout": logp_old + 0.001,
  }  # inside the trajectory bounds: every token kept
  actor = {"params": v["params"], "router": v["router"], "opt": tx_a.init(v["params"])}
  new, m = fns.actor_step(actor, mb)
  want, _ = losses.mispo_loss(logp_old, logp_old, mb["logp_rollout"], adv, jb["mask"])
  np.testing.assert_allclose(float(m["actor_loss"]), float(want), rtol=1e-5)  # kl(pi, pi_old = pi_ref) = 0
  assert float(m["kept_frac"]) == 1.0 and float(m["skipped"]) == 0.0
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new["params"], actor["params"])
  assert moved["lm_head"]["kernel"] > 0
  assert moved["layer_2"]["moe"]["router"]["kernel"] == 0.0  # router frozen
  critic = {"params": cv["params"], "router": cv["router"], "opt": tx_c.init(cv["params"])}
  newc, mc = fns.critic_step(critic, mb)
  assert float(mc["critic_loss"]) > 0
  assert float(jnp.abs(newc["params"]["value_head"]["kernel"]).max()) > 0
  moved_c = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), newc["params"], critic["params"])
  assert moved_c["layer_2"]["moe"]["router"]["kernel"] == 0.0  # the critic's router follows rl.freeze_router


@pytest.fixture(scope="module")
def fp32_rollout(setup):
  """Responses of the fp32 rollout engine at temperature 0.7, top-p 0.9 (a peaked lm_head so the nucleus is small),
  and the training engine's scoring of them under the same config."""
  from stepflash_jax.sampling import FAST_COMPILE, RolloutEngine

  cfg, args, v, prompts, _, P, R = setup
  v = {**v, "params": {**v["params"], "lm_head": {"kernel": v["params"]["lm_head"]["kernel"] * 40.0}}}
  rc = cfg.rl.copy_and_resolve_references()
  rc.temperature, rc.top_p = 0.7, 0.9
  engine = RolloutEngine(
    cfg.model, max_prompt_len=P, max_new_tokens=R, eos_id=3, pad_id=0, dtype="float32", temperature=0.7, top_p=0.9,
    compiler_options=FAST_COMPILE,
  )  # fmt: skip
  gen = jax.device_get(engine.generate(v, prompts["tokens"], prompts["lengths"], jax.random.key(1)))
  b = batches.sequences(prompts, gen)
  jb = {k: jnp.asarray(x) for k, x in b.items()}
  fns = programs.Programs(args, rc, None, None, P, frozen_mask(v["params"], True))
  logp_old, _, conf, _ = jax.device_get(fns.score(v["params"], v["router"], jb))
  return gen, b, logp_old, conf


def test_logp_old_matches_rollout_under_temperature_and_top_p(fp32_rollout):
  """fp32 rollout engine log-probs (after temperature and top-p) = the training engine's recomputed logp_old."""
  gen, b, logp_old, _ = fp32_rollout
  m = b["mask"] > 0
  assert m.sum() >= 8
  # 3e-5: fp32 rounding of logits ~40x the usual scale (the peaked head), summed in another order by each engine
  np.testing.assert_allclose(logp_old[m], gen["logp"][m], atol=3e-5)
  lp1 = programs.token_logp(jnp.zeros((1, 1, 4)), jnp.zeros((1, 1), jnp.int32))  # temperature 1, no nucleus
  np.testing.assert_allclose(lp1, np.log(0.25), rtol=1e-6)


def test_token_logp_outside_the_nucleus_is_finite():
  """A token the nucleus excludes (possible when the two engines' nuclei differ) gets a finite log-prob and gradient."""
  logits = jnp.asarray([[[4.0, 3.0, 0.0, -1.0]]])
  f = lambda x, t: programs.token_logp(x, jnp.asarray([[t]]), 1.0, 0.5).sum()
  inside = float(f(logits, 0))  # nucleus {0}: log 1
  assert inside == pytest.approx(0.0, abs=1e-6)
  p = np.exp(logits[0, 0] - jax.nn.logsumexp(logits[0, 0]))
  assert float(f(logits, 2)) == pytest.approx(float(np.log(p[2] / (p[0] + p[2]))), rel=1e-5)
  g = jax.grad(f)(logits, 2)
  assert np.all(np.isfinite(np.asarray(g))) and float(jnp.abs(g).sum()) > 0


def test_routing_confidence_over_the_same_response_tokens(fp32_rollout):
  """The training pass averages Sigma_k over the response tokens the rollout fed (fp32 engines: equal)."""
  gen, b, _, conf = fp32_rollout
  assert sorted(conf) == sorted(gen["routing_confidence_layers"])
  for k, c in conf.items():
    np.testing.assert_allclose(c, gen["routing_confidence_layers"][k], rtol=1e-5)
  np.testing.assert_allclose(np.mean(list(conf.values())), gen["routing_confidence"], rtol=1e-5)


def test_router_replay_scoring_and_flip_rate(setup, fp32_rollout):
  """fp32 engines choose the same experts: flip rate 0 and replayed logp_old = own logp_old; other experts
  (every rollout id shifted by one) flip every fed token and change logp_old; the replayed actor step runs."""
  cfg, args, v, _, _, P, R = setup
  gen, b, logp_old, _ = fp32_rollout
  v = {**v, "params": {**v["params"], "lm_head": {"kernel": v["params"]["lm_head"]["kernel"] * 40.0}}}
  rc = cfg.rl.copy_and_resolve_references()
  rc.temperature, rc.top_p = 0.7, 0.9
  tx = make_optimizer(cfg.optim, warmup_constant(1e-2, 1))
  fns = programs.Programs(args, rc, tx, tx, P, frozen_mask(v["params"], True))
  jb = {k: jnp.asarray(x) for k, x in b.items()}
  assert jb["rollout_experts"].shape == (2, len(cfg.model.moe_layers), P + R, cfg.model.num_experts_per_tok)
  own = jax.device_get(fns.score(v["params"], v["router"], jb))
  assert sorted(own[3]) == sorted(gen["expert_ids"]) and max(own[3].values()) == 0.0
  replayed = jax.device_get(fns.score(v["params"], v["router"], jb, replay=True))
  m = b["mask"] > 0
  np.testing.assert_allclose(replayed[0][m], logp_old[m], atol=1e-6)
  other = {**jb, "rollout_experts": (jb["rollout_experts"] + 1) % cfg.model.num_experts}
  fed = b["mask"] * np.pad(b["mask"][:, 1:], ((0, 0), (0, 1)))
  assert fed.sum() > 0 and min(jax.device_get(fns.score(v["params"], v["router"], other)[3]).values()) == 1.0
  shifted = jax.device_get(fns.score(v["params"], v["router"], other, replay=True))[0]
  assert np.abs(shifted[m] - logp_old[m]).max() > 1e-3
  mb = {**jb, "logp_old": replayed[0], "logp_ref": replayed[0], "adv": jnp.ones((2, R)), "returns": jnp.ones((2, R))}
  actor = {"params": v["params"], "router": v["router"], "opt": tx.init(v["params"])}
  _, met = fns.actor_step(actor, mb, replay=True)
  assert float(met["skipped"]) == 0.0 and float(met["actor_grad_norm"]) > 0
  with pytest.raises(ValueError, match="rollout_experts"):
    fns.score(v["params"], v["router"], {k: x for k, x in jb.items() if k != "rollout_experts"}, replay=True)


def test_router_replay_config_is_checked(setup):
  from stepflash_jax.train.validate import validate_run_config

  cfg = setup[0].copy_and_resolve_references()
  cfg.rl.router_replay = "sometimes"
  with pytest.raises(ValueError, match="rl.router_replay"):
    validate_run_config(cfg)
  cfg.rl.router_replay, cfg.rl.replay_threshold = "auto", 1.5
  with pytest.raises(ValueError, match="rl.replay_threshold"):
    validate_run_config(cfg)
  cfg.rl.router_replay, cfg.rl.replay_threshold, cfg.rl.rho_tokens = "off", 0.5, "some"
  with pytest.raises(ValueError, match="rl.rho_tokens"):
    validate_run_config(cfg)


@pytest.mark.parametrize("objective", ["mispo", "ppo", "gspo", "tis"])
def test_normalizer_applies_to_every_objective(setup, objective, monkeypatch):
  rc = setup[0].rl.copy_and_resolve_references()
  rc.objective, rc.normalizer = objective, "kept"
  seen = []
  fn = getattr(losses, f"{objective}_loss")
  monkeypatch.setattr(losses, f"{objective}_loss", lambda *a, **kw: seen.append(kw.get("normalizer")) or fn(*a, **kw))
  rng = np.random.default_rng(0)
  lr = rng.normal(-1, 0.3, (4, 6)).astype(np.float32)
  lo = lr + rng.normal(0, 1e-4, (4, 6)).astype(np.float32)
  lo[1] += 0.01  # trajectory 1 filtered by MIS
  mb = {"logp_old": lo, "logp_rollout": lr, "adv": rng.normal(0, 1, (4, 6)).astype(np.float32)}
  mb["mask"] = np.ones((4, 6), np.float32)
  _, m = programs.objective(rc, jnp.asarray(lo), {k: jnp.asarray(x) for k, x in mb.items()})
  kept = 18.0 if objective in ("mispo", "gspo") else 24.0  # PPO / TIS filter nothing: "kept" = "valid"
  assert float(m["denominator"]) == kept
  rc.normalizer = "valid"
  assert float(programs.objective(rc, jnp.asarray(lo), mb)[1]["denominator"]) == 24.0
  assert seen == ["kept", "valid"]  # the trainer passes rl.normalizer to every objective
  if objective in ("mispo", "gspo"):  # and rl.rho_tokens to the MIS-filtered ones: rho over the kept tokens only
    rc.rho_tokens = "kept"
    mb["logp_old"] = lo.copy()
    mb["logp_old"][1, 0] += 5.0  # one token outside the token bounds: without it trajectory 1's rho is ~1.0
    mb["logp_old"][1, 1:] = lr[1, 1:]
    assert float(programs.objective(rc, jnp.asarray(lo), mb)[1]["traj_keep_frac"]) == 1.0


def test_rl_mixture_is_checked_and_long_config_is_valid():
  """rl.mixture (RL prompts other than the SFT data) names itself when bad; configs/long.py validates in both modes
  and runs RL on 3-digit long multiplication with a budget that fits its ~210-token answers."""
  from stepflash_jax.data import tasks
  from stepflash_jax.data.hf_tokenizer import tokenizer_for
  from stepflash_jax.train.validate import validate_run_config

  for mode in ("small", None):
    cfg = load_config_file(os.path.join(ROOT, "configs", "long.py"), mode)
    validate_run_config(cfg)
  answer = tasks.generate("longmul", 0, 3, "test")["answer"]
  tok = tokenizer_for(cfg)
  assert 150 <= len(tok.encode(answer)) <= cfg.rl.max_new_tokens - 16
  assert [c.family for c in tasks.parse_mixture(cfg.rl.mixture)] == ["longmul"]
  cfg.rl.mixture = "longmul:9:1"
  with pytest.raises(ValueError, match="config field 'rl.mixture'"):
    validate_run_config(cfg)


def test_countdown_search_config_fits_its_longest_answers():
  """configs/countdown_search.py validates in both modes; its budget holds the longest search answer (3 misses) of
  its held-out problems and its eos, and its problems are countdown's."""
  from stepflash_jax.data.hf_tokenizer import tokenizer_for
  from stepflash_jax.train.evaluate import heldout_examples
  from stepflash_jax.train.validate import validate_run_config

  for mode in ("small", None):
    cfg = load_config_file(os.path.join(ROOT, "configs", "countdown_search.py"), mode)
    validate_run_config(cfg)
  tok = tokenizer_for(cfg)
  cfg.eval.num_examples = 256
  held = heldout_examples(cfg, tok)
  assert {x["family"] for x in held} == {"countdown_search"}
  longest = max(len(tok.encode(x["answer"])) for x in held)
  assert cfg.rl.max_new_tokens >= longest + 1 and longest >= 60  # + eos
  cfg.data.mixture = "countdown:3"  # the one-try comparison: the same problems
  assert [x["prompt"] for x in heldout_examples(cfg, tok)] == [x["prompt"] for x in held]


def test_kl_start_schedule_and_validation(setup):
  from stepflash_jax.train.validate import validate_run_config

  cfg = setup[0].copy_and_resolve_references()
  assert cfg.rl.kl_start == 0 and programs.kl_coef_at(cfg.rl, 0) == cfg.rl.kl_coef  # default: always on
  cfg.rl.kl_start = 3
  assert [programs.kl_coef_at(cfg.rl, s) for s in range(5)] == [0.0, 0.0, 0.0, cfg.rl.kl_coef, cfg.rl.kl_coef]
  validate_run_config(cfg)
  cfg.rl.kl_start = -1
  with pytest.raises(ValueError, match="rl.kl_start"):
    validate_run_config(cfg)


def test_frozen_leaves_take_no_part_in_the_clip_norm():
  """The router's gradient (frozen) neither enters the reported norm nor shrinks the others' update by clipping."""
  import optax

  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  params = {"moe": {"router": {"kernel": jnp.zeros((2,))}}, "w": jnp.zeros((2,))}
  state = {"params": params, "opt": tx.init(params)}
  grads = {"moe": {"router": {"kernel": jnp.full((2,), 100.0)}}, "w": jnp.asarray([0.3, 0.4])}
  p, _, gnorm, skipped = guarded_update(state, grads, jnp.float32(1.0), tx, frozen_mask(params, True))
  assert float(gnorm) == pytest.approx(0.5) and float(skipped) == 0.0
  np.testing.assert_allclose(p["w"], [-0.3, -0.4], rtol=1e-6)  # norm 0.5 < 1: not clipped
  np.testing.assert_array_equal(p["moe"]["router"]["kernel"], 0.0)
  grads["moe"]["router"]["kernel"] = jnp.full((2,), jnp.nan)  # a frozen leaf's non-finite gradient is ignored
  assert float(guarded_update(state, grads, jnp.float32(1.0), tx, frozen_mask(params, True))[3]) == 0.0


def test_mismatch_stats_match_numpy(setup):
  """The mismatch statistics every objective logs, against NumPy."""
  rc = setup[0].rl
  rng = np.random.default_rng(0)
  B, T = 5, 7
  lr = rng.normal(-1, 0.3, (B, T)).astype(np.float32)
  lo = (lr + rng.normal(0, 0.01, (B, T))).astype(np.float32)
  lo[1, 2] = lr[1, 2] + 1.0  # x = e > 2: token filtered
  mask = np.ones((B, T), np.float32)
  mask[3, 4:] = 0
  mask[4] = 0  # an empty trajectory
  lo[3, 5] = 50.0  # garbage under the mask
  got = {
    k: float(v)
    for k, v in programs.mismatch_stats(
      rc, {"logp_old": jnp.asarray(lo), "logp_rollout": jnp.asarray(lr), "mask": jnp.asarray(mask)}
    ).items()
  }
  d = np.abs(lo - lr)[mask > 0]
  log_x = np.where(mask > 0, lo - lr, 0.0)
  n = mask.sum(1)
  log_rho = log_x[:4].sum(1) / n[:4]
  tok_ok = (mask > 0) & (log_x >= np.log(0.5)) & (log_x <= np.log(2.0))
  traj_ok = (log_rho >= np.log(0.996)) & (log_rho <= np.log(1.001))
  np.testing.assert_allclose(got["logp_abs_diff_mean"], d.mean(), rtol=1e-5)
  np.testing.assert_allclose(got["logp_abs_diff_max"], d.max(), rtol=1e-5)
  np.testing.assert_allclose(got["log_rho_abs_mean"], np.abs(log_rho).mean(), rtol=1e-5)
  np.testing.assert_allclose(got["log_seq_ratio_abs_mean"], np.abs(log_x[:4].sum(1)).mean(), rtol=1e-5)
  np.testing.assert_allclose(got["mis_token_keep_frac"], tok_ok.sum() / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(got["mis_traj_keep_frac"], traj_ok.mean(), rtol=1e-6)
  np.testing.assert_allclose(got["mis_kept_frac"], (tok_ok[:4] & traj_ok[:, None]).sum() / mask.sum(), rtol=1e-6)


def _rl_cmd(workdir, steps, sft_workdir="", overlap=False):
  small = [
    "--config.train.steps=4",
    "--config.train.checkpoint_every=4",
    "--config.eval.num_examples=4",
    "--config.eval.batch_size=4",
    "--config.eval.max_new_tokens=8",
    "--config.data.batch_size=4",
    "--config.data.seq_len=64",
    "--config.rl.prompts_per_step=2",
    "--config.rl.samples_per_prompt=2",
    "--config.rl.actor_minibatches=2",
    "--config.rl.critic_minibatches=2",
    "--config.rl.max_new_tokens=8",
    "--config.rl.rollout_slots=2",  # continuous batching: 2 rows serve the 4 responses (static: notebooks 02, 04)
    "--config.rl.micro_batch=1",  # every pass in micro-batches of one row
    "--config.rl.pack=0",  # (packing runs whole batches: tests/test_packing.py)
    "--config.rl.oversample=2",  # 4 prompts sampled, the 2 whose rewards vary most trained on
    "--config.rl.max_staleness=1",  # generation j sampled by the actor of j - 1 ...
    f"--config.rl.async={overlap}",  # ... in the background while j - 1 trains, or in turn
    "--config.rl.checkpoint_every=2",
    "--config.rl.eval_every=100",
    f"--config.rl.sft_workdir={sft_workdir}",
  ]
  return [
    sys.executable,
    os.path.join(ROOT, "experiments", "run.py"),
    "--config=" + os.path.join(ROOT, "configs", "mispo.py:small"),
    f"--workdir={workdir}",
    f"--config.rl.steps={steps}",
    *small,
  ]


# rl/warmup.py's compile_eval and compile_rl on the config of a run.py command line (argv: its flags, parsed as
# run.py parses them)
COMPILE_AHEAD = """
import sys
from absl import flags
from experiments import run
from stepflash_jax import caches
from stepflash_jax.config import keyword_fields
from stepflash_jax.rl import warmup
sys.argv = keyword_fields(sys.argv)  # ml_collections reads sys.argv itself (as run.py's __main__ does)
flags.FLAGS(sys.argv)
caches.enable_compile_cache()
warmup.compile_eval(run._CONFIG.value)
warmup.compile_rl(run._CONFIG.value)
"""


def test_rl_resume_equals_uninterrupted(tmp_path):
  """4 generations in one go == 2 generations, then a rerun of the command that resumes to 4 (same SFT); the
  first run samples each generation in turn, the other two overlap it with the previous generation's training
  (rl.async): the same rollouts, updates and metrics. Before them the held-out eval's and the RL programs are
  compiled ahead (rl/warmup.py) into the cache, and the first run loads them: it writes no entry for them."""
  env = dict(
    os.environ,
    PYTHONUNBUFFERED="1",
    JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )  # the three runs compile the same programs once
  a, b = tmp_path / "a", tmp_path / "b"
  cmd = _rl_cmd(a, 4)
  subprocess.run(
    [sys.executable, "-c", COMPILE_AHEAD, *cmd[2:]], check=True, env=dict(env, PYTHONPATH=ROOT), timeout=600
  )
  rl_programs = ("jit_actor_step-", "jit_critic_step-", "jit_score-", "jit_values-")
  rl_programs += ("jit_generate_plain-", "jit_generate_continuous-")  # the held-out eval's decode, the rollout's
  entries = lambda: sorted(n for n in os.listdir(tmp_path / "xla") if n.startswith(rl_programs))
  ahead = entries()
  assert {n.split("-")[0] for n in ahead} == {p[:-1] for p in rl_programs}
  subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900)
  assert entries() == ahead  # every RL program of the run loaded from the cache
  subprocess.run(_rl_cmd(b, 2, a / "sft", True), check=True, env=env, capture_output=True, timeout=900)
  out = subprocess.run(_rl_cmd(b, 4, a / "sft", True), check=True, env=env, capture_output=True, text=True, timeout=900)
  assert "resumed from generation 2" in out.stdout
  rows = lambda w: {r["step"]: r for r in map(json.loads, open(w / "rl" / "metrics_rl.jsonl")) if "reward" in r}
  ra, rb = rows(a), rows(b)
  assert sorted(ra) == sorted(rb) == [1, 2, 3, 4]
  for s in ra:
    assert ra[s]["staleness"] == rb[s]["staleness"] == min(s - 1, 1)
    keys = ("reward", "actor_loss", "actor_grad_norm", "critic_loss", "kl", "entropy", "value_mean", "kept_frac")
    for k in (*keys, "sampled_reward", "sampled_informative"):
      assert ra[s][k] == rb[s][k], (s, k, ra[s][k], rb[s][k])
    assert "gold" not in ra[s]  # rule-checked tasks have no hidden gold score
    assert ra[s]["reward_zeroed/empty"] == rb[s]["reward_zeroed/empty"] and 0 <= ra[s]["reward_zeroed/empty"] <= 1
