"""Finding the bottleneck: profiles and the compilation cache (TF's `tf.profiler.experimental`).

* `profile(logdir, steps=None)`: a context manager that captures a trace of this process into
  ``logdir/process_<i>/`` (TensorBoard's profile plugin: ``tensorboard --logdir logdir``; Perfetto with
  ``create_perfetto_trace=True``), as TF's ``tf.profiler.experimental.Profile`` / JAX's
  `jax.profiler.trace`; `start_profile` / `stop_profile` are the same as two calls (TF's ``start`` /
  ``stop``). Every process of a job calls it (they run the same program), each writing its own directory.
  Steps (`strategy.run`, `experimental_run_steps`) appear as `jax.profiler.StepTraceAnnotation` marks, the
  host's wait for input as ``tpustrat/input_wait``; ``python -m tpustrat.launch --profile DIR`` profiles
  every process without changing the program.
* `enable_compilation_cache(directory)`: JAX's persistent compilation cache, every program cached (``python
  -m tpustrat.launch --compilation-cache DIR`` for every process and restart).
"""

from tpustrat._src.compilation_cache import compilation_cache_dir as compilation_cache_dir
from tpustrat._src.compilation_cache import enable_compilation_cache as enable_compilation_cache
from tpustrat._src.profiler import profile as profile
from tpustrat._src.profiler import start as start_profile
from tpustrat._src.profiler import steps_dispatched as steps_dispatched
from tpustrat._src.profiler import stop as stop_profile

__all__ = ["compilation_cache_dir", "enable_compilation_cache", "profile", "start_profile", "steps_dispatched",
           "stop_profile"]
