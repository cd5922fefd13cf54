"""What the padding rows of a partial batch hold (`InputOptions.experimental_padding`), and the
`PaddingReadWarning` analysis of the steps that read them (tpustrat/_src/padding_reads.py).

Every value is checked against numpy (or one-device JAX) on the real rows, TF's semantics: TF hands each
replica only its real rows. 15 rows of a global batch of 16 on 8 replicas: k = 2, replica 7 holds one real
row and one padding row.
"""

import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import tpustrat

N, GLOBAL = 8, 16
ROWS = 15
ZEROS = tpustrat.InputOptions(experimental_padding="zeros")


def _data(seed=0, rows=ROWS):
  rng = np.random.default_rng(seed)
  return {
      "x": rng.normal(size=(rows, 4)).astype(np.float32),
      "y": rng.normal(size=(rows,)).astype(np.float32),
      "mask": (rng.random(rows) > 0.3).astype(np.float32),
      "w": (rng.random(rows) + 0.1).astype(np.float32),
  }


def _batch(strategy, data, options=None):
  # One full batch first, so that the partial one is padded to k = 2 (the first batch's size).
  full = {k: np.concatenate([v, v[:1]]) for k, v in data.items()}
  it = iter(strategy.experimental_distribute_dataset([full, data], options))
  next(it)
  return next(it)


def _run(strategy, fn, batch, *args):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = strategy.run(fn, args=(batch, *args))
  said = [str(w.message) for w in caught if issubclass(w.category, tpustrat.PaddingReadWarning)]
  return out, said


W0 = np.array([0.5, -1.0, 0.25, 2.0], np.float32)


def _pe(b):
  return (b["x"] @ W0 - b["y"]) ** 2 + 1.0


def _pe_np(d):
  return (d["x"].astype(np.float64) @ W0 - d["y"]) ** 2 + 1.0


# -- item 4: a padding row cannot make NaN ----------------------------------------------------------------


def _normalised_loss(w, x, y):  # row-normalised features: 0/0 on an all-zero row
  unit = x / jnp.linalg.norm(x, axis=1, keepdims=True)
  return (unit @ w - y) ** 2


def _masked_mean_loss(w, x, y):  # a mean over a row's nonzero entries (a masked sequence pooled): 0/0 on zeros
  keep = (x != 0).astype(x.dtype)
  return ((jnp.sum(x * keep, axis=1) / jnp.sum(keep, axis=1)) * jnp.sum(w) - y) ** 2


@pytest.mark.parametrize("loss", [_normalised_loss, _masked_mean_loss], ids=["normalised", "masked mean"])
def test_padding_rows_cannot_make_nan_gradients(strategy, loss):
  d = _data(1)
  w = strategy.experimental_mirror(W0)

  def step(b, w):
    return jax.value_and_grad(lambda w: tpustrat.compute_average_loss(loss(w, b["x"], b["y"]),
                                                                       global_batch_size=GLOBAL))(w)

  value, grad = strategy.run(step, args=(_batch(strategy, d), w))
  want_value, want_grad = jax.value_and_grad(lambda w: jnp.sum(loss(w, d["x"], d["y"])) / GLOBAL)(W0)
  got_grad = strategy.experimental_local_results(grad)[0]  # a Mirrored value's gradient: summed over replicas
  assert np.isfinite(np.asarray(got_grad)).all()
  assert_close(strategy.reduce("SUM", value, axis=None), want_value, rtol=1e-5, scale=abs(float(want_value)) + 1)
  assert_close(got_grad, want_grad, rtol=1e-5, scale=np.abs(np.asarray(want_grad)).max() + 1)
  # Zero padding rows (the option for steps masking with a dataset column) make the class come back: the
  # loss is right, the gradient NaN (0 * NaN).
  value, grad = strategy.run(step, args=(_batch(strategy, d, ZEROS), w))
  assert_close(strategy.reduce("SUM", value, axis=None), want_value, rtol=1e-5, scale=abs(float(want_value)) + 1)
  assert np.isnan(np.asarray(strategy.experimental_local_results(grad)[0])).any()


def test_the_padding_rows_are_copies_of_the_first_row_or_zeros(strategy):
  d = _data(2)
  for options, want in ((None, d["x"][0]), (ZEROS, np.zeros(4, np.float32))):
    parts = np.asarray(_batch(strategy, d, options)["x"].tree)  # [replica, k, ...], as the replicas hold it
    np.testing.assert_array_equal(np.concatenate(parts)[:ROWS], d["x"])
    np.testing.assert_array_equal(parts[7][1], want)


def test_per_replica_batches_pad_with_their_own_first_row(strategy):
  # Six per-replica batches of 2 or 1 rows (k = 2); replicas 6 and 7 get none (the pipeline has ended).
  # Replica r's padding is its own first row; replicas 6 and 7 take replica 0's, the first with a row.
  rows = [np.full((2 if r % 2 == 0 else 1, 3), 10.0 * r + 1, np.float32) for r in range(6)]
  batch = next(iter(strategy.experimental_distribute_datasets_from_function(lambda ctx: rows)))
  parts = np.asarray(batch.tree)  # [replica, k, ...], as the replicas hold it
  for r, p in enumerate(parts):
    np.testing.assert_array_equal(p, np.full((2, 3), 10.0 * r + 1 if r < 6 else 1.0, np.float32),
                                  err_msg=f"replica {r}")
  zeros = next(iter(strategy.experimental_distribute_datasets_from_function(lambda ctx: rows, ZEROS)))
  parts = np.asarray(zeros.tree)
  assert (parts[1][1] == 0).all() and (parts[7] == 0).all()


def test_the_padding_option_is_checked():
  with pytest.raises(ValueError, match=r"experimental_padding must be one of 'first_row', 'zeros', got 'zero'"):
    tpustrat.InputOptions(experimental_padding="zero")


# -- item 8: the warning follows what a step does with the rows -------------------------------------------


def _centred(b):
  c = b["x"] - b["x"].mean(0)
  return jnp.sum(jnp.where(tpustrat.valid_mask(b), jnp.sum(c ** 2, axis=1), 0)) / GLOBAL


def _replica_mean(b):
  return jnp.mean(jnp.where(tpustrat.valid_mask(b), _pe(b), 0))


def _in_cond(b):
  return jax.lax.cond(b["y"][0] > -1e9, lambda: jnp.sum(_pe(b)) / GLOBAL, lambda: jnp.sum(_pe(b)) * 0.0)


def _contrastive(b):
  z = b["x"] / 4.0
  lse = jax.nn.logsumexp(z @ z.T, axis=1)
  return jnp.sum(jnp.where(tpustrat.valid_mask(b), lse, 0)) / GLOBAL


def _sorted(b):
  return jnp.sum(jnp.sort(_pe(b))) / GLOBAL


def _running(b):
  return jnp.cumsum(_pe(b))[-1] / GLOBAL


def _tf_replica_parts(d):
  """Each replica's real rows, as TF hands them (k = 2)."""
  return [{k: v[2 * r:2 * r + 2] for k, v in d.items()} for r in range(N)]


def _tf_centred(d):
  return sum(((p["x"] - p["x"].mean(0)) ** 2).sum() for p in _tf_replica_parts(d)) / GLOBAL


def _tf_replica_mean(d):
  return sum(_pe_np(p).mean() for p in _tf_replica_parts(d))


def _tf_contrastive(d):
  total = 0.0
  for p in _tf_replica_parts(d):
    z = p["x"].astype(np.float64) / 4.0
    logits = z @ z.T
    total += np.log(np.exp(logits).sum(1)).sum()
  return total / GLOBAL


def _tf_sum(d):
  return _pe_np(d).sum() / GLOBAL


@pytest.mark.parametrize("padding", ["first_row", "zeros"])
@pytest.mark.parametrize("step,tf,how", [
    (_centred, _tf_centred, r"a (sum|mean) over the rows"),
    (_replica_mean, _tf_replica_mean, "a mean over the rows .* whose denominator counts its padding rows"),
    (_in_cond, _tf_sum, "a sum over the rows"),
    (_contrastive, _tf_contrastive, "paired with its rows"),
    (_sorted, _tf_sum, "a sum over the rows"),
    (_running, _tf_sum, "a running sum along the rows"),
], ids=["centred", "replica mean", "cond", "contrastive", "sort", "cumsum"])
def test_a_step_that_reads_padding_rows_is_warned(strategy, step, tf, how, padding):
  d = _data(3)
  out, said = _run(strategy, step, _batch(strategy, d, ZEROS if padding == "zeros" else None))
  got, want = float(strategy.reduce("SUM", out, axis=None)), tf(d)
  assert len(said) == 1 and "strategy.run: the output at <root> is computed from" in said[0], said
  assert pytest.approx(got, rel=1e-4) != want, "the warned step must really differ from TF's on this batch"
  assert re.search(how, said[0]), said[0]


def _masked(b):
  return jnp.sum(jnp.where(tpustrat.valid_mask(b), _pe(b), 0)) / GLOBAL


def _masked_mean(b):
  return jnp.mean(_pe(b), where=tpustrat.valid_mask(b))


def _per_example_scan(b):  # a loop over the rows, masked
  per = jax.lax.map(lambda row: (row[0] @ W0 - row[1]) ** 2 + 1.0, (b["x"], b["y"]))
  return jnp.sum(jnp.where(tpustrat.valid_mask(b), per, 0)) / GLOBAL


def _masked_cumsum(b):
  return jnp.cumsum(jnp.where(tpustrat.valid_mask(b), _pe(b), 0))[-1] / GLOBAL


@pytest.mark.parametrize("padding", ["first_row", "zeros"])
@pytest.mark.parametrize("step,tf", [
    (_masked, _tf_sum),
    (lambda b: tpustrat.compute_average_loss(_pe(b), global_batch_size=GLOBAL), _tf_sum),
    (_masked_mean, lambda d: sum(_pe_np(p).mean() for p in _tf_replica_parts(d))),
    (_per_example_scan, _tf_sum),
    (_masked_cumsum, _tf_sum),
], ids=["valid_mask", "compute_average_loss", "mean where=valid_mask", "lax.map then mask", "masked cumsum"])
def test_a_step_that_masks_is_right_and_not_warned(strategy, step, tf, padding):
  d = _data(4)
  out, said = _run(strategy, step, _batch(strategy, d, ZEROS if padding == "zeros" else None))
  assert not said, said
  want = tf(d)
  assert_close(strategy.reduce("SUM", out, axis=None), want, rtol=1e-5, scale=abs(want) + 1)


# -- the false alarms: steps that mask with the dataset's own column --------------------------------------


COLUMN_MASKED = {
    "where mask": (lambda b: jnp.sum(jnp.where(b["mask"] > 0, _pe(b), 0)) / GLOBAL,
                   lambda d: (np.where(d["mask"] > 0, _pe_np(d), 0)).sum() / GLOBAL),
    "where w > 0": (lambda b: jnp.sum(jnp.where(b["w"] > 0, _pe(b), 0)) / GLOBAL, _tf_sum),
    "mean where=mask": (lambda b: jnp.mean(_pe(b), where=b["mask"] > 0),
                        lambda d: sum(_pe_np(p)[p["mask"] > 0].mean() for p in _tf_replica_parts(d))),
    "mask * loss": (lambda b: jnp.sum(b["mask"] * _pe(b)) / GLOBAL,
                    lambda d: (d["mask"] * _pe_np(d)).sum() / GLOBAL),
}


@pytest.mark.parametrize("name", sorted(COLUMN_MASKED))
def test_a_step_masking_with_a_dataset_column_is_right_with_zero_padding_and_warned_without(strategy, name):
  step, tf = COLUMN_MASKED[name]
  d = _data(5)
  d["mask"][::2] = 1.0  # each replica's first row counts (and the row copied into the padding)
  want = tf(d)
  out, said = _run(strategy, step, _batch(strategy, d, ZEROS))
  assert not said, said
  assert_close(strategy.reduce("SUM", out, axis=None), want, rtol=1e-5, scale=abs(want) + 1)
  # By default the padding rows are copies of the first row: its mask or weight counts them, and the
  # warning says which option the step needs.
  out, said = _run(strategy, step, _batch(strategy, d))
  assert len(said) == 1 and 'experimental_padding="zeros"' in said[0], said


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("between", ["masked", "reading"])
def test_the_warning_is_that_of_the_signature_that_ran(strategy, between, keyed):
  """`jax.jit` keeps one executable per argument signature. A step that reads the padding for 2 features and
  masks it for 3: a partial 2-feature batch is warned even after a 3-feature trace in between (its sum is
  the padded one, numpy: 16 against the real 10), and a partial 3-feature batch is not warned after a
  2-feature trace (its masked sum is numpy's)."""

  def step(x, key=None):  # keyed: a typed PRNG key argument too (a dropout key), whose dtype is JAX's own
    ctx = tpustrat.get_replica_context()
    if x.shape[1] == 2:
      return ctx.all_reduce("sum", jnp.sum(x))  # reads the padding rows (copies of the first row)
    return ctx.all_reduce("sum", jnp.sum(jnp.where(tpustrat.valid_mask(x)[:, None], x, 0.0)))

  features, other = (2, 3) if between == "masked" else (3, 2)
  full = next(iter(strategy.experimental_distribute_dataset([np.ones((8, other), np.float32)])))
  partial = next(iter(strategy.experimental_distribute_dataset([np.ones((5, features), np.float32)])))
  first = next(iter(strategy.experimental_distribute_dataset([np.ones((8, features), np.float32)])))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    extra = (jax.random.key(0),) if keyed else ()
    strategy.run(step, args=(first, *extra))  # the trace of this signature
    strategy.run(step, args=(full, *extra))  # a trace of the other one in between
    total = float(np.asarray(strategy.run(step, args=(partial, *extra))))
  said = [w for w in caught if issubclass(w.category, tpustrat.PaddingReadWarning)]
  if features == 2:
    assert total == 8 * 2  # every replica's 1 row of 2 ones: 5 real rows, 3 padding copies
    assert len(said) == 1
  else:
    assert total == np.ones((5, 3)).sum()
    assert said == []


@pytest.mark.parametrize("first", ["reading", "masked"])
def test_the_stacked_steps_warning_is_that_of_the_signature_that_ran(strategy, first):
  """`experimental_run_steps` keeps its inner steps' padding-read warnings per signature of its own program:
  the step of `test_the_warning_is_that_of_the_signature_that_ran` (reads the padding for 2 features, masks it
  for 3) scanned over two stacked batches. Both signatures traced on full batches (in either order), then a
  partial batch of each (the second of 8 holds 5 rows; the fast path: the signatures of the full calls): only
  the reading one is warned, and its sum is the padded one (numpy: 16 + 16 against the real 16 + 10)."""

  def step(carry, x):
    ctx = tpustrat.get_replica_context()
    if x.shape[1] == 2:
      s = ctx.all_reduce("sum", jnp.sum(x))  # reads the padding rows (copies of the first row)
    else:
      s = ctx.all_reduce("sum", jnp.sum(jnp.where(tpustrat.valid_mask(x)[:, None], x, 0.0)))
    return carry + s, s

  def stacked(rows, f):
    it = iter(strategy.experimental_distribute_dataset([np.ones((r, f), np.float32) for r in rows]))
    return it.take_steps(len(rows))

  init = strategy.experimental_mirror(np.float32(0.0))
  order = (2, 3) if first == "reading" else (3, 2)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for f in order:  # the traces
      strategy.experimental_run_steps(step, stacked([8, 8], f), init=init)
    masked, _ = strategy.experimental_run_steps(step, stacked([8, 5], 3), init=init)
    assert not [w for w in caught if issubclass(w.category, tpustrat.PaddingReadWarning)]
    reading, _ = strategy.experimental_run_steps(step, stacked([8, 5], 2), init=init)
    again, _ = strategy.experimental_run_steps(step, stacked([8, 5], 2), init=reading)
  said = [w for w in caught if issubclass(w.category, tpustrat.PaddingReadWarning)]
  assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in said]
  assert float(np.asarray(masked)) == np.ones((8, 3)).sum() + np.ones((5, 3)).sum()
  assert float(np.asarray(reading)) == np.ones((8, 2)).sum() + 8 * 2  # 5 real rows, 3 copies of the first
  assert float(np.asarray(again)) == 2 * float(np.asarray(reading))


def test_the_stacked_steps_warning_tells_two_kinds_of_padding_of_one_shape_apart(strategy):
  """One run-steps program traced for a first-row-padded and a zero-padded dataset of the same shapes (the
  padding's kind is in the structure): the first-row padded partial batch, whose sum reads the copies of the
  first row (numpy: 16 + 10 ones, the step 16 + 16), is warned."""

  def step(carry, x):
    s = tpustrat.get_replica_context().all_reduce("sum", jnp.sum(x))
    return carry + s, s

  def it(rows, options):
    return iter(strategy.experimental_distribute_dataset([np.ones((r, 2), np.float32) for r in rows], options))

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    strategy.experimental_run_steps(step, it([8, 8], None), steps=2, init=np.float32(0))
    strategy.experimental_run_steps(step, it([8, 8], ZEROS), steps=2, init=np.float32(0))
    total, _ = strategy.experimental_run_steps(step, it([8, 5], None), steps=2, init=np.float32(0))
  said = [w for w in caught if issubclass(w.category, tpustrat.PaddingReadWarning)]
  assert float(np.asarray(total)) == 2 * np.ones((8, 2)).sum()
  assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in said]


def test_steps_that_read_padding_inside_a_users_jit_run_in_any_thread(strategy):
  """Under the user's own `jax.jit` the real-row counts are not on the host: no warning, and no error (the
  check read them: ConcretizationTypeError; a `run` traced in a `scan` in another thread: AttributeError).
  The values are what the program computes: the padding rows (copies of the first row) read."""

  def reading(carry, x):
    s = tpustrat.get_replica_context().all_reduce("sum", jnp.sum(x))
    return carry + s, s

  stacked = iter(strategy.experimental_distribute_dataset([np.ones((r, 2), np.float32) for r in (8, 5)]))
  stacked = stacked.take_steps(2)
  init = strategy.experimental_mirror(np.float32(0.0))
  padded_sum = 2 * np.ones((8, 2)).sum()  # 8 + 5 real rows, 3 padding copies of the first row
  run_steps = jax.jit(lambda c, b: strategy.experimental_run_steps(reading, b, init=c)[0])
  assert float(np.asarray(run_steps(init, stacked))) == padded_sum

  @jax.jit
  def loop(c, bs):
    return jax.lax.scan(lambda c, b: (strategy.run(lambda c, x: reading(c, x)[0], args=(c, b)), None), c, bs)[0]

  got = {}

  def work():
    try:
      got["out"] = float(np.asarray(loop(init, stacked)))
    except Exception as e:  # pylint: disable=broad-except  # reported below
      got["error"] = repr(e)

  thread = threading.Thread(target=work)
  thread.start()
  thread.join()
  assert got == {"out": padded_sum}
