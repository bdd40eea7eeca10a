"""Checkpointer: round trip (optax adamw + dict params + keys), keep-last-N, crash orphans, resume."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stepflash_jax.train.checkpoint import Checkpointer, decode_json, encode_json

TX = optax.adamw(1e-2)


def _params(seed=0):
  r = np.random.default_rng(seed)
  return {
    "embed": {"embedding": jnp.asarray(r.normal(size=(5, 4)), jnp.float32)},
    "layer_0": {"attn": {"q_proj": {"kernel": jnp.asarray(r.normal(size=(4, 2, 2)), jnp.bfloat16)}}},
  }


def _state(seed=0):
  p = _params(seed)
  return {
    "params": p,
    "opt": TX.init(p),
    "router": {"layer_0": {"moe": {"router_bias": jnp.arange(3, dtype=jnp.float32)}}},
    "key": jax.random.key_data(jax.random.PRNGKey(seed)),  # uint32 [2]
    "typed_key": jax.random.key(seed + 7),  # typed key
    "np_leaf": np.arange(6, dtype=np.int64).reshape(2, 3),
    "step": 3,
  }


@jax.jit
def _update(params, opt, key):
  loss = lambda p: sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(p))
  upd, opt = TX.update(jax.grad(loss)(params), opt, params)
  key, sub = jax.random.split(key)
  noise = jax.random.normal(sub, ())
  params = jax.tree.map(lambda p, u: (p + u * (1 + 0.1 * noise)).astype(p.dtype), params, upd)
  return params, opt, key


def _train_step(state):
  params, opt, key = _update(state["params"], state["opt"], state["typed_key"])
  return dict(state, params=params, opt=opt, typed_key=key, step=state["step"] + 1)


def _assert_same(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, (ta, tb)
  for x, y in zip(la, lb):
    assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (type(x), type(y))
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert x.dtype == y.dtype
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_exact_structure_and_extra(tmp_path):
  state = _state()
  extra = {
    "step": 3,
    "config_hash": "abc",
    "data": {"iter": b"\x00\xffgrain-state", "pos": (1, 2)},
    "loss": np.float32(0.5),
  }
  ck = Checkpointer(tmp_path / "ck", max_to_keep=2)
  assert ck.latest_step() is None
  assert ck.save(3, state, extra)
  got, got_extra = ck.restore(target=state)
  _assert_same(state, got)
  assert isinstance(got["opt"][0], optax.ScaleByAdamState)
  assert got["params"]["layer_0"]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
  assert got_extra == {
    "step": 3,
    "config_hash": "abc",
    "data": {"iter": b"\x00\xffgrain-state", "pos": [1, 2]},
    "loss": 0.5,
  }
  # abstract target (ShapeDtypeStruct with sharding) restores directly sharded
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, state
  )
  got2, _ = ck.restore(3, target=abstract)
  _assert_same(state, got2)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  shd = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  emb = state["params"]["embed"]["embedding"]
  tgt = dict(
    abstract,
    params=dict(abstract["params"], embed={"embedding": jax.ShapeDtypeStruct(emb.shape, emb.dtype, sharding=shd)}),
  )
  got3, _ = ck.restore(3, target=tgt)
  assert got3["params"]["embed"]["embedding"].sharding == shd
  # no target: raw tree, typed key re-wrapped from recorded impl
  raw, _ = ck.restore(3)
  np.testing.assert_array_equal(
    np.asarray(raw["opt"][0]["mu"]["embed"]["embedding"]), np.asarray(state["opt"][0].mu["embed"]["embedding"])
  )
  assert raw["typed_key"].dtype == state["typed_key"].dtype
  ck.close()


def test_mismatch_raises_naming_field(tmp_path):
  state = _state()
  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, state, None)
  bad = jax.tree.map(lambda x: x, state)
  bad["params"]["embed"]["embedding"] = jnp.zeros((6, 4), jnp.float32)
  with pytest.raises(ValueError, match="params/embed/embedding.*shape"):
    ck.restore(1, target=bad)
  missing = dict(state)
  del missing["router"]
  with pytest.raises(ValueError, match="router/layer_0/moe/router_bias"):
    ck.restore(1, target=missing)
  added = dict(state, extra_leaf=jnp.zeros(2))
  with pytest.raises(ValueError, match="extra_leaf"):
    ck.restore(1, target=added)
  cast = jax.tree.map(lambda x: x, state)
  cast["np_leaf"] = np.zeros((2, 3), np.int32)
  with pytest.raises(ValueError, match="np_leaf.*dtype"):
    ck.restore(1, target=cast)
  got, extra = ck.restore(1, target=cast, strict_dtype=False)
  assert got["np_leaf"].dtype == np.int32 and extra is None
  with pytest.raises(ValueError, match="step 7"):
    ck.restore(7, target=state)
  ck.close()


def test_keep_last_n_and_interval(tmp_path):
  ck = Checkpointer(tmp_path / "ck", max_to_keep=2, save_interval_steps=2)
  s = {"w": jnp.zeros(3)}
  written = [ck.save(i, {"w": s["w"] + i}, {"i": i}) for i in range(7)]
  assert written == [True, False, True, False, True, False, True]
  assert ck.all_steps() == [4, 6] and ck.latest_step() == 6
  assert sorted(os.listdir(tmp_path / "ck")) == ["4", "6"]
  assert ck.save(7, s, force=True) and ck.all_steps() == [6, 7]
  got, extra = ck.restore(6, target=s)
  np.testing.assert_array_equal(np.asarray(got["w"]), np.full(3, 6.0))
  assert extra == {"i": 6}
  ck.close()


def test_crash_orphan_tmp_dirs_ignored(tmp_path):
  d = tmp_path / "ck"
  ck = Checkpointer(d, max_to_keep=3)
  s = {"w": jnp.arange(4.0)}
  ck.save(1, s, {"i": 1})
  ck.close()
  # simulate a crash mid-save of step 2 (orbax's tmp naming, with and without timestamp)
  for name in ("2.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1712345678"):
    os.makedirs(d / name / "state")
    (d / name / "state" / "partial").write_bytes(b"\x00" * 10)
  reader = Checkpointer(d, read_only=True)  # read-only: sees step 1, leaves tmp alone
  assert reader.latest_step() == 1 and reader.all_steps() == [1]
  assert reader.restore(target=s)[1] == {"i": 1}
  assert (d / "2.orbax-checkpoint-tmp").exists()
  with pytest.raises(ValueError, match="read_only"):
    reader.save(5, s)
  ck = Checkpointer(d, max_to_keep=3)  # writer: deletes the orphans
  assert sorted(os.listdir(d)) == ["1"]
  assert ck.latest_step() == 1
  got, _ = ck.restore(target=s)
  np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(4.0))
  assert ck.save(2, {"w": s["w"] * 2}) and ck.latest_step() == 2
  ck.close()


def test_resume_exactness(tmp_path):
  """Train 4 steps straight == train 2, checkpoint, 'restart' from disk, train 2 more."""
  ref = _state()
  for _ in range(4):
    ref = _train_step(ref)
  st = _state()
  ck = Checkpointer(tmp_path / "ck")
  for _ in range(2):
    st = _train_step(st)
  ck.save(st["step"], st, {"step": st["step"]})
  ck.close()
  ck2 = Checkpointer(tmp_path / "ck")
  template = jax.eval_shape(lambda: _state(1))  # abstract target, no real arrays
  template = dict(template, np_leaf=np.zeros((2, 3), np.int64), step=0)
  st2, extra = ck2.restore(target=template)
  assert extra["step"] == st2["step"] == 5
  for _ in range(2):
    st2 = _train_step(st2)
  _assert_same(ref, st2)
  ck2.close()


def test_json_encoding():
  obj = {"a": b"xyz", "b": [1, (2, b"")], "c": {"d": None, "e": np.int32(4)}}
  enc = encode_json(obj)
  assert enc["a"] == {"__b64__": "eHl6"}
  assert decode_json(enc) == {"a": b"xyz", "b": [1, [2, b""]], "c": {"d": None, "e": 4}}
  with pytest.raises(ValueError, match="extra/c"):
    encode_json({"c": {1: 2}})
  with pytest.raises(ValueError, match="extra/arr"):
    encode_json({"arr": np.zeros(3)})


def test_async_save_then_wait(tmp_path):
  ck = Checkpointer(tmp_path / "ck", async_save=True)
  s = {"w": jnp.arange(8.0).reshape(2, 4), "n": np.ones(3, np.float16)}
  assert ck.save(5, s, {"k": "v"})
  ck.wait()
  assert ck.all_steps() == [5]
  assert not ck.save(5, s) and not ck.save(4, s)  # not after the latest step -> skipped
  got, extra = ck.restore(target=s)
  _assert_same(s, got)
  assert extra == {"k": "v"}
  ck.close()
