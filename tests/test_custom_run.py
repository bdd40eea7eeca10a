"""Bring your own checkpoint and data (configs/custom.py): SFT + RL from the locally made HF fixture on its JSONL
prompts through experiments/run.py; bad records reported by line, kill -9 + rerun equal to an uninterrupted run, and
the exported checkpoint reloading with the trained actor's exact logits."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import stepflash_jax as sfj
from stepflash_jax.data import load_tokenizer_dir
from stepflash_jax.fixtures import make_fixture
from stepflash_jax.train.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_LINES = [
  '{"prompt": "Compute 1+1", "reference": "2"',
  '{"prompt": "Compute 1+1", "reference": "2", "verifier": "nope"}',
]


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
  d = make_fixture(str(tmp_path_factory.mktemp("fixture")), num_prompts=48)
  with open(os.path.join(d, "prompts.jsonl"), "a") as f:  # a 50-line file: records 49 and 50 are bad
    f.write("\n".join(BAD_LINES) + "\n")
  return d


def _cmd(fixture_dir, workdir):
  return [
    sys.executable,
    os.path.join(ROOT, "experiments", "run.py"),
    "--config=" + os.path.join(ROOT, "configs", "custom.py:small"),
    f"--workdir={workdir}",
    f"--config.model.hf_dir={fixture_dir}",
    f"--config.data.jsonl={os.path.join(fixture_dir, 'prompts.jsonl')}",
    "--config.train.steps=10",
    "--config.train.checkpoint_every=5",
    "--config.eval.num_examples=8",
    "--config.eval.batch_size=8",
  ]


def _rl_rows(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "rl", "metrics_rl.jsonl"))]


def test_custom_run_resumes_after_kill_and_exports(fixture_dir, tmp_path):
  """(Exact equality of a resumed RL run with an uninterrupted one: test_trainer.py; here the HF / JSONL path.)"""
  env, b = dict(os.environ, PYTHONUNBUFFERED="1"), tmp_path / "b"
  p = subprocess.Popen(_cmd(fixture_dir, b), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ck, deadline = b / "rl" / "checkpoints" / "1", time.time() + 900
  while not ck.exists() and p.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert ck.exists(), "the run never wrote its first RL checkpoint"
  out = subprocess.run(_cmd(fixture_dir, b), env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "rl: resumed from generation 1" in out.stdout
  assert "prompts.jsonl: 48 valid records (train 39, test 9), 2 skipped" in out.stdout
  assert "prompts.jsonl:49: not valid JSON" in out.stdout and "prompts.jsonl:50: field 'verifier'" in out.stdout
  rows = [r for r in _rl_rows(b) if "reward" in r]
  assert [r["step"] for r in rows] == [1, 2]
  assert json.load(open(b / "summary.json"))["generations"] == 2

  # The export holds the final actor exactly: same logits as the RL checkpoint's parameters.
  cfg, v = sfj.load_hf_checkpoint(str(b / "hf"))
  state, _ = Checkpointer(str(b / "rl" / "checkpoints")).restore()
  actor = {"params": state["actor"]["params"], "router": state["actor"]["router"]}
  tok = load_tokenizer_dir(str(b / "hf"))
  ids = np.asarray([tok.format_prompt("Compute 12+30")], np.int32)
  np.testing.assert_array_equal(sfj.forward(cfg, v, ids), sfj.forward(cfg, actor, ids))


def test_custom_config_checks_name_the_field(fixture_dir, tmp_path):
  from stepflash_jax.config import load_config_file
  from stepflash_jax.hf import resolve_model
  from stepflash_jax.train.validate import validate_run_config

  def config(**fields):
    c = load_config_file(os.path.join(ROOT, "configs", "custom.py"), "small")
    c.model.hf_dir, c.data.jsonl = fixture_dir, os.path.join(fixture_dir, "prompts.jsonl")
    for k, v in fields.items():
      section, name = k.split("__")
      c[section][name] = v
    return resolve_model(c)

  validate_run_config(config())
  validate_run_config(config(train__steps=0))  # RL straight from the checkpoint
  with pytest.raises(ValueError, match="config field 'data.jsonl'"):
    validate_run_config(config(data__jsonl=str(tmp_path / "missing.jsonl")))
  c = load_config_file(os.path.join(ROOT, "configs", "custom.py"), "small")
  c.train.steps = 0
  with pytest.raises(ValueError, match="config field 'train.steps'"):  # without a checkpoint to start from
    validate_run_config(c)
  out = subprocess.run(
    [sys.executable, os.path.join(ROOT, "experiments", "run.py"),
     "--config=" + os.path.join(ROOT, "configs", "custom.py:small"),
     f"--config.model.hf_dir={tmp_path}", f"--workdir={tmp_path / 'w'}"],
    capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert out.returncode != 0 and "config field 'model.hf_dir'" in out.stderr and "Traceback" not in out.stderr
