"""The Step 3.5 Flash decoder: embedding, decoder layers (the repeating block compiled once with nn.scan),
final norm, untied lm_head (or a scalar value head for the critic) and the MTP-3 modules.

Layer i is built from `ModelArgs.layers[i]` (attention type, heads, window, RoPE, dense/MoE, clamps), so the
published 45-layer model and the toy configs run the same code. Layers `scan[0] : scan[0] + period*n` are stacked
as `blocks/sub_{j}` with a leading "layers" axis; the others are `layer_{i}`. Per-layer clamp limits are scan
inputs, so blocks that differ only in their clamps still share one compiled body.
"""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from stepflash_jax.config import LayerSpec, ModelArgs
from stepflash_jax.model.attention import Attention
from stepflash_jax.model.mlp import MLP, Weight
from stepflash_jax.model.moe import MoE
from stepflash_jax.model.norms import RMSNorm

ACT = ("batch", "length", "embed")


class DecoderLayer(nn.Module):
  """Pre-norm block: x + Attn(norm(x)), then x + FFN(norm(x)) with FFN = dense SwiGLU or MoE."""

  spec: LayerSpec
  args: ModelArgs

  @nn.compact
  def __call__(self, x, positions, segment_ids, token_mask, limits=None, cache=None, cache_index=None, replay=None):
    """replay: [B, T, k] experts of an MoE layer (router replay), else None."""
    a, s = self.args, self.spec
    lim, shared_lim = (s.ffn_limit, s.shared_limit) if limits is None else (limits[0], limits[1])
    dt = dict(dtype=a.dtype, param_dtype=a.param_dtype)
    h = RMSNorm(a.eps, name="input_norm", **dt)(x)
    out, cache = Attention(
      a.hidden_size,
      s.num_heads,
      a.num_kv_heads,
      a.head_dim,
      s.window,
      s.inv_freq,
      a.eps,
      a.init_std,
      a.attention_impl,
      a.context_full,
      name="attn",
      **dt,
    )(h, positions, segment_ids, cache, cache_index)
    x = nn.with_logical_constraint(x + out, ACT)
    h = RMSNorm(a.eps, name="post_attn_norm", **dt)(x)
    if s.moe:
      out = MoE(
        a.hidden_size,
        a.num_experts,
        a.top_k,
        a.moe_intermediate_size,
        a.shared_intermediate_size,
        a.routed_scaling_factor,
        a.norm_expert_weight,
        a.init_std,
        a.moe_impl,
        name="moe",
        **dt,
      )(h, token_mask, lim, shared_lim, replay)
    else:
      out = MLP(a.hidden_size, a.intermediate_size, a.init_std, name="mlp", **dt)(h, lim)
    return nn.with_logical_constraint(x + out, ACT), cache


class Block(nn.Module):
  """`period` consecutive decoder layers; the body of the scan. Carry: x. Scanned inputs: limits, cache, replay."""

  specs: tuple
  args: ModelArgs

  @nn.compact
  def __call__(self, x, limits, cache, replay, positions, segment_ids, token_mask, cache_index):
    new = {}
    for j, spec in enumerate(self.specs):
      name = f"sub_{j}"
      x, c = DecoderLayer(spec, self.args, name=name)(
        x,
        positions,
        segment_ids,
        token_mask,
        limits[j],
        None if cache is None else cache[name],
        cache_index,
        None if replay is None else replay.get(name),
      )
      new[name] = c
    return x, (None if cache is None else new)


def head_logits(normed, weight):
  """normed [B, T, H] (final-normed hidden), weight [H, V] -> logits [B, T, V] float32."""
  return jnp.dot(normed, weight, preferred_element_type=jnp.float32)


class MTPModule(nn.Module):
  """h_k = Layer_k(eh_proj([enorm(embed(token_{t+k})), hnorm(h_{k-1})])); logits_k = head_k(norm_k(h_k)).
  Returns (h_k, norm_k(h_k), head_k's weight [H, V], cache): the logits are `head_logits` of the two."""

  spec: LayerSpec
  args: ModelArgs

  @nn.compact
  def __call__(self, h_prev, emb, positions, segment_ids, token_mask, cache=None, cache_index=None):
    a = self.args
    dt = dict(dtype=a.dtype, param_dtype=a.param_dtype)
    z = jnp.concatenate([RMSNorm(a.eps, name="enorm", **dt)(emb), RMSNorm(a.eps, name="hnorm", **dt)(h_prev)], -1)
    z = z @ Weight((2 * a.hidden_size, a.hidden_size), ("concat_embed", "embed"), a.init_std, name="eh_proj", **dt)()
    h, cache = DecoderLayer(self.spec, a, name="layer")(z, positions, segment_ids, token_mask, None, cache, cache_index)
    hn = RMSNorm(a.eps, name="final_norm", **dt)(h)
    return h, hn, Weight((a.hidden_size, a.vocab_size), ("embed", "vocab"), a.init_std, name="head", **dt)(), cache


class Transformer(nn.Module):
  """tokens [B, T] int32 -> dict(logits [B, T, V] fp32 | values [B, T] fp32, hidden [B, T, H], mtp_logits, cache).

  `hidden` is the last hidden state *before* the final norm (the MTP input). segment_ids [B, T] (0 = padding)
  keep packed documents apart; positions [B, T] restart per document. With `cache` (see model/cache.py) the call
  is a prefill/decode step writing at columns cache_index.. .
  logits=False: no [B, T, V] logits; instead `heads` = ((normed [B, T, H], weight [H, V]) of the main head, then of
  each MTP module), the inputs of the vocabulary-chunked `ops.token_logprobs`.
  """

  args: ModelArgs
  head: str = "lm"  # "lm" | "value" (critic: a zero-initialised scalar head, no MTP)

  def setup(self):
    a = self.args
    dt = dict(dtype=a.dtype, param_dtype=a.param_dtype)
    self.embed = nn.Embed(
      a.vocab_size,
      a.hidden_size,
      param_dtype=a.param_dtype,
      name="embed",
      embedding_init=nn.with_logical_partitioning(nn.initializers.normal(a.init_std), ("vocab", "embed")),
    )
    start, period, n = a.scan if a.scan else (len(a.layers), 0, 0)
    self.unrolled = [i for i in range(len(a.layers)) if not start <= i < start + period * n]
    self.layer = {i: DecoderLayer(a.layers[i], a) for i in self.unrolled}
    if n:
      body = nn.remat(Block, prevent_cse=False) if a.remat else Block
      self.blocks = nn.scan(
        body,
        variable_axes={"params": 0, "router": 0, "moe_stats": 0},
        split_rngs={"params": True},
        length=n,
        in_axes=(0, 0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        metadata_params={nn.PARTITION_NAME: "layers"},
      )(a.layers[start : start + period], a)
      self.block_limits = np.array(
        [
          [
            [a.layers[start + b * period + j].ffn_limit, a.layers[start + b * period + j].shared_limit]
            for j in range(period)
          ]
          for b in range(n)
        ],
        np.float32,
      )
    self.final_norm = RMSNorm(a.eps, **dt)
    if self.head == "lm":
      self.lm_head = Weight((a.hidden_size, a.vocab_size), ("embed", "vocab"), a.init_std, **dt)
      self.mtp = [MTPModule(s, a) for s in a.mtp_layers]
    else:
      self.value_head = Weight((a.hidden_size,), ("embed",), zero_init=True, dtype=jnp.float32)

  def backbone(self, tokens, positions, segment_ids, cache=None, cache_index=None, replay=None):
    """replay: None or model/replay.py's `replay_tree` ({"layer_i": [B, T, k], "blocks": {"sub_j": [n, B, T, k]}})."""
    a = self.args
    x = nn.with_logical_constraint(self.embed(tokens).astype(a.dtype), ACT)
    mask = None if segment_ids is None else segment_ids > 0
    new_cache = {}
    start, period, n = a.scan if a.scan else (len(a.layers), 0, 0)
    get = (lambda k: None) if cache is None else (lambda k: cache[k])
    rep = (lambda k: None) if replay is None else replay.get

    def layer(i, x):
      name = f"layer_{i}"
      x, new_cache[name] = self.layer[i](x, positions, segment_ids, mask, None, get(name), cache_index, rep(name))
      return x

    for i in [i for i in self.unrolled if i < start]:
      x = layer(i, x)
    if n:
      x, new_cache["blocks"] = self.blocks(
        x, jnp.asarray(self.block_limits), get("blocks"), rep("blocks"), positions, segment_ids, mask, cache_index
      )
    for i in [i for i in self.unrolled if i >= start]:
      x = layer(i, x)
    return x, new_cache

  def __call__(
    self, tokens, positions=None, segment_ids=None, cache=None, cache_index=None, mtp=False, replay=None, logits=True
  ):
    B, T = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, new_cache = self.backbone(tokens, positions, segment_ids, cache, cache_index, replay)
    hn = self.final_norm(hidden)
    out = {"hidden": hidden, "cache": new_cache if cache is not None else None}
    if self.head == "value":
      out["values"] = jnp.dot(hn.astype(jnp.float32), self.value_head())
      return out
    heads = [(hn, self.lm_head())]
    if mtp:
      # Module k (0-based) reads token t+k+1 and predicts token t+k+2; shifted-in positions past the end are pad.
      h = hidden
      mask = None if segment_ids is None else segment_ids > 0
      for k, module in enumerate(self.mtp):
        shifted = jnp.pad(tokens[:, k + 1 :], ((0, 0), (0, k + 1)))
        h, hn_k, w_k, _ = module(h, self.embed(shifted).astype(self.args.dtype), positions, segment_ids, mask)
        heads.append((hn_k, w_k))
    if not logits:
      return {**out, "heads": tuple(heads)}
    out["logits"] = head_logits(*heads[0])
    if mtp:
      out["mtp_logits"] = tuple(head_logits(*hw) for hw in heads[1:])
    return out

  def mtp_step(self, k, h_prev, tokens, positions, segment_ids=None, cache=None, cache_index=None):
    """One MTP module on given inputs (drafting): returns (h_k, logits_k, new_cache)."""
    h, hn, w, cache = self.mtp[k](
      h_prev,
      self.embed(tokens).astype(self.args.dtype),
      positions,
      segment_ids,
      None if segment_ids is None else segment_ids > 0,
      cache,
      cache_index,
    )
    return h, head_logits(hn, w), cache
