"""String values as CEL and YAML literals that no value can end early."""

from __future__ import annotations

from gpudra_operator.deviceclasses.errors import TemplateValueError


def cel_string(value: object) -> str:
    """``value`` as a double-quoted CEL string literal that decodes back to exactly ``value``.

    Backslash and double quote are escaped; everything outside printable ASCII (control
    characters, newlines, DEL, non-ASCII) becomes ``\\uXXXX``/``\\UXXXXXXXX``. The literal is
    therefore one token of printable ASCII whatever the input: a value can never end it early.
    """
    if not isinstance(value, str):
        raise TemplateValueError(f"cel_string() needs a string, got {type(value).__name__} {value!r}")
    return _double_quoted(value, "cel_string()", hex_bytes=False)


def yaml_string(value: object) -> str:
    """``value`` (a string) as a double-quoted YAML scalar of printable ASCII, safe on one line
    after ``key: `` whatever it contains."""
    if not isinstance(value, str):
        raise TemplateValueError(f"yaml_string needs a string, got {type(value).__name__}")
    return _double_quoted(value, "yaml_string", hex_bytes=True)


def _double_quoted(value: str, helper: str, *, hex_bytes: bool) -> str:
    """The escapes CEL and YAML share; ``hex_bytes`` writes U+0080..U+00FF as ``\\xNN`` (the
    YAML form; the CEL literal keeps to ``\\u``)."""
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == "\\" or ch == '"':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif 0xD800 <= code <= 0xDFFF:
            raise TemplateValueError(f"{helper}: lone surrogate U+{code:04X} is not text")
        elif hex_bytes and code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)
