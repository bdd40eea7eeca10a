"""The inference engine (prefill / decode with KV and ring caches, MTP speculative decoding, sampling).

Used by RL rollouts, evaluation and generation; its numerics (dtype, logit noise) are its own (engine.py)."""

from stepflash_jax.sampling.calls import cast_variables
from stepflash_jax.sampling.engine import ENGINE_DTYPES, FAST_COMPILE, RolloutEngine
from stepflash_jax.sampling.sample import sampling_logprobs
from stepflash_jax.sampling.speculative import draft_prefill, draft_step

__all__ = [
  "ENGINE_DTYPES",
  "FAST_COMPILE",
  "RolloutEngine",
  "cast_variables",
  "draft_prefill",
  "draft_step",
  "sampling_logprobs",
]
