"""JAX's persistent compilation cache, switched on in one call (`tpustrat.experimental.enable_compilation_cache`).

A second start of a job (a restart after preemption, the next run of a script) compiles the same programs
again; with the cache, XLA's executables are read from a directory instead. This module only sets JAX's
documented options (https://docs.jax.dev/en/latest/persistent_compilation_cache.html):

* ``jax_compilation_cache_dir``: the directory (local, or a path JAX's file system layer takes, e.g.
  ``gs://``);
* ``jax_persistent_cache_min_compile_time_secs = 0`` and ``jax_persistent_cache_min_entry_size_bytes = -1``:
  every program is cached, the small ones too (JAX's defaults skip programs that compiled in under a
  second, which on a TPU is most of a small model's);
* and makes JAX decide again whether to use the cache, in case something compiled before this call
  (`jax_compat.reset_compilation_cache`).

Off by default. ``python -m tpustrat.launch --compilation-cache DIR`` sets ``TPUSTRAT_COMPILATION_CACHE_DIR``
in every process of every start (restarts share it), and ``import tpustrat`` calls `enable_from_environment`.
In a multi-process job every process reads the cache; JAX writes entries from process 0 only, so on several
hosts put the directory on a file system they share. Entries are keyed by the program, the devices, the
compile options and the JAX / jaxlib version: a new JAX version starts from an empty cache, never a wrong one.
Measured by ``benchmarks/bench_compile_cache.py`` (the char transformer's time to first step, second start
against first).
"""

from __future__ import annotations

import os

import jax

from tpustrat._src import jax_compat, names

__all__ = ["compilation_cache_dir", "enable_compilation_cache", "enable_from_environment"]


def enable_compilation_cache(directory: str | os.PathLike, *, min_compile_time_secs: float = 0.0) -> str:
  """Turns on JAX's persistent compilation cache in `directory` (created if missing) for this process.

  Call it before the programs to cache are compiled (programs compiled before it are compiled again once,
  then cached). `min_compile_time_secs`: programs that compiled faster than this are not written (0: every
  program). Returns the directory, made absolute.
  """
  if isinstance(min_compile_time_secs, bool) or not isinstance(min_compile_time_secs, (int, float)) or not (
      min_compile_time_secs >= 0):
    raise ValueError("tpustrat.experimental.enable_compilation_cache: min_compile_time_secs must be a number "
                     f">= 0, got {min_compile_time_secs!r}")
  text = os.fspath(directory)
  if not text.strip():
    raise ValueError("tpustrat.experimental.enable_compilation_cache: directory must not be empty.")
  if "://" not in text:  # a local path: absolute, so that a later chdir changes nothing
    text = os.path.abspath(text)
    os.makedirs(text, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", text)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  jax_compat.reset_compilation_cache()
  return text


def compilation_cache_dir() -> str | None:
  """The persistent compilation cache's directory JAX uses now, or None when it is off."""
  # A dynamic attribute of jax.config, which JAX's types lack (`jax.config.read` refuses this flag).
  return jax.config.jax_compilation_cache_dir or None  # type: ignore[attr-defined]


def enable_from_environment() -> str | None:
  """`enable_compilation_cache(TPUSTRAT_COMPILATION_CACHE_DIR)` when the variable is set (by
  ``python -m tpustrat.launch --compilation-cache DIR``, or by hand); returns the directory, or None."""
  text = os.environ.get(names.ENV_COMPILATION_CACHE_DIR, "").strip()
  return enable_compilation_cache(text) if text else None
