"""parallel/threads.py: worker threads run under the caller's mesh and logical-axis rules (thread-local state)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from stepflash_jax import parallel

RULES = (("batch", "data"), ("embed", None))


def test_workers_see_the_callers_mesh_and_rules_and_reuse_its_program():
  traces = []

  @jax.jit
  def f(x):
    traces.append(1)  # runs once per trace: a worker thread without the caller's mesh would trace (compile) again
    return nn.with_logical_constraint(x * 2.0, ("batch", "embed"))

  seen = lambda: (jax.sharding.get_mesh(), nn.get_logical_axis_rules())
  mesh = parallel.make_mesh(dict(data=1, fsdp=1, expert=1, context=1, tensor=1))
  xs = [jnp.full((4, 3), float(i)) for i in range(5)]
  with parallel.use_mesh(mesh, RULES):
    first = f(xs[0])
    rest = parallel.thread_map(f, xs[1:])
    both = parallel.concurrently(a=lambda: f(xs[1]), where=seen)
  assert len(traces) == 1
  assert both["where"] == (mesh, RULES)
  for i, y in enumerate([first] + rest):  # results in order
    np.testing.assert_array_equal(np.asarray(y), np.full((4, 3), 2.0 * i))
  np.testing.assert_array_equal(np.asarray(both["a"]), np.full((4, 3), 2.0))


def test_without_a_mesh_workers_run_without_one():
  out = parallel.concurrently(where=lambda: jax.sharding.get_mesh().empty)
  assert out["where"] is True
  assert parallel.thread_map(lambda x: x + 1, [1, 2, 3]) == [2, 3, 4]
