"""stepflash_jax: Step 3.5 Flash (hybrid SWA/full-attention MoE with MTP-3) and its MIS-PO RL recipe in JAX.

import stepflash_jax as sfj
cfg, params = sfj.load_hf_checkpoint(path)     # HF-layout dir: config.json + *.safetensors
logits = sfj.forward(cfg, params, input_ids)   # int32 [B, T] -> float32 [B, T, vocab]
sfj.save_hf_checkpoint(cfg, params, path)
loss, metrics = sfj.mispo_loss(logp, logp_old, logp_rollout, advantages, mask)
"""

from stepflash_jax.config import from_hf_config, load_config_file, model_config, to_hf_config
from stepflash_jax.hf import load_hf_checkpoint, save_hf_checkpoint
from stepflash_jax.model import abstract_variables, apply, forward, init, logical_axes

from stepflash_jax.rl.advantages import gae_advantages
from stepflash_jax.rl.losses import gspo_loss, mispo_loss, ppo_loss, tis_loss, unbiased_kl, value_loss

__version__ = "0.1.0"
