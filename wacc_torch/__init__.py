"""wacc_torch: weighted gradient accumulation over unequal microbatches, for PyTorch.

See ``docs/semantics.md`` for the normative semantics. Production code: imports torch only.
"""

from wacc_torch._environment import denormals_flushed
from wacc_torch.accumulator import (
    AccumulatedGradients,
    AccumulatorState,
    StateDictHandle,
    WeightedGradientsAccumulator,
    normalize_sums,
)
from wacc_torch.distributed import (
    ProcessGroupUnavailableError,
    all_reduce_mean,
    all_reduce_sums,
)
from wacc_torch.errors import (
    BrokenWindowError,
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    RecordError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    ZeroCopyError,
    ZeroTotalWeightError,
)
from wacc_torch.records import FORMAT_VERSION, load_record, save_record
from wacc_torch.scaler import WindowLossScaler

__all__ = [
    "FORMAT_VERSION",
    "AccumulatedGradients",
    "AccumulatorState",
    "BrokenWindowError",
    "InvalidLossScaleError",
    "InvalidWeightError",
    "ParameterMismatchError",
    "ProcessGroupUnavailableError",
    "RecordError",
    "StateDictHandle",
    "UnsupportedEnvironmentError",
    "WeightedAccumulationError",
    "WeightedGradientsAccumulator",
    "WindowLossScaler",
    "ZeroCopyError",
    "ZeroTotalWeightError",
    "all_reduce_mean",
    "all_reduce_sums",
    "denormals_flushed",
    "load_record",
    "normalize_sums",
    "save_record",
]
