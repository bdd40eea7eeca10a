"""An RL run's compiled programs, made ahead of the run into the persistent compilation cache (docs/rl.md §12).

XLA compiles a program from shapes, dtypes and the config alone, so a process with nothing else to do can compile a
later stage's programs while an earlier stage trains: the later stage then loads them from the cache (its tracing
still runs). `ahead` runs such a helper beside a with-block (the main job's SFT, the pipeline's pre-training and
SFT). `compile_eval` runs the held-out evaluation's decode program on one eval batch with stand-in weights (random
weights of the run's shapes); `compile_rl` rolls out one prompt batch with a stand-in policy (the rollout engine's
programs) and compiles the generation's scoring and update programs on that batch, its responses cut to one token
each so that the batch packs as a trained policy's short responses do (the packed programs: rl/packing.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from stepflash_jax import caches, hf, host, parallel
from stepflash_jax import model as model_lib
from stepflash_jax.data import prompt_dataset
from stepflash_jax.data.hf_tokenizer import tokenizer_for
from stepflash_jax.rl import build
from stepflash_jax.rl.batches import repeat_prompts, sequences, take_rows
from stepflash_jax.rl.programs import Programs
from stepflash_jax.train import evaluate
from stepflash_jax.train import state as state_lib
from stepflash_jax.train.step import frozen_mask


def _stand_in(config):
  """(config with its model resolved, mesh, rules, model args, random variables of the run's shapes)."""
  config = hf.resolve_model(config)
  mesh, rules = parallel.make_mesh(config.mesh), parallel.rules(config)
  args = model_lib.as_args(config.model)
  with parallel.use_mesh(mesh, rules):
    return config, mesh, rules, args, state_lib.init_variables(args, jax.random.key(0), mesh, rules)


def compile_eval(config) -> None:
  """Compile the held-out evaluation of a run of `config` (evaluate.accuracy: its first eval batch)."""
  config, mesh, rules, _, ref = _stand_in(config)
  with parallel.use_mesh(mesh, rules):
    tok = tokenizer_for(config)
    evaluate.accuracy(config, ref, tok, evaluate.heldout_examples(config, tok)[: config.eval.batch_size])


def compile_rl(config) -> None:
  """Compile the programs of trainer.run(config) that depend on neither its SFT weights nor its data: the
  rollout (single- or multi-turn), the scoring passes and the actor / critic updates (each router-replay flag)."""
  config, mesh, rules, args, ref = _stand_in(config)
  rc, P = config.rl, config.data.max_prompt_len
  with parallel.use_mesh(mesh, rules):
    tok = tokenizer_for(config)
    state, actor_tx, critic_tx = build.init_state(config, ref, args, mesh, rules)
    sampled = rc.prompts_per_step * rc.get("oversample", 1)  # the rollout's prompts; prompts_per_step train
    data = prompt_dataset(tok, batch_size=sampled, max_prompt_len=P, mixture=config.data.mixture)
    prompts = repeat_prompts(next(iter(data)), rc.samples_per_prompt)
    sample, close = build.sampler(config, tok, mesh, rules)
    try:
      gen = sample(ref, prompts, 0)
    finally:
      close()
    rows, n = np.arange(rc.prompts_per_step * rc.samples_per_prompt), len(prompts["examples"])
    prompts, gen = take_rows(prompts, rows, n), take_rows(gen, rows, n)
    gen["response_mask"] = np.zeros_like(np.asarray(gen["response_mask"]))
    gen["response_mask"][:, 0] = 1.0
    gen["response_valid"] = gen["response_mask"]
    fns = Programs(args, rc, actor_tx, critic_tx, P, frozen_mask(ref["params"], rc.freeze_router))
    build.compile_programs(fns, state, sequences(prompts, gen), rc, mesh, rules)


@contextlib.contextmanager
def ahead(stages):
  """While the with-block runs, a helper process compiles stages = [(name, compile_eval or compile_rl, config),
  ...] in order into the compilation cache; it is stopped when the block ends, and whatever it has not compiled yet
  the stages compile themselves. Nothing without a compilation cache or stages, or off a CPU backend (a second
  process would claim the accelerator's memory beside the job's)."""
  cache = jax.config.jax_compilation_cache_dir
  if not (cache and stages and jax.default_backend() == "cpu"):
    yield
    return
  scratch = tempfile.mkdtemp(prefix=".ahead-", dir=cache)  # the helper's own cache: it may be killed mid-write
  try:
    with parallel.beside(_compile_ahead, (stages, cache, scratch)):
      yield
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _compile_ahead(stages, cache, scratch):
  """The helper of `ahead`, at the lowest CPU priority: each stage compiled in the cache directory scratch (the
  job's cache linked in first: what exists loads), each new entry added to the job's cache as soon as it is
  written whole (caches.share_when_written), so a helper stopped mid-stage hands over what it finished."""
  os.nice(19)  # the idle share of the cores: pre-training beside it slowed by 15% instead of 57% (README)
  host.keep_freed_memory()
  caches.share(cache, scratch)
  caches.enable_compile_cache(scratch)
  caches.share_when_written(scratch, cache)
  for name, compile_fn, config in stages:
    t, before = time.time(), set(os.listdir(scratch))
    compile_fn(config)
    caches.share(scratch, cache)
    n = sum(f.endswith("-cache") for f in set(os.listdir(scratch)) - before)
    print(f"[compile ahead] {name}: {n} programs in {time.time() - t:.0f} s", flush=True)
