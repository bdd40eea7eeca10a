"""What an RL run builds from its config (docs/rl.md §1): the actor / critic state with their optimizers, the rollout
engine and the sampler of a generation's rollout, and the compiled programs of a generation. Used by the trainer
and, ahead of a run, by rl/warmup.py, which compiles the same programs with stand-in weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import parallel
from stepflash_jax.agents.rollout import Agent
from stepflash_jax.rl.critic import critic_from_actor
from stepflash_jax.sampling import RolloutEngine
from stepflash_jax.train import state as state_lib
from stepflash_jax.train.step import make_optimizer, warmup_constant


def init_state(config, ref, args, mesh, rules):
  """Actor (the SFT params) and critic (the SFT backbone + a zero value head), each with its Muon state."""
  rc = config.rl
  actor_tx = make_optimizer(config.optim, warmup_constant(rc.actor_lr, rc.actor_warmup))
  critic_tx = make_optimizer(config.optim, warmup_constant(rc.critic_lr, rc.critic_warmup))
  critic = state_lib.place_state(critic_from_actor(ref), args, mesh, rules)
  state = {
    "actor": {**ref, "opt": state_lib.init_opt_state(actor_tx, ref["params"], args, mesh, rules)},
    "critic": {**critic, "opt": state_lib.init_opt_state(critic_tx, critic["params"], args, mesh, rules)},
    "step": jnp.int32(0),
  }
  return state, actor_tx, critic_tx


def engine_kw(rc) -> dict:
  """The rollout engine's numerics and sampling: rl.rollout_dtype, rl.rollout_quantize weights, rl.temperature /
  top_p / logit_noise."""
  quantize = None if rc.get("rollout_quantize", "none") == "none" else rc.rollout_quantize
  return dict(
    dtype=rc.rollout_dtype, temperature=rc.temperature, top_p=rc.top_p, logit_noise=rc.logit_noise, quantize=quantize
  )


def rollout_engine(config, tok) -> RolloutEngine:
  """The inference engine of the (single-turn) rollouts, with engine_kw(config.rl)."""
  return RolloutEngine(
    config.model,
    max_prompt_len=config.data.max_prompt_len,
    max_new_tokens=config.rl.max_new_tokens,
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    **engine_kw(config.rl),
  )


def sampler(config, tok, mesh, rules):
  """(sample(policy, prompts, generation index) -> the rollout on the host, a function that releases the engine):
  multi-turn tool use with an `agent` section (agents/rollout.py), else the single-turn engine."""
  rc = config.rl
  if "agent" in config:
    agent = Agent(config, tok, rc.max_new_tokens, **engine_kw(rc))

    def sample(policy, prompts, index):  # in the rollout thread with rl.async: its own mesh context
      with parallel.use_mesh(mesh, rules):
        return agent.sample(policy, prompts, prompts["examples"], generation_rng(config.seed, index)[0])

    return sample, agent.close
  engine = rollout_engine(config, tok)

  def sample(policy, prompts, index):
    with parallel.use_mesh(mesh, rules):
      return rollout(engine, policy, prompts, generation_rng(config.seed, index)[0], rc, mesh, rules)

  return sample, lambda: None


def generation_rng(seed: int, step: int):
  """(the rollout's key, the host RNG of the update's mini-batch permutations) of generation `step`."""
  rng = np.random.default_rng([seed, step])
  return jax.random.key(rng.integers(2**31)), rng


def rollout(engine, policy, prompts, key, rc, mesh, rules) -> dict:
  """The rollout engine's samples for a prompt batch (static batching, or rl.rollout_slots rows served
  continuously: sampling/continuous.py), on the host."""
  pb = parallel.shard_batch(
    {"tokens": prompts["tokens"], "lengths": prompts["lengths"]}, mesh, rules, global_batch=True
  )
  slots = rc.get("rollout_slots", 0)
  if slots:
    return parallel.to_host(engine.generate_queue(policy, pb["tokens"], pb["lengths"], key, slots=slots))
  return parallel.to_host(engine.generate(policy, pb["tokens"], pb["lengths"], key))


def compile_programs(fns, state, batch, rc, mesh, rules) -> None:
  """Compile the generation's big programs (Programs.compile) on `batch`'s shapes, with the router-replay flags
  rl.router_replay will use."""
  flags = {"off": (False,), "always": (True,), "auto": (False, True)}[rc.router_replay]
  fns.compile(state, batch, (rc.actor_minibatches, rc.critic_minibatches), mesh, rules, replay=flags)
