"""`configure_batch`: from a target global batch to ready-to-use training
pieces, with the micro-batch measured to fit in memory."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from keras_mgpu._flavour import flavour_of, keras_of, tf
from keras_mgpu._validation import check_choice, check_int, check_number
from keras_mgpu.backend import require_backend
from keras_mgpu.batch_size._settings import ProbeSettings
from keras_mgpu.batch_size.finder import (
    BatchSizeResult,
    check_safety_margin,
    probe_batch_size,
)
from keras_mgpu.batch_size.plan import DEFAULT_MIN_FILL, BatchPlan, plan_batch
from keras_mgpu.batch_size.search import DEFAULT_MAX_TRIALS
from keras_mgpu.distribute import current_strategy, num_replicas_in_sync
from keras_mgpu.distribute import worker_info as _worker_info
from keras_mgpu.schedules.scaling import SCALING_RULES, scaled_learning_rate


@dataclasses.dataclass(frozen=True)
class BatchSetup:
    """What `configure_batch` decided, ready to use.

    Attributes:
        per_replica_batch_size: the micro-batch of each replica.
        accumulation_steps: micro-steps per optimizer update.
        num_replicas: replicas in sync.
        global_batch_size: `per_replica_batch_size x num_replicas x
            accumulation_steps`, exactly.
        optimizer: a fresh copy of the model's optimizer (its configuration,
            not its state), wrapped in `GradientAccumulationOptimizer` when
            `accumulation_steps > 1`; created in the strategy's scope.
            Compile the model with it.
        base_learning_rate: the model's optimizer's current learning rate.
        learning_rate: the rate scaled to the global batch
            (`base_learning_rate` without `base_batch_size`).
        learning_rate_scaler: a `LearningRateScaler` callback that applies
            that scaling in `fit`, or None without `base_batch_size`.
        search: the `BatchSizeResult` of the memory search.
        plan: the `BatchPlan`.
        explanation: one paragraph saying what was measured and decided.
    """

    per_replica_batch_size: int
    accumulation_steps: int
    num_replicas: int
    global_batch_size: int
    optimizer: Any
    base_learning_rate: float
    learning_rate: float
    learning_rate_scaler: Any
    search: BatchSizeResult
    plan: BatchPlan
    explanation: str

    @property
    def step_batch_size(self) -> int:
        """The batch of one `fit` step across replicas (per-replica batch x
        replicas): what to pass to `dataset.batch(...)`."""
        return self.plan.step_batch_size

    @property
    def callbacks(self) -> list:
        """The callbacks to pass to `fit` (the scaler, when there is one)."""
        return [self.learning_rate_scaler] if self.learning_rate_scaler else []


def configure_batch(
    model: Any,
    data: Any,
    global_batch_size: int,
    *,
    base_batch_size: int | None = None,
    scaling_rule: str = "linear",
    memory_fraction: float | None = None,
    memory_budget_mb: float | None = None,
    max_batch_size: int | None = None,
    device: str | None = None,
    multiple_of: int = 1,
    min_fill: float = DEFAULT_MIN_FILL,
    strategy: tf.distribute.Strategy | None = None,
    safety_margin: float | None = None,
    verbose: int = 0,
) -> BatchSetup:
    """Reach `global_batch_size` with the largest micro-batch that fits:
    `find_batch_size`, then `plan_batch`, then the optimizer and learning
    rate to train with.

    The memory search runs on a copy of `model` whose optimizer is wrapped
    in `GradientAccumulationOptimizer`, so the accumulators are counted;
    it never looks past `global_batch_size / replicas` (or
    `max_batch_size`). When that whole share fits, there is no
    accumulation and the optimizer is returned unwrapped.

    **Under `tf.distribute`.** The replicas are the strategy's (the model's
    by default; every worker's under `MultiWorkerMirroredStrategy`, where
    all workers get the same setup). Call it after compiling the model in
    the strategy's scope, then compile again with `setup.optimizer`.

    **On JAX.** `strategy` is a `keras.distribution` (default: the one in
    force); the replicas are its data-parallel size (the batch axis of its
    mesh), and the search reads XLA's compiled step (see
    `find_batch_size`), with Keras's own accumulation buffers in the
    copy's optimizer. `memory_budget_mb` is required on CPU. Build and
    compile the model, and compile it again with `setup.optimizer`,
    inside `distribution.scope()`.

    Args:
        model: a compiled Keras model (see `find_batch_size`).
        data: samples the model trains on (see `find_batch_size`).
        global_batch_size: int >= 1, examples per optimizer update.
        base_batch_size: int >= 1 or None, the batch the model's learning
            rate was tuned for; with it, the rate is scaled to the global
            batch (`LearningRateScaler`).
        scaling_rule: "linear" (default) or "sqrt".
        memory_fraction: as in `find_batch_size`.
        memory_budget_mb: as in `find_batch_size`.
        device: as in `find_batch_size`.
        multiple_of: as in `find_batch_size`.
        max_batch_size: int >= 1 or None, a cap on the micro-batch besides
            memory.
        min_fill: as in `plan_batch`.
        strategy: defaults to the model's.
        safety_margin: as in `find_batch_size` (None: derived from what
            the answer's confirmation measures).
        verbose: int, 0 (default, as Keras) prints nothing; 1 prints
            `explanation` (on the chief).

    Returns:
        A `BatchSetup`.

    Raises:
        NoExactSplitError: no good exact split (see `plan_batch`); raised
            before any probing when the global batch is not a multiple of
            the replicas.
        ValueError, TypeError, RuntimeError: as `find_batch_size`.

    Example:

    ```python
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    setup = keras_mgpu.configure_batch(
        model, (x, y), global_batch_size=4096, base_batch_size=256)
    with strategy.scope():
        model.compile(optimizer=setup.optimizer, loss="mse")
    model.fit(x, y, batch_size=setup.step_batch_size,
              callbacks=setup.callbacks)
    ```
    """
    require_backend("configure_batch")
    check_int(global_batch_size, "global_batch_size", minimum=1)
    check_int(base_batch_size, "base_batch_size", minimum=1, allow_none=True)
    check_choice(scaling_rule, "scaling_rule", SCALING_RULES)
    check_int(max_batch_size, "max_batch_size", minimum=1, allow_none=True)
    check_number(min_fill, "min_fill", minimum=0.0, maximum=1.0)
    check_safety_margin(safety_margin)
    verbose = check_int(verbose, "verbose", minimum=0)
    strategy = current_strategy(
        strategy or getattr(model, "distribute_strategy", None)
    )
    replicas = num_replicas_in_sync(strategy)
    share = global_batch_size // replicas
    if global_batch_size % replicas:
        plan_batch(global_batch_size, max(share, 1), num_replicas=replicas)
    cap = share if max_batch_size is None else min(share, max_batch_size)
    search = probe_batch_size(
        model,
        data,
        ProbeSettings(
            memory_fraction=memory_fraction,
            max_batch_size=max(cap, multiple_of),
            device=device,
            memory_budget_mb=memory_budget_mb,
            multiple_of=multiple_of,
            strategy=strategy,
            max_trials=DEFAULT_MAX_TRIALS,
            verbose=0,
            accumulate=True,
            safety_margin=safety_margin,
        ),
    )
    plan = plan_batch(
        global_batch_size,
        min(search.batch_size, cap),
        num_replicas=replicas,
        min_fill=min_fill,
    )
    optimizer = _training_optimizer(model, strategy, plan.accumulation_steps)
    base_lr, lr, scaler = _learning_rate(
        model, global_batch_size, base_batch_size, scaling_rule, plan
    )
    explanation = " ".join(
        [
            search.explain(),
            _plan_sentence(plan, optimizer),
            _rate_sentence(base_lr, lr, base_batch_size, scaling_rule, plan),
        ]
    )
    if verbose and _worker_info(strategy)["is_chief"]:
        print(explanation)
    return BatchSetup(
        per_replica_batch_size=plan.per_replica_batch_size,
        accumulation_steps=plan.accumulation_steps,
        num_replicas=replicas,
        global_batch_size=global_batch_size,
        optimizer=optimizer,
        base_learning_rate=base_lr,
        learning_rate=lr,
        learning_rate_scaler=scaler,
        search=search,
        plan=plan,
        explanation=explanation,
    )


def _innermost(optimizer: Any) -> Any:
    """The optimizer under any `LossScaleOptimizer` / accumulation
    wrapper."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def _training_optimizer(model: Any, strategy: Any, steps: int) -> Any:
    """A fresh copy of the model's optimizer, wrapped for `steps`."""
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    current = model.optimizer
    correction = False
    wrapper = current
    while wrapper is not None:
        # Either flavour's wrapper (they are different classes).
        correction = correction or bool(
            getattr(wrapper, "momentum_correction", False)
        )
        wrapper = getattr(wrapper, "inner_optimizer", None)
    innermost = _innermost(current)
    keras = keras_of(flavour_of(innermost))
    config = keras.saving.serialize_keras_object(innermost)
    # On JAX without a distribution there is no scope to enter.
    scope = contextlib.nullcontext() if strategy is None else strategy.scope()
    with scope:
        inner = keras.saving.deserialize_keras_object(config)
        if steps == 1 and not correction:
            return inner
        return GradientAccumulationOptimizer(
            inner, steps, momentum_correction=correction
        )


def _learning_rate(model, global_batch, base_batch, rule, plan) -> tuple:
    """(base rate, scaled rate, scaler callback or None)."""
    from keras_mgpu.callbacks import LearningRateScaler
    from keras_mgpu.schedules import current_learning_rate

    base = current_learning_rate(model.optimizer)
    if base_batch is None:
        return base, base, None
    scaled = scaled_learning_rate(
        base, global_batch, base_batch, scaling_rule=rule
    )
    scaler = LearningRateScaler(
        base_batch_size=base_batch,
        per_replica_batch_size=plan.per_replica_batch_size,
        scaling_rule=rule,
        verbose=0,
    )
    return base, scaled, scaler


def _plan_sentence(plan: BatchPlan, optimizer: Any) -> str:
    name = type(_innermost(optimizer)).__name__
    if plan.accumulation_steps == 1:
        return (
            f"The target global batch {plan.global_batch_size:,} fits "
            f"without accumulation: {plan.per_replica_batch_size:,} per "
            f"replica x {plan.num_replicas} replica(s), batches of "
            f"{plan.step_batch_size:,} per step, plain {name}."
        )
    text = (
        f"The target global batch {plan.global_batch_size:,} = "
        f"{plan.per_replica_batch_size:,} per replica x {plan.num_replicas} "
        f"replica(s) x {plan.accumulation_steps} accumulation steps: feed "
        f"batches of {plan.step_batch_size:,} per step and train with "
        f"GradientAccumulationOptimizer({name}, accumulation_steps="
        f"{plan.accumulation_steps})"
    )
    if plan.per_replica_batch_size < plan.max_batch_size:
        text += (
            f" (micro-batches of {plan.fill:.0%} of the "
            f"{plan.max_batch_size:,} that fit: the largest that "
            "split the global batch exactly)"
        )
    return text + "."


def _rate_sentence(base, scaled, base_batch, rule, plan) -> str:
    if base_batch is None:
        return (
            f"The learning rate stays {base:.4g} (pass base_batch_size to "
            "scale it to the global batch)."
        )
    ratio = f"{plan.global_batch_size}/{base_batch}"
    factor = ratio if rule == "linear" else f"sqrt({ratio})"
    return (
        f"LearningRateScaler(base_batch_size={base_batch}) scales the "
        f"learning rate {base:.4g} by {factor} ({rule} rule) to "
        f"{scaled:.4g}."
    )
