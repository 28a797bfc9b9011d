"""The order of samples: which sample row ``r`` of global microbatch ``index`` of step ``step`` reads.

Samples are numbered ``0 .. samples-1``. The run reads them as one stream, ``micro_batch`` per microbatch
and ``global_microbatches`` microbatches per step, so row ``r`` of microbatch ``index`` of step ``step`` is
position ``n = (step * global_microbatches + index) * micro_batch + r`` of the stream. Position ``n`` is in
epoch ``e = n // samples`` and reads sample ``permutation_e[n % samples]``, where ``permutation_e`` is a
seeded shuffle of all samples drawn for that epoch alone (NumPy's PCG64 seeded with ``(seed, e)``): every
sample once per epoch, a new order every epoch.

Nothing in it depends on the number of pipelines D, on which node asks, or on what was read before: a
failover, a joiner, a reconfiguration to another D (the global batch is kept) and ``--resume`` at step N
all read the same samples as the run that never stopped.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np

__all__ = ["DataError", "SampleOrder"]


class DataError(ValueError):
    """A data source that cannot give the run its samples; the message names the file and the numbers."""


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, samples: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(samples)
    order.flags.writeable = False
    return order


@attrs.frozen
class SampleOrder:
    """The seeded per-epoch order of ``samples`` samples, read ``micro_batch`` per microbatch and
    ``global_microbatches`` microbatches per step (see the module docstring)."""

    samples: int = attrs.field(validator=attrs.validators.gt(0))
    micro_batch: int = attrs.field(validator=attrs.validators.gt(0))
    global_microbatches: int = attrs.field(validator=attrs.validators.gt(0))
    seed: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch * self.global_microbatches

    def sample_ids(self, step: int, index: int) -> np.ndarray:
        """The samples of global microbatch ``index`` of step ``step``, one per row (int64)."""
        if step < 0 or not 0 <= index < self.global_microbatches:
            raise DataError(f"microbatch ({step}, {index}) is outside the run's data: the step must be >= 0 and the "
                            f"index in 0..{self.global_microbatches - 1} (the global batch)")
        first = (step * self.global_microbatches + index) * self.micro_batch
        positions = np.arange(first, first + self.micro_batch, dtype=np.int64)
        epochs, within = np.divmod(positions, self.samples)
        ids = np.empty(self.micro_batch, dtype=np.int64)
        for epoch in np.unique(epochs):  # a microbatch may straddle two epochs
            rows = epochs == epoch
            ids[rows] = _permutation(self.seed, int(epoch), self.samples)[within[rows]]
        return ids

    def epoch(self, step: int) -> float:
        """How many epochs the run has read by the start of step ``step`` (a fraction)."""
        return step * self.samples_per_step / self.samples
