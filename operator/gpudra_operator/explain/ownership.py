"""Which requests are gpudra's to explain: those whose DeviceClass can select the driver's devices.

A class is the driver's when gpudra's operator manages it, when a selector names the driver (a
string literal equal to the driver name: ``device.driver == "gpu.gpudra.io"`` or an attribute
domain), or when it has no selector (then it selects every device, ours too). Requests of other
classes are dropped from the claim before explaining, with a note: their devices are not in the
slices explain reads, so they would look unsatisfiable when they are not."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from gpudra_operator.deviceclasses.celrefs import CelSyntaxError, cel_tokens
from gpudra_operator.explain.inventory import Obj
from gpudra_operator.render import LABEL_MANAGED_BY, MANAGED_BY


def class_is_ours(device_class: Obj, driver: str) -> bool:
    labels = (device_class.get("metadata") or {}).get("labels") or {}
    if labels.get(LABEL_MANAGED_BY) == MANAGED_BY:
        return True
    selectors = (device_class.get("spec") or {}).get("selectors") or []
    if not selectors:
        return True
    for selector in selectors:
        try:
            tokens = cel_tokens(str((selector.get("cel") or {}).get("expression", "")))
        except CelSyntaxError:
            continue
        if any(t.kind == "string" and t.value == driver for t in tokens):
            return True
    return False


def _request_classes(entry: Obj) -> list[str]:
    if entry.get("firstAvailable"):
        return [str(sub.get("deviceClassName", "")) for sub in entry["firstAvailable"]]
    return [str((entry.get("exactly") or {}).get("deviceClassName", ""))]


def ours_only(claim: Obj, classes: Mapping[str, Obj], driver: str) -> tuple[dict[str, Any], list[str]]:
    """``claim`` without the requests no class of which is ours, and a note per dropped request.
    A missing class counts as ours: that the class is missing is the explanation."""
    kept: list[Obj] = []
    notes: list[str] = []
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    for entry in requests:
        names = _request_classes(entry)
        if any(name not in classes or class_is_ours(classes[name], driver) for name in names):
            kept.append(entry)
        else:
            notes.append(f"request {entry.get('name')} (DeviceClass {', '.join(names)}) is not for {driver}'s "
                         "devices: not explained")
    if len(kept) == len(requests):
        return dict(claim), notes
    trimmed = copy.deepcopy(dict(claim))
    devices = trimmed["spec"]["devices"]
    devices["requests"] = kept
    kept_names = {r.get("name") for r in kept}
    devices["constraints"] = [c for c in devices.get("constraints") or []
                              if not c.get("requests") or all(r.split("/")[0] in kept_names for r in c["requests"])]
    return trimmed, notes
