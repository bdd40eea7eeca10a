"""Independent parts of a job side by side, one OS process each.

Threads share one process's XLA:CPU thread pools and Python interpreter; two whole training stages in two threads
ran slower than one after the other on 2 cores, two processes ran 1.4x the steps of one (docs/training.md).
The first call runs in the calling process (which keeps what it already compiled); each other call runs in a
freshly spawned interpreter (not forked: a forked JAX runtime is unsafe), which dies with the calling process, also
after a kill -9 of it, so that a rerun of the same command never races an orphan over the same files.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time


def _exit_with_parent(parent: int) -> None:
  while os.getppid() == parent:
    time.sleep(0.5)
  os._exit(1)  # the parent is gone (kill -9 included): stop at once, whatever this process is doing


def _spawned(fn, args, parent: int) -> None:
  threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
  fn(*args)


def side_by_side(calls) -> None:
  """Run calls = [(fn, args), ...] at the same time: calls[0] here, every other one in a spawned process of its own
  (fn and args must pickle: module-level functions, plain data), and wait for all. A spawned call that fails ->
  RuntimeError after the others finished (its traceback is on stderr); if the call here fails or is interrupted,
  the spawned ones are killed. Results are not returned: the calls write files."""
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_spawned, args=(fn, args, os.getpid())) for fn, args in calls[1:]]
  for p in procs:
    p.start()
  try:
    fn, args = calls[0]
    fn(*args)
    for p in procs:
      p.join()
  finally:
    for p in procs:
      if p.is_alive():
        p.kill()
        p.join()
  failed = {i + 1: p.exitcode for i, p in enumerate(procs) if p.exitcode != 0}
  if failed:
    raise RuntimeError(f"side_by_side: the call(s) {sorted(failed)} failed (exit codes {list(failed.values())})")


@contextlib.contextmanager
def beside(fn, args):
  """fn(*args) in a spawned process (as side_by_side's) while the with-block runs, for work that is only worth
  having before the block ends (e.g. compiling a later stage's programs): the process is killed when the block
  ends, and its failure is no error (its traceback is on stderr)."""
  proc = multiprocessing.get_context("spawn").Process(target=_spawned, args=(fn, args, os.getpid()))
  proc.start()
  try:
    yield proc
  finally:
    if proc.is_alive():
      proc.kill()
    proc.join()
