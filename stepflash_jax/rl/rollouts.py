"""The generations' rollouts, in order, each sampled by an actor at most rl.max_staleness generations old
(docs/rl.md §1 step 1 and §10).

With s = rl.max_staleness, generation j is sampled by the actor of generation max(0, j - s): its job (that actor's
parameters, the prompts, the data-stream state before they were drawn) is queued at the start of generation j - s,
when that actor exists. With rl.async the queued jobs run in one background thread, so the rollout of generation
j + s runs while generation j trains (overlapped generation, the rollout engine's parameters refreshed at every
job); without it each job runs when its generation needs it: the same samples, one after the other (the mismatch
lab's staleness knob). A checkpoint stores the queued jobs' actors and the data state before the oldest queued
prompts, so a resumed run queues the same jobs again and samples the same rollouts.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time


@dataclasses.dataclass
class Job:
  index: int  # the generation it is for
  version: int  # the generation whose actor samples it
  policy: dict  # that actor's variables
  prompts: dict | None  # None: past the run's last generation (kept for the checkpoint)
  data_state: dict | None  # the prompt stream's state before these prompts
  future: concurrent.futures.Future | None = None


class RolloutQueue:
  """Queued rollouts of the coming generations.

  Args:
    sample: (policy, prompts, generation index) -> the rollout engine's host output (a dict); called in a
      background thread when `background`.
    data: the prompt stream (grain iterator: next(), get_state(), set_state()).
    max_staleness: s >= 0; generation j is sampled by the actor of generation max(0, j - s).
    background: run the jobs in one background thread (rl.async; needs s >= 1 to overlap anything).
    prepare: applied to each drawn prompt batch (e.g. repeat each prompt once per sample).
  """

  def __init__(self, sample, data, max_staleness: int, background: bool = False, prepare=lambda batch: batch):
    if max_staleness < 0:
      raise ValueError(f"rl.max_staleness must be >= 0, got {max_staleness}")
    self.sample, self.data, self.staleness, self.prepare = sample, data, max_staleness, prepare
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout") if background else None
    self.jobs: collections.deque[Job] = collections.deque()

  def start(self, start: int, steps: int, behind: list):
    """Queue generations start .. start + s - 1, sampled by `behind` (the actors of generations
    start - s .. start - 1, oldest first; see `checkpoint`)."""
    if len(behind) != self.staleness:
      raise ValueError(f"RolloutQueue.start: need {self.staleness} actors (rl.max_staleness), got {len(behind)}")
    for i, policy in enumerate(behind):
      self.put(start + i, max(0, start + i - self.staleness), policy, steps)

  def advance(self, step: int, steps: int, policy: dict):
    """At the start of generation `step` (actor `policy`): queue generation step + s."""
    self.put(step + self.staleness, step, policy, steps)

  def put(self, index: int, version: int, policy: dict, steps: int):
    """Queue generation `index`, sampled by `policy` (the actor of generation `version`). Its prompts are drawn
    (and with `background` its rollout starts) only if it is one of the run's `steps` generations; a later one
    is only kept for the checkpoint (a rerun with more steps samples it with the same actor)."""
    job = Job(index, version, policy, None, None)
    if index < steps:
      job.data_state = self.data.get_state()
      job.prompts = self.prepare(next(self.data))
      if self.pool is not None:
        job.future = self.pool.submit(self._timed, job)
    self.jobs.append(job)

  def take(self, index: int):
    """(prompts, rollout, version) of generation `index`, the oldest queued one (waits for it)."""
    if not self.jobs or self.jobs[0].index != index or self.jobs[0].prompts is None:
      queued = [j.index for j in self.jobs]
      raise RuntimeError(f"RolloutQueue.take({index}): queued generations are {queued}")
    job = self.jobs.popleft()
    gen = job.future.result() if job.future is not None else self._timed(job)
    return job.prompts, gen, job.version

  def checkpoint(self):
    """After a generation: (the s actors that sample the queued generations, oldest first; the data state before
    the oldest queued prompts). `start` with them queues the same jobs again."""
    drawn = [j.data_state for j in self.jobs if j.prompts is not None]
    return [j.policy for j in self.jobs], drawn[0] if drawn else self.data.get_state()

  def close(self):
    """Drop the queued jobs; wait for the running one."""
    if self.pool is not None:
      self.pool.shutdown(wait=True, cancel_futures=True)
    self.jobs.clear()

  def _timed(self, job: Job) -> dict:
    t0 = time.time()
    gen = self.sample(job.policy, job.prompts, job.index)
    return {**gen, "sample_seconds": time.time() - t0}
