"""The built-in DeviceClass templates: their names, parameters, what they select, and their text."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

from gpudra_operator.deviceclasses.errors import TemplateValueError


@dataclass(frozen=True)
class Builtin:
    """A built-in template: its parameters, and what it selects (for docs and ``--help``)."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    description: str

    @property
    def parameters(self) -> tuple[str, ...]:
        return self.required + self.optional


BUILTINS: Mapping[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("all", (), (), "every device of the driver"),
        Builtin("full-gpu", (), (), "whole GPUs (type == \"gpu\"), no MIG devices"),
        Builtin("mig", (), ("profile",), "MIG devices, optionally of one profile such as 3g.40gb"),
        Builtin("min-memory", ("memory",), (), "devices with at least `memory` (a quantity) of memory"),
        Builtin("product", ("productName",), (), "devices whose productName equals `productName`"),
        Builtin("min-compute-capability", ("version",), (),
                "devices whose CUDA compute capability is at least `version` (e.g. 8.0)"),
        Builtin("architecture", ("architecture",), (), "devices of one architecture, e.g. Hopper"),
    )
}


@cache
def builtin_source(template: str) -> str:
    """The text of the built-in template ``template`` (``templates/<template>.j2``)."""
    if template not in BUILTINS:
        raise KeyError(template)
    return (resources.files("gpudra_operator") / "templates" / f"{template}.j2").read_text("utf-8")


def check_parameters(template: str, params: Mapping[str, str]) -> None:
    """Refuse missing, unknown and non-string parameters of the built-in ``template``."""
    builtin = BUILTINS[template]
    missing = [p for p in builtin.required if p not in params]
    unknown = sorted(set(params) - set(builtin.parameters))
    if missing:
        raise TemplateValueError(f"template {template} needs parameter(s) {', '.join(missing)}")
    if unknown:
        allowed = ", ".join(builtin.parameters) or "none"
        raise TemplateValueError(f"template {template} does not take parameter(s) {', '.join(unknown)} "
                                 f"(it takes: {allowed})")
    for key, value in params.items():
        if not isinstance(value, str):
            raise TemplateValueError(f"parameter {key} must be a string, got {value!r}")

