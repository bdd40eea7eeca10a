"""The entry point: pre-training, SFT, SFT -> RL (MIS-PO / PPO / GSPO / TIS), or the whole post-training pipeline
(configs/pipeline.py), chosen by the config's `job`.

  python experiments/run.py --config=configs/mispo.py                       # the main job (10-16 min on 2 cores)
  python experiments/run.py --config=configs/sft.py --workdir=runs/sft --config.train.steps=200
Without --workdir it writes to runs/<config name>. Rerunning the same command resumes from the latest checkpoint.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging
from ml_collections import config_flags

from stepflash_jax.config.files import keyword_fields, parse_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Python config file (get_config), ':arg' for a variant.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (multi-host pods).")
_COMPILE_CACHE = flags.DEFINE_string(
  "compile_cache",
  "default",
  "JAX persistent compilation cache directory ('default' = $STEPFLASH_CACHE/xla, "
  "'' = off): reruns load compiled programs instead of compiling them again.",
)
flags.mark_flags_as_required(["config"])


def default_workdir(config_path: str) -> str:
  return os.path.join("runs", os.path.splitext(os.path.basename(config_path))[0])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
  from stepflash_jax.host import keep_freed_memory

  keep_freed_memory()  # before JAX's first computation: no page faults on every step's buffers (stepflash_jax/host.py)
  import jax

  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  if _COMPILE_CACHE.value:
    from stepflash_jax.caches import enable_compile_cache

    enable_compile_cache(None if _COMPILE_CACHE.value == "default" else _COMPILE_CACHE.value)
  from stepflash_jax.config import ConfigError
  from stepflash_jax.hf import resolve_model
  from stepflash_jax.train.validate import resolve_pack, validate_run_config

  config = _CONFIG.value
  try:
    resolve_model(config)  # model.hf_dir: the checkpoint's architecture
    note = resolve_pack(config, jax.device_count())
    if note:
      print(note, flush=True)
    validate_run_config(config, num_devices=jax.device_count())
    if config.job in ("rl", "pipeline"):
      from stepflash_jax.rl import posttrain, reward_training

      reward_training.check_config(config)
      if config.job == "pipeline":
        posttrain.check_config(config)
  except ValueError as e:
    sys.exit(f"error: {e}")
  workdir = _WORKDIR.value or default_workdir(config_flags.get_config_filename(flags.FLAGS["config"]))
  print(f"writing to {os.path.abspath(workdir)}", flush=True)
  try:
    if config.job in ("sft", "pretrain"):
      from stepflash_jax.train import sft

      out = sft.train(config, workdir)
      done = f"{config.job} done: step {out['step']}"
      print(done if out["accuracy"] is None else f"{done}, held-out accuracy {out['accuracy']['accuracy']:.3f}")
    elif config.job == "rl":
      from stepflash_jax.rl import trainer

      trainer.run(config, workdir)
    elif config.job == "pipeline":
      from stepflash_jax.rl import posttrain

      posttrain.run(config, workdir)
    else:
      sys.exit(f"error: config field 'job': unknown job {config.job!r}")
  except ConfigError as e:  # a field that does not fit what is on disk (e.g. a reused run's length)
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  sys.argv = keyword_fields(sys.argv)
  app.run(main, flags_parser=parse_flags)
