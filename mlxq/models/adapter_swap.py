"""Change which adapters a loaded model serves while it runs (``POST`` / ``DELETE /admin/adapters``).

The engine thread calls ``serve_adapters`` between two steps (engine/engine_calls.py):
every adapted layer gets its base layer back, then the new set is read with
models/adapters.py (mlx-lm's checks) and installed as at start-up
(models/multi_lora.py). Rows route by adapter *name*, so a row running on an
adapter that stays keeps decoding on it. The adapters that stay are read
again from their directories, each checked against the identity it was
loaded with (its cache namespace): files changed since are refused, never
served under the old namespace. On any failure the previous set is put back.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxq.models.adapters import AdapterError, AdapterInfo, adapter_identity, read_adapter


def serve_adapters(loaded, infos: Sequence[AdapterInfo]) -> None:
    """Engine thread: ``loaded`` (models.loader.LoadedModel) serves exactly ``infos`` from now on;
    AdapterError (nothing changed) when one cannot be served."""
    previous = list(loaded.adapters.values())
    _check_unchanged(infos)
    try:
        _install(loaded.model, infos)
    except Exception:
        _install(loaded.model, previous)  # read and served a moment ago: they fit
        raise
    loaded.adapters = {info.name: info for info in infos}  # a new dict: other threads see the old or the new


def _install(model, infos: Sequence[AdapterInfo]) -> None:
    """Base layers back, then ``infos`` installed (an error leaves the model on its base layers)."""
    from mlxq.models.multi_lora import install_adapters

    _uninstall(model)
    if infos:
        install_adapters(model, [info.name for info in infos], [read_adapter(model, info) for info in infos])


def _uninstall(model) -> None:
    from mlx.utils import tree_unflatten

    from mlxq.models.multi_lora import ROUTING_ATTRIBUTE, MultiLoRALinear

    adapted = [(name, m.base) for name, m in model.named_modules() if isinstance(m, MultiLoRALinear)]
    if adapted:
        model.update_modules(tree_unflatten(adapted))
    if hasattr(model, ROUTING_ATTRIBUTE):
        delattr(model, ROUTING_ATTRIBUTE)


def _check_unchanged(infos: Sequence[AdapterInfo]) -> None:
    for info in infos:
        if adapter_identity(info.path) != info.identity:
            raise AdapterError(f"adapter {info.name!r}: the files in {info.path} changed since it was loaded "
                               f"(cache namespace {info.identity}); unload it and load it again")
