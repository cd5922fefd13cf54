"""The engine: how `strategy.run(fn, args)` becomes one compiled SPMD program, and how every compiled
program is dispatched.

One concept per module:

* `options`: `RunOptions`, the options of `run` and `experimental_run_steps`, checked when made.
* `engine`: `Engine`, `run` for one strategy's mesh: the program cache, argument placement, dispatch.
* `program`: the program builder, `jax.jit(jax.shard_map(fn))` over the mesh (inputs, outputs as
  `Mirrored` / `PerReplica`, padded batches, logical cores, `LayoutMap`, NaN / Inf flags).
* `flat_program`: `FlatProgram`, that program compiled over flat argument leaves.
* `step_jaxpr`: `StepJaxpr`, the step traced to a jaxpr and read (batch rows, block statistics, padding
  reads).
* `output_padding`: which outputs carry a padded batch's rows; the padding-read warning.
* `donation`: `RunOptions.donate_argnums` mapped to leaves, and the errors said before dispatch.
* `in_flight`: `InFlight`, the bound on programs in flight, and `dispatch`, the one way a program runs,
  which calls the per-step hooks (`tpustrat._src.step_hooks`; the engine's are `STEP_HOOKS`).
* `weak_keys`: cache keys and calls that do not keep the user's function alive.

The names other modules use are re-exported here; the modules import one another, never this package.
"""

from tpustrat._src.engine.donation import (
  DONATION_USED,
  check_donatable,
  check_not_deleted,
  donated_leaves,
  donation_used,
)
from tpustrat._src.engine.engine import Engine, check_run_call, same_over_replicas
from tpustrat._src.engine.flat_program import FlatProgram
from tpustrat._src.engine.in_flight import (
  DEFAULT_STEPS_IN_FLIGHT,
  STEP_HOOKS,
  InFlight,
  default_hooks_apply,
  dispatch,
  dispatch_default_hooks,
  dispatch_flat,
  wait_leaf,
)
from tpustrat._src.engine.options import RunOptions, donate_argnums_of
from tpustrat._src.engine.output_padding import (
  inner_padding_notes,
  note_stacked_padding_reads,
  output_padding,
  stacked_signature,
  warn_padding_reads,
  warn_padding_reads_stacked,
)
from tpustrat._src.engine.program import batch_group, make_program
from tpustrat._src.engine.step_jaxpr import StepJaxpr, is_output_node
from tpustrat._src.engine.weak_keys import weak_callable, weak_key

_same_over_replicas = same_over_replicas  # the name tests/test_logical.py imports

__all__ = ["RunOptions", "Engine", "InFlight", "check_not_deleted", "dispatch", "default_hooks_apply",
           "dispatch_default_hooks", "dispatch_flat", "donated_leaves", "donation_used", "wait_leaf",
           "donate_argnums_of", "DEFAULT_STEPS_IN_FLIGHT", "DONATION_USED", "STEP_HOOKS", "FlatProgram",
           "StepJaxpr", "batch_group", "check_donatable", "check_run_call", "inner_padding_notes",
           "is_output_node", "note_stacked_padding_reads", "make_program", "output_padding", "same_over_replicas",
           "stacked_signature", "warn_padding_reads", "warn_padding_reads_stacked", "weak_callable", "weak_key"]
