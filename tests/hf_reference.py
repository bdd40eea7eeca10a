"""An independent float64 NumPy implementation of Step 3.5 Flash that reads Hugging Face tensors directly.

Written from docs/architecture.md with per-token loops and no code shared with the library; tests compare the JAX model
(loaded through `load_hf_checkpoint`) against it.
"""

import math

import numpy as np


def _norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)


def _inv_freq(D, partial, theta, scaling):
  rot = int(D * partial)
  inv = np.array([1.0 / theta ** (2 * i / rot) for i in range(rot // 2)])
  if scaling is None:
    return inv
  out = []
  for f in inv:
    wl = 2 * math.pi / f
    lo_wl = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    hi_wl = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    if wl < hi_wl:
      out.append(f)
    elif wl > lo_wl:
      out.append(f / scaling["factor"])
    else:
      sm = (scaling["original_max_position_embeddings"] / wl - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
      )
      out.append((1 - sm) * f / scaling["factor"] + sm * f)
  return np.array(out)


def _rope(x, inv):  # x [T, H, D]
  r = 2 * len(inv)
  out = x.copy()
  for t in range(x.shape[0]):
    for i, f in enumerate(inv):
      c, s = math.cos(t * f), math.sin(t * f)
      a, b = x[t, :, i], x[t, :, i + r // 2]
      out[t, :, i], out[t, :, i + r // 2] = a * c - b * s, b * c + a * s
  return out


def _swiglu(x, g, u, d, lim):
  a = x @ g.T
  a = a / (1 + np.exp(-a))
  b = x @ u.T
  if lim > 0:
    a, b = np.minimum(a, lim), np.clip(b, -lim, lim)
  return (a * b) @ d.T


def _layer(W, p, hf, i, x, moe):
  D, eps, T = hf["head_dim"], hf.get("rms_norm_eps", 1e-5), x.shape[0]
  full = hf["layer_types"][i] == "full_attention"
  Hq = hf["num_attention_heads"] if full else hf["attention_other_setting"]["num_attention_heads"]
  Hkv = hf["num_attention_groups"]
  win = None if full else hf["sliding_window"]
  scaling = hf["rope_scaling"] if hf["layer_types"][i] in hf.get("yarn_only_types", []) else None
  inv = _inv_freq(D, hf["partial_rotary_factors"][i], hf["rope_theta"][i], scaling)
  h = _norm(x, W[p + "input_layernorm.weight"], eps)
  q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, Hq, D)
  k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, Hkv, D)
  v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, Hkv, D)
  g = 1 / (1 + np.exp(-(h @ W[p + "self_attn.g_proj.weight"].T)))
  q = _rope(_norm(q, W[p + "self_attn.q_norm.weight"], eps), inv)
  k = _rope(_norm(k, W[p + "self_attn.k_norm.weight"], eps), inv)
  o = np.zeros((T, Hq, D))
  for t in range(T):
    for hh in range(Hq):
      kv = hh // (Hq // Hkv)
      js = [j for j in range(t + 1) if win is None or t - j < win]
      s = np.array([q[t, hh] @ k[j, kv] for j in js]) / math.sqrt(D)
      pr = np.exp(s - s.max())
      pr /= pr.sum()
      o[t, hh] = sum(pj * v[j, kv] for pj, j in zip(pr, js)) * g[t, hh]
  x = x + o.reshape(T, Hq * D) @ W[p + "self_attn.o_proj.weight"].T
  h = _norm(x, W[p + "post_attention_layernorm.weight"], eps)
  if not moe:
    return x + _swiglu(
      h,
      W[p + "mlp.gate_proj.weight"],
      W[p + "mlp.up_proj.weight"],
      W[p + "mlp.down_proj.weight"],
      hf["swiglu_limits_shared"][i],
    )
  y = np.zeros_like(h)
  K = hf["moe_top_k"]
  for t in range(T):
    s = 1 / (1 + np.exp(-(W[p + "moe.gate.weight"] @ h[t])))
    chosen = np.argsort(-(s + W[p + "moe.router_bias"]), kind="stable")[:K]
    w = s[chosen] / s[chosen].sum() * hf["moe_router_scaling_factor"]
    for e, we in zip(chosen, w):
      y[t] += (
        we
        * _swiglu(
          h[t : t + 1],
          W[p + "moe.gate_proj.weight"][e],
          W[p + "moe.up_proj.weight"][e],
          W[p + "moe.down_proj.weight"][e],
          hf["swiglu_limits"][i],
        )[0]
      )
  y += _swiglu(
    h,
    W[p + "share_expert.gate_proj.weight"],
    W[p + "share_expert.up_proj.weight"],
    W[p + "share_expert.down_proj.weight"],
    hf["swiglu_limits_shared"][i],
  )
  return x + y


def forward(W, hf, tokens):
  """W: dict name -> float64 array (HF layout), hf: config.json dict, tokens [T] -> (logits [T,V], [mtp logits])."""
  W = {k: np.asarray(v, np.float64) for k, v in W.items()}
  L, eps = hf["num_hidden_layers"], hf.get("rms_norm_eps", 1e-5)
  moe = {int(s) for s in str(hf["moe_layers_enum"]).split(",") if s}
  x = W["model.embed_tokens.weight"][tokens]
  for i in range(L):
    x = _layer(W, f"model.layers.{i}.", hf, i, x, i in moe)
  logits = _norm(x, W["model.norm.weight"], eps) @ W["lm_head.weight"].T
  mtp, h = [], x
  for k in range(hf.get("num_nextn_predict_layers", 0)):
    p = f"model.layers.{L + k}."
    shifted = np.concatenate([tokens[k + 1 :], np.zeros(k + 1, int)])
    e = W["model.embed_tokens.weight"][shifted]
    z = np.concatenate([_norm(e, W[p + "enorm.weight"], eps), _norm(h, W[p + "hnorm.weight"], eps)], -1)
    h = _layer(W, p, hf, L + k, z @ W[p + "eh_proj.weight"].T, False)
    mtp.append(
      _norm(h, W[p + "transformer.shared_head.norm.weight"], eps) @ W[p + "transformer.shared_head.output.weight"].T
    )
  return logits, mtp
