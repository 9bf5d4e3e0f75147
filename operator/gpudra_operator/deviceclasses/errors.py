"""The two ways a DeviceClass template fails: a value a helper refused, and the class's one error."""

from __future__ import annotations


class RenderError(Exception):
    """One DeviceClass that could not be rendered: ``class_name`` says which, ``message`` why."""

    def __init__(self, class_name: str, message: str) -> None:
        super().__init__(f"DeviceClass {class_name!r}: {message}")
        self.class_name = class_name
        self.message = message

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RenderError) and other.class_name == self.class_name
                and other.message == self.message)

    def __hash__(self) -> int:
        return hash((self.class_name, self.message))


class TemplateValueError(ValueError):
    """A value a template helper refused (a bad quantity, an unknown attribute, ...)."""
