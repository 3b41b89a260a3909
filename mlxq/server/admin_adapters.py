"""Operator endpoints: adapters loaded and unloaded while the server runs.

- ``POST /admin/adapters`` ``{"name": ..., "path": ...}``: serve the mlx-lm
  adapter directory at ``path`` as the model id ``name``, with the checks of
  ``--adapter`` at start-up. A bad directory (or one that does not fit the
  model) is a 400 naming the problem; a name already served a 409.
- ``DELETE /admin/adapters/{name}``: stop serving it. Refused (409) while any
  request on it is running or queued: a running row is never broken, and the
  operator retries once they finished. Afterwards the name is a 404 like any
  unknown model.

The directory is checked (and its identity hashed) on a worker thread; the
model's layers change only on the engine thread, between two steps
(models/adapter_swap.py), which decode pauses for. ``/v1/models`` and
``/stats`` follow at once. Not available when ranks serve the model together.
"""

from __future__ import annotations

from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from mlxq.engine.engine_calls import EngineCallTimeout
from mlxq.models.adapter_swap import serve_adapters
from mlxq.models.adapters import NAME_PATTERN, AdapterError, AdapterInfo, AdapterSpec, check_adapter_dir
from mlxq.server.errors import APIError, invalid
from mlxq.server.json_body import read_json
from mlxq.server.state import ServerState

ENGINE_CALL_TIMEOUT_S = 120.0  # for the engine to reach a point between steps (a long prefill chunk)


async def load_adapter(http: HTTPRequest):
    state = _ready(http)
    spec = _spec_of(await read_json(http, state.config.max_request_bytes))
    _refuse_taken(state, spec.name)
    try:
        info = await run_in_threadpool(check_adapter_dir, spec)
    except AdapterError as exc:
        raise invalid(str(exc), param="path", code="invalid_adapter") from None
    await run_in_threadpool(_on_engine, state, lambda: _load(state, info))
    state.adapters_loaded_at_run_time = True
    return JSONResponse({"id": info.name, "object": "model", "parent": state.model_name, "kind": info.kind,
                         "rank": info.rank, "namespace": info.identity})


async def unload_adapter(http: HTTPRequest):
    state = _ready(http)
    name = http.path_params["name"]
    _require_loaded(state, name)
    await run_in_threadpool(_on_engine, state, lambda: _unload(state, name))
    return JSONResponse({"id": name, "object": "model", "deleted": True})


def _ready(http: HTTPRequest) -> ServerState:
    state: ServerState = http.app.state.mlxq
    state.require_ready()
    if state.config.world_size > 1:
        raise APIError(409, f"adapters cannot be loaded or unloaded with --{state.config.parallel_mode}-parallel "
                            "(every rank would have to swap it between the same two steps); "
                            "pass --adapter at start-up instead", code="unsupported")
    return state


def _spec_of(body) -> AdapterSpec:
    if not isinstance(body, dict):
        raise invalid('the body must be a JSON object: {"name": MODEL_ID, "path": ADAPTER_DIRECTORY}')
    unknown = sorted(set(body) - {"name", "path"})
    if unknown:
        raise invalid(f"unknown field(s) {', '.join(map(repr, unknown))}; expected 'name' and 'path'",
                      param=unknown[0])
    name, path = body.get("name"), body.get("path")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise invalid("'name' must be a model id of letters, digits and . _ : / - (at most 128)", param="name")
    if not isinstance(path, str) or not path.strip():
        raise invalid("'path' must be the path of an mlx-lm adapter directory on the server", param="path")
    return AdapterSpec(name, Path(path.strip()).expanduser())


def _refuse_taken(state: ServerState, name: str) -> None:
    if name == state.model_name or name in state.loaded.adapters:
        raise APIError(409, f"model {name!r} is already served; unload it first to replace it", param="name",
                       code="model_exists")


def _require_loaded(state: ServerState, name: str) -> None:
    if name not in state.loaded.adapters:
        served = ", ".join(map(repr, state.loaded.adapters)) or "none"
        raise APIError(404, f"no adapter {name!r} is loaded (loaded: {served})", param="name",
                       code="model_not_found")


def _on_engine(state: ServerState, fn) -> None:
    """``fn`` on the engine thread between steps; its refusals become the protocol's errors."""
    try:
        state.engine.call_between_steps(fn, ENGINE_CALL_TIMEOUT_S)
    except AdapterError as exc:
        raise invalid(str(exc), param="path", code="invalid_adapter") from None
    except EngineCallTimeout as exc:
        raise APIError(503, f"{exc}; nothing was changed, retry", code="engine_busy") from None


def _load(state: ServerState, info: AdapterInfo) -> None:
    """Engine thread."""
    _refuse_taken(state, info.name)  # another load of the name may have got here first
    serve_adapters(state.loaded, [*state.loaded.adapters.values(), info])


def _unload(state: ServerState, name: str) -> None:
    """Engine thread: only when no request it holds runs on the adapter."""
    _require_loaded(state, name)
    using = sum(request.adapter == name for request in state.engine.requests_held())
    if using:
        raise APIError(409, f"adapter {name!r} has {using} request(s) running or queued; it can be unloaded once "
                            "none is (retry after they finish)", param="name", code="adapter_in_use")
    serve_adapters(state.loaded, [info for info in state.loaded.adapters.values() if info.name != name])
