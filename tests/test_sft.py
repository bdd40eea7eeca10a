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
  out = subprocess.run(_cmd(b), check=True, env=env, capture_output=True, text=True, timeout=600)
  assert "resumed from step" in out.stdout
  la, lb = _losses(a), _losses(b)
  assert sorted(la) == sorted(lb) == [1, 2, 3, 4, 5, 6]
  for s in la:
    assert la[s] == lb[s], (s, la[s], lb[s])


def test_bad_config_is_a_one_line_error(tmp_path):
  out = subprocess.run(_cmd(tmp_path) + ["--config.optim.lr=-1"], capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert "config field 'optim.lr'" in out.stderr and "Traceback" not in out.stderr
  assert not os.path.exists(tmp_path / "checkpoints")


def test_bad_eval_dtype_names_the_field():
  from stepflash_jax.config import load_config_file
  from stepflash_jax.train.validate import validate_run_config

  cfg = load_config_file(os.path.join(ROOT, "configs", "mispo.py"), "small")
  validate_run_config(cfg)
  cfg.eval.dtype = "float16"
  with pytest.raises(ValueError, match="config field 'eval.dtype'"):
    validate_run_config(cfg)
