"""The reports of `tpustrat.launch`: which process failed first and how (the first to exit with an error,
or the one JAX's errors or a step watchdog name), what became of the others, and the status the launcher
exits with.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from tpustrat._src import names
from tpustrat._src.launch.processes import Proc

# What the statuses that tpustrat's own handlers exit with mean.
_MEANINGS = {
    names.EXIT_START_FAILED: "it could not start: the coordinator's address is in use, by another job or by "
                             "another process started as process 0",
    names.EXIT_RESTART: "the preemption handler saved a checkpoint and asked to be restarted",
    names.EXIT_STEP_TIMEOUT: ("its step watchdog or checkpoint deadline fired: a step, save or restore waited "
                              "longer than its timeout"),
    names.EXIT_CHECKPOINT_FAILED: ("it failed to save a checkpoint: the storage refused a write (disk full, "
                                   "read-only file system, I/O error); the previous checkpoints are intact"),
    names.EXIT_CHECKPOINT_PEER_LOST: ("it failed to save a checkpoint because another process stopped in the "
                                      "middle of the save (a barrier or collective across the processes failed: "
                                      "a peer died, hung or lost its connection); the storage refused nothing, "
                                      "and the previous checkpoints are intact"),
}

# The statuses with which every process of a job stops after a failed checkpoint save.
_SAVE_FAILED = (names.EXIT_CHECKPOINT_FAILED, names.EXIT_CHECKPOINT_PEER_LOST)


def describe(returncode: int) -> str:
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = f"signal {-returncode}"
    return f"was killed by {name}"
  meaning = _MEANINGS.get(returncode)
  return f"exited with status {returncode}" + (f" ({meaning})" if meaning else "")


def exit_status(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def _ended_after(p: Proc, q: Proc) -> bool:
  """Whether `p` ended after `q` (both ended): by the order of their ends when known, else by time."""
  if p.order is not None and q.order is not None:
    return p.order > q.order
  return p.end_time > q.end_time


def _ending(p: Proc, reference: float, grace_period: float, after: str = "the failure") -> str:
  if p.killed:
    return f"was still running {grace_period:g} s after {after} and was killed by the launcher"
  if p.returncode == 0:
    return "exited normally"
  return f"stopped on its own: it {describe(p.code)} {p.end_time - reference:+.1f} s after {after}"


def _ended_failed_save(p: Proc) -> bool:
  """Whether `p` ended on its own after a failed checkpoint save (`CheckpointManager`'s statuses)."""
  return p.ended is not None and not p.killed and p.returncode in _SAVE_FAILED


def first_failure(procs: Sequence[Proc], first: Proc) -> tuple[Proc, str]:
  """The process that failed first, and how it is known: (`first`, the first to exit with an error, "")
  unless JAX's errors name a process that stopped responding to heartbeats before it ("heartbeats"), `first`
  ended a checkpoint save because a peer stopped in it and another process ended with a failure of its own
  ("peer"), or the step watchdog whose message `first` printed names a process holding the job up
  ("watchdog")."""
  def later(i: int) -> bool:  # a process that is still running, or ended after `first`
    return 0 <= i < len(procs) and (procs[i].ended is None or _ended_after(procs[i], first))

  # A process that hangs (or is stopped) does not exit: JAX declares it dead when its heartbeats stop and
  # stops the others, so the first process to *exit* is then a victim. JAX's message names the culprit.
  # Not a process that ended a failed checkpoint save on its own (status 69 or 74, every process of the job
  # stopping with it): it did not hang, and when it is process 0 the coordinator ends with it, which the
  # processes still running report as their leader lost.
  hung = sorted({i for p in procs for i in p.unhealthy if later(i) and not _ended_failed_save(procs[i])})
  if hung:
    return procs[hung[0]], "heartbeats"
  # A process that ended a save with 69 says, by its own status, that another process stopped in the middle
  # of it: a victim. The process that ended on its own with another failure (a signal, an error) is the
  # culprit, even when its end came second: the kernel reports a large process's end after tearing it
  # down, while the peer reacts to its closed connections at once (a SIGKILLed process, in a loaded CI run).
  if first.returncode == names.EXIT_CHECKPOINT_PEER_LOST and not first.killed:
    # Not one that JAX's errors show reacting to a dead peer (its own `unhealthy`: aborted when it lost the
    # coordinator, which the save's end took with it).
    failed = [p for p in procs if p is not first and p.ended is not None and not p.killed
              and p.returncode not in (0, *_SAVE_FAILED) and not p.unhealthy]
    if failed:
      return min(failed, key=lambda p: (p.order is None, p.order or 0, p.end_time)), "peer"
  # A live process stuck in a host callback, or behind, keeps its heartbeats: the step watchdog of a process
  # waiting for it fires, names it (`names.WATCHDOG_BLAMES`, printed by every process) and ends every
  # process with 124, in any order. The process named is the culprit, even when it is the first to end.
  stuck = sorted(i for i in first.blamed if i == first.index or later(i))
  if stuck:
    culprit = first if first.index in stuck else procs[stuck[0]]
    return culprit, "" if culprit.index == first.blamed_by else "watchdog"
  return first, ""


def cause(procs: Sequence[Proc], first: Proc) -> str:
  """Why the job failed, in a few words (for the line that announces a restart)."""
  culprit, how = first_failure(procs, first)
  if how == "peer":
    return (f"process {culprit.index} {describe(culprit.code)} (process {first.index} then "
            f"{describe(first.code)})")
  if how == "heartbeats":
    return (f"process {culprit.index} stopped responding to heartbeats (JAX declared it dead; process "
            f"{first.index} then {describe(first.code)})")
  if how == "watchdog":
    return (f"process {culprit.index} held the job up (named by the step watchdog of process "
            f"{first.blamed_by}; process {culprit.index} then {describe(culprit.code)})")
  return f"process {first.index} {describe(first.code)}"


def report(procs: Sequence[Proc], first: Proc, start: float, grace_period: float) -> str:
  """Which process failed first, how, and what became of the others; the launcher exits with the status
  of the process named first (`first_failure`)."""
  culprit, how = first_failure(procs, first)
  evidence = first  # the first process to end: its last output holds the evidence
  if how == "peer":  # reported as the first failure: the process that ended the save with 69 is its victim
    first, how = culprit, ""
  if how == "heartbeats":
    lines = [f"process {culprit.index} failed first: it stopped responding to heartbeats (it hangs, or was "
             f"stopped), so JAX's distributed runtime declared it dead; process {first.index} then "
             f"{describe(first.code)} after {first.end_time - start:.1f} s. Process {culprit.index} "
             f"{_ending(culprit, first.end_time, grace_period)}."]
  elif how == "watchdog":
    lines = [f"process {culprit.index} failed first: the step watchdog of process {first.blamed_by} named it as "
             f"holding the job up (the message below)"
             + (f"; process {first.index} then {describe(first.code)} after {first.end_time - start:.1f} s. "
                f"Process {culprit.index} {_ending(culprit, first.end_time, grace_period)}."
                if culprit is not first else f", and it {describe(first.code)} after {first.end_time - start:.1f} s.")]
  else:
    lines = [f"process {first.index} failed first: it {describe(first.code)} after "
             f"{first.end_time - start:.1f} s."]
  for p in procs:
    if p is not first and p is not culprit:
      lines.append(f"process {p.index} {_ending(p, first.end_time, grace_period)}.")
  lines.append(f"the launcher exits with {exit_status(culprit.code)}, the status of process {culprit.index}.")
  if evidence.tail:
    lines.append(f"last output of process {evidence.index}:")
    lines.extend(f"  {line}" for line in evidence.tail)
  return "\n  ".join(lines)


def report_terminated(procs: Sequence[Proc], first: Proc | None, forwarded: float, grace: float,
                       status: int, received: str = "SIGTERM") -> str:
  """What became of each process after the launcher forwarded SIGTERM (on `received`: ``"SIGTERM"`` or
  ``"Ctrl-C"``), and the status it exits with."""
  how = "SIGTERM, forwarded" if received == "SIGTERM" else f"SIGINT ({received}), forwarded as SIGTERM"
  lines = [f"stopped by {how} to every process; the launcher exits with {status}"
           + (f", the status of process {first.index}, the first to fail." if first is not None else ".")]
  for p in procs:
    if p.ended is not None and p.ended < forwarded and not p.killed:
      lines.append(f"process {p.index} {describe(p.returncode) if p.returncode else 'exited normally'}, "
                   f"before the {received}.")
    else:
      lines.append(f"process {p.index} {_ending(p, forwarded, grace, 'the ' + received)}.")
  return "\n  ".join(lines)
