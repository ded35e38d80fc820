"""Saving and loading block-sparse models: safetensors files that record which layers are block-sparse,
loaded into a model skeleton without ever materialising its dense weights.

``save_sparse(model, path)`` writes ``model.state_dict()`` (a :class:`~bsrkit.nn.BSRLinear` holds
``values``, ``crow_indices``, ``col_indices`` and ``bias``) with, in the header's metadata under the key
``"bsrkit"``, a JSON record of each ``BSRLinear`` (fqn, features, blocksize, nnz, bias) and of the tied
names (a parameter shared by two modules, such as a language model's output head tied to its embedding,
is written once, as safetensors requires, and re-tied on load).

``load_sparse(model_or_factory, path)`` builds the model with its parameters on the ``meta`` device (no
memory, no initialisation; buffers are built for real, so non-persistent ones such as rotary
frequencies hold their computed values), swaps each recorded layer for a ``BSRLinear`` of the recorded
nnz, then reads the file's tensors one at a time and assigns them. Memory grows by the checkpoint's size
plus one tensor at a time; no dense weight of a block-sparse layer exists at any point.

A plain ``model.state_dict()`` round-trips as well: ``torch.save`` it, and ``load_state_dict`` into a
model sparsified with the same layers (``BSRLinear`` takes a checkpoint of another pattern or nnz).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from bsrkit.nn import BSRLinear
from bsrkit.places import module_places, put
from bsrkit.validation import SUPPORTED_DTYPES, check_data_device, check_floating_dtype, type_name

__all__ = ["load_sparse", "parameters_on_meta", "read_sparse_metadata", "save_sparse"]

METADATA_KEY = "bsrkit"
FORMAT = 1


def _linear_features(module: nn.Module) -> tuple[int, int] | None:
    """``(out_features, in_features)`` of an ``nn.Linear``, a ``BSRLinear`` or transformers' ``Conv1D``
    (weight ``(in, out)``); None for any other module."""
    if isinstance(module, (nn.Linear, BSRLinear)):
        return module.out_features, module.in_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(weight, torch.Tensor):
        return int(weight.shape[1]), int(weight.shape[0])
    return None


def _tensors_to_write(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to write, each once, and ``{dropped name: kept name}`` for the names that alias another
    entry exactly (tied parameters). A tensor sharing memory with another kept one in any other way is
    copied (safetensors refuses overlapping entries); a non-contiguous one is packed."""
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[str, int]] = set()
    for name, tensor in state.items():
        t = tensor.detach()
        if t.layout != torch.strided:
            raise ValueError(
                f"save_sparse(): expected strided tensors in the state_dict, got {name!r} {t.layout}"
            )
        # (an empty tensor has no address of its own: one on an empty storage of its own is named by that
        # storage object, so tied layers with no stored block are tied as well; an empty slice of a buffer
        # names nothing)
        own = t.untyped_storage()
        where = t.data_ptr() if t.numel() else ("storage", own._cdata) if not own.nbytes() else None
        if where is None:
            kept[name] = t.contiguous()
            continue
        alias = (t.device, t.dtype, where, tuple(t.shape), t.stride())
        if alias in seen:
            tied[name] = seen[alias]
            continue
        storage = (str(t.device), own.data_ptr())
        if t.numel() and storage in storages:
            t = t.clone(memory_format=torch.contiguous_format)
        elif not t.is_contiguous():
            t = t.contiguous()
        seen[alias] = name
        if t.numel():
            storages.add((str(t.device), t.untyped_storage().data_ptr()))
        kept[name] = t
    return kept, tied


def save_sparse(
    model: nn.Module, path: str | os.PathLike[str], *, metadata: dict[str, str] | None = None
) -> None:
    """Write ``model.state_dict()`` to the safetensors file ``path``, recording every
    :class:`~bsrkit.nn.BSRLinear` (fqn, features, blocksize, nnz, bias) and every tied parameter in the
    header's metadata (key ``"bsrkit"``, JSON), so that :func:`load_sparse` can rebuild the model.
    ``metadata`` adds string entries of your own (the key ``"bsrkit"`` is reserved)."""
    from safetensors.torch import save_file

    if not isinstance(model, nn.Module):
        raise TypeError(f"save_sparse(): expected model to be an nn.Module, got {type_name(model)}")
    if isinstance(model, BSRLinear):
        raise ValueError(
            "save_sparse(): expected a model holding BSRLinear layers, got a BSRLinear itself (load_sparse "
            "swaps layers inside a model): save the model that holds it, or the layer's state_dict with "
            "torch.save"
        )
    for reserved, why in ((METADATA_KEY, "bsrkit's record"), ("format", "safetensors' framework, 'pt'")):
        if metadata is not None and reserved in metadata:  # (it would be overwritten, silently)
            raise ValueError(f"save_sparse(): the metadata key {reserved!r} is reserved for {why}")
    layers = {
        fqn: {
            "in_features": m.in_features,
            "out_features": m.out_features,
            "blocksize": list(m.blocksize),
            "nnz": int(m.values.shape[0]),
            "bias": m.bias is not None,
        }
        for fqn, m in model.named_modules()
        if isinstance(m, BSRLinear)
    }
    state = model.state_dict()
    others = [n for n, t in state.items() if not isinstance(t, torch.Tensor)]
    if others:  # (a module's get_extra_state)
        raise ValueError(
            f"save_sparse(): expected only tensors in the state_dict (safetensors stores tensors), got "
            f"{_some(others)} of types {sorted({type(state[n]).__name__ for n in others})}: save it with "
            "torch.save"
        )
    meta_names = [n for n, t in state.items() if t.device.type == "meta"]
    if meta_names:
        raise ValueError(
            f"save_sparse(): expected tensors with data, got {meta_names[:5]} on the meta device"
        )
    tensors, tied = _tensors_to_write(state)
    # The dtypes of the floating buffers the file does not hold (non-persistent): the model computes them
    # again when built, in its factory's dtype; load_sparse gives them the dtype they had here (a model
    # converted with .half() before saving).
    floating = {
        f"{fqn}.{n}" if fqn else n: str(b.dtype).removeprefix("torch.")
        for fqn, module in model.named_modules()
        for n, b in module._buffers.items()
        if b is not None and b.is_floating_point() and n in module._non_persistent_buffers_set
    }
    record = {"format": FORMAT, "layers": layers, "tied": tied, "buffer_dtypes": floating}
    if os.path.isdir(path):  # (safetensors' own error named no path)
        raise ValueError(
            f"save_sparse(): expected path to name a file, got the directory {os.fspath(path)!r}"
        )
    save_file(
        tensors,
        os.fspath(path),
        metadata={**(metadata or {}), "format": "pt", METADATA_KEY: json.dumps(record)},
    )


def read_sparse_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The record :func:`save_sparse` wrote in ``path``'s header: ``{"format": 1, "layers": {fqn: {...}},
    "tied": {name: kept name}}``. Raises ``ValueError`` for a file that is not a safetensors file or that
    bsrkit did not write, ``FileNotFoundError`` (as ``open`` and ``torch.load``) for a path naming nothing."""
    return _read_record(path, "read_sparse_metadata")


def _read_record(path: str | os.PathLike[str], op: str) -> dict[str, Any]:
    """:func:`read_sparse_metadata`, its errors naming ``op``."""
    from safetensors import SafetensorError, safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{op}(): expected path to name a file, got {os.fspath(path)!r}: no such file"
        )
    if os.path.isdir(path):  # (safetensors' reason: "No such device")
        raise ValueError(
            f"{op}(): expected path to be a safetensors file, got the directory {os.fspath(path)!r}"
        )
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            header = f.metadata() or {}
    except (SafetensorError, OSError) as exc:  # (OSError: a directory, an unreadable file)
        raise ValueError(
            f"{op}(): expected path to be a safetensors file, got {os.fspath(path)!r}: {exc}"
        ) from exc
    text = header.get(METADATA_KEY)
    if text is None:
        raise ValueError(
            f"{op}(): expected a bsrkit checkpoint (written by save_sparse, with {METADATA_KEY!r} in "
            f"its metadata), got a safetensors file with metadata keys {sorted(header)} at "
            f"{os.fspath(path)!r}"
        )
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{op}(): malformed {METADATA_KEY!r} metadata in {os.fspath(path)!r}: {exc}"
        ) from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        got = record.get("format") if isinstance(record, dict) else record
        raise ValueError(f"{op}(): expected bsrkit checkpoint format {FORMAT}, got {got!r}")
    malformed = f"{op}(): malformed {METADATA_KEY!r} metadata in {os.fspath(path)!r}:"
    layers = record.get("layers")
    for fqn, spec in layers.items() if isinstance(layers, dict) else [("layers", layers)]:
        lacking = sorted(_LAYER_KEYS - set(spec)) if isinstance(spec, dict) else sorted(_LAYER_KEYS)
        if lacking:
            raise ValueError(f"{malformed} layer {fqn!r} lacks {lacking}")
        assert isinstance(spec, dict)
        wrong = [key for key, ok in _LAYER_CHECKS.items() if not ok(spec[key])]
        if wrong:
            raise ValueError(f"{malformed} layer {fqn!r} has malformed {wrong}: {[spec[k] for k in wrong]}")
    for key in ("tied", "buffer_dtypes"):  # (names to names; buffer_dtypes: absent from older files)
        entries = record.setdefault(key, {}) if key == "buffer_dtypes" else record.get(key)
        if not (isinstance(entries, dict) and all(isinstance(v, str) for v in entries.values())):
            raise ValueError(f"{malformed} expected {key!r} to map names to names, got {entries!r}")
    for name, dtype in record["buffer_dtypes"].items():
        found = getattr(torch, dtype, None)  # (save_sparse records floating buffers only)
        if not (isinstance(found, torch.dtype) and found.is_floating_point):
            raise ValueError(f"{malformed} buffer {name!r} has no floating dtype {dtype!r}")
    return record


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# What save_sparse records of each layer, and what each must be.
_LAYER_CHECKS: dict[str, Callable[[Any], bool]] = {
    "in_features": _is_count,
    "out_features": _is_count,
    "blocksize": lambda v: isinstance(v, list) and len(v) == 2 and all(_is_count(b) and b for b in v),
    "nnz": _is_count,
    "bias": lambda v: isinstance(v, bool),
}
_LAYER_KEYS = frozenset(_LAYER_CHECKS)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within this context every parameter a module registers goes to the ``meta`` device (no memory, and
    ``reset_parameters`` then writes nothing); buffers are built as usual, so computed non-persistent ones
    (rotary frequencies) hold real values. As accelerate's ``init_empty_weights(include_buffers=False)``,
    it patches ``nn.Module.register_parameter`` for the duration, in every thread."""
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        kept = self._parameters[name]
        if kept is not None and kept.device.type != "meta":
            moved = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)
            moved.__dict__.update(kept.__dict__)
            self._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _swap_layers(model: nn.Module, layers: dict[str, dict[str, Any]]) -> None:
    """Replace each recorded layer of ``model`` by a ``BSRLinear`` of the recorded nnz on ``meta`` (all
    checked first: a model that does not match is left as it was)."""
    swaps: list[tuple[list[str], BSRLinear]] = []
    places = module_places(model)
    for fqn, spec in layers.items():
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise ValueError(
                f"load_sparse(): the checkpoint's block-sparse layer {fqn!r} is not in the model"
            ) from None
        features = _linear_features(module)
        want = (spec["out_features"], spec["in_features"])
        if features is None:
            raise ValueError(
                f"load_sparse(): expected the model's {fqn!r} to be a linear layer (nn.Linear, Conv1D or "
                f"BSRLinear) as in the checkpoint, got {type(module).__name__}"
            )
        if features != want:
            raise ValueError(
                f"load_sparse(): expected the model's {fqn!r} to have (out, in) features {want} as in the "
                f"checkpoint, got {features}"
            )
        weight = module.values if isinstance(module, BSRLinear) else module.weight
        dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
        bo, bi = spec["blocksize"]
        if want[0] % bo or want[1] % bi:
            raise ValueError(
                f"load_sparse(): the checkpoint's layer {fqn!r} records blocksize {(bo, bi)}, which does not "
                f"divide its (out, in) features {want}"
            )
        layer = BSRLinear(
            spec["in_features"],
            spec["out_features"],
            (bo, bi),
            bias=spec["bias"],
            density=0.0,
            device="meta",
            dtype=dtype,
        )
        layer.values = nn.Parameter(layer.values.new_empty((spec["nnz"], bo, bi)))
        layer.col_indices = layer.col_indices.new_empty(spec["nnz"])
        layer.train(module.training)  # (a model built in eval mode serves in eval mode)
        # (a module used at several places is one layer at all of them, as sparsify_ made it)
        swaps.append((places[id(module)][1] if id(module) in places else [fqn], layer))
    for fqns, layer in swaps:
        put(model, fqns, layer)


def _materialise_buffers(model: nn.Module, device: torch.device, loaded: set[str]) -> None:
    """Give real values to non-persistent buffers left on ``meta`` (a model passed in built on ``meta``;
    ``loaded``: the names the file will fill): a transformers model recomputes them through its
    ``_init_weights`` (as ``from_pretrained`` does) on modules whose own parameters are all on meta
    (rotary embeddings: none; Gemma's scaled embedding: its weight); anything else left on meta is an
    error. Runs before the file's tensors are assigned, while the parameters are still on meta: an
    ``_init_weights`` that also writes a child's weights (GPT-2's attention module) writes nothing there,
    never over a loaded weight."""
    init = getattr(model, "_init_weights", None)
    for fqn, module in model.named_modules():
        names = [
            n for n, b in module._buffers.items()
            if b is not None and b.device.type == "meta" and (f"{fqn}.{n}" if fqn else n) not in loaded
        ]  # fmt: skip
        if not names:
            continue
        # (weights on meta take any write, never over a loaded one; an init that cannot run there
        # computed nothing, and the error below names the buffers)
        failure: Exception | None = None
        if callable(init) and all(p.device.type == "meta" for p in module.parameters(recurse=False)):
            try:
                names = _computed_by_init(init, module, names, device)
            except Exception as exc:  # (named below, and chained as the cause)
                failure = exc
        if names:
            why = "did not compute them" if failure is None else f"raised {type(failure).__name__}: {failure}"
            raise ValueError(
                f"load_sparse(): the model's buffers {[f'{fqn}.{n}' if fqn else n for n in names]} are on "
                f"the meta device and not in the checkpoint (non-persistent), and its _init_weights (if any) "
                f"{why}; pass a factory instead of a model built on meta (load_sparse builds buffers for "
                "real)"
            ) from failure


def _filled(buffer: torch.Tensor, device: torch.device, second: bool) -> torch.Tensor:
    """``buffer``'s shape and dtype on ``device``, filled with what a computing ``_init_weights`` overwrites:
    NaN (floating), else one of two values (``second`` picks), so that two fills tell a buffer it
    computed from one it left alone."""
    if buffer.is_floating_point() or buffer.is_complex():
        return torch.full_like(buffer, torch.nan, device=device)
    return torch.full_like(buffer, int(second), device=device)


def _computed_by_init(init: Callable[[nn.Module], Any], module: nn.Module, names: list[str],
                      device: torch.device) -> list[str]:  # fmt: skip
    """The buffers among ``names`` (on meta) that ``init(module)`` did not compute, the others computed
    into ``module``. Run twice on two fills (:func:`_filled`): a buffer it computed is the same after
    both; one it left alone keeps the fill (NaN, or a different value each time), an error, never
    uninitialised memory."""
    meta = {n: module._buffers[n] for n in names}
    after: list[dict[str, torch.Tensor | None]] = []
    for second in (False, True):
        for n, b in meta.items():
            assert b is not None
            module._buffers[n] = _filled(b, device, second)
        with torch.no_grad():
            init(module)
        after.append({n: module._buffers.get(n) for n in names})

    def computed(n: str) -> bool:
        first, last = after[0][n], after[1][n]
        if first is None or last is None or last.device.type == "meta":
            return False
        if last.is_floating_point() or last.is_complex():
            return not bool(last.isnan().any())
        return first.shape == last.shape and bool(torch.equal(first.to(last.device), last))

    return [n for n in names if not computed(n)]


def load_sparse(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    path: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Load a :func:`save_sparse` checkpoint into a model without materialising dense weights; return it.

    ``model_or_factory`` is a callable returning the (dense) model, called with parameters on the meta
    device (:func:`parameters_on_meta`), or a model already built, typically on meta. The layers the file
    records as block-sparse become :class:`~bsrkit.nn.BSRLinear` with the file's pattern; every tensor is
    read from the file one at a time onto ``device`` (floating ones cast to ``dtype`` when given) and
    assigned; tied parameters are re-tied (one ``Parameter`` again). Raises ``ValueError`` naming the
    entry for a file that does not match the model.
    """
    dtype = check_floating_dtype("load_sparse", dtype)
    if dtype is not None and dtype not in SUPPORTED_DTYPES:  # (float8 would load, then never run)
        raise ValueError(f"load_sparse(): expected dtype in {SUPPORTED_DTYPES} or None, got {dtype}")
    record = _read_record(path, "load_sparse")
    device = check_data_device("load_sparse", device)
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
    elif callable(model_or_factory):
        with parameters_on_meta():
            model = model_or_factory()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"load_sparse(): expected the factory to return an nn.Module, got {type_name(model)}"
            )
    else:
        raise TypeError(
            "load_sparse(): expected an nn.Module or a callable returning one, got "
            f"{type_name(model_or_factory)}"
        )
    layers: dict[str, dict[str, Any]] = record["layers"]
    tied: dict[str, str] = record["tied"]
    _swap_layers(model, layers)
    model_state = model.state_dict(keep_vars=True)
    expected = {name: tuple(t.shape) for name, t in model_state.items()}
    state: dict[str, torch.Tensor] = {}
    saved_dtypes: dict[torch.dtype, int] = {}  # (the file's floating tensors by dtype: the model's is first)
    with _open_for_reading(os.fspath(path), str(device)) as (f, copy):
        stored = set(f.keys())
        missing = [name for name in expected if name not in stored and name not in tied]
        unexpected = sorted(stored - set(expected))
        if missing or unexpected:
            raise ValueError(
                "load_sparse(): the checkpoint does not match the model: in the model, not in the file: "
                f"{_some(missing)}; in the file, not in the model: {_some(unexpected)}"
            )
        order = {name: i for i, name in enumerate(expected)}
        for name in sorted(stored, key=order.__getitem__):
            shape = tuple(f.get_slice(name).get_shape())
            if shape != expected[name] and not _resizable(name, layers):
                raise ValueError(f"load_sparse(): {name}: expected shape {expected[name]}, got {shape}")
            tensor = f.get_tensor(name)
            _check_kind(name, tensor, model_state[name])
            if tensor.is_floating_point():
                saved_dtypes[tensor.dtype] = saved_dtypes.get(tensor.dtype, 0) + 1
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            elif copy and tensor.device.type == "cpu":
                tensor = tensor.clone()
            state[name] = tensor
    for name, source in tied.items():
        if name not in expected or source not in state:
            raise ValueError(
                f"load_sparse(): the checkpoint ties {name!r} to {source!r}, which the model lacks"
            )
        if state[source].shape != expected[name] and not _resizable(name, layers):
            raise ValueError(
                f"load_sparse(): the checkpoint ties {name!r} to {source!r}, of shape "
                f"{tuple(state[source].shape)}; the model's {name!r} has shape {expected[name]}"
            )
        _check_kind(name, state[source], model_state[name])
        state[name] = state[source]
    del model_state
    _materialise_buffers(model, device, set(state))
    model.load_state_dict(state, strict=True, assign=True)
    del state
    for name, source in tied.items():
        parent_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent_name) if parent_name else model
        if leaf in owner._parameters:
            setattr(owner, leaf, model.get_parameter(source))
        elif leaf in owner._buffers:  # (tied layers' pattern: sparsify_ shares their index buffers too)
            owner._buffers[leaf] = model.get_buffer(source)
    saved = max(saved_dtypes, key=saved_dtypes.__getitem__) if saved_dtypes else None
    _cast_computed_buffers(model, stored, record["buffer_dtypes"], dtype, saved)
    return model.to(device)


def _cast_computed_buffers(
    model: nn.Module,
    stored: set[str],
    recorded: dict[str, str],
    dtype: torch.dtype | None,
    saved: torch.dtype | None,
) -> None:
    """Give the floating buffers the file does not hold (computed by the model's factory) the dtype they
    had when saved; ``dtype``, when given, where they had the saved model's own (``saved``: they followed
    it, as ``model.to(dtype)`` moves them) or no record. A buffer the model kept apart (float32 rotary
    frequencies in a bfloat16 model) keeps its dtype: the loaded model computes as the saved one."""
    for fqn, module in model.named_modules():
        for n, b in module._buffers.items():
            name = f"{fqn}.{n}" if fqn else n
            if b is None or not b.is_floating_point() or name in stored:
                continue
            want = getattr(torch, recorded.get(name, ""), None)
            if dtype is not None and (want is None or want == saved):
                want = dtype
            if isinstance(want, torch.dtype) and b.dtype != want:
                module._buffers[n] = b.to(want)


@contextlib.contextmanager
def _open_for_reading(path: str, device: str) -> Iterator[tuple[Any, bool]]:
    """``safe_open`` reading each tensor with ``pread`` into memory of its own (safetensors >= 0.8), else
    memory-mapped; then ``copy`` is True: a CPU tensor must be copied out of the mapping, which would
    otherwise change under the model if the file were rewritten in place."""
    from safetensors import safe_open

    try:
        handle, copy = safe_open(path, framework="pt", device=device, backend="pread"), False
    except TypeError:  # (no backend argument before safetensors 0.8)
        handle, copy = safe_open(path, framework="pt", device=device), True
    with handle as f:
        yield f, copy


def _check_kind(name: str, stored: torch.Tensor, model_tensor: torch.Tensor) -> None:
    """Refuse a stored tensor of another kind of dtype than the model's (floating, complex, integer or
    bool): ``load_state_dict(assign=True)`` would take it, and a forward would fail far from the file."""

    def kind(t: torch.Tensor) -> str:
        if t.is_floating_point():
            return "floating"
        if t.is_complex():
            return "complex"
        return "bool" if t.dtype == torch.bool else "integer"

    if kind(stored) != kind(model_tensor):
        raise ValueError(
            f"load_sparse(): {name}: expected a tensor of dtype kind {kind(model_tensor)!r} (the model's is "
            f"{model_tensor.dtype}), got {stored.dtype} in the file"
        )


def _some(names: list[str]) -> str:
    return f"{names[:10]}{' ...' if len(names) > 10 else ''}"


def _resizable(name: str, layers: dict[str, Any]) -> bool:
    # (BSRLinear's own load_state_dict checks its parts' shapes, with its own messages)
    prefix, _, leaf = name.rpartition(".")
    return prefix in layers and leaf in ("values", "col_indices")
