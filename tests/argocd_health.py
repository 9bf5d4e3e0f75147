"""Runs manifests/argocd/health.lua the way Argo CD does: the object as the global ``obj``, the
script's return value as the health. Argo CD embeds gopher-lua, a Lua 5.1, so this uses lupa's
Lua 5.1 runtime (numbers are doubles there, as in gopher-lua)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lupa.lua51 import LuaRuntime

HEALTH_LUA = Path(__file__).resolve().parents[1] / "manifests" / "argocd" / "health.lua"


def _to_lua(lua: LuaRuntime, value: Any) -> Any:
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def health(obj: dict[str, Any]) -> dict[str, str]:
    """``{"status": ..., "message": ...}`` as Argo CD would show it for ``obj``."""
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = _to_lua(lua, obj)
    result = lua.execute(HEALTH_LUA.read_text())
    return {k: result[k] for k in ("status", "message")}
