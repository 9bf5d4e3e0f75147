"""Rendering one template's text in Jinja2's immutable sandbox, with bounded output and time.

No Python internals (``''.__class__`` is a :class:`jinja2.exceptions.SecurityError`), no mutation
of the context, no silently empty variables (``StrictUndefined``), no ``include``/``import`` (the
environment has no loader); the output is capped at :data:`MAX_RENDERED_CHARS` and the render at
:data:`MAX_RENDER_SECONDS`. Built-in templates render here in the operator; inline ones render
here too, inside the bounded worker (:mod:`gpudra_operator.deviceclasses.worker`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from types import TracebackType
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpudra_operator.deviceclasses.celhelpers import (attribute_ref, capacity_ref, driver_match,
                                                      quantity_literal, semver_literal)
from gpudra_operator.deviceclasses.errors import TemplateValueError
from gpudra_operator.deviceclasses.escape import cel_string, yaml_string

MAX_RENDERED_CHARS = 64 * 1024
MAX_RENDER_SECONDS = 2.0  # wall time a render may take (a loop that prints nothing is not size-capped);
# in the worker it fires before the 2 to 3 s of CPU the kernel allows there (worker.CPU_LIMIT), and stops
# what runs bytecode; a computation in C, which no signal interrupts, meets that CPU limit instead
_TEMPLATE_NAME = "<template>"


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(cel_string=cel_string, quantity=quantity_literal, semver=semver_literal,
                       yaml_string=yaml_string)
    return env


_ENV = _environment()


@lru_cache(maxsize=256)  # inline sources come from users: bounded
def _compiled(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def template_context(name: str, driver: str, params: Mapping[str, str]) -> dict[str, Any]:
    """What every template (built-in or inline) sees."""
    return {
        "name": name,
        "driver": driver,
        "params": dict(params),
        "driver_match": driver_match(driver),
        "attr": lambda attribute: attribute_ref(attribute, driver),
        "capacity": lambda capacity: capacity_ref(capacity, driver),
        "cel_string": cel_string,
        "quantity": quantity_literal,
        "semver": semver_literal,
        "yaml_string": yaml_string,
    }


def _template_line(error: BaseException) -> int | None:
    line = getattr(error, "lineno", None)
    tb: TracebackType | None = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _TEMPLATE_NAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def describe_error(error: BaseException) -> str:
    """One line for a class's error: what went wrong, and where in the template."""
    line = _template_line(error)
    at = f" (template line {line})" if line else ""
    if isinstance(error, jinja2.TemplateSyntaxError):
        return f"template syntax error{at}: {error.message}"
    if isinstance(error, jinja2.exceptions.SecurityError):
        return f"sandbox violation{at}: {error}"
    if isinstance(error, jinja2.UndefinedError):
        return f"undefined variable{at}: {error.message}"
    if isinstance(error, TemplateValueError):
        return f"invalid value{at}: {error}"
    return f"template failed{at}: {type(error).__name__}: {error}"


class _RenderTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the render after ``seconds`` of wall time (SIGALRM; main thread only, which is
    where the operator's event loop and the CLI run; elsewhere there is no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(_signum: int, _frame: object) -> None:
        raise _RenderTimeout()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_text_here(source: str, context: Mapping[str, Any]) -> str:
    """Render in this process (built-in templates; inline ones in the bounded worker, where this
    runs too: see :mod:`gpudra_operator.deviceclasses.worker`)."""
    template = _compiled(source)
    size = 0
    chunks: list[str] = []
    try:
        with _time_limit(MAX_RENDER_SECONDS):
            for chunk in template.generate(context):
                size += len(chunk)
                if size > MAX_RENDERED_CHARS:
                    raise TemplateValueError(f"template output exceeds {MAX_RENDERED_CHARS} characters")
                chunks.append(chunk)
    except _RenderTimeout:
        raise TemplateValueError(f"template took longer than {MAX_RENDER_SECONDS:g} s to render") from None
    return "".join(chunks)
