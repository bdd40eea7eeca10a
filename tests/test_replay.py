"""Router replay (stepflash_jax/model/replay.py): apply(..., stats=True) -> stats["expert_ids"], and
apply(..., replay_experts=ids), against the model's own top-k and a NumPy recomputation of the routing weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax import model as model_lib
from stepflash_jax.config import load_config_file
from stepflash_jax.model.moe import route


def _setup(scan: bool):
  cfg = load_config_file("configs/model/tiny.py")
  cfg.scan_layers = scan
  variables = model_lib.init(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  return cfg, variables, tokens


@pytest.mark.parametrize("scan", [False, True])
def test_own_ids_reproduce_the_logits_and_train_the_router(scan):
  cfg, v, tokens = _setup(scan)
  out, st = model_lib.apply(cfg, v, tokens, stats=True)
  ids = st["expert_ids"]
  moe_layers = [i for i in cfg.moe_layers if i < cfg.num_layers]
  assert len(ids) == len(moe_layers)  # one entry per MoE layer of the main model, scanned or not
  for x in ids.values():
    assert x.dtype == jnp.int32 and x.shape == (2, 12, cfg.num_experts_per_tok)
    assert int(x.min()) >= 0 and int(x.max()) < cfg.num_experts
  replayed = model_lib.apply(cfg, v, tokens, replay_experts=ids)
  np.testing.assert_allclose(replayed["logits"], out["logits"], atol=1e-6, rtol=0)

  def loss(params):
    return model_lib.apply(cfg, {**v, "params": params}, tokens, replay_experts=ids)["logits"].std()

  grads = jax.grad(loss)(v["params"])
  router = [x for p, x in jax.tree_util.tree_flatten_with_path(grads)[0] if "router" in jax.tree_util.keystr(p)]
  assert router and all(float(jnp.abs(g).max()) > 0 for g in router)


def test_other_ids_change_the_output():
  cfg, v, tokens = _setup(False)
  out, st = model_lib.apply(cfg, v, tokens, stats=True)
  ids = dict(st["expert_ids"])
  ids["layer_5"] = (ids["layer_5"] + 1) % cfg.num_experts  # one layer, other (still distinct) experts
  changed = model_lib.apply(cfg, v, tokens, replay_experts=ids)
  assert float(jnp.abs(changed["logits"] - out["logits"]).max()) > 1e-4
  _, st2 = model_lib.apply(cfg, v, tokens, stats=True, replay_experts=ids)
  np.testing.assert_array_equal(st2["expert_ids"]["layer_5"], ids["layer_5"])  # the stats report what was used


def test_route_replay_weights_are_the_current_scores_renormalised():
  rng = np.random.default_rng(0)
  x, w_r = rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=(8, 6)).astype(np.float32)
  ids = np.array([[0, 3], [5, 1], [2, 2], [4, 0], [1, 5]], np.int32)
  _, chosen, w = route(jnp.asarray(x), jnp.asarray(w_r), jnp.zeros(6), 2, 3.0, replay=jnp.asarray(ids))
  s = 1 / (1 + np.exp(-(x.astype(np.float64) @ w_r)))
  sel = np.take_along_axis(s, ids, 1)
  np.testing.assert_array_equal(chosen, ids)
  np.testing.assert_allclose(w, 3.0 * sel / sel.sum(1, keepdims=True), rtol=1e-5)


def test_bad_replay_input_names_the_entry():
  cfg, v, tokens = _setup(False)
  _, st = model_lib.apply(cfg, v, tokens, stats=True)
  ids = st["expert_ids"]
  bad = {
    "shape": {**ids, "layer_2": ids["layer_2"][:, :3]},
    "dtype": {**ids, "layer_2": ids["layer_2"].astype(jnp.float32)},
    "range": {**ids, "layer_2": ids["layer_2"] + cfg.num_experts},
    "missing": {k: x for k, x in ids.items() if k != "layer_2"},
    "unknown": {**ids, "layer_0": ids["layer_2"]},
  }
  for what, d in bad.items():
    with pytest.raises(ValueError, match="layer_2" if what != "unknown" else "layer_0"):
      model_lib.apply(cfg, v, tokens, replay_experts=d)
  with pytest.raises(ValueError, match="replay_experts must be a dict"):
    model_lib.apply(cfg, v, tokens, replay_experts=[1, 2])


@pytest.mark.parametrize("scan", [False, True])
def test_routing_metrics_per_layer(scan):
  """routing_metrics against the chosen experts (load = their counts) and the bias values themselves."""
  from stepflash_jax.model.moe import routing_metrics

  cfg, v, tokens = _setup(scan)
  rng = np.random.default_rng(0)
  v = {**v, "router": jax.tree.map(lambda b: jnp.asarray(rng.normal(size=b.shape), jnp.float32), v["router"])}
  _, st = jax.jit(lambda v: model_lib.apply(cfg, v, tokens, stats=True))(v)
  m = routing_metrics(st, v["router"])
  layers = sorted(st["expert_ids"])
  assert sorted(k[len("routing/load_imbalance/") :] for k in m if k.startswith("routing/load_imbalance/")) == layers
  biases = dict(zip(layers, [np.asarray(b) for b in jax.tree.leaves(v["router"])]))
  if scan:  # one leaf per scanned sub-layer [blocks, E]: names "<sub-layer path>[block]"
    biases = {}
    for p, b in jax.tree_util.tree_flatten_with_path(v["router"])[0]:
      where = "/".join(str(k.key) for k in p[:-1] if k.key != "moe")
      biases.update({f"{where}[{i}]": np.asarray(b[i]) for i in range(b.shape[0])})
  imbalance = []
  for name in layers:
    counts = np.bincount(np.asarray(st["expert_ids"][name]).ravel(), minlength=cfg.num_experts)
    imbalance.append(counts.max() / counts.mean())
    np.testing.assert_allclose(m[f"routing/load_imbalance/{name}"], imbalance[-1], rtol=1e-6)
    np.testing.assert_allclose(m[f"routing/bias_norm/{name}"], np.linalg.norm(biases[name]), rtol=1e-6)
    assert 0 < float(m[f"routing/confidence/{name}"]) <= 1
  np.testing.assert_allclose(m["routing/load_imbalance"], np.mean(imbalance), rtol=1e-6)
