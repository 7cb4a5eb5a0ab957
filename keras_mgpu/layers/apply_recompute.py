"""`apply_recompute` / `strip_recompute`: recompute chosen layers of a model.

Two modes. `in_place=True` (the default since 0.2) switches the chosen
layers, anywhere in the layer tree (nested functional models, keras-hub
backbones inside task or user models, subclassed models' attributes), to
recompute in the backward pass: the model keeps its class, config, weights
and seed states (`recompute_in_place`). `in_place=False` (the default of
0.1) rebuilds a Sequential or functional model with its own chosen layers
wrapped in `RecomputeGrad`, in the manner of TFMOT's `prune_low_magnitude`
(`_rebuild`). `strip_recompute` undoes either.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, Union

from keras_mgpu._flavour import IS_TF_KERAS, TF_RUNS, check_flavour, keras
from keras_mgpu._layer_calls import is_placed
from keras_mgpu._validation import check_choice
from keras_mgpu.backend import require_backend
from keras_mgpu.layers import _rebuild
from keras_mgpu.layers._recompute_engine import check_replayable
from keras_mgpu.layers.min_memory_segments import min_memory_segments
from keras_mgpu.layers.recompute_grad import RecomputeGrad
from keras_mgpu.layers.recompute_in_place import (
    execution_order,
    graph_of,
    is_recomputed_in_place,
    is_selective,
    is_switched_per_layer,
    recompute_layer_in_place,
    recompute_segments_in_place,
    recompute_selective,
    reset_compiled_functions,
    restore_graph,
    restore_layer,
    segment_plan_nodes,
    set_offload,
    sqrt_segments,
    units_of,
)

LayerSelector = Union[
    None,
    str,
    type,
    Callable[[Any], bool],
    Iterable[Union[str, type, Callable[[Any], bool]]],
]

POLICIES = ("per_layer", "sqrt", "min_memory", "selective")
SEGMENT_PREFIX = _rebuild.SEGMENT_PREFIX


# ---------------------------------------------------------------------------
# The layer tree.
# ---------------------------------------------------------------------------


def _sublayers(layer: Any) -> list:
    """The layers `layer` tracks directly: a functional model's graph
    layers, a subclassed model's or layer's attributes, a wrapper's layer.

    `_flatten_layers` is private; Keras 3.15 and tf_keras 2.x both define it
    with this signature.
    """
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _walk(root: Any) -> Iterator[Any]:
    """Every layer under `root` (not `root`), depth first, each once."""
    seen = {id(root)}
    stack = list(reversed(_sublayers(root)))
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer
        stack.extend(reversed(_sublayers(layer)))


def _choose_in_place(root: Any, match: Callable[[Any], bool]) -> list:
    """The outermost matching layers under `root`.

    Never descends into a chosen layer, a `RecomputeGrad` wrapper or a layer
    already recomputed in place (those are kept as they are); input layers
    are never chosen.
    """
    chosen, seen = [], {id(root)}

    def visit(layer: Any) -> None:
        for sub in _sublayers(layer):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            if (
                _rebuild.is_input_layer(sub)
                or isinstance(sub, RecomputeGrad)
                or is_recomputed_in_place(sub)
            ):
                continue
            if match(sub):
                chosen.append(sub)
            else:
                visit(sub)

    visit(root)
    return chosen


def _graphs(root: Any) -> list:
    """Every Keras 3 functional graph in the tree, `root`'s included."""
    graphs, seen = [], set()
    for layer in [root, *_walk(root)]:
        graph = graph_of(layer)
        if graph is not None and id(graph) not in seen:
            seen.add(id(graph))
            graphs.append(graph)
    return graphs


# ---------------------------------------------------------------------------
# Arguments.
# ---------------------------------------------------------------------------


def _check_model(model: Any, function: str) -> None:
    require_backend(function)
    check_flavour(model, "model")
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`{function}` expects a keras.Model as argument `model`. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )


def _check_rebuildable(model: Any, function: str) -> None:
    if not isinstance(model, keras.Sequential) and not _rebuild.is_functional(
        model
    ):
        raise ValueError(
            f"`{function}` cannot rebuild a subclassed model: its layers "
            "are wired in Python code, not in a graph it can clone. Pass "
            "in_place=True to recompute its layers in place, or wrap the "
            "blocks yourself with `keras_mgpu.RecomputeGrad(block)` inside "
            "the model. Received: "
            f"model={model.name!r} (of type {type(model).__name__})"
        )


def _check_class_kept(model: Any, new_model: Any, function: str) -> None:
    if type(new_model) is not type(model):
        raise ValueError(
            f"`{function}` would rebuild model {model.name!r} as a plain "
            f"{type(new_model).__name__}, losing its class "
            f"{type(model).__name__} (its config, presets and task models "
            "built on it). Pass in_place=True to recompute its layers "
            f"without rebuilding it. Received: model={model.name!r} (of "
            f"type {type(model).__name__})"
        )


def _matcher(
    layers: LayerSelector,
    known: set,
    owner: str,
    nested: set = frozenset(),
    members: set = frozenset(),
) -> Callable[[Any], bool]:
    """Turn the `layers` argument into a predicate over layers (`known`:
    names of the layers that can be chosen; `members`: their ids, against
    which layer instances are checked)."""
    if layers is None:
        return lambda layer: True
    if isinstance(layers, (str, type)) or (
        callable(layers) and not isinstance(layers, Iterable)
    ):
        items = [layers]
    elif isinstance(layers, Iterable):
        items = list(layers)
    else:
        raise TypeError(
            "Argument `layers` must be None, a layer name, a layer class, a "
            "predicate `fn(layer) -> bool`, or a list of those or of layers. "
            "Received: "
            f"layers={layers!r} (of type {type(layers).__name__})"
        )
    names, classes, predicates, instances = set(), [], [], set()
    for item in items:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, keras.layers.Layer):
            # A layer is callable: without this it would be taken for a
            # predicate and called on every layer of the model.
            if id(item) not in members:
                twin = (
                    " (its layer of that name is another object)"
                    if item.name in known | nested
                    else ""
                )
                raise ValueError(
                    f"Argument `layers` holds layer {item.name!r}, which "
                    f"model {owner!r} does not have{twin}. Pass the "
                    "model's own layers, or their names. Received: "
                    f"layers={layers!r}"
                )
            instances.add(id(item))
        elif isinstance(item, type) and issubclass(item, keras.layers.Layer):
            classes.append(item)
        elif callable(item) and not isinstance(item, type):
            predicates.append(item)
        else:
            raise TypeError(
                "Argument `layers` must hold layers, layer names, Keras "
                "layer classes or predicates `fn(layer) -> bool`. Received: "
                f"layers={layers!r} with item {item!r}"
            )
    unknown = sorted(names - known)
    if unknown:
        listed = sorted(known)
        more = f" and {len(listed) - 40} more" if len(listed) > 40 else ""
        hint = ""
        if set(unknown) <= nested:
            hint = (
                " They are nested inside sub-models; the rebuild only "
                "reaches the model's own layers: pass in_place=True."
            )
        raise ValueError(
            f"Argument `layers` names layers that model {owner!r} does "
            f"not have: {unknown}. Its layers are: {listed[:40]}{more}."
            f"{hint} Received: layers={layers!r}"
        )

    def match(layer: Any) -> bool:
        return (
            layer.name in names
            or id(layer) in instances
            or any(isinstance(layer, c) for c in classes)
            or any(bool(p(layer)) for p in predicates)
        )

    return match


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def apply_recompute(
    model: Any,
    layers: LayerSelector = None,
    *,
    policy: str = "per_layer",
    in_place: bool = True,
    group_by: Callable[[Any], Hashable] | None = None,
    offload: bool = False,
) -> Any:
    """Recompute the activations of chosen layers of `model` in backprop.

    With `in_place=True` (the default since 0.2), the chosen layers (anywhere in
    the layer tree: inside nested functional models, keras-hub backbones,
    subclassed models' attributes) are switched to recompute in the backward
    pass and `model` itself is returned: its class, config, weights, seed
    states, `.keras` file and keras-hub presets stay those of the plain model
    (the switch is not saved; apply it again after loading). The outermost
    matching layers are chosen; layers already recomputed are kept as they are.
    The model's traced train/test/predict functions are dropped so the next
    `fit` traces the switch. Forward outputs and gradients are bit-identical to
    the plain model's eagerly and in `tf.function`, dropout included (seed
    states are replayed).

    Backends: on TensorFlow (and tf_keras) a recomputed layer or segment
    runs under `tf.custom_gradient`, in the replica context of a
    `tf.distribute` strategy (each replica recomputes its own slice). On
    Keras 3's JAX backend it runs under `jax.checkpoint`, as a pure function
    of its inputs, its layers' variable values and seed states: the
    backward pass keeps the segment's inputs only and replays the traced
    forward (same dropout masks); state updates (seed states,
    BatchNormalization statistics) and losses added inside are applied
    once, outside the checkpoint. Gradients equal the plain model's in
    `fit`, in a custom loop (`jax.grad` of `model.stateless_call`) and
    under `keras.distribution.DataParallel` and `ModelParallel` (the jitted
    step is the global program; variables keep their layouts; the
    recompute communicates nothing).
    Unlike `keras.RematScope`, which rematerializes each layer alone (each
    layer's input is kept anyway) and fails with Dropout on JAX, segments
    (`policy="sqrt"`, `"min_memory"`) keep only their boundaries. Layers
    built under a `keras.RematScope` are taken over: while switched, Keras's
    own remat of them is off (it would wrap the switched call a second
    time), so they are recomputed once, with the plain gradients;
    `strip_recompute` gives the scope's mode back. Other backends are
    refused.

    With `in_place=False` (the default of 0.1), a Sequential or
    functional `model` is rebuilt with its own chosen layers wrapped in
    `RecomputeGrad` and the rebuilt model is returned (the original is left
    untouched; compile it before training). Only the model's top-level
    layers can be chosen; a subclassed model, or one whose class the rebuild
    would lose (a keras-hub backbone), is refused, pointing to
    `in_place=True`.

    Policies:
    - `"per_layer"`: each chosen layer (a block: a transformer layer, a
      `Sequential` or functional sub-model) is recomputed on its own; its
      inputs are stored, the activations inside it are not. With `group_by`
      (in place, Keras 3), chosen layers of one functional graph that run
      one after another and have the same key are recomputed as one unit:
      the residual blocks or stages of a flat model such as
      `keras.applications.ResNet50`.
    - `"sqrt"`: consecutive units (chosen layers, or `group_by` groups) are
      grouped into segments of `ceil(sqrt(n))` and each segment is
      recomputed as one unit: only segment boundaries are stored and one
      segment is recomputed at a time (Chen et al., 2016). Rebuild: the
      model must be a single-input chain; segments become `Sequential`
      blocks named `recompute_segment_<k>`. In place (Keras 3): within any
      functional graph of the tree, side inputs allowed (a decoder stack fed
      a padding mask); n counts the units of that graph.
    - `"min_memory"` (in place, Keras 3): as `"sqrt"`, but the segments are
      sized so that the activations stored at any point of the backward
      pass (the boundaries below a segment and the segment's own, estimated
      per sample from the graph's shapes) are fewest: they shrink towards
      the output, k, k-1, ... units for n equal units (k(k+1)/2 >= n), which
      stores about sqrt(2n) activations where `"sqrt"` stores about
      2 sqrt(n), for the same one extra forward. On a chain of 32 Dense
      layers: segments of 8, 7, 6, 5, 4 and 2 layers, 9 activations stored
      at the peak against sqrt's 11 (`keras_mgpu.layers.min_memory_segments`).
    - `"selective"` (in place, Keras 3; tf_keras is refused): inside each
      chosen layer the outputs of matrix products (Dense, EinsumDense,
      convolutions) are kept and only the cheap, large parts are
      recomputed, each from its own input (Korthikanti et al., 2022): the
      attention core (`_compute_attention` of `MultiHeadAttention` and of
      keras-hub's attention layers: scores, masking, softmax, attention
      dropout, product with the values), softmax and activation layers,
      and the activation of a Dense / EinsumDense (its product kept); on
      JAX also normalization layers. Dropout masks outside the attention
      core are kept. Each part is one `jax.checkpoint` (JAX) or
      `tf.custom_gradient` (TensorFlow) region. Gradients equal the plain
      model's to float rounding, dropout masks replayed. Measured on
      keras-hub GPT-2 / Llama, hidden 1024, sequence 512 (CPU): about
      0.25-0.5x of plain's activations at about plain's step time
      (docs/guides/recompute-selective.md).
      `keras_mgpu.apply_recompute(backbone,
      keras_hub.layers.TransformerDecoder, policy="selective")`.

    Args:
        model: a `keras.Model`. `in_place=False`: Sequential or functional.
        layers: which layers to choose (default None: every layer but
            the inputs; the outermost are chosen, so that is the model's top
            level, unless `group_by` maps a layer to None, in which case its
            sublayers are searched: nested functional or Sequential models,
            keras-hub backbones, the stages of a placed model). A layer
            name, a layer class (matched with `isinstance`), a predicate
            `fn(layer) -> bool`, or a list mixing those and layers of the
            model (a layer is chosen when any item matches). In place,
            names may be those of nested layers; the rebuild only reaches
            the model's own layers.
        policy: str, `"per_layer"` (default), `"sqrt"`, `"min_memory"`
            or `"selective"` (the last two in place only).
        in_place: bool, default True. Switch the layers of `model` itself
            (False: return a rebuilt model).
        group_by: optional `fn(layer) -> key` (in place only). Chosen layers
            with a key other than None are grouped as described above;
            layers it maps to None are not chosen (with `layers=None`,
            their sublayers are searched instead).
        offload: bool, default False. Keras 3 on JAX, in place: what each
            recomputed unit keeps for the backward pass (its input
            activations: a layer's or segment's inputs, with `"selective"`
            the inputs of each recomputed part) is kept in pinned host
            memory instead of on the device, moved there in the forward
            pass and back just before the unit is replayed (JAX's
            `save_and_offload_only_these_names` remat policy). The device
            then holds the weights, the optimizer state and one unit's
            activations at a time; the price is two host transfers of
            each kept activation per step, which a GPU overlaps with
            compute. Gradients are those of the plain model (dropout
            replayed). Combines with every policy. TensorFlow has no
            memory spaces in a traced step: refused there.

    Returns:
        `model` itself (`in_place=True`) or a new model of the same class.

    Example:

    ```python
    import keras_hub
    backbone = keras_hub.models.BertBackbone(...)       # or .from_preset
    classifier = build_classifier(backbone)            # a user model
    keras_mgpu.apply_recompute(
        classifier, keras_hub.layers.TransformerEncoder, in_place=True
    )
    classifier.compile("adam", "sparse_categorical_crossentropy")
    keras_mgpu.strip_recompute(classifier)              # back to plain

    resnet = keras.applications.ResNet50(weights=None)
    keras_mgpu.apply_recompute(                          # per stage
        resnet, in_place=True, group_by=lambda l: l.name.split("_")[0]
    )
    ```
    """
    _check_model(model, "apply_recompute")
    policy = check_choice(policy, "policy", POLICIES)
    if not isinstance(in_place, bool):
        raise TypeError(
            "Argument `in_place` must be a bool. Received: "
            f"in_place={in_place!r} (of type {type(in_place).__name__})"
        )
    if group_by is not None and not callable(group_by):
        raise TypeError(
            "Argument `group_by` must be None or a function `fn(layer) -> "
            f"key`. Received: group_by={group_by!r} (of type "
            f"{type(group_by).__name__})"
        )
    if policy == "min_memory" and not in_place:
        raise ValueError(
            "policy='min_memory' sizes its segments from the model's "
            "functional graph and recomputes them in place; pass "
            "in_place=True (the default), or policy='sqrt' to rebuild. "
            f"Received: policy='min_memory', in_place={in_place!r}"
        )
    if policy == "selective":
        _check_selective(model, in_place, group_by)
    _check_offload(offload, in_place)
    if group_by is not None and not in_place:
        raise ValueError(
            "Argument `group_by` groups layers of a functional graph in "
            "place; pass in_place=True. Received: group_by="
            f"{group_by!r}, in_place=False"
        )
    if in_place:
        return _apply_in_place(model, layers, policy, group_by, offload)
    return _apply_rebuild(model, layers, policy)


def _check_offload(offload: Any, in_place: bool) -> None:
    if not isinstance(offload, bool):
        raise TypeError(
            "Argument `offload` must be a bool. Received: "
            f"offload={offload!r} (of type {type(offload).__name__})"
        )
    if not offload:
        return
    if TF_RUNS:
        raise ValueError(
            "offload=True keeps recomputed units' inputs in host memory "
            "inside a jitted JAX step (memory spaces); TensorFlow's traced "
            "step has none. On TensorFlow use policy='sqrt' or "
            "'min_memory' (fewer kept activations) or a smaller batch with "
            "GradientAccumulationOptimizer. Received: offload=True with "
            f"backend {keras.backend.backend()!r}"
        )
    if not in_place:
        raise ValueError(
            "offload=True switches the chosen layers in place; pass "
            "in_place=True (the default). Received: offload=True, "
            f"in_place={in_place!r}"
        )


def _check_selective(model: Any, in_place: bool, group_by: Any) -> None:
    if not in_place:
        raise ValueError(
            "policy='selective' switches the parts inside the chosen "
            "layers in place; pass in_place=True (the default). Received: "
            f"policy='selective', in_place={in_place!r}"
        )
    if group_by is not None:
        raise ValueError(
            "policy='selective' recomputes inside each chosen layer; it "
            "does not group layers. Drop `group_by`, or use policy='sqrt' "
            f"or 'min_memory' with it. Received: policy='selective', "
            f"group_by={group_by!r}"
        )
    if IS_TF_KERAS:
        raise ValueError(
            "policy='selective' needs Keras 3 (on TensorFlow or JAX): "
            "under tf_keras the dropout masks of the parts it recomputes "
            "cannot be replayed. Use policy='per_layer' (blocks without "
            "Dropout) or Keras 3. Received: policy='selective' on tf_keras "
            f"model {model.name!r}"
        )


def _apply_in_place(
    model: Any,
    layers: LayerSelector,
    policy: str,
    group_by: Callable | None,
    offload: bool,
) -> Any:
    known = {layer.name for layer in _walk(model)}
    # layers=None matches every layer; the outermost are chosen, so without
    # `group_by` that is the top level, and with it the search goes down
    # into every sub-model whose own key is None (the blocks of a backbone
    # inside a classifier, the stages of a placed model).
    members = {id(layer) for layer in _walk(model)}
    match = _matcher(layers, known, model.name, members=members)
    if group_by is not None:
        selected = match
        match = lambda layer: selected(layer) and group_by(layer) is not None  # noqa: E731
    chosen = _choose_in_place(model, match)
    if not chosen:
        raise ValueError(
            f"No layer of model {model.name!r} matched argument `layers` "
            "anywhere in its layer tree, nested models included (input "
            "layers, RecomputeGrad wrappers, layers already recomputed in "
            "place and layers `group_by` maps to None are never chosen). "
            f"Received: layers={layers!r}, group_by={group_by!r}"
        )
    for layer in chosen:
        check_replayable(
            layer,
            f"Layer {layer.name!r}, chosen by argument `layers`,",
            f"layers={layers!r}",
        )
    for layer in chosen:
        # A chosen block recomputes everything inside it.
        _restore_in_place(layer)
    if policy == "selective":
        for layer in chosen:
            recompute_selective(layer)
    else:
        _switch_chosen(model, chosen, policy, group_by)
    for layer in chosen:
        # Read by each switched call inside the layer's tree: set after
        # switching (a segment's switch restores its members first).
        set_offload(layer, offload)
    reset_compiled_functions(model)
    return model


def _switch_chosen(
    model: Any, chosen: list, policy: str, group_by: Callable | None
) -> None:
    placed: set = set()
    if policy != "per_layer" or group_by is not None:
        placed = _apply_segments(model, chosen, policy, group_by)
    for layer in chosen:
        if id(layer) not in placed:
            recompute_layer_in_place(layer)


def _apply_segments(
    model: Any, chosen: list, policy: str, group_by: Callable | None
) -> set:
    """Plan the recomputed segments of every functional graph of the tree;
    the ids of the layers placed in a segment."""
    if IS_TF_KERAS:
        raise ValueError(
            "Segments (policy='sqrt', policy='min_memory' or `group_by`) "
            "with in_place=True run in a Keras 3 functional graph; under "
            "tf_keras use in_place=False with policy='sqrt' (a sequential "
            "stack) or policy='per_layer' without `group_by`. Received: "
            f"policy={policy!r}, "
            f"group_by={group_by!r}, in_place=True"
        )
    key = group_by if group_by is not None else id
    placed: set = set()
    found = False
    for graph in _graphs(model):
        members = {id(op) for op in graph.operations}
        here = [
            layer
            for layer in chosen
            if id(layer) in members and id(layer) not in placed
        ]
        units = units_of(graph, here, key)
        found = found or bool(units)
        if policy == "sqrt":
            units = sqrt_segments(graph, units)
        elif policy == "min_memory":
            units = min_memory_segments(graph, units)
        segments = [unit for unit in units if len(unit) > 1]
        if segments:
            recompute_segments_in_place(graph, segments)
            placed.update(id(node.operation) for s in segments for node in s)
    # min_memory may plan one unit per segment (units that hold much more
    # than they hand on, transformer layers): those are recomputed per
    # layer, which is its plan, not a failure to find a run.
    nothing = not found if policy == "min_memory" else not placed
    if policy != "per_layer" and nothing:
        raise ValueError(
            f"policy={policy!r} found no run of chosen layers in model "
            f"{model.name!r} to group: segments need layers of a functional "
            "graph, each called once, running one after another (layers "
            "called from a subclassed model's Python code are not). Use "
            f"policy='per_layer'. Received: policy={policy!r}"
        )
    return placed


def _check_not_placed(model: Any) -> None:
    """A rebuild would wrap placed layers (and a pipelined model's
    micro-batch split, stages and concatenation) in `RecomputeGrad`."""
    if IS_TF_KERAS:
        return  # Placement is Keras 3 only.
    if any(is_placed(layer) for layer in _walk(model)):
        raise ValueError(
            f"Model {model.name!r} is placed (`apply_placement`); a rebuild "
            "would wrap its placed layers, and a pipelined model's "
            "micro-batch split and stages, in RecomputeGrad. Pass "
            "in_place=True (its layers are recomputed on their devices), or "
            "call `apply_recompute` before `apply_placement`. Received: "
            "in_place=False"
        )


def _apply_rebuild(model: Any, layers: LayerSelector, policy: str) -> Any:
    _check_rebuildable(model, "apply_recompute")
    _check_not_placed(model)
    switched = [
        layer for layer in _walk(model) if is_recomputed_in_place(layer)
    ]
    if switched:
        raise ValueError(
            f"Model {model.name!r} has layers recomputed in place "
            f"({', '.join(repr(layer.name) for layer in switched[:5])}); a "
            "rebuild would drop those switches. Call "
            "`strip_recompute(model)` first, or pass in_place=True. "
            "Received: in_place=False"
        )
    known = {layer.name for layer in model.layers}
    nested = {layer.name for layer in _walk(model)}
    match = _matcher(
        layers,
        known,
        model.name,
        nested,
        members={id(layer) for layer in _walk(model)},
    )

    def chosen(layer: Any) -> bool:
        return (
            not _rebuild.is_input_layer(layer)
            and not isinstance(layer, RecomputeGrad)
            and match(layer)
        )

    if not any(chosen(layer) for layer in model.layers):
        nested = _choose_in_place(model, match) if layers is not None else []
        hint = ""
        if nested:
            names = ", ".join(repr(layer.name) for layer in nested[:3])
            hint = (
                f" {len(nested)} layers nested inside sub-models match "
                f"({names}{', ...' if len(nested) > 3 else ''}); the rebuild "
                "only reaches the model's own layers: pass in_place=True."
            )
        raise ValueError(
            f"No layer of model {model.name!r} matched argument `layers` "
            "(input layers and layers already wrapped in RecomputeGrad are "
            f"never chosen).{hint} Received: layers={layers!r}"
        )
    if policy == "per_layer":
        new_model = _rebuild.rebuild_per_layer(model, chosen)
    else:
        new_model = _rebuild.rebuild_sqrt(model, chosen)
    _check_class_kept(model, new_model, "apply_recompute")
    return new_model


def _restore_in_place(root: Any) -> bool:
    """Switch every in-place recompute under and at `root` back."""
    restored = False
    for layer in [root, *_walk(root)]:
        restored = restore_layer(layer) or restored
        graph = graph_of(layer)
        if graph is not None and restore_graph(graph):
            restored = True
    return restored


def _carry_segments(source: Any, target: Any, what: str) -> None:
    """Plan in graph `target` the segments planned in graph `source`, node
    for node, matched by operation name (a copy made from the config, or
    a placed copy whose `PlacedLayer`s carry the wrapped layers' names)."""
    plan = segment_plan_nodes(source)
    if not plan:
        return
    by_name: dict = {}
    for node in execution_order(target):
        by_name.setdefault(node.operation.name, []).append(node)
    position = {id(node): i for i, node in enumerate(execution_order(target))}
    segments = []
    for nodes in plan:
        names = [node.operation.name for node in nodes]
        mapped = [by_name.get(name, []) for name in names]
        if any(len(found) != 1 for found in mapped):
            raise ValueError(
                f"{what}: the recomputed segment {names[:4]}... of "
                f"{source.name!r} has no single counterpart in the copy "
                f"{target.name!r}. Call `keras_mgpu.strip_recompute` first "
                "and apply it again to the result."
            )
        copy = [found[0] for found in mapped]
        spots = [position[id(node)] for node in copy]
        if spots != list(range(spots[0], spots[0] + len(spots))):
            raise ValueError(  # pragma: no cover - clone keeps node order
                f"{what}: the recomputed segment {names[:4]}... of "
                f"{source.name!r} is not consecutive in the copy "
                f"{target.name!r}. Call `keras_mgpu.strip_recompute` first "
                "and apply it again to the result."
            )
        segments.append(copy)
    recompute_segments_in_place(target, segments)


def carry_recompute(
    pairs: Iterable[tuple[Any, Any]], graphs: tuple[Any, Any] | None, what: str
) -> None:
    """Switch in a copy of a model what `apply_recompute(..., in_place=True)`
    switched in the original (placement rebuilds models from their
    configs, which carry none of it).

    Args:
        pairs: (original layer, its copy made from the original's config):
            switches anywhere under the original are carried to the layer
            at the same place under the copy (the two trees match).
        graphs: (original top-level graph, copy's top-level graph), whose
            segments are carried node by node (matched by name), or None.
        what: the operation, for errors.
    """
    for source, copy in pairs:
        sources, copies = [source, *_walk(source)], [copy, *_walk(copy)]
        names = [layer.name for layer in sources]
        if names != [layer.name for layer in copies]:
            raise ValueError(  # pragma: no cover - from_config keeps them
                f"{what}: the copy of layer {source.name!r} has other "
                "sublayers than the original; its recompute switches cannot "
                "be carried over. Call `keras_mgpu.strip_recompute` first and "
                "apply it again to the result."
            )
        for original, twin in zip(sources, copies, strict=True):
            if is_switched_per_layer(original):
                recompute_layer_in_place(twin)
            elif is_selective(original):
                recompute_selective(twin)
            graph, twin_graph = graph_of(original), graph_of(twin)
            if graph is not None and twin_graph is not None:
                _carry_segments(graph, twin_graph, what)
    if graphs is not None and graphs[0] is not None and graphs[1] is not None:
        _carry_segments(graphs[0], graphs[1], what)


def strip_recompute(model: Any) -> Any:
    """Undo `apply_recompute`.

    Layers recomputed in place (anywhere in the tree) are switched back and
    `model` itself is returned. `RecomputeGrad` wrappers, which only a
    rebuild can remove, are unwrapped in a rebuilt clone of a Sequential or
    functional model (segments made by `policy="sqrt"` are inlined back,
    weights carried over; compile it before training), which is returned.

    Args:
        model: a `keras.Model`.

    Returns:
        `model` (nothing to rebuild) or a rebuilt model of the same class
        without `RecomputeGrad` wrappers.

    Example:

    ```python
    plain = keras_mgpu.strip_recompute(remat_model)
    ```
    """
    _check_model(model, "strip_recompute")
    if _restore_in_place(model):
        reset_compiled_functions(model)
        if not any(isinstance(layer, RecomputeGrad) for layer in _walk(model)):
            return model
    _check_rebuildable(model, "strip_recompute")
    new_model = _rebuild.rebuild_stripped(model)
    _check_class_kept(model, new_model, "strip_recompute")
    return new_model


def recomputed_layers(model: Any) -> list:
    """The layers of `model` whose activations are recomputed in backprop.

    Layers wrapped in `RecomputeGrad` and layers recomputed in place, in
    layer-tree order; members of a segment (`policy="sqrt"` or
    `"min_memory"`, `group_by`) included.

    Args:
        model: a Keras layer or model.

    Returns:
        A list of layers.

    Example:

    ```python
    keras_mgpu.apply_recompute(model, MyBlock, in_place=True)
    assert len(keras_mgpu.recomputed_layers(model)) == 12
    ```
    """
    check_flavour(model, "model")
    found = []
    for layer in _walk(model):
        if isinstance(layer, RecomputeGrad):
            found.append(layer.layer)
        elif is_recomputed_in_place(layer):
            found.append(layer)
    return found


__all__ = ["apply_recompute", "recomputed_layers", "strip_recompute"]
