"""Bad arguments of `Warmup` and `scaled_learning_rate` and what each must
raise: one table for the TensorFlow and JAX test modules."""

from __future__ import annotations

# (kwargs, error, match) for `Warmup`.
WARMUP_BAD_INPUT = [
    (
        {"warmup_steps": 0},
        ValueError,
        r"Argument `warmup_steps` must be an integer >= 1\. "
        r"Received: warmup_steps=0",
    ),
    (
        {"warmup_steps": -3},
        ValueError,
        r"Received: warmup_steps=-3",
    ),
    (
        {"warmup_steps": 2.5},
        TypeError,
        r"`warmup_steps` must be an integer >= 1",
    ),
    (
        {"ramp": "quadratic"},
        ValueError,
        r"Argument `ramp` must be one of 'linear', 'exponential', "
        r"'cosine'\. Received: ramp='quadratic'",
    ),
    (
        {"ramp": "exponential"},
        ValueError,
        r"`initial_learning_rate` must be > 0 with ramp='exponential'",
    ),
    (
        {"initial_learning_rate": -1.0},
        ValueError,
        r"`initial_learning_rate` must be a number >= 0\.0",
    ),
    (
        {"schedule": "0.1"},
        TypeError,
        r"Argument `schedule` must be a float or a .*LearningRateSchedule"
        r".*Received: schedule='0\.1'",
    ),
    (
        {"schedule": -0.5},
        ValueError,
        r"Argument `schedule` must be a number >= 0\.0",
    ),
]

# (kwargs, error, match) for `scaled_learning_rate`.
SCALING_BAD_INPUT = [
    (
        {"scaling_rule": "cubic"},
        ValueError,
        r"Argument `scaling_rule` must be one of 'linear', 'sqrt'\. "
        r"Received: scaling_rule='cubic'",
    ),
    (
        {"base_batch_size": 0},
        ValueError,
        r"`base_batch_size` must be an integer >= 1\. "
        r"Received: base_batch_size=0",
    ),
    (
        {"global_batch_size": 8.0},
        TypeError,
        r"`global_batch_size` must be an integer >= 1",
    ),
    (
        {"base_learning_rate": -0.1},
        ValueError,
        r"`base_learning_rate` must be a number > 0\.0\. "
        r"Received: base_learning_rate=-0\.1",
    ),
]
