"""Mixed precision (Keras's `keras.mixed_precision`): a dtype `Policy`, gradients all-reduced in the policy's
reduce dtype, and dynamic loss scaling for float16 (`LossScaleOptimizer`, an optax transformation whose
skipped steps every replica and process agrees on). See `tpustrat._src.mixed_precision`.
"""

from tpustrat._src.mixed_precision import LossScaleOptimizer as LossScaleOptimizer
from tpustrat._src.mixed_precision import LossScaleState as LossScaleState
from tpustrat._src.mixed_precision import Policy as Policy
from tpustrat._src.mixed_precision import all_finite as all_finite
from tpustrat._src.mixed_precision import all_reduce_gradients as all_reduce_gradients

__all__ = ["LossScaleOptimizer", "LossScaleState", "Policy", "all_finite", "all_reduce_gradients"]
