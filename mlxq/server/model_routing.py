"""Which model a request names: the base model or one of its --adapter's.

With no adapter served, any ``model`` runs the base model (clients send their
own names, e.g. an agent's default). With adapters, ``model`` must name the
base model (its id, or leave the field out) or an adapter; anything else is a
404, in the protocol's own error shape (server/errors.py picks it by path). So
it stays once an adapter was loaded at run time, even after it was unloaded:
its name is then a 404, not the base model.
"""

from __future__ import annotations

from mlxq.models.adapters import AdapterInfo
from mlxq.server.errors import APIError

UNNAMED = "default_model"  # what protocol.py reads when a body has no "model"


def resolve_model(state, requested: str) -> AdapterInfo | None:
    """The adapter ``requested`` names, None for the base model; APIError 404 for an unknown name."""
    adapters = state.loaded.adapters if state.loaded else {}
    if requested in (state.model_name, UNNAMED) or not (adapters or state.adapters_loaded_at_run_time):
        return None
    if requested in adapters:
        return adapters[requested]
    served = ", ".join(repr(name) for name in (state.model_name, *adapters))
    raise APIError(404, f"model {requested!r} not found; this server serves {served}", param="model",
                   code="model_not_found")


def model_cards(state) -> list[dict]:
    """/v1/models: the base model, then every adapter (with its base as ``parent``, as vLLM does)."""
    created = int(state.started_at_wall)
    base = {"id": state.model_name, "object": "model", "created": created, "owned_by": "mlxq",
            "description": state.loaded.description if state.loaded else None}
    adapters = state.loaded.adapters if state.loaded else {}
    return [base] + [{"id": info.name, "object": "model", "created": created, "owned_by": "mlxq",
                      "parent": state.model_name, "root": state.model_name,
                      "description": f"{info.kind} adapter (rank {info.rank}) on {state.model_name}, "
                                     f"cache namespace {info.identity}"}
                     for info in adapters.values()]
