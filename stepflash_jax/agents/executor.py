"""Executors: run many environment calls (tool calls, sandboxed programs) concurrently (docs/agents.md §2).

    with executor.make("local", max_workers=8) as ex:          # or make("ray", address=None, num_cpus=4)
      results = ex.map(fn, items)                               # results[i] = fn(items[i]), in order

`fn` must be a module-level function (Ray pickles it by reference). A call that raises does not take the batch
down: its slot holds a `Failure` with the exception's type and message. Nothing is dropped or reordered.

  "local"  a thread pool: every sandboxed call already runs in its own confined OS process (sandbox.run_python),
           so threads only wait on them; in-process tools (pure functions of their parsed arguments) run here.
  "ray"    Ray tasks (the optional `ray` extra): environments spread over a Ray cluster's machines; `address=None`
           starts a local Ray instance, which `close()` shuts down again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Failure:
  """The slot of a call that raised."""

  error: str


def _guarded(fn, item):
  try:
    return fn(item)
  except Exception as e:  # noqa: BLE001 - one bad call must not lose the others' results
    return Failure(f"{type(e).__name__}: {e}")


class LocalExecutor:
  def __init__(self, max_workers: int | None = None):
    self.max_workers = max_workers or min(32, 4 * (os.cpu_count() or 1))
    self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="sfj-env")

  def map(self, fn, items) -> list:
    return list(self._pool.map(lambda x: _guarded(fn, x), list(items)))

  def close(self):
    self._pool.shutdown(wait=True, cancel_futures=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class RayExecutor:
  def __init__(self, address: str | None = None, num_cpus: int | None = None):
    try:
      import ray
    except ImportError as e:
      raise ValueError("executor 'ray' needs the optional dependency: pip install -e '.[ray]'") from e
    self._ray = ray
    self._owns = not ray.is_initialized()
    if self._owns:
      kw = dict(address=address) if address else dict(num_cpus=num_cpus, include_dashboard=False)
      ray.init(**kw, log_to_driver=False, configure_logging=False)
    self._task = ray.remote(_guarded)

  def map(self, fn, items) -> list:
    return self._ray.get([self._task.remote(fn, x) for x in items])

  def close(self):
    if self._owns and self._ray.is_initialized():
      self._ray.shutdown()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def make(kind: str = "local", *args, **kwargs):
  """An executor by name: make("local", max_workers) -> LocalExecutor, make("ray", address, num_cpus) ->
  RayExecutor (arguments by position or name)."""
  if kind == "local":
    return LocalExecutor(*args, **kwargs)
  if kind == "ray":
    return RayExecutor(*args, **kwargs)
  raise ValueError(f"executor must be 'local' or 'ray', got {kind!r}")
