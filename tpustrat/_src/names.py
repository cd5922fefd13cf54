"""Names that several layers (and the launcher) share: the mesh axis of the replicas and the environment
variables that configure a multi-process job. Each is written here once.

Imports nothing from tpustrat or JAX, so the launcher can read it before JAX starts.
"""

REPLICA_AXIS = "replica"
"""The name of the replica axis of every strategy mesh (logical-core axes, if any, come after it)."""

# Environment variables of a multi-process job (set by `python -m tpustrat.launch`, or by hand on a cluster).
ENV_COORDINATOR_ADDRESS = "TPUSTRAT_COORDINATOR_ADDRESS"
ENV_COORDINATOR_BIND_ADDRESS = "TPUSTRAT_COORDINATOR_BIND_ADDRESS"
ENV_NUM_PROCESSES = "TPUSTRAT_NUM_PROCESSES"
ENV_PROCESS_ID = "TPUSTRAT_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "TPUSTRAT_LOCAL_DEVICE_IDS"
ENV_INITIALIZATION_TIMEOUT = "TPUSTRAT_INITIALIZATION_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "TPUSTRAT_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "TPUSTRAT_SHUTDOWN_TIMEOUT"
ENV_EXIT_ON_UNCAUGHT = "TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION"
ENV_STEP_TIMEOUT = "TPUSTRAT_STEP_TIMEOUT"  # seconds; the step watchdog (`watchdog.py`) is off when unset
ENV_COMPILE_TIMEOUT = "TPUSTRAT_COMPILE_TIMEOUT"  # seconds; the step watchdog's compile bound (`watchdog.py`)
ENV_RESTART_COUNT = "TPUSTRAT_RESTART_COUNT"  # set by the launcher: 0 on the first start, then 1, 2, ...
ENV_JOB_ID = "TPUSTRAT_JOB_ID"  # the job's identity, checked before joining its coordinator (`distributed.py`)
ENV_PROFILE_DIR = "TPUSTRAT_PROFILE_DIR"  # a trace of each process into <dir>/process_<i> (`profiler.py`)
ENV_PROFILE_STEPS = "TPUSTRAT_PROFILE_STEPS"  # with ENV_PROFILE_DIR: stop the trace after this many steps
ENV_COMPILATION_CACHE_DIR = "TPUSTRAT_COMPILATION_CACHE_DIR"  # JAX's persistent cache (`compilation_cache.py`)

# The job check (`distributed.py`): process 0 of a job with an identity serves it on this TCP port offset
# from the coordinator's port (coordinator port + 1), and every other process reads it there before it
# registers with the coordinator, so that no process ever joins another job's coordinator.
JOB_CHECK_PORT_OFFSET = 1

# Bounds of every timeout, in seconds (launcher flags, TPUSTRAT_* variables, resolver arguments), checked
# up front by `validation.check_seconds`. JAX's distributed runtime takes its timeouts as C int32 seconds,
# so none may exceed 2**31 - 1 (about 68 years). A step timeout under a second cannot tell a hung peer
# from a slow step (1e-300 would fire on the first step), so the step timeout is at least 1 s.
MAX_TIMEOUT_SECONDS = 2**31 - 1
MIN_STEP_TIMEOUT_SECONDS = 1.0

# Exit status of a process whose distributed start-up failed because its coordinator port was taken (the
# launcher reads it and starts the job again on another port; no message text is matched). 75 is
# sysexits.h's EX_TEMPFAIL ("temporary failure, the user is invited to retry"), far from the statuses
# Python and most programs use (1 uncaught exception, 2 usage).
EXIT_START_FAILED = 75

# Exit status of a process that saved a checkpoint after a termination notice
# (`tpustrat.PreemptionCheckpointHandler`'s default `exit_fn`): "restart me". TF's handler uses 42 too.
# `python -m tpustrat.launch --max-restarts N` restarts the job after it, as after any other failure.
EXIT_RESTART = 42

# Exit status of a process whose step watchdog fired: a step waited longer than the step timeout for its
# peers (`watchdog.py`). 124 is what `timeout(1)` (and the launcher's own --timeout) exits with.
EXIT_STEP_TIMEOUT = 124

# The line with which a firing step watchdog names the processes it finds holding the job up (inside a
# host callback that has not returned, behind on their step counters or their devices, compiling past the
# compile bound), `stuck` being "process 1" or "processes 1, 3" (`watchdog.py`). Every process of the job
# prints it (the firing one, and the others with the abort message they read); the launcher reads it from
# the output of the process that ended first, to blame the right one (`launch._culprit`).
WATCHDOG_BLAMES = "tpustrat: step watchdog of process {firing}: holding the job up: {stuck}."

# Exit status of a process whose checkpoint save failed in the storage (disk full, read-only file system, a
# write error: `CheckpointManager`), in a multi-process job: every process stops with it at once, rather than
# waiting at orbax's barriers for the deadline (124, which would blame a hang). 74 is sysexits.h's EX_IOERR
# ("an error occurred while doing I/O on some file").
EXIT_CHECKPOINT_FAILED = 74

# Exit status of a process whose checkpoint save failed because another process of the job stopped in the
# middle of it (`CheckpointManager`, multi-process jobs): a barrier or collective of the save across the
# processes failed in JAX's distributed runtime (the peer died, hung or lost its connection), not a write of
# this process. Every process stops with it at once, as with 74, which stays the storage's. 69 is
# sysexits.h's EX_UNAVAILABLE ("a service is unavailable").
EXIT_CHECKPOINT_PEER_LOST = 69
