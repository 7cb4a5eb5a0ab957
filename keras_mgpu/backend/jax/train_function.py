"""A train function that JAX traces afresh, for the learning-rate wrappers.

The LR callbacks put Python-side wrappers (a factor, a ramp length) in
front of the optimizer's learning rate and then ask Keras for a new train
function, to be traced with them. Keras's JAX trainer (3.15) makes it as
`jax.jit(self.train_step)`, and JAX (0.10) keys its trace cache on the
function *by equality*: every bound method `model.train_step` equals every
other, so while an earlier train function is alive (the callbacks keep the
one traced with their wrappers, to reuse it in the next `fit`), a new
`jit(model.train_step)` with the same argument shapes gets that earlier
trace back, wrappers and all. Measured: a second `fit` with a 100-step ramp
ran the first fit's 6-step ramp.

`fresh_train_function` hands `make_train_function` a step function of its
own identity (a `functools.partial` of the model's `train_step`, compared
by identity), so the new train function is traced with the wrappers
installed now. Only `model.train_step` is shadowed, for the duration of the
call, on the instance: a user's override of `train_step` is what runs.
"""

from __future__ import annotations

import functools
from typing import Any

_ATTRIBUTE = "train_step"


def fresh_train_function(model: Any) -> None:
    """`model.make_train_function(force=True)`, traced on first call even
    when an equal function was traced before."""
    shadowed = _ATTRIBUTE in model.__dict__
    previous = model.__dict__.get(_ATTRIBUTE)
    # `object.__setattr__`: a plain attribute, not tracked by Keras.
    object.__setattr__(
        model, _ATTRIBUTE, functools.partial(getattr(model, _ATTRIBUTE))
    )
    try:
        model.make_train_function(force=True)
    finally:
        if shadowed:
            object.__setattr__(model, _ATTRIBUTE, previous)
        else:
            object.__delattr__(model, _ATTRIBUTE)
