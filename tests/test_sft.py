"""SFT: LR schedule values, frozen router, skipped non-finite steps, and kill -9 + resume == uninterrupted."""

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax.train import sft as sft_lib
from stepflash_jax.train import step as step_lib
from conftest import ROOT


def test_lr_schedule_values():
  f = step_lib.lr_schedule(1e-5, 1000, warmup_frac=0.03, end_frac=0.5)
  assert float(f(0)) == 0.0
  np.testing.assert_allclose(float(f(15)), 0.5e-5, rtol=1e-6)  # halfway through the 30-step warmup
  np.testing.assert_allclose(float(f(30)), 1e-5, rtol=1e-6)  # peak
  np.testing.assert_allclose(float(f(515)), 0.75e-5, rtol=1e-3)  # cosine midpoint: (1 + 0.5) / 2
  np.testing.assert_allclose(float(f(1000)), 0.5e-5, rtol=1e-6)  # end: half the peak (1e-5 -> 5e-6)


def test_frozen_router_mask():
  params = {"layer_2": {"moe": {"router": {"kernel": jnp.ones((4, 8))}, "gate_proj": {"kernel": jnp.ones((8, 4, 2))}}}}
  m = step_lib.frozen_mask(params, True)
  assert m["layer_2"]["moe"]["router"]["kernel"] == 0.0 and m["layer_2"]["moe"]["gate_proj"]["kernel"] == 1.0
  assert step_lib.frozen_mask(params, False)["layer_2"]["moe"]["router"]["kernel"] == 1.0
  scaled = step_lib.frozen_mask(params, False, router_lr_scale=4.0)["layer_2"]["moe"]
  assert scaled["router"]["kernel"] == 4.0 and scaled["gate_proj"]["kernel"] == 1.0


def test_non_finite_step_is_skipped():
  import optax

  params = {"w": jnp.ones((3,))}
  tx = optax.sgd(0.1)
  state = {"params": params, "opt": tx.init(params)}
  mask = {"w": 1.0}
  p, _, _, skipped = step_lib.guarded_update(state, {"w": jnp.array([1.0, jnp.nan, 0.0])}, jnp.float32(1.0), tx, mask)
  assert float(skipped) == 1.0 and bool(jnp.all(p["w"] == 1.0))
  p, _, _, skipped = step_lib.guarded_update(state, {"w": jnp.ones(3)}, jnp.float32(1.0), tx, mask)
  assert float(skipped) == 0.0 and np.allclose(p["w"], 0.9)


def test_sft_loss_is_the_full_logits_cross_entropy():
  """sft_loss (vocabulary-chunked log-probs, no [B, T, V] logits) = the cross-entropy of the model's full logits,
  main head and MTP heads, value and gradient."""
  import jax

  import stepflash_jax as sfj
  from configs.model.tiny import micro_model
  from stepflash_jax import model as M
  from stepflash_jax.config import load_config_file
  from stepflash_jax.data import future_targets
  from stepflash_jax.train.sft import sft_loss

  args = M.as_args(micro_model(load_config_file(os.path.join(ROOT, "configs", "model", "tiny.py")), num_mtp_layers=2))
  v = sfj.init(args, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, args.vocab_size, (2, 24)), jnp.int32)
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 10 + [0] * 4], 2, 0), jnp.int32)
  pos = jnp.asarray(np.tile(np.r_[np.arange(10), np.arange(10), np.zeros(4)], (2, 1)), jnp.int32)
  batch = dict(
    tokens=tokens, targets=jnp.roll(tokens, -1, 1), loss_mask=(seg > 0) * 1.0, segment_ids=seg, positions=pos
  )

  def reference(params):
    out = M.apply(args, {**v, "params": params}, tokens, positions=pos, segment_ids=seg, mtp=True)
    terms = []
    for k, logits in enumerate((out["logits"], *out["mtp_logits"])):
      t, m = future_targets(batch["targets"], batch["loss_mask"], seg, k)
      lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), t[..., None], -1)[..., 0]
      terms.append(-(lp * m).sum() / m.sum())
    return terms[0] + 0.3 * jnp.mean(jnp.stack(terms[1:]))

  loss, g = jax.value_and_grad(lambda p: sft_loss(p, v["router"], batch, args, 0.3)[0])(v["params"])
  want, g_want = jax.value_and_grad(reference)(v["params"])
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g, g_want)


def _cmd(workdir):
  return [
    sys.executable,
    os.path.join(ROOT, "experiments", "run.py"),
    "--config=" + os.path.join(ROOT, "configs", "sft.py:small"),
    f"--workdir={workdir}",
    "--config.train.steps=6",
    "--config.train.checkpoint_every=2",
    "--config.train.eval_every=100",
    "--config.eval.num_examples=4",
    "--config.eval.batch_size=4",
    "--config.eval.max_new_tokens=4",
    "--config.data.batch_size=4",
    "--config.data.seq_len=64",
  ]


def _losses(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics_sft.jsonl"))]
  return {r["step"]: r["loss"] for r in rows}


def test_kill_and_resume_equals_uninterrupted(tmp_path):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  a, b = tmp_path / "a", tmp_path / "b"
  subprocess.run(_cmd(a), check=True, env=env, capture_output=True, timeout=600)
  p = subprocess.Popen(_cmd(b), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ck = b / "checkpoints" / "2"
  deadline = time.time() + 600
  while not ck.exists() and p.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert ck.exists(), "the run never wrote its step-2 checkpoint"
  assert sft_lib.finished(b, 2) and not sft_lib.finished(tmp_path / "none", 1)  # (what rl.compile_ahead reads)
  out = subprocess.run(_cmd(b), check=True, env=env, capture_output=True, text=True, timeout=600)
  assert "resumed from step" in out.stdout
  assert sft_lib.finished(b, 6) and not sft_lib.finished(b, 7)
  la, lb = _losses(a), _losses(b)
  assert sorted(la) == sorted(lb) == [1, 2, 3, 4, 5, 6]
  for s in la:
    assert la[s] == lb[s], (s, la[s], lb[s])


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--config.optim.lr=-1", "error: config field 'optim.lr': must be > 0, got -1.0"),
    # a field the config lacks, with ml_collections' suggestion; a keyword (rl.async) reaches it as ['async']
    (
      "--config.optim.lrr=1",
      """error: config field 'optim.lrr' does not exist (Did you mean "lr" instead of "lrr"?)""",
    ),
    ("--config.nosuch.x=1", "error: config field 'nosuch' does not exist"),
    ("--config.data.lambda=1", "error: config field 'data.lambda' does not exist"),
    # the config file itself: missing, or its get_config raising
    (
      f"--config={ROOT}/configs/nope.py",
      f"error: --config: [Errno 2] No such file or directory: '{ROOT}/configs/nope.py'",
    ),
    (
      f"--config={ROOT}/configs/sft.py:smal",
      f"error: flag --config={ROOT}/configs/sft.py:smal: Error whilst parsing config file: ValueError: unknown config "
      "option(s) ['smal']; known: ['small', 'pretrained']",
    ),
  ],
)
def test_bad_config_is_a_one_line_error(tmp_path, flag, message):
  file = flag.startswith("--config=")  # replaces the config file, or adds an override
  cmd = [flag if file and a.startswith("--config=") else a for a in _cmd(tmp_path)] + ([] if file else [flag])
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1] == message and "Traceback" not in out.stderr
  assert not os.listdir(tmp_path)  # nothing written in the workdir


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("eval.dtype", "float16", "config field 'eval.dtype'"),
    ("rl.token_bounds", (0.5, 2.0, 3.0), r"config field 'rl.token_bounds': need a pair"),
    ("rl.traj_bounds", ("a", "b"), r"config field 'rl.traj_bounds': need a pair"),
    ("rl.traj_bounds", (1.001, 0.996), r"config field 'rl.traj_bounds'.*0 < low <= 1 <= high"),
    ("train.steps", True, r"config field 'train.steps': must be > 0, got True"),
    ("rl.ppo_clip", -0.2, r"config field 'rl.ppo_clip': must be > 0, got -0.2"),
    ("rl.tis_cap", 0.0, r"config field 'rl.tis_cap': must be > 0, got 0.0"),
  ],
)
def test_bad_run_field_is_named(field, value, message):
  from stepflash_jax.config import load_config_file
  from stepflash_jax.train.validate import validate_run_config

  cfg = load_config_file(os.path.join(ROOT, "configs", "mispo.py"), "small")
  validate_run_config(cfg)
  section, name = field.split(".")
  cfg[section][name] = value
  with pytest.raises(ValueError, match=message):
    validate_run_config(cfg)


def test_pretrain_then_sft_starts_from_its_weights(tmp_path):
  """configs/sft.py:small,pretrained: the pre-training stage runs first (router trained, bias balancing on, routing
  statistics logged per MoE layer), then SFT starts from its weights; a second SFT reuses the finished stage."""
  import orbax.checkpoint as ocp

  base = _cmd(tmp_path / "sft")
  cmd = base[:2] + ["--config=" + os.path.join(ROOT, "configs", "sft.py:small,pretrained")]
  cmd += [a for a in base[3:] if "train.steps" not in a] + [
    "--config.train.steps=2",  # step 1 runs at learning rate 0 (warmup)
    "--config.pretrain.train.steps=3",
    "--config.pretrain.data.batch_size=4",
    "--config.pretrain.data.seq_len=64",
  ]
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=600)
  assert "starting from the pre-training run" in out.stdout
  pre = tmp_path / "sft" / "pretrain"
  rows = [json.loads(l) for l in open(pre / "metrics_pretrain.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3]
  moe = [k for k in rows[-1] if k.startswith("routing/confidence/layer_")]
  assert len(moe) == 2  # the small mode's 4-layer model: MoE layers 2 and 3
  assert rows[0]["routing/bias_norm"] > 0  # the bias moved (0.001 * sign per expert: norm sqrt(8) * 0.001)
  np.testing.assert_allclose(rows[0]["routing/bias_norm/layer_2"], 0.001 * np.sqrt(8), rtol=1e-5)

  def variables(d, step):
    state = ocp.StandardCheckpointer().restore(os.path.abspath(d / "checkpoints" / str(step) / "state"))
    return state["params"], state["router"]

  (p0, r0), (p1, r1) = variables(pre, 3), variables(tmp_path / "sft", 2)
  router_w = lambda p: np.asarray(p["layer_2"]["moe"]["router"]["kernel"])
  assert np.array_equal(router_w(p0), router_w(p1))  # frozen in SFT: exactly the pre-trained router
  np.testing.assert_array_equal(r0["layer_2"]["moe"]["router_bias"], r1["layer_2"]["moe"]["router_bias"])
  embed = lambda p: np.asarray(p["embed"]["embedding"])
  assert 0 < np.abs(embed(p0) - embed(p1)).max() < 0.1  # one SFT update away from the pre-trained weights
  rerun = subprocess.run(
    [a.replace("train.steps=2", "train.steps=3") for a in cmd], env=env, capture_output=True, text=True, timeout=600
  )
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert "sft: resumed from step 2" in rerun.stdout and "starting from the pre-training" not in rerun.stdout
  # A new SFT run that reuses this pre-training run (train.init_from) with another length: a clear error, and the
  # reused run is left as it was (it used to be trained on to the new length, in place).
  before = sorted(os.listdir(pre / "checkpoints")), (pre / "metrics_pretrain.jsonl").read_bytes()
  other = [a for a in cmd if not a.startswith(("--workdir", "--config.pretrain.train.steps"))] + [
    f"--workdir={tmp_path / 'sft2'}",
    f"--config.train.init_from={pre}",
    "--config.pretrain.train.steps=5",
  ]
  bad = subprocess.run(other, env=env, capture_output=True, text=True, timeout=600)
  assert bad.returncode != 0 and "Traceback" not in bad.stderr
  assert "config field 'pretrain.train.steps': 5" in bad.stderr and "started with 3 steps" in bad.stderr
  assert (sorted(os.listdir(pre / "checkpoints")), (pre / "metrics_pretrain.jsonl").read_bytes()) == before


def test_bad_pretrain_fields_name_the_field():
  import ml_collections

  from stepflash_jax.config import load_config_file
  from stepflash_jax.train.validate import validate_run_config

  sft = lambda arg: load_config_file(os.path.join(ROOT, "configs", "sft.py"), arg)
  cfg = sft("small")
  cfg.train.init_from = "runs/pretrain"
  with pytest.raises(ValueError, match="config field 'train.init_from'"):
    validate_run_config(cfg)
  cfg = sft("small,pretrained")
  validate_run_config(cfg)
  cfg.pretrain.train.ep_groups = 3
  with pytest.raises(ValueError, match="config field 'pretrain.train.ep_groups'"):
    validate_run_config(cfg)
  cfg = sft("small,pretrained")
  cfg.model.num_experts = 16  # one model: pre-training's follows an override of model.*
  validate_run_config(cfg)
  assert cfg.pretrain.model.num_experts == 16
  cfg.pretrain.model = ml_collections.ConfigDict({**cfg.model.to_dict(), "num_experts": 8})  # a model of its own
  with pytest.raises(ValueError, match="config field 'pretrain.model'"):
    validate_run_config(cfg)
  cfg = sft("small")
  cfg.job = "finetune"
  with pytest.raises(ValueError, match="config field 'job'"):
    validate_run_config(cfg)
  with pytest.raises(ValueError, match="unknown config option"):
    sft("smal")
