"""Bad arguments of the LR callbacks and what each must raise: one table
for the TensorFlow and JAX test modules (the checks happen at
construction, the same on every backend)."""

from __future__ import annotations

# (kwargs, error, match) for `LearningRateScaler`.
SCALER_BAD_INPUT = [
    (
        {"base_batch_size": 0},
        ValueError,
        r"Argument `base_batch_size` must be an integer >= 1\. "
        r"Received: base_batch_size=0",
    ),
    (
        {"base_batch_size": 8, "scaling_rule": "log"},
        ValueError,
        r"Argument `scaling_rule` must be one of 'linear', 'sqrt'\. "
        r"Received: scaling_rule='log'",
    ),
    (
        {
            "base_batch_size": 8,
            "batch_size": 8,
            "per_replica_batch_size": 4,
        },
        ValueError,
        r"Pass at most one of `batch_size` and `per_replica_batch_size`",
    ),
    (
        {"base_batch_size": 8, "per_replica_batch_size": -1},
        ValueError,
        r"Received: per_replica_batch_size=-1",
    ),
]

# (kwargs, error, match) for `LearningRateWarmup`.
WARMUP_CALLBACK_BAD_INPUT = [
    (
        {"warmup_steps": 0},
        ValueError,
        r"Argument `warmup_steps` must be an integer >= 1 or None\. "
        r"Received: warmup_steps=0",
    ),
    (
        {"warmup_steps": -2},
        ValueError,
        r"Received: warmup_steps=-2",
    ),
    (
        {"warmup_epochs": 0},
        ValueError,
        r"Argument `warmup_epochs` must be a number > 0\.0 or None",
    ),
    (
        {"warmup_steps": 3, "warmup_epochs": 1},
        ValueError,
        r"Pass exactly one of `warmup_steps` and `warmup_epochs`",
    ),
    ({}, ValueError, r"Pass exactly one of"),
    (
        {"warmup_steps": 3, "ramp": "step"},
        ValueError,
        r"Argument `ramp` must be one of .* Received: ramp='step'",
    ),
    (
        {"warmup_steps": 3, "ramp": "exponential"},
        ValueError,
        r"`initial_learning_rate` must be > 0 with ramp='exponential'",
    ),
]
