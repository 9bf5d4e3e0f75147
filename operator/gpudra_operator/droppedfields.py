"""DeviceClass fields the API server dropped, remembered per class: spec.extendedResourceName,
while its DRAExtendedResource feature gate is off.

Applying such a class again would change nothing (the field is dropped again), so without this
memory every drift tick would write the class; and the config says that pods asking for the name
are not served, rather than pretend the class serves it. The memory lasts an hour: then the class
is applied anyway, in case the gate was turned on since."""

from __future__ import annotations

import time

from gpudra_core.kubeapi import Obj

from gpudra_operator.conditions import ApplyError

DROPPED_FIELD_RECHECK = 3600.0  # seconds before a class whose field the API server dropped is applied again


def _dropped_extended_resource(desired: Obj, stored: Obj | None) -> str | None:
    """The extendedResourceName the API server dropped from ``stored`` (its feature gate is off)."""
    name = (desired.get("spec") or {}).get("extendedResourceName")
    if stored is not None and name and not (stored.get("spec") or {}).get("extendedResourceName"):
        return str(name)
    return None


def _dropped_error(class_name: str, name: str) -> ApplyError:
    """The class is applied without the field; the config says so rather than pretend the class
    serves the name."""
    return ApplyError(
        "DeviceClass", class_name,
        f"spec.extendedResourceName {name} was dropped by the API server: its DRAExtendedResource "
        "feature gate is off (alpha and off in Kubernetes 1.35; beta and on from 1.36), so pods asking "
        f"for {name} are not served by this class. Upgrade to 1.36, enable the gate, or remove the field")


def _without_extended_resource(desired: Obj) -> Obj:
    return {**desired, "spec": {k: v for k, v in desired["spec"].items() if k != "extendedResourceName"}}


class DroppedFields:
    """Per class, when the API server dropped which extendedResourceName."""

    def __init__(self) -> None:
        self._dropped: dict[str, tuple[float, str]] = {}  # class -> (when, extendedResourceName dropped)

    def as_kept(self, desired: Obj) -> tuple[Obj, ApplyError | None]:
        """``desired`` as the API server keeps it, to compare the live object with, and the error
        that says what it drops; ``desired`` itself and None unless a field was dropped (from the
        same value, within the hour)."""
        name = desired["metadata"]["name"]
        seen = self._dropped.get(name) if desired["kind"] == "DeviceClass" else None
        if seen is None:
            return desired, None
        if desired["spec"].get("extendedResourceName") != seen[1] or time.monotonic() - seen[0] >= DROPPED_FIELD_RECHECK:
            del self._dropped[name]
            return desired, None
        return _without_extended_resource(desired), _dropped_error(name, seen[1])

    def applied(self, desired: Obj, stored: Obj | None) -> ApplyError | None:
        """Remember what the API server dropped of ``desired`` when it stored it; the error that says
        so (None: it kept everything)."""
        dropped = _dropped_extended_resource(desired, stored)
        if dropped is None:
            return None
        self._dropped[desired["metadata"]["name"]] = (time.monotonic(), dropped)
        return _dropped_error(desired["metadata"]["name"], dropped)
