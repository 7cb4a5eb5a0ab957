"""Switch layers of an existing model to recompute in place, and back.

In the manner of Keras's own `RematScope`, which changes how chosen layers
are *called* instead of rebuilding the model: the model keeps its class,
config, weights, seed states and everything built on it (keras-hub task
models and presets, `.keras` files). Two switches, both undone by
`restore_in_place`:

- per layer: the layer's `call` is replaced on the instance (Keras itself
  wraps `build` per instance the same way) by one that runs the class's
  `call` under `recompute` (see `_recompute_engine`);
- per segment (`group_by=`, `policy="sqrt"` or `"min_memory"`, Keras 3
  functional graphs):
  the graph runner of the functional model that calls the chosen layers
  runs each segment (nodes consecutive in its execution order: a residual
  block, a run of transformer layers) as one recomputed unit.

Nothing of this is saved: `get_config`, `.keras` files and presets hold the
model as it was, and load without keras_mgpu.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from keras_mgpu._flavour import IS_TF_KERAS, TF_RUNS, keras
from keras_mgpu.layers._recompute_engine import (
    current_training,
    in_symbolic_build,
    recompute,
)

# Markers on switched objects (set with object.__setattr__, so neither Keras
# flavour tracks them and `get_config` never sees them).
_CALL_MARK = "_keras_mgpu_recompute"
_SEGMENT_MARK = "_keras_mgpu_recompute_segment"
_PLAN = "_keras_mgpu_recompute_segments"
_RUNNER = "_run_through_graph"
_SELECTIVE_MARK = "_keras_mgpu_recompute_selective"
_CORE_MARK = "_keras_mgpu_recompute_core"
_ACTIVATION_MARK = "_keras_mgpu_recompute_activation"
_REMAT_MARK = "_keras_mgpu_keras_remat_mode"
_OFFLOAD_MARK = "_keras_mgpu_recompute_offload"

# Layers whose recomputation is running on this thread (replica threads of
# MirroredStrategy trace and differentiate concurrently): their switched
# `call` must run the plain `call` then.
_local = threading.local()


def _bypassed_ids() -> set:
    if not hasattr(_local, "ids"):
        _local.ids = set()
    return _local.ids


@contextlib.contextmanager
def _bypass(layer: Any) -> Iterator[None]:
    ids = _bypassed_ids()
    ids.add(id(layer))
    try:
        yield
    finally:
        ids.discard(id(layer))


# ---------------------------------------------------------------------------
# Keras's own per-layer remat (`keras.RematScope`), taken over.
# ---------------------------------------------------------------------------


def _take_over_remat(layer: Any) -> None:
    """Turn Keras's own rematerialization off for a layer recomputed here.

    A layer built under `keras.RematScope` keeps the scope's mode in the
    private `_remat_mode` (Keras 3.9-3.15, set in `Operation.__init__`) and
    `Operation.__call__` then runs `keras.remat(self.call)`: `jax.checkpoint`
    on JAX, `tf.recompute_grad` on TensorFlow. With our switch on, that
    `self.call` is the switched method stored on the instance, the same
    object at every call, and `jax.checkpoint` caches its trace per function
    object: every later trace (the next `fit`, a `fit` after `predict`)
    reused the first one, its weights baked in as constants (zero gradients)
    or its tracers leaked (`UnexpectedTracerError`). On TensorFlow
    `tf.recompute_grad` fails in graph mode. Our recomputation covers the
    layer already, so Keras's is switched off while ours is on and given
    back by `restore_layer`. tf_keras layers have no `_remat_mode`.
    """
    mode = getattr(layer, "_remat_mode", None)
    if mode is None or _REMAT_MARK in layer.__dict__:
        return
    object.__setattr__(layer, _REMAT_MARK, mode)
    object.__setattr__(layer, "_remat_mode", None)


def _give_back_remat(layer: Any) -> bool:
    if _REMAT_MARK not in layer.__dict__:
        return False
    object.__setattr__(layer, "_remat_mode", layer.__dict__.pop(_REMAT_MARK))
    return True


# ---------------------------------------------------------------------------
# Per layer: the instance's `call`.
# ---------------------------------------------------------------------------


def is_recomputed_in_place(layer: Any) -> bool:
    """Whether `layer` is switched to recompute in place (alone or as part
    of a recomputed segment)."""
    call = layer.__dict__.get("call")
    return (
        bool(getattr(call, _CALL_MARK, False))
        or layer.__dict__.get(_SEGMENT_MARK) is not None
        or layer.__dict__.get(_SELECTIVE_MARK, False)
    )


def is_switched_per_layer(layer: Any) -> bool:
    """Whether `layer`'s own `call` is switched to full recompute (not as a
    segment member, not selectively)."""
    return getattr(layer.__dict__.get("call"), _CALL_MARK, False) is True


def is_selective(layer: Any) -> bool:
    """Whether `layer` is a block switched by `recompute_selective`."""
    return bool(layer.__dict__.get(_SELECTIVE_MARK, False))


def _run_recomputed(layer: Any, class_call: Any, args, kwargs) -> Any:
    original = functools.partial(class_call, layer)
    if id(layer) in _bypassed_ids() or in_symbolic_build():
        return original(*args, **kwargs)
    # The forward runs inside the layer's `__call__` (autocast, call
    # context); the recomputation goes through `__call__` again, with the
    # `training` value the forward saw, and runs the plain `call` there.
    training = kwargs["training"] if "training" in kwargs else None
    if training is None:
        training = current_training()

    def forward(structure):
        call_args, call_kwargs = structure
        return original(*call_args, **call_kwargs)

    def again(structure):
        call_args, call_kwargs = structure
        call_kwargs = dict(call_kwargs)
        if call_kwargs.get("training") is None and training is not None:
            call_kwargs["training"] = training
        with _bypass(layer):
            return layer(*call_args, **call_kwargs)

    return recompute(
        forward,
        (list(args), dict(kwargs)),
        [layer],
        again,
        offload=offloads(layer),
    )


def _recomputed_call(class_call: Any) -> Any:
    # `wraps`: `inspect.signature(layer.call)` stays the class's.
    @functools.wraps(class_call)
    def call(self, *args, **kwargs):
        return _run_recomputed(self, class_call, args, kwargs)

    setattr(call, _CALL_MARK, True)
    return call


def recompute_layer_in_place(layer: Any) -> None:
    """Switch `layer`'s `call` to recompute in the backward pass."""
    if is_recomputed_in_place(layer):
        return
    if "call" in layer.__dict__:
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) has its `call` "
            "replaced on the instance by other code; recomputing it in place "
            "would hide that replacement. Choose its sublayers instead."
        )
    # A bound method, like the class's `call` it stands for. (Copies of the
    # model made through its config, `clone_model` and Keras 3's
    # `copy.deepcopy`, are plain.)
    method = types.MethodType(_recomputed_call(type(layer).call), layer)
    object.__setattr__(layer, "call", method)
    _take_over_remat(layer)


# ---------------------------------------------------------------------------
# Selective: keep the matrix products, recompute the cheap, large rest.
# ---------------------------------------------------------------------------

# Cheap to recompute and (with their internals) large to keep: softmax and
# elementwise activation layers on both backends; normalization on JAX only
# (keras-hub's own norms, `LlamaLayerNorm`, `GemmaRMSNorm`, ..., matched by
# class name). Measured on keras-hub GPT-2 and Llama (issue 32): on JAX a
# recomputed norm fuses into the backward pass for no measurable time and
# cuts what is kept by a tenth; on TensorFlow each recomputed region is a
# `tf.custom_gradient` of its own (weights re-read, ordering anchors) and
# the norms alone took the step from 0.7-0.8x to 1.2x of plain's time.
# Dropout layers are kept on both: their mask is small next to what they
# feed (a boolean on JAX) and replaying it means drawing the random bits
# again. (Inside the attention core, dropout is recomputed with the rest.)
_CHEAP_CLASS_NAMES = ("Softmax", "Activation", "ReLU", "LeakyReLU", "ELU")
_NORM_CLASS_NAMES = (
    "LayerNormalization",
    "RMSNormalization",
    "UnitNormalization",
)
_NORM_NAME_ENDINGS = ("LayerNorm", "RMSNorm")


def _is_cheap(layer: Any) -> bool:
    names = _CHEAP_CLASS_NAMES
    if not TF_RUNS:
        names = names + _NORM_CLASS_NAMES
    for cls in type(layer).__mro__:
        if cls.__name__ in names and cls.__module__.startswith("keras"):
            return True
    return not TF_RUNS and type(layer).__name__.endswith(_NORM_NAME_ENDINGS)


def _has_attention_core(layer: Any) -> bool:
    """`keras.layers.MultiHeadAttention` and its keras-hub subclasses
    (`CachedMultiHeadAttention`), keras-hub's Llama/Mistral/Gemma attention:
    the scores-softmax-dropout-product core is the method
    `_compute_attention` (Keras 3.15 documents it as the override point;
    keras-hub 0.32 names its own cores the same)."""
    return callable(getattr(type(layer), "_compute_attention", None))


def _nonlinear_activation(layer: Any) -> Any:
    activation = layer.__dict__.get("activation")
    if activation is None or not callable(activation):
        return None
    if getattr(activation, "__name__", "") == "linear":
        return None
    return activation


def _switch_core(layer: Any) -> None:
    class_core = type(layer)._compute_attention

    @functools.wraps(class_core)
    def core(self, *args, **kwargs):
        if in_symbolic_build():
            return class_core(self, *args, **kwargs)

        def forward(structure):
            call_args, call_kwargs = structure
            return class_core(self, *call_args, **call_kwargs)

        return recompute(
            forward,
            (list(args), dict(kwargs)),
            [self],
            offload=offloads(self),
        )

    object.__setattr__(
        layer, "_compute_attention", types.MethodType(core, layer)
    )
    object.__setattr__(layer, _CORE_MARK, True)


def _switch_activation(layer: Any, activation: Any) -> None:
    """Recompute `layer.activation` (a function) from its input.

    Keras 3.15's Dense and EinsumDense apply `self.activation` after the
    product: the product's output is kept, the activation recomputed. The
    attribute holds a stand-in while the switch is on, so the layer's
    `get_config` is switched too: it runs the class's `get_config` with the
    original activation in place, and the config (a `.keras` file's, a
    registered activation's `'package>name'`) is exactly the plain layer's.
    """

    def recomputed(x):
        return recompute(activation, x, [], offload=offloads(layer))

    # The name, module and docstring, for whoever reads them (not `__dict__`:
    # an activation object's attributes are its own).
    functools.update_wrapper(recomputed, activation, updated=())
    class_get_config = type(layer).get_config

    @functools.wraps(class_get_config)
    def get_config(self):
        switched = self.__dict__.get("activation")
        object.__setattr__(self, "activation", activation)
        try:
            return class_get_config(self)
        finally:
            object.__setattr__(self, "activation", switched)

    object.__setattr__(layer, "activation", recomputed)
    object.__setattr__(layer, "get_config", types.MethodType(get_config, layer))
    object.__setattr__(layer, _ACTIVATION_MARK, activation)


def _switch_activation_layer(layer: Any) -> None:
    """An activation given as a layer object (`Dense(activation=
    keras.layers.LeakyReLU(0.2))`, a sublayer of its owner): its own `call`
    is switched, as any cheap layer's; the owner's attribute, and so its
    config, stay as they are."""
    if not is_recomputed_in_place(layer):
        recompute_layer_in_place(layer)


def _restore_selective(layer: Any) -> bool:
    restored = bool(layer.__dict__.pop(_SELECTIVE_MARK, False))
    if layer.__dict__.pop(_CORE_MARK, False):
        layer.__dict__.pop("_compute_attention", None)
        restored = True
    original = layer.__dict__.pop(_ACTIVATION_MARK, None)
    if original is not None:
        object.__setattr__(layer, "activation", original)
        layer.__dict__.pop("get_config", None)
        restored = True
    return restored


def recompute_selective(block: Any) -> None:
    """Switch `block` to selective recompute: the matrix products inside it
    are kept for the backward pass, the cheap parts are recomputed, each
    from its own input.

    The parts, on both backends: the attention core (`_compute_attention`
    of `keras.layers.MultiHeadAttention` and keras-hub's attention layers:
    scores, masking, softmax, attention dropout and the product with the
    values, recomputed from the projected queries, keys and values);
    softmax and activation layers; the activation of a Dense / EinsumDense
    or of the block itself (a keras-hub decoder's `activation`), its
    product kept. On JAX also normalization layers. Each part is one
    recomputed region (`jax.checkpoint` on JAX, `tf.custom_gradient` on
    TensorFlow); what lies between them (the products, residual additions,
    dropout masks outside attention) is kept as in the plain model.
    """

    def visit(layer: Any) -> None:
        if _is_cheap(layer):
            recompute_layer_in_place(layer)
            return
        # Keras's own remat of a layer switched here (`keras.RematScope`)
        # would recompute its products too: ours takes over.
        _take_over_remat(layer)
        if _has_attention_core(layer):
            _switch_core(layer)
            return  # Its softmax and dropout run inside the core.
        activation = _nonlinear_activation(layer)
        if isinstance(activation, keras.layers.Layer):
            _switch_activation_layer(activation)
        elif activation is not None and _ACTIVATION_MARK not in layer.__dict__:
            _switch_activation(layer, activation)
        for sub in layer._flatten_layers(include_self=False, recursive=False):
            if not is_recomputed_in_place(sub):
                visit(sub)

    visit(block)
    object.__setattr__(block, _SELECTIVE_MARK, True)


def set_offload(root: Any, offload: bool) -> None:
    """Whether the recomputed parts in `root`'s layer tree keep their
    inputs in host memory (read at each call, so it holds for every switch
    made inside `root`: its own call, segments, selective parts)."""
    for layer in root._flatten_layers(include_self=True, recursive=True):
        if offload:
            object.__setattr__(layer, _OFFLOAD_MARK, True)
        else:
            layer.__dict__.pop(_OFFLOAD_MARK, None)


def offloads(layer: Any) -> bool:
    """Whether `layer`'s recomputed regions offload their inputs."""
    return bool(layer.__dict__.get(_OFFLOAD_MARK, False))


def restore_layer(layer: Any) -> bool:
    """Undo `recompute_layer_in_place` (and the selective switches of
    `recompute_selective`); True if there was something to undo."""
    layer.__dict__.pop(_OFFLOAD_MARK, None)
    restored = _restore_selective(layer)
    restored = _give_back_remat(layer) or restored
    if not getattr(layer.__dict__.get("call"), _CALL_MARK, False):
        return restored
    del layer.__dict__["call"]
    return True


# ---------------------------------------------------------------------------
# Per segment: a functional model's graph runner (Keras 3 only).
# ---------------------------------------------------------------------------


def graph_of(container: Any) -> Any:
    """The Keras 3 functional graph that runs `container`'s layers, or None.

    Keras 3.15: a functional model is its own graph (`Function`, with
    `_nodes_by_depth` and `_run_through_graph`); a built `Sequential` runs
    the functional model in its `_functional` attribute. Both private.
    """
    if IS_TF_KERAS:
        return None
    from keras.src.ops.function import Function

    if isinstance(container, keras.Sequential):
        container = getattr(container, "_functional", None)
    if isinstance(container, Function) and hasattr(
        container, "_nodes_by_depth"
    ):
        return container
    return None


def _execution_order(graph: Any) -> list:
    """The graph's nodes in the order Keras 3.15's `_run_through_graph`
    visits them (deepest first)."""
    nodes_by_depth = graph._nodes_by_depth
    order = []
    for depth in sorted(nodes_by_depth, reverse=True):
        for node in nodes_by_depth[depth]:
            if node.operation is not None and not node.is_input:
                order.append(node)
    return order


def units_of(
    graph: Any, chosen: Sequence[Any], key: Callable[[Any], Hashable]
) -> list[list]:
    """Runs of nodes of chosen layers, consecutive in execution order, whose
    layers have the same `key`: the units a region of `graph` is recomputed
    in (a residual block of a flat model, say).

    A residual block or stage with one entry and one exit tensor is always
    consecutive: Keras orders nodes by depth, and every node of the block
    lies strictly between its entry and its exit. Only layers called once in
    the graph take part.
    """
    order = _execution_order(graph)
    chosen_ids = {id(layer) for layer in chosen}
    calls: dict = {}
    for node in order:
        calls[id(node.operation)] = calls.get(id(node.operation), 0) + 1
    units: list = []
    run: list = []
    run_key: Any = None
    for node in order:
        op = node.operation
        if id(op) not in chosen_ids or calls[id(op)] != 1:
            run = []
            continue
        node_key = key(op)
        if run and node_key == run_key:
            run.append(node)
            continue
        run, run_key = [node], node_key
        units.append(run)
    return units


def sqrt_segments(graph: Any, units: list[list]) -> list[list]:
    """Group adjacent units into segments of ceil(sqrt(len(units))) units
    (Chen et al., 2016): only segment boundaries are stored."""
    if not units:
        return []
    position = {id(node): i for i, node in enumerate(_execution_order(graph))}
    size = math.ceil(math.sqrt(len(units)))
    segments: list = []
    current: list = []
    count = 0
    for unit in units:
        adjacent = current and (
            position[id(unit[0])] == position[id(current[-1])] + 1
        )
        if not adjacent or count == size:
            if current:
                segments.append(current)
            current, count = [], 0
        current = current + unit
        count += 1
    segments.append(current)
    return segments


def _exits(graph: Any, nodes: list) -> list:
    """The tensors `nodes` produce that the rest of `graph` uses."""
    inside = {id(node) for node in nodes}
    used_outside = {id(x) for x in graph.outputs}
    for node in _execution_order(graph):
        if id(node) not in inside:
            used_outside.update(id(x) for x in node.input_tensors)
    return [x for node in nodes for x in node.outputs if id(x) in used_outside]


def recompute_segments_in_place(graph: Any, segments: list[list]) -> None:
    """Run each segment (consecutive nodes of `graph`) as one recomputed
    unit from now on."""
    plan = dict(graph.__dict__.get(_PLAN, {}))
    for nodes in segments:
        for node in nodes:
            restore_layer(node.operation)
            object.__setattr__(node.operation, _SEGMENT_MARK, id(nodes[0]))
            _take_over_remat(node.operation)
        plan[id(nodes[0])] = (list(nodes), _exits(graph, nodes))
    object.__setattr__(graph, _PLAN, plan)
    if _RUNNER not in graph.__dict__:
        runner = types.MethodType(_segmented_run_through_graph, graph)
        object.__setattr__(graph, _RUNNER, runner)


def restore_graph(graph: Any) -> list:
    """Undo `recompute_segments_in_place`; the layers that were segment
    members."""
    plan = graph.__dict__.pop(_PLAN, None)
    graph.__dict__.pop(_RUNNER, None)
    members = []
    for nodes, _ in (plan or {}).values():
        for node in nodes:
            node.operation.__dict__.pop(_SEGMENT_MARK, None)
            _give_back_remat(node.operation)
            members.append(node.operation)
    return members


def segment_plan_nodes(graph: Any) -> list[list]:
    """The nodes of each recomputed segment of `graph`, in plan order."""
    return [list(nodes) for nodes, _ in graph.__dict__.get(_PLAN, {}).values()]


def execution_order(graph: Any) -> list:
    """The nodes of `graph` in the order its runner visits them."""
    return _execution_order(graph)


def segment_plan(model: Any) -> list[list]:
    """The layers of each recomputed segment of the functional graph that
    runs `model`'s own layers (empty if none)."""
    graph = graph_of(model)
    plan = {} if graph is None else graph.__dict__.get(_PLAN, {})
    return [[node.operation for node in nodes] for nodes, _ in plan.values()]


def _segmented_run_through_graph(
    self, inputs, operation_fn=lambda op: op, call_fn=None
):
    """Keras 3.15's `Function._run_through_graph`, with planned segments
    run as one recomputed unit each (read from keras/src/ops/function.py;
    the symbolic path with `call_fn` is left to Keras)."""
    flat_inputs = keras.tree.flatten(inputs)
    symbolic = any(isinstance(x, keras.KerasTensor) for x in flat_inputs)
    if call_fn is not None or symbolic or in_symbolic_build():
        return type(self)._run_through_graph(
            self, inputs, operation_fn=operation_fn, call_fn=call_fn
        )
    plan = self.__dict__.get(_PLAN, {})
    tensor_dict = {id(x): y for x, y in zip(self.inputs, flat_inputs)}
    done: set = set()
    for node in _execution_order(self):
        if id(node) in done:
            continue
        if any(id(x) not in tensor_dict for x in node.input_tensors):
            continue  # Not computable; Keras skips it too.
        segment = plan.get(id(node))
        if segment is None:
            args, kwargs = node.arguments.fill_in(tensor_dict)
            op = operation_fn(self._get_operation_for_node(node))
            outputs = op(*args, **kwargs)
            produced = node.outputs
        else:
            nodes, produced = segment
            outputs = _run_segment(self, segment, tensor_dict, operation_fn)
            done.update(id(n) for n in nodes)
        for x, y in zip(produced, keras.tree.flatten(outputs)):
            tensor_dict[id(x)] = y
    output_tensors = []
    for x in self.outputs:
        if id(x) not in tensor_dict:  # pragma: no cover - Keras checked it
            raise ValueError(f"Output {x} is not connected to `inputs`.")
        output_tensors.append(tensor_dict[id(x)])
    return keras.tree.pack_sequence_as(self._outputs_struct, output_tensors)


def _run_segment(graph, segment, tensor_dict, operation_fn) -> list:
    """Run a segment's nodes under one `recompute`; its exit tensors."""
    nodes, exits = segment
    produced = {id(x) for node in nodes for x in node.outputs}
    external_ids = []
    for node in nodes:
        for x in node.input_tensors:
            if id(x) not in produced and id(x) not in external_ids:
                external_ids.append(id(x))
    values = [tensor_dict[i] for i in external_ids]
    layers = [node.operation for node in nodes]

    def run(structure):
        local = dict(zip(external_ids, structure, strict=True))
        for node in nodes:
            args, kwargs = node.arguments.fill_in(local)
            op = operation_fn(graph._get_operation_for_node(node))
            outputs = op(*args, **kwargs)
            for x, y in zip(node.outputs, keras.tree.flatten(outputs)):
                local[id(x)] = y
        return [local[id(x)] for x in exits]

    return recompute(run, values, layers, offload=offloads(layers[0]))


def reset_compiled_functions(model: Any) -> None:
    """Drop `model`'s traced train/test/predict functions so the next `fit`
    traces the switched calls (Keras caches them on the model)."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


__all__ = [
    "offloads",
    "set_offload",
    "sqrt_segments",
    "units_of",
    "graph_of",
    "is_recomputed_in_place",
    "is_switched_per_layer",
    "recompute_layer_in_place",
    "recompute_segments_in_place",
    "reset_compiled_functions",
    "restore_graph",
    "restore_layer",
    "recompute_selective",
    "is_selective",
    "segment_plan",
    "segment_plan_nodes",
    "execution_order",
]
