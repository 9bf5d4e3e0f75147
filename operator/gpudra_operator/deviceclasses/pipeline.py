"""One DeviceClass per spec entry: check the parameters, render (built-ins here, inline templates in
the bounded worker), then check the shape. A failing class is one :class:`RenderError` that names
it, never a stop for the others."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpudra_core import limits
from gpudra_operator.deviceclasses.catalog import BUILTINS, builtin_source, check_parameters
from gpudra_operator.deviceclasses.errors import RenderError, TemplateValueError
from gpudra_operator.deviceclasses.sandbox import describe_error, render_text_here, template_context
from gpudra_operator.deviceclasses.shape import check_device_class, load_one


def render_device_class(name: str, driver: str, *, template: str | None = None,
                        inline: str | None = None,
                        params: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One DeviceClass (a dict, metadata.name forced to ``name``), or :class:`RenderError`.

    Exactly one of ``template`` (a key of :data:`BUILTINS`) or ``inline`` (Jinja2 source)."""
    params = dict(params or {})
    try:
        if (template is None) == (inline is None):
            raise TemplateValueError("exactly one of template or inline must be set")
        if not limits.is_dns_subdomain(name):
            raise TemplateValueError(f"{name!r} is not a DNS subdomain")
        if template is not None:
            if template not in BUILTINS:
                raise TemplateValueError(f"unknown template {template!r} (built-ins: {', '.join(BUILTINS)})")
            check_parameters(template, params)
            text = render_text_here(builtin_source(template), template_context(name, driver, params))
        else:  # a config author's code: rendered where memory and CPU are bounded
            # Imported here, not above: the worker child runs that module as __main__ after
            # importing this package, which must not have imported it already.
            from gpudra_operator.deviceclasses.worker import WORKER, TemplateBoundExceeded

            try:
                text = WORKER.render(name, driver, params, str(inline))
            except TemplateBoundExceeded as error:
                raise RenderError(name, f"template exceeded its bounds: {error}") from None
            except ValueError as error:  # the template's own failure, described by the worker
                raise RenderError(name, str(error)) from None
        return check_device_class(load_one(text), name, driver)
    except RenderError:
        raise
    except Exception as error:  # noqa: BLE001 - every template failure becomes one RenderError
        raise RenderError(name, describe_error(error)) from error


def render_device_classes(classes: Iterable[Any], driver: str) -> tuple[list[dict[str, Any]], list[RenderError]]:
    """Render each class (objects with ``name``, ``template``, ``inline``, ``parameters``); a bad
    class is reported and skipped, never stopping the others. Duplicate names are errors."""
    objects: list[dict[str, Any]] = []
    errors: list[RenderError] = []
    seen: set[str] = set()
    for cls in classes:
        if cls.name in seen:
            errors.append(RenderError(cls.name, "listed twice in spec.deviceClasses"))
            continue
        seen.add(cls.name)
        try:
            objects.append(render_device_class(cls.name, driver, template=cls.template,
                                               inline=cls.inline, params=cls.parameters))
        except RenderError as error:
            errors.append(error)
    return objects, errors
