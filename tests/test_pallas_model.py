"""The tiny model trains with the Pallas kernels (interpret mode on CPU) and matches the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np

import stepflash_jax as sfj
from stepflash_jax import model as M
from stepflash_jax.train import sft


def test_sft_step_loss_and_grads_pallas_equal_xla(tiny_cfg):
  rs = np.random.RandomState(0)
  B, T = 1, 40
  tokens = jnp.asarray(rs.randint(1, tiny_cfg.vocab_size, (B, T)), jnp.int32)
  seg = jnp.asarray(np.r_[np.ones(25), 2 * np.ones(15)][None], jnp.int32)  # two packed documents
  pos = jnp.asarray(np.r_[np.arange(25), np.arange(15)][None], jnp.int32)
  batch = {
    "tokens": tokens,
    "targets": jnp.roll(tokens, -1, 1),
    "loss_mask": jnp.ones((B, T)),
    "segment_ids": seg,
    "positions": pos,
  }
  v = sfj.init(tiny_cfg, jax.random.key(0))
  out = {}
  for impl in ("xla", "pallas"):
    c = tiny_cfg.copy_and_resolve_references()
    c.attention_impl = c.moe_impl = impl
    args = M.as_args(c)
    f = jax.jit(jax.value_and_grad(lambda p: sft.sft_loss(p, v["router"], batch, args, 0.1)[0]))
    out[impl] = f(v["params"])
  np.testing.assert_allclose(out["pallas"][0], out["xla"][0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(out["pallas"][1]), jax.tree.leaves(out["xla"][1])):
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5)
