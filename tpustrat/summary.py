"""TensorBoard scalars from a custom training loop (TF's ``tf.summary``), without TensorFlow.

The same names and rules as TF's: `create_file_writer`, ``writer.as_default(step=...)``, `scalar`,
`record_if`, `should_record_summaries`, `flush`, `create_noop_writer`. The event files are written with
tensorboardX (``pip install 'tpustrat[tensorboard]'``) by process 0 only (TF's chief), and TensorBoard reads
them. `scalar` takes host values: call it after ``strategy.run`` returns, not inside the step (where TF
allows it). ``fit`` has `tpustrat.keras.TensorBoard`. See docs/guides/training_loop.md and
`tpustrat._src.summary`.
"""

from tpustrat._src.summary import SummaryWriter as SummaryWriter
from tpustrat._src.summary import create_file_writer as create_file_writer
from tpustrat._src.summary import create_noop_writer as create_noop_writer
from tpustrat._src.summary import flush as flush
from tpustrat._src.summary import record_if as record_if
from tpustrat._src.summary import scalar as scalar
from tpustrat._src.summary import should_record_summaries as should_record_summaries

__all__ = ["SummaryWriter", "create_file_writer", "create_noop_writer", "flush", "record_if", "scalar",
           "should_record_summaries"]
