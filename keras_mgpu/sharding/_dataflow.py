"""Which weight contractions feed which, read from the model's jaxpr.

Megatron-style sharding alternates column and row splits along the data
flow, and a Keras model does not record that flow inside subclassed layers
(keras-hub's decoder blocks run their sublayers on tracers, not on
KerasTensors). Tracing the forward pass with `jax.make_jaxpr` (shapes only,
nothing computed) gives it for any model: every `dot_general` or
`conv_general_dilated` with one operand that is (a view of) a weight is a
contraction of that weight, and the contractions reached by walking back from
its other operand, through anything but another contraction, are its
predecessors. This module is JAX-only (the whole of `keras_mgpu.sharding`
is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Operations that only re-view a weight (cast, reshape, transpose, ...): a
# contraction with their output is a contraction of the weight.
_VIEWS = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "reduce_precision",
        # A transposed convolution flips its kernel's spatial dimensions.
        "rev",
    }
)
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
_LOOKUPS = frozenset({"gather", "dynamic_slice", "slice"})


@dataclass(frozen=True)
class Use:
    """One use of a weight: a contraction or a lookup, and the uses whose
    outputs reach its other operand without another contraction between."""

    weight: int
    kind: str  # "contract" or "lookup"
    predecessors: frozenset[int]  # indices into the list of uses


@dataclass(frozen=True)
class _Value:
    weight: int | None = None
    producers: frozenset[int] = frozenset()


_EMPTY = _Value()


def _inner_jaxprs(params: dict) -> list[Any]:
    found = []
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            jaxpr = getattr(item, "jaxpr", item)
            if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars"):
                found.append(jaxpr)
    return found


class _Walker:
    def __init__(self) -> None:
        self.uses: list[Use] = []

    def read(self, env: dict, var: Any) -> _Value:
        if type(var).__name__ == "Literal":
            return _EMPTY
        return env.get(var, _EMPTY)

    def walk(self, jaxpr: Any, inputs: list[_Value]) -> list[_Value]:
        env = {}
        for var, value in zip(jaxpr.invars, inputs):
            env[var] = value
        for var in getattr(jaxpr, "constvars", ()):
            env[var] = _EMPTY
        for eqn in jaxpr.eqns:
            values = [self.read(env, v) for v in eqn.invars]
            outputs = self.equation(eqn, values)
            for var, value in zip(eqn.outvars, outputs):
                env[var] = value
        return [self.read(env, v) for v in jaxpr.outvars]

    def equation(self, eqn: Any, values: list[_Value]) -> list[_Value]:
        name = eqn.primitive.name
        n_out = len(eqn.outvars)
        union = frozenset().union(*(v.producers for v in values))
        weights = [v.weight for v in values if v.weight is not None]
        if name in _VIEWS and values and values[0].weight is not None:
            return [_Value(weight=values[0].weight)] * n_out
        if name in _CONTRACTIONS and len(values) >= 2 and len(weights) == 1:
            other = values[1] if values[0].weight is not None else values[0]
            self.uses.append(Use(weights[0], "contract", other.producers))
            return [_Value(producers=frozenset({len(self.uses) - 1}))] * n_out
        if name in _LOOKUPS and values and values[0].weight is not None:
            self.uses.append(Use(values[0].weight, "lookup", frozenset()))
            return [_Value(producers=frozenset({len(self.uses) - 1}))] * n_out
        inner = _inner_jaxprs(eqn.params)
        if len(inner) == 1 and len(inner[0].invars) == len(values):
            outputs = self.walk(inner[0], values)
            if len(outputs) == n_out:
                return outputs
        elif inner and name == "cond":
            # Branches take the operands after the predicate; a value out of
            # a cond may come from any branch.
            branch_outputs = [
                self.walk(branch, values[1:])
                for branch in inner
                if len(branch.invars) == len(values) - 1
            ]
            if branch_outputs and all(len(o) == n_out for o in branch_outputs):
                return [
                    _Value(
                        producers=frozenset().union(
                            *(o[i].producers for o in branch_outputs)
                        )
                    )
                    for i in range(n_out)
                ]
        # Anything else (loops, unknown primitives): its outputs depend on
        # all its inputs.
        return [_Value(producers=union)] * n_out


def trace_uses(
    model: Any, variables: list[Any], inputs: Any
) -> list[Use] | None:
    """The uses of `variables` (`model.trainable_variables` then
    `model.non_trainable_variables`) in one forward pass on `inputs`
    (arrays, `jax.ShapeDtypeStruct`s or KerasTensors, in `model.input`'s
    structure), in execution order; None when the model cannot be traced."""
    import jax
    import keras

    n_trainable = len(model.trainable_variables)

    def spec(x: Any) -> Any:
        shape = tuple(2 if d is None else int(d) for d in x.shape)
        return jax.ShapeDtypeStruct(
            shape, keras.backend.standardize_dtype(x.dtype)
        )

    def forward(trainable, non_trainable, x):
        return model.stateless_call(trainable, non_trainable, x)[0]

    try:
        closed = jax.make_jaxpr(forward)(
            [spec(v) for v in variables[:n_trainable]],
            [spec(v) for v in variables[n_trainable:]],
            keras.tree.map_structure(spec, inputs),
        )
    except Exception:  # noqa: BLE001  (any failure: plan without data flow)
        return None
    jaxpr = closed.jaxpr
    starts = [_Value(weight=i) for i in range(len(variables))]
    starts += [_EMPTY] * (len(jaxpr.invars) - len(variables))
    walker = _Walker()
    walker.walk(jaxpr, starts)
    return walker.uses


def roles_from_uses(uses: list[Use], n_weights: int) -> dict[int, str]:
    """ "column" or "row" for each weight contracted (the role of its first
    contraction), "lookup" for weights only looked up. A contraction whose
    input comes from a column-split one is row-split; every other one is
    column-split (its input is whole), so the roles alternate along the
    data flow: attention q/k/v column, attention output row, FFN in
    column, FFN out row."""
    use_roles: list[str] = []
    roles: dict[int, str] = {}
    for use in uses:
        if use.kind == "lookup":
            role = "lookup"
        elif any(use_roles[p] == "column" for p in use.predecessors):
            role = "row"
        else:
            role = "column"
        use_roles.append(role)
        if use.weight < n_weights and (
            use.weight not in roles or roles[use.weight] == "lookup"
        ):
            roles[use.weight] = role
    return roles
