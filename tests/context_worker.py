"""The 8-device half of tests/test_context_parallel.py, run as one subprocess (flags set before jax is imported).

Context parallelism (parallel/context.py) against one device: the attention op alone, the whole model (forward +
backward, MTP heads, packed and unpacked), the compiled program's collectives. The report (JSON on the last stdout
line, prefixed "REPORT ") is what the tests assert on.
"""

import json
import math
import os
import re
import sys
import time

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
  )
  os.environ["JAX_PLATFORMS"] = "cpu"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from sharding_worker import _maxdiff, small_tiny_config  # noqa: E402

# 13 + 15 tokens of two documents and 4 of padding; positions restart per document
SEGMENTS = [1] * 13 + [2] * 15 + [0] * 4
POSITIONS = list(range(13)) + list(range(15)) + [0] * 4
MODEL_MESH = dict(data=2, fsdp=1, expert=1, context=2, tensor=2)


def _rel(a, b):
  """max |a - b| / max |b| over the leaves of two trees."""
  import jax
  import numpy as np

  return _maxdiff(a, b) / max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(b))


def _attention_op():
  """local_ops.sliding_window_attention on context 4 x tensor 2 = ops on one device: windows 5 (halo of 4 < Tl = 8),
  12 (two hops) and None (full), packed or not, ring and all-gather, xla and pallas."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from stepflash_jax import ops, parallel
  from stepflash_jax.parallel import local_ops

  rng = np.random.default_rng(3)
  B, T, Hq, Hkv, D = 2, 32, 6, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, h, D)), jnp.float32) for h in (Hq, Hkv, Hkv))
  seg = jnp.asarray(np.repeat([SEGMENTS], B, 0), jnp.int32)
  mesh = parallel.make_mesh(dict(data=1, fsdp=1, expert=1, context=4, tensor=2))
  out = {}
  for window in (5, 12, None):
    for packed in (False, True):
      s = seg if packed else None

      def value_and_grads(attn, **kw):
        y, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, window=window, segment_ids=s, **kw), q, k, v)
        return y, vjp(jnp.cos(y))

      y0, g0 = value_and_grads(ops.sliding_window_attention)
      for full in ("ring", "all_gather") if window is None else ("ring",):  # the full mode: full layers only
        for impl in ("xla", "pallas"):
          with parallel.use_mesh(mesh, parallel.DEFAULT_RULES):
            y, g = jax.jit(
              lambda: value_and_grads(local_ops.sliding_window_attention, implementation=impl, context_full=full)
            )()
          out[f"w{window}/packed{int(packed)}/{full}/{impl}"] = {"y": _rel(y, y0), "grad": _rel(g, g0)}
  return out


def _model(impl, full, window, T=32, mesh_shape=None, run=True):
  """(logits and gradient differences vs one device, compiled HLO text) of the model's forward + backward with the
  MTP heads on `mesh_shape`; packed and unpacked input when `run`, else only the (unpacked) HLO."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from stepflash_jax import model as model_lib
  from stepflash_jax import parallel

  c = small_tiny_config()
  c.update(dict(attention_impl=impl, context_full=full, sliding_window=window))
  args = model_lib.as_args(c)
  variables = model_lib.init(args, jax.random.key(2))
  B = 4
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, args.vocab_size, (B, T)), jnp.int32)
  packed = dict(
    segment_ids=jnp.asarray(np.repeat([SEGMENTS * (T // 32)], B, 0), jnp.int32),
    positions=jnp.asarray(np.repeat([POSITIONS * (T // 32)], B, 0), jnp.int32),
  )
  mesh = parallel.make_mesh(mesh_shape or MODEL_MESH)
  out, hlo = {}, None
  for name, kw in (("unpacked", {}), ("packed", packed))[: 2 if run else 1]:

    def loss(params):
      o = model_lib.apply(args, {**variables, "params": params}, tokens, mtp=True, **kw)
      return jnp.sum(jnp.cos(o["logits"])) + sum(jnp.sum(jnp.sin(m)) for m in o["mtp_logits"]), o["logits"]

    grad = jax.grad(loss, has_aux=True)
    with parallel.use_mesh(mesh, parallel.DEFAULT_RULES):
      step = jax.jit(grad)
      hlo = hlo or step.lower(variables["params"]).compile().as_text()
      if run:
        g, y = step(variables["params"])
    if run:
      g0, y0 = jax.jit(grad)(variables["params"])
      out[name] = {"logits": _rel(y, y0), "grad": _rel(g, g0)}
  swa = [f"layer_{i}/attn/" for i, s in enumerate(args.layers) if s.window is not None]
  swa += [f"mtp_{i}/layer/attn/" for i, s in enumerate(args.mtp_layers) if s.window is not None]
  return out, hlo, swa


def _collectives(hlo, kind, markers):
  """(count, bytes) of the `kind` collectives (e.g. "all-gather") whose op_name contains one of `markers`.
  Bytes: the per-device result shapes (what a device receives; for a permute, what its neighbour sends)."""
  size = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1}
  n = total = 0
  for line in hlo.splitlines():
    meta = line.split("metadata=")[-1]
    if f" {kind}(" not in line or not any(m in meta for m in markers):
      continue
    n += 1
    lhs = line.split(f" {kind}(")[0].split("=", 1)[1]
    for dtype, dims in re.findall(r"(f32|s32|bf16|f16|pred)\[([\d,]*)\]", lhs):
      total += size[dtype] * int(math.prod(int(d) for d in dims.split(",") if d))
  return n, total


def _model_checks():
  """Logits and gradients of the model on data 2 x context 2 x tensor 2 = one device's (xla and pallas, ring; xla
  with all-gather), and no all-gather inside an SWA layer's attention in the compiled program."""
  out = {}
  for impl, full in (("xla", "ring"), ("pallas", "ring"), ("xla", "all_gather")):  # all_gather: its HLO only
    diffs, hlo, swa = _model(impl, full, window=8, run=full == "ring")
    out[f"{impl}/{full}"] = {
      **diffs,
      "swa_gathers": _collectives(hlo, "all-gather", swa)[0],
      "attn_gathers": _collectives(hlo, "all-gather", ["/attn/"])[0],
      "swa_permutes": _collectives(hlo, "collective-permute", swa)[0],
    }
  return out


def _halo_bytes():
  """Bytes the SWA layers' and the full layer's collective-permutes move per forward + backward step with context
  4 (x tensor 2), at two sequence lengths and two windows, beside parallel.context.exchange_bytes' estimate."""
  from stepflash_jax import model as model_lib
  from stepflash_jax.parallel import context

  out = {}
  for T, window in ((32, 5), (64, 5), (32, 9)):
    mesh = dict(data=1, fsdp=1, expert=1, context=4, tensor=2)
    _, hlo, swa = _model("xla", "ring", window, T=T, mesh_shape=mesh, run=False)
    n, b = _collectives(hlo, "collective-permute", swa)
    c = small_tiny_config()
    c.sliding_window = window
    est = context.exchange_bytes(model_lib.as_args(c), T, 4, rows=4, tensor=2)
    out[f"T{T}/W{window}"] = {
      "permutes": n,
      "bytes": b,
      "full_bytes": _collectives(hlo, "collective-permute", ["layer_0/attn/"])[1],
      "swa_gathers": _collectives(hlo, "all-gather", swa)[0],
      "estimate": est,
    }
  return out


def _worker():
  import jax

  assert jax.device_count() == 8
  report, t0 = {}, time.time()
  for name, fn in (("op", _attention_op), ("model", _model_checks), ("halo", _halo_bytes)):
    t = time.time()
    report[name] = fn()
    print(name, f"{time.time() - t:.1f}s", json.dumps(report[name]), file=sys.stderr, flush=True)
  report["time_total"] = time.time() - t0
  print("REPORT " + json.dumps(report))


if __name__ == "__main__":
  _worker()
