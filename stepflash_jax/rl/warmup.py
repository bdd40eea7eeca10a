"""An RL run's compiled programs, made ahead of the run into the persistent compilation cache (docs/rl.md §12).

XLA compiles a program from shapes, dtypes and the config alone, so a process with nothing else to do can compile a
later stage's programs while an earlier stage trains: the later stage then loads them from the cache (its tracing
still runs). `compile_rl` rolls out one prompt batch with a stand-in policy (random weights of the run's shapes:
the rollout engine's programs) and compiles the generation's scoring and update programs on that batch, its
responses cut to one token each so that the batch packs as a trained policy's short responses do (the packed
programs: rl/packing.py).
"""

from __future__ import annotations

import jax
import numpy as np

from stepflash_jax import hf, parallel
from stepflash_jax import model as model_lib
from stepflash_jax.data import prompt_dataset
from stepflash_jax.data.hf_tokenizer import tokenizer_for
from stepflash_jax.rl import trainer
from stepflash_jax.rl.batches import repeat_prompts, sequences, take_rows
from stepflash_jax.rl.programs import Programs
from stepflash_jax.train import state as state_lib
from stepflash_jax.train.step import frozen_mask


def compile_rl(config) -> None:
  """Compile the programs of trainer.run(config) that depend on neither its SFT weights nor its data: the
  rollout (single- or multi-turn), the scoring passes and the actor / critic updates (each router-replay flag)."""
  config = hf.resolve_model(config)
  rc, mesh, rules = config.rl, parallel.make_mesh(config.mesh), parallel.rules(config)
  with parallel.use_mesh(mesh, rules):
    args, tok, P = model_lib.as_args(config.model), tokenizer_for(config), config.data.max_prompt_len
    ref = state_lib.init_variables(args, jax.random.key(0), mesh, rules)
    state, actor_tx, critic_tx = trainer.init_state(config, ref, args, mesh, rules)
    sampled = rc.prompts_per_step * rc.get("oversample", 1)  # the rollout's prompts; prompts_per_step train
    data = prompt_dataset(tok, batch_size=sampled, max_prompt_len=P, mixture=config.data.mixture)
    prompts = repeat_prompts(next(iter(data)), rc.samples_per_prompt)
    sample, close = trainer.sampler(config, tok, mesh, rules)
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
    trainer.compile_programs(fns, state, sequences(prompts, gen), rc, mesh, rules)
