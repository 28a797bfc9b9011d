"""A training script's hooks into the worker loop: a callback after every step, evaluation every N steps, and
a callback on each change of the worker's phase.

:func:`bamboo.launch.train_worker` takes them as ``on_step=`` and ``evaluate=(fn, every_n_steps)``:

- ``on_step(info)`` is called once per step of the job, by the node that reports the job's loss (the host of
  the last stage of pipeline 0, its shadow after a failover; with one stage, the first live node), with a :class:`bamboo.rc.StepInfo`: the step
  (steps done, 1 after the first), its mean loss over the global batch, the learning rate its update used,
  the global batch's samples per second of that step, the samples trained so far, and ``eval_loss`` when an
  evaluation ran right after the step (None otherwise, or when a failure interrupted it). A step redone after
  a restore from a checkpoint is reported again.
- ``evaluate=(fn, every_n_steps)``: after every ``every_n_steps``-th step, every node runs
  ``engine.eval_batch``: a forward-only pass through the pipelines (eval mode, no gradients), over the
  microbatches ``fn(step, index)`` for ``index = 0 .. M*D-1`` (the same indices as a training step's global
  batch; pipeline d evaluates ``d*M .. d*M+M-1``). ``fn`` returns ``(inputs, labels)`` as ``microbatch`` does;
  a fixed validation set simply ignores ``step``. The evaluation changes nothing the training sees: the run's
  parameters are those of a run without it. Its loss reaches ``on_step`` and the config's monitors
  (``Train/Samples/eval_loss``).

- ``on_phase(change)`` is called in every worker, each time its state machine
  (:mod:`bamboo.launch.worker_phases`) enters a phase, with a :class:`~bamboo.launch.worker_phases.PhaseChange`
  (the node, the phase it left and the one it entered, the outcome that caused it, the layout generation): a
  script can, say, free a cache when its node goes to standby, or log how long it waited for a role.

The hooks run in the worker processes; an exception in one is a worker error, which the launcher reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from bamboo.launch.worker_phases import PhaseChange
    from bamboo.rc import Engine
    from bamboo.rc.monitor import StepInfo
    from torch import Tensor

__all__ = ["Evaluation", "TrainingHooks", "evaluation_batches", "run_step_hooks"]


_POSITIVE_INT = attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(1))


@attrs.frozen
class Evaluation:
    """Evaluate on ``microbatch(step, index)`` after every ``every_n_steps``-th training step."""

    microbatch: Callable[[int, int], tuple[Tensor, Tensor]] = attrs.field(validator=attrs.validators.is_callable())
    every_n_steps: int = attrs.field(validator=_POSITIVE_INT)

    @classmethod
    def from_argument(cls, value: object) -> Evaluation | None:
        """``train_worker``'s ``evaluate=``: None, an :class:`Evaluation`, or a pair ``(fn, every_n_steps)``."""
        if value is None or isinstance(value, Evaluation):
            return value
        if not isinstance(value, tuple | list) or len(value) != 2:
            raise TypeError(f"evaluate must be a pair (fn, every_n_steps), got {value!r}")
        return cls(value[0], value[1])

    def due(self, step: int) -> bool:
        """Whether an evaluation runs after training step ``step`` (steps done, 1 after the first)."""
        return step > 0 and step % self.every_n_steps == 0


@attrs.frozen
class TrainingHooks:
    """What a script hooks into the worker loop (see the module docstring); each optional."""

    on_step: Callable[[StepInfo], object] | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.is_callable()))
    evaluate: Evaluation | None = attrs.field(default=None, converter=Evaluation.from_argument)
    on_phase: Callable[[PhaseChange], object] | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.is_callable()))


def evaluation_batches(evaluation: Evaluation, step: int, first: int,
                       count: int) -> Iterator[tuple[Tensor, Tensor]]:
    """A pipeline's share of the evaluation after step ``step``, the ``count`` microbatches from ``first`` (its
    share of the global batch): ``fn(step, first + k)``, ``k = 0 .. count-1``."""
    return (evaluation.microbatch(step, first + k) for k in range(count))


def run_step_hooks(engine: Engine, hooks: TrainingHooks) -> StepInfo:
    """After ``engine.train_batch``: evaluate if due (every node), then call ``on_step`` (the reporting node);
    returns the step's :class:`~bamboo.rc.StepInfo` with its ``eval_loss``.

    Every node of the job calls this after the same steps, as it calls ``train_batch``: the evaluation is a
    collective pass through the pipelines.
    """
    info = engine.last_step
    if info is None:
        raise RuntimeError("run_step_hooks needs a step: call engine.train_batch first")
    evaluation = hooks.evaluate
    if evaluation is not None and evaluation.due(info.step):
        batches = evaluation_batches(evaluation, info.step, *engine.microbatch_share())
        step = info.step
        # P = 1: a node that took over a failed node's share evaluates that share too, by global index.
        engine.eval_batch(batches, microbatch=lambda index: evaluation.microbatch(step, index))
        info = attrs.evolve(info, eval_loss=engine.last_eval_loss)
    if hooks.on_step is not None and engine.reports():
        hooks.on_step(info)
    return info
