"""``ip()`` and its members, as k8s.io/apiserver/pkg/cel/library/ip.go (Kubernetes 1.35, in the base
environment from 1.30) declares them: ``ip``, ``isIP``, ``ip.isCanonical``, ``string(ip)``, and the
members ``family``, ``isUnspecified``, ``isLoopback``, ``isLinkLocalMulticast``,
``isLinkLocalUnicast`` and ``isGlobalUnicast``.

Parsing is Go's ``netip.ParseAddr`` (go/src/net/netip/netip.go), ported with its error messages,
which upstream puts in its own: dotted decimal without leading zeros, RFC 4291 text with at most one
``::`` and an optional embedded IPv4 tail. On top of it upstream's ``parseIPAddr`` refuses a zone
(``fe80::1%eth0``) and an IPv4-mapped IPv6 address (``::ffff:1.2.3.4``). ``String()`` is netip's
RFC 5952 form (lower case, the longest run of two or more zero groups as ``::``, the first of equal
runs).

:func:`go_quote` is Go's ``strconv.Quote``, which the net libraries' error messages use (``%q``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cel_expr_python import cel

from gpudra_operator.cel.opaque import IP_TYPE, CIDRMessage, IPMessage

IP = cel.Type(IP_TYPE)

_GO_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v",
               "\\": "\\\\", '"': '\\"'}
_HEX = "0123456789abcdefABCDEF"


def go_quote(text: str) -> str:
    """strconv.Quote: printable runes as they are (unicode.IsPrint is Python's isprintable), the
    rest escaped as Go escapes them; a byte that is no UTF-8 (a surrogate escape here) as \\xNN."""
    out = ['"']
    for ch in text:
        if 0xDC80 <= ord(ch) <= 0xDCFF:
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


class AddrError(ValueError):
    """netip's parseAddrError: ``ParseAddr("<in>"): <msg>[ (at "<rest>")]``."""

    def __init__(self, text: str, message: str, at: str = "") -> None:
        suffix = f" (at {go_quote(at)})" if at else ""
        super().__init__(f"ParseAddr({go_quote(text)}): {message}{suffix}")


def _ipv4_fields(text: str, start: int, end: int) -> bytes:
    """netip parseIPv4Fields over ``text[start:end]`` (errors name the whole ``text``)."""
    part = text[start:end]
    fields: list[int] = []
    value, digits = 0, 0
    for i, ch in enumerate(part):
        if "0" <= ch <= "9":
            if digits == 1 and value == 0:
                raise AddrError(text, "IPv4 field has octet with leading zero")
            value = value * 10 + ord(ch) - ord("0")
            digits += 1
            if value > 255:
                raise AddrError(text, "IPv4 field has value >255")
        elif ch == ".":
            if i == 0 or i == len(part) - 1 or part[i - 1] == ".":
                raise AddrError(text, "IPv4 field must have at least one digit", part[i:])
            if len(fields) == 3:
                raise AddrError(text, "IPv4 address too long")
            fields.append(value)
            value, digits = 0, 0
        else:
            raise AddrError(text, "unexpected character", part[i:])
    if len(fields) < 3:
        raise AddrError(text, "IPv4 address too short")
    return bytes([*fields, value])


def _hex_group(rest: str, text: str) -> tuple[int, int]:
    """The hex number at the start of ``rest``: (value, digits used)."""
    value, used = 0, 0
    while used < len(rest) and rest[used] in _HEX:
        value = value * 16 + int(rest[used], 16)
        if used > 3:
            raise AddrError(text, "each group must have 4 or less digits", rest)
        if value > 0xFFFF:
            raise AddrError(text, "IPv6 field has value >=2^16", rest)
        used += 1
    return value, used


def _ipv6(text: str) -> tuple[bytes, str]:
    """netip parseIPv6: (16 bytes, zone)."""
    rest, zone = text, ""
    if "%" in rest:
        rest, zone = rest.split("%", 1)
        if not zone:
            raise AddrError(text, "zone must be a non-empty string")
    address = bytearray(16)
    ellipsis = -1
    if rest.startswith("::"):
        ellipsis, rest = 0, rest[2:]
        if not rest:
            return bytes(address), zone
    i = 0
    while i < 16:
        value, used = _hex_group(rest, text)
        if used == 0:
            raise AddrError(text, "each colon-separated field must have at least one digit", rest)
        if used < len(rest) and rest[used] == ".":
            if ellipsis < 0 and i != 12:
                raise AddrError(text, "embedded IPv4 address must replace the final 2 fields of the address", rest)
            if i + 4 > 16:
                raise AddrError(text, "too many hex fields to fit an embedded IPv4 at the end of the address", rest)
            end = len(text) - (len(zone) + 1 if zone else 0)
            address[i:i + 4] = _ipv4_fields(text, end - len(rest), end)
            rest, i = "", i + 4
            break
        address[i], address[i + 1] = value >> 8, value & 0xFF
        i += 2
        rest = rest[used:]
        if not rest:
            break
        if rest[0] != ":":
            raise AddrError(text, "unexpected character, want colon", rest)
        if len(rest) == 1:
            raise AddrError(text, "colon must be followed by more characters", rest)
        rest = rest[1:]
        if rest[0] == ":":
            if ellipsis >= 0:
                raise AddrError(text, "multiple :: in address", rest)
            ellipsis, rest = i, rest[1:]
            if not rest:
                break
    if rest:
        raise AddrError(text, "trailing garbage after address", rest)
    if i < 16:
        if ellipsis < 0:
            raise AddrError(text, "address string too short")
        gap = 16 - i
        address[ellipsis + gap:16] = address[ellipsis:i]
        address[ellipsis:ellipsis + gap] = bytes(gap)
    elif ellipsis >= 0:
        raise AddrError(text, "the :: must expand to at least one field of zeros")
    return bytes(address), zone


def parse_addr(text: str) -> tuple[bytes, str]:
    """netip.ParseAddr: (4 or 16 bytes, zone); :class:`AddrError` as netip words it."""
    for ch in text:
        if ch == ".":
            return _ipv4_fields(text, 0, len(text)), ""
        if ch == ":":
            return _ipv6(text)
        if ch == "%":
            raise AddrError(text, "missing IPv6 address")
    raise AddrError(text, "unable to parse IP")


def is_4in6(address: bytes) -> bool:
    return len(address) == 16 and address[:12] == bytes(10) + b"\xff\xff"


def parse(text: str) -> bytes:
    """ip.go parseIPAddr: the address, or ``ValueError`` with upstream's message."""
    try:
        address, zone = parse_addr(text)
    except AddrError as error:
        raise ValueError(f"IP Address {go_quote(text)} parse error during conversion from string: {error}") from None
    if zone:
        raise ValueError(f"IP address {go_quote(text)} with zone value is not allowed")
    if is_4in6(address):
        raise ValueError(f"IPv4-mapped IPv6 address {go_quote(text)} is not allowed")
    return address


def addr_string(address: bytes) -> str:
    """netip Addr.String (zones and IPv4-mapped addresses never get here)."""
    if len(address) == 4:
        return ".".join(str(b) for b in address)
    groups = [address[i] << 8 | address[i + 1] for i in range(0, 16, 2)]
    start, end = -1, -1  # the first longest run of two or more zero groups
    i = 0
    while i < 8:
        j = i
        while j < 8 and groups[j] == 0:
            j += 1
        if j - i >= 2 and j - i > end - start:
            start, end = i, j
        i = j + 1 if j > i else i + 1
    if start < 0:
        return ":".join(f"{g:x}" for g in groups)
    return ":".join(f"{g:x}" for g in groups[:start]) + "::" + ":".join(f"{g:x}" for g in groups[end:])


def _ip(message: Any) -> bytes:
    return bytes(message.address)


def to_string(value: Any) -> str:
    """``string()`` of an IP (ip.go ``ip_to_string``) or a CIDR (cidr.go ``cidr_to_string``): one
    function, since cel-cpp dispatches a Python function by runtime kind and both are messages."""
    if isinstance(value, CIDRMessage):
        return f"{addr_string(bytes(value.address))}/{value.prefix_length}"
    if isinstance(value, IPMessage):
        return addr_string(_ip(value))
    raise TypeError(f"no such overload: string({type(value).__name__})")


def parses(parse: Callable[[str], Any]) -> Callable[[str], bool]:
    """``isIP``, ``isCIDR``, ``isURL``: whether the library's parse takes the string."""
    def accepted(text: str) -> bool:
        try:
            parse(text)
        except ValueError:
            return False
        return True
    return accepted


def _is_canonical(text: str) -> bool:
    # ip.go ipIsCanonical: String() is the canonical form; an invalid address is an error.
    return addr_string(parse(text)) == text


def _family(message: Any) -> int:
    return 4 if len(_ip(message)) == 4 else 6


def _is_unspecified(message: Any) -> bool:
    return not any(_ip(message))


def _is_loopback(message: Any) -> bool:
    address = _ip(message)
    return address[0] == 127 if len(address) == 4 else address == bytes(15) + b"\x01"


def _is_multicast(address: bytes) -> bool:
    return address[0] & 0xF0 == 0xE0 if len(address) == 4 else address[0] == 0xFF


def _is_link_local_unicast(address: bytes) -> bool:
    if len(address) == 4:
        return address[0] == 169 and address[1] == 254
    return address[0] == 0xFE and address[1] & 0xC0 == 0x80


def _is_link_local_multicast(message: Any) -> bool:
    address = _ip(message)
    if len(address) == 4:
        return address[:3] == b"\xe0\x00\x00"
    return address[0] == 0xFF and address[1] & 0x0F == 0x02


def _is_global_unicast(message: Any) -> bool:
    # netip Addr.IsGlobalUnicast: not 0.0.0.0, 255.255.255.255, ::, loopback, multicast or
    # link-local unicast (private ranges count as global, as in package net).
    address = _ip(message)
    if address in (bytes(4), b"\xff\xff\xff\xff", bytes(16)):
        return False
    return not (_is_loopback(message) or _is_multicast(address) or _is_link_local_unicast(address))


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """(function name, overloads), merged with the other libraries' by :mod:`.environment`.
    ``string(ip)`` is :func:`to_string`, declared by the environment (it extends a standard
    function)."""
    T = cel.Type

    def member(name: str, overload: str, result: cel.Type, impl: Any) -> tuple[str, list[cel.Overload]]:
        return name, [cel.Overload(overload, result, [IP], is_member=True, impl=impl)]

    return [
        ("ip", [cel.Overload("string_to_ip", IP, [T.STRING], impl=lambda text: IPMessage(address=parse(text)))]),
        ("isIP", [cel.Overload("is_ip", T.BOOL, [T.STRING], impl=parses(parse))]),
        ("ip.isCanonical", [cel.Overload("ip_is_canonical", T.BOOL, [T.STRING], impl=_is_canonical)]),
        member("family", "ip_family", T.INT, _family),
        member("isUnspecified", "ip_is_unspecified", T.BOOL, _is_unspecified),
        member("isLoopback", "ip_is_loopback", T.BOOL, _is_loopback),
        member("isLinkLocalMulticast", "ip_is_link_local_multicast", T.BOOL, _is_link_local_multicast),
        member("isLinkLocalUnicast", "ip_is_link_local_unicast", T.BOOL, lambda m: _is_link_local_unicast(_ip(m))),
        member("isGlobalUnicast", "ip_is_global_unicast", T.BOOL, _is_global_unicast),
    ]
