"""RL post-training pieces (docs/rl.md): MIS-PO and baseline losses, GAE, routing confidence."""

from stepflash_jax.rl.advantages import (
  gae_advantages,
  last_valid_index,
  place_terminal_reward,
  terminal_rewards,
  value_after_last,
)
from stepflash_jax.rl.losses import (
  entropy_from_logits,
  gspo_loss,
  mis_mask,
  mispo_loss,
  ppo_loss,
  tis_loss,
  unbiased_kl,
  value_loss,
)
from stepflash_jax.rl.routing import routing_confidence, routing_probs
