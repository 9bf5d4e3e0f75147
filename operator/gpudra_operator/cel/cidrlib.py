"""``cidr()`` and its members, as k8s.io/apiserver/pkg/cel/library/cidr.go (Kubernetes 1.35, in the
base environment from 1.30) declares them: ``cidr``, ``isCIDR``, ``string(cidr)`` (with
:func:`.iplib.to_string`), and the members ``containsIP`` and ``containsCIDR`` (each with a string
or a value), ``ip``, ``prefixLength`` and ``masked``.

Parsing is Go's ``netip.ParsePrefix`` with its error messages, plus upstream's refusal of an
IPv4-mapped address; the address keeps its host bits (``cidr("10.0.0.1/8")`` is valid and unequal
to ``cidr("10.0.0.0/8")``; ``masked()`` clears them).

Two upstream quirks are kept: a failed parse's message says "network address parse error during
conversion from string: " twice (``stringToCIDR`` wraps ``parseCIDR``'s already wrapped error), and
``containsIP`` with a string that is not an IP is the error "no such overload", not the parse error
(``cidrContainsIP`` reports the CIDR argument), where ``containsCIDR`` passes the parse error on.
"""

from __future__ import annotations

from typing import Any

from cel_expr_python import cel

from gpudra_operator.cel import iplib
from gpudra_operator.cel.opaque import CIDR_TYPE, CIDRMessage, IPMessage

CIDR = cel.Type(CIDR_TYPE)
_PREFIX = "network address parse error during conversion from string: "


def _prefix_error(text: str, message: str) -> ValueError:
    return ValueError(f"{_PREFIX}{_PREFIX}netip.ParsePrefix({iplib.go_quote(text)}): {message}")


def parse(text: str) -> tuple[bytes, int]:
    """cidr.go parseCIDR over netip.ParsePrefix: (address, prefix length), or ``ValueError`` with
    upstream's message."""
    slash = text.rfind("/")
    if slash < 0:
        raise _prefix_error(text, "no '/'")
    try:
        address, zone = iplib.parse_addr(text[:slash])
    except iplib.AddrError as error:
        raise _prefix_error(text, str(error)) from None
    if zone:
        raise _prefix_error(text, "IPv6 zones cannot be present in a prefix")
    bits = text[slash + 1:]
    # strconv.Atoi with netip's extra refusals: no sign, no leading zero, within int64.
    if not bits.isascii() or not bits.isdigit() or (len(bits) > 1 and bits[0] == "0") or int(bits) >= 2**63:
        raise _prefix_error(text, f"bad bits after slash: {iplib.go_quote(bits)}")
    if int(bits) > len(address) * 8:
        raise _prefix_error(text, "prefix length out of range")
    if iplib.is_4in6(address):
        raise ValueError(f"{_PREFIX}IPv4-mapped IPv6 address {iplib.go_quote(text)} is not allowed")
    return address, int(bits)


def _message(text: str) -> Any:
    address, bits = parse(text)
    return CIDRMessage(address=address, prefix_length=bits)


def _masked(address: bytes, bits: int) -> bytes:
    value = int.from_bytes(address, "big")
    width = len(address) * 8
    return (value >> (width - bits) << (width - bits)).to_bytes(len(address), "big")


def _contains_ip(cidr: Any, ip: Any) -> bool:
    # netip Prefix.Contains: same family, and the first prefixLength bits equal.
    address, other = bytes(cidr.address), bytes(ip.address)
    return len(address) == len(other) and _masked(address, cidr.prefix_length) == _masked(other, cidr.prefix_length)


def _contains_ip_string(cidr: Any, text: str) -> bool:
    try:
        address = iplib.parse(text)
    except ValueError:
        raise ValueError("no such overload") from None  # cidr.go: MaybeNoSuchOverloadErr(the CIDR)
    return _contains_ip(cidr, IPMessage(address=address))


def _contains_cidr(cidr: Any, other: Any) -> bool:
    # cidr.go: Overlaps and a prefix no longer than the other's, i.e. the other's first
    # prefixLength bits are this one's.
    if len(cidr.address) != len(other.address) or cidr.prefix_length > other.prefix_length:
        return False
    return _contains_ip(cidr, other)


def _contains_cidr_string(cidr: Any, text: str) -> bool:
    return _contains_cidr(cidr, _message(text))


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """(function name, overloads), merged with the other libraries' by :mod:`.environment`."""
    T = cel.Type
    member = True
    return [
        ("cidr", [cel.Overload("string_to_cidr", CIDR, [T.STRING], impl=_message)]),
        ("isCIDR", [cel.Overload("is_cidr", T.BOOL, [T.STRING], impl=iplib.parses(parse))]),
        ("containsIP", [
            cel.Overload("cidr_contains_ip_string", T.BOOL, [CIDR, T.STRING], is_member=member, impl=_contains_ip_string),
            cel.Overload("cidr_contains_ip_ip", T.BOOL, [CIDR, iplib.IP], is_member=member, impl=_contains_ip)]),
        ("containsCIDR", [
            cel.Overload("cidr_contains_cidr_string", T.BOOL, [CIDR, T.STRING], is_member=member,
                         impl=_contains_cidr_string),
            cel.Overload("cidr_contains_cidr", T.BOOL, [CIDR, CIDR], is_member=member, impl=_contains_cidr)]),
        ("ip", [cel.Overload("cidr_ip", iplib.IP, [CIDR], is_member=member,
                             impl=lambda cidr: IPMessage(address=bytes(cidr.address)))]),
        ("prefixLength", [cel.Overload("cidr_prefix_length", T.INT, [CIDR], is_member=member,
                                       impl=lambda cidr: cidr.prefix_length)]),
        ("masked", [cel.Overload("cidr_masked", CIDR, [CIDR], is_member=member, impl=lambda cidr: CIDRMessage(
            address=_masked(bytes(cidr.address), cidr.prefix_length), prefix_length=cidr.prefix_length))]),
    ]
