"""Compare desired state with what the API server holds, so unchanged objects cost no write."""

from __future__ import annotations

import json
from typing import Any

from gpudra_core.quantity import quantity_value


def contains(live: Any, desired: Any) -> bool:
    """True when every field set in ``desired`` has the same value in ``live``.

    Fields only ``live`` has (server defaults, status, other managers' fields) are ignored; lists
    must match element by element, as the atomic lists of DRA objects are replaced whole. A
    quantity the server stored canonically (``"0.5"`` as ``"500m"``, ``1024Mi`` as ``1Gi``) equals
    what was asked for."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(live) == len(desired)
                and all(contains(a, b) for a, b in zip(live, desired)))
    if live == desired:
        return True
    wanted = quantity_value(desired)
    return wanted is not None and quantity_value(live) == wanted


def dropped_fields(live: Any, desired: Any, manager: str) -> list[str]:
    """Fields ``manager`` applied to ``live`` (its server-side-apply ``managedFields`` entry) that
    ``desired`` no longer sets: a server-side apply of ``desired`` would remove them, so the object
    must be applied even when :func:`contains` holds (an optional field taken out of the spec).
    Returns their paths, e.g. ``spec.template.spec.tolerations``; none means nothing to remove.

    The fieldsV1 set is walked where it names map keys (``f:<name>``) and list items by key
    (``k:{...}``) or index (``i:<n>``). A leaf that is a map in both objects is an atomic map
    (``nodeSelector``): applied whole, so a key only the live one has is dropped too. A set value
    (``v:``) belongs to a list that :func:`contains` already compares whole."""
    owned = [entry.get("fieldsV1") or {} for entry in (live or {}).get("metadata", {}).get("managedFields") or []
             if entry.get("manager") == manager and entry.get("operation") == "Apply"]
    missing: list[str] = []
    for fields in owned:
        _walk_owned(fields, live, desired, "", missing)
    return missing


def _walk_owned(fields: Any, live: Any, desired: Any, path: str, missing: list[str]) -> None:
    if not isinstance(fields, dict):
        return
    for key, sub in fields.items():
        if key == ".":
            continue
        if key.startswith("f:"):
            name = key[2:]
            where = f"{path}.{name}" if path else name
            if not isinstance(desired, dict) or name not in desired:
                missing.append(where)
                continue
            ours, theirs = desired[name], live.get(name) if isinstance(live, dict) else None
            if not sub and isinstance(ours, dict) and isinstance(theirs, dict) and set(theirs) - set(ours):
                missing.append(f"{where}.{{{','.join(sorted(set(theirs) - set(ours)))}}}")  # atomic map
            else:
                _walk_owned(sub, theirs, ours, where, missing)
        elif key.startswith("k:") and isinstance(desired, list):
            try:
                wanted = json.loads(key[2:])
            except ValueError:
                continue

            def matches(item: Any) -> bool:
                return isinstance(item, dict) and all(str(item.get(k)) == str(v) for k, v in wanted.items())

            item = next((d for d in desired if matches(d)), None)
            if item is None:
                missing.append(f"{path}[{key[2:]}]")
            else:
                live_item = next((d for d in live if matches(d)), None) if isinstance(live, list) else None
                _walk_owned(sub, live_item, item, f"{path}[{key[2:]}]", missing)
        elif key.startswith("i:") and isinstance(desired, list):
            index = int(key[2:]) if key[2:].isdigit() else -1
            if not 0 <= index < len(desired):
                missing.append(f"{path}[{index}]")
            else:
                live_item = live[index] if isinstance(live, list) and index < len(live) else None
                _walk_owned(sub, live_item, desired[index], f"{path}[{index}]", missing)
