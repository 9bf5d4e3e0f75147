"""DeviceClasses from Jinja2 templates: built-in ones shipped in ``templates/*.j2`` and users' inline
ones, both rendered the same way. Pure: no API calls.

Safety, in layers, one module each:

* :mod:`.sandbox`: templates run in Jinja2's immutable sandbox with ``StrictUndefined``: no Python
  internals (``''.__class__`` is a :class:`jinja2.exceptions.SecurityError`), no mutation of the
  context, no silently empty variables, no ``include``/``import`` (the environment has no loader),
  and the output is capped. :mod:`.worker`: inline templates (a config author's code) render in a
  child process whose memory and CPU are bounded.
* :mod:`.escape` and :mod:`.celhelpers`: values enter CEL only through helpers that escape or
  validate them (a CEL string literal of printable ASCII, a checked quantity, a normalised semantic
  version), and the CEL string enters YAML as a double-quoted scalar, so no value can change the
  expression or the document's structure.
* :mod:`.celrefs`: attribute and capacity names come from the driver's device model
  (:mod:`gpudra_core.devicemodel`); every finished CEL expression is scanned for references to
  them, so a hand-written name in an inline template is checked too.
* :mod:`.shape`: the result must be exactly one ``resource.k8s.io/v1`` DeviceClass whose name (when
  set) is the spec's; anything else is a :class:`RenderError` that names the class.

:mod:`.rendering` puts the layers together; :mod:`.catalog` lists the built-in templates. What only
the API server can check (CEL types, cost) is left to the operator's server-side dry run.
"""

from gpudra_operator.deviceclasses.catalog import BUILTINS, Builtin
from gpudra_operator.deviceclasses.errors import RenderError, TemplateValueError
from gpudra_operator.deviceclasses.pipeline import render_device_class, render_device_classes

__all__ = ["BUILTINS", "Builtin", "RenderError", "TemplateValueError", "render_device_class",
           "render_device_classes"]
