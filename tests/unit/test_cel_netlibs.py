"""The Kubernetes URL, IP, CIDR, regex and named-format CEL libraries (gpudra_operator.cel.urlslib,
.iplib, .cidrlib, .regexlib, .formatlib) against upstream's own tests, each case citing its table:

* k8s.io/apiserver@v0.35.4/pkg/cel/library/ip_test.go ``TestIP``, cidr_test.go ``TestCIDR``,
  format_test.go ``TestFormat``, and the documented examples in ip.go, cidr.go and urls.go;
* k8s.io/apiextensions-apiserver@v0.35.4/pkg/apiserver/schema/cel/validation_test.go (the "stdlib
  regex functions", "URL parsing", "IP and CIDR" and "format" cases);
* Go's own tables for what the libraries call: go/src/net/netip/netip_test.go (``TestParseAddr``,
  ``TestParsePrefixError``), net/url/url_test.go (``parseRequestURLTests``,
  ``TestURLHostnameAndPort``), regexp/find_test.go (``findTests``), regexp/all_test.go
  (``badRe``) and regexp/syntax/parse_test.go (``parseTests``).

The real kube-scheduler's answers on such selectors: tests/integration/test_cel_netlibs_scheduler.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from cel_expr_python import cel

from gpudra_operator.cel import SelectorCompileError, SelectorResult, compile_selector, device_input
from gpudra_operator.cel.environment import selector_environment

DRIVER = "net.gpudra.io"
NIC = device_input(DRIVER, {
    "name": "nic-0",
    "attributes": {
        "ip": {"string": "10.1.2.3"},
        "ip6": {"string": "2001:db8::68"},
        "mapped": {"string": "::ffff:1.2.3.4"},
        "zoned": {"string": "fe80::1%eth0"},
        "subnet": {"string": "10.0.0.0/8"},
        "endpoint": {"string": "https://user:pass@kubernetes.io:80/docs/home?k1=a&k2=b&k2=c#anchor"},
        "relative": {"string": "../relative-path"},
        "text": {"string": "this is a 123 string 456"},
        "badRegex": {"string": "("},
        "byteEscape": {"string": "\\C"},
        "name": {"string": "contains a space"},
        "index": {"int": 3},
    },
})
ATTRS = f'device.attributes["{DRIVER}"]'


def evaluate(expression: str, device=NIC) -> SelectorResult:
    # The libraries' answers, without the cost gate: cel-go estimates == between two computed CIDRs
    # past the limit (so the API server refuses such a selector; tests/unit/test_cel_cost.py).
    return compile_selector(expression).evaluate(device, cost_limit=None)


def holds(expression: str) -> bool:
    result = evaluate(expression)
    assert result.error is None, result.error
    return result.matched


def value(expression: str) -> Any:
    """The value of a non-bool expression (a list, a map, a string), on :data:`NIC`."""
    attributes, capacity = NIC.maps
    result = selector_environment().compile(expression).eval(
        data={"device": {"driver": DRIVER, "allowMultipleAllocations": False, "attributes": attributes,
                         "capacity": capacity}})
    assert result.type() != cel.Type.ERROR, result.value()

    def plain(v: Any) -> Any:
        v = v.value() if isinstance(v, cel.Value) else v
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {plain(k): plain(x) for k, x in v.items()}
        return v
    return plain(result.value())


# -- IP ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression", [
    # ip_test.go TestIP
    'string(ip("192.168.0.1")) == "192.168.0.1"',
    'isIP("192.168.0.1")',
    '!isIP("192.168.0.1.0")',
    'ip.isCanonical("127.0.0.1")',
    'ip("192.168.0.1").family() == 4',
    'ip("0.0.0.0").isUnspecified()',
    '!ip("127.0.0.1").isUnspecified()',
    'ip("127.0.0.1").isLoopback()',
    '!ip("1.2.3.4").isLoopback()',
    'ip("224.0.0.1").isLinkLocalMulticast()',
    '!ip("224.0.1.1").isLinkLocalMulticast()',
    'ip("169.254.169.254").isLinkLocalUnicast()',
    '!ip("192.168.0.1").isLinkLocalUnicast()',
    'ip("192.168.0.1").isGlobalUnicast()',
    '!ip("255.255.255.255").isGlobalUnicast()',
    'string(ip("2001:db8::68")) == "2001:db8::68"',
    'isIP("2001:db8::68")',
    '!isIP("2001:db8:::68")',
    'ip.isCanonical("2001:db8::68")',
    '!ip.isCanonical("2001:DB8::68")',
    'ip("2001:db8::68").family() == 6',
    'ip("::").isUnspecified()',
    '!ip("::1").isUnspecified()',
    'ip("::1").isLoopback()',
    '!ip("2001:db8::abcd").isLoopback()',
    'ip("ff02::1").isLinkLocalMulticast()',
    '!ip("fd00::1").isLinkLocalMulticast()',
    'ip("fe80::1").isLinkLocalUnicast()',
    '!ip("fd80::1").isLinkLocalUnicast()',
    'ip("2001:db8::abcd").isGlobalUnicast()',
    '!ip("ff00::1").isGlobalUnicast()',
    'type(ip("192.168.0.1")) == net.IP',
    # ip.go's examples
    'ip("127.0.0.1").family() == 4 && ip("::1").family() == 6',
    '!isIP("127.0.0.256") && !isIP(":::1")',
    '!ip.isCanonical("2001:DB8::ABCD") && !ip.isCanonical("2001:db8::0:0:0:abcd")',
    'ip.isCanonical("2001:db8::abcd")',
    # ip.go: "IPv4-mapped IPv6 addresses (e.g. ::ffff:1.2.3.4) are not allowed. IP addresses with
    # zones (e.g. fe80::1%eth0) are not allowed. Leading zeros in IPv4 address octets are not allowed."
    '!isIP("::ffff:1.2.3.4") && !isIP("fe80::1%eth0") && !isIP("01.2.3.4")',
    # netip_test.go TestParseAddr: String() of valid inputs (RFC 5952)
    'string(ip("fd7a:115c:a1e0:ab12:4843:cd96:626b::")) == "fd7a:115c:a1e0:ab12:4843:cd96:626b:0"',
    'string(ip("fd7a:115c:a1e0::4843:cd96:626b:430b")) == "fd7a:115c:a1e0:0:4843:cd96:626b:430b"',
    'string(ip("FD9E:1A04:F01D::1")) == "fd9e:1a04:f01d::1"',
    'string(ip("fd7a:115c::626b:430b")) == "fd7a:115c::626b:430b"',
    # value equality (ip.go Equal: the netip.Addr)
    'ip("2001:DB8::68") == ip("2001:db8::68") && ip("1.2.3.4") != ip("1.2.3.5")',
])
def test_ip_library_answers_as_upstream_tests(expression: str) -> None:
    assert holds(expression)


@pytest.mark.parametrize("address", [
    # netip_test.go TestParseAddr's invalidIPs
    "", "bad", "1234", "1.2.3.4%eth0", ".1.2.3", "1.2.3.", "1..2.3", "1.2.3.4.5", "0300.0250.0214.0377",
    "0xc0.0xa8.0x8c.0xff", "192.168.12345", "127.0.1", "192.1234567", "127.1", "192.168.300.1", "192.168.0.1.5.6",
    "1:2:3:4:5:6:7", "1:2:3:4:5:6:7:8:9", "1:2:3:4::5:6:7:8", "fe801::1", "fe80:tail:scal:e::", "fe80::1%",
    "ffff:ffff:ffff:ffff:ffff:ffff:ffff:192.168.140.255", "ffff::ffff:ffff:ffff:ffff:ffff:ffff:192.168.140.255",
    "::ffff:192.168.140.bad", "fe80::1::1", "fe80:1?:1", "fe80:", "0:0:0:0:0:ffff:0:00000",
    "0:0:0:0:00000:ffff:127.1.2.3",
])
def test_what_netip_refuses_is_no_ip(address: str) -> None:
    assert holds(f'!isIP("{address}")')


@pytest.mark.parametrize("expression, error", [
    # ip_test.go TestIP's runtime errors
    ('ip("192.168.0.1.0").family() == 4',
     'IP Address "192.168.0.1.0" parse error during conversion from string: ParseAddr("192.168.0.1.0"): '
     'IPv4 address too long'),
    ('ip.isCanonical("127.0.0.1.0")',
     'IP Address "127.0.0.1.0" parse error during conversion from string: ParseAddr("127.0.0.1.0"): '
     'IPv4 address too long'),
    ('ip("2001:db8:::68").family() == 6',
     'IP Address "2001:db8:::68" parse error during conversion from string: ParseAddr("2001:db8:::68"): '
     'each colon-separated field must have at least one digit (at ":68")'),
    ('ip.isCanonical("2001:db8:::68")',
     'IP Address "2001:db8:::68" parse error during conversion from string: ParseAddr("2001:db8:::68"): '
     'each colon-separated field must have at least one digit (at ":68")'),
    # netip_test.go TestParseAddr's wantErr, within ip.go parseIPAddr's message
    ('ip("010.000.015.001").family() == 4',
     'IP Address "010.000.015.001" parse error during conversion from string: ParseAddr("010.000.015.001"): '
     'IPv4 field has octet with leading zero'),
    ('ip("::ffff:1.2.3.z").family() == 6',
     'IP Address "::ffff:1.2.3.z" parse error during conversion from string: ParseAddr("::ffff:1.2.3.z"): '
     'unexpected character (at "z")'),
    # ip.go parseIPAddr's refusals, from a device's attributes as the scheduler reads them
    (f'ip({ATTRS}.mapped).family() == 6', 'IPv4-mapped IPv6 address "::ffff:1.2.3.4" is not allowed'),
    (f'ip({ATTRS}.zoned).isLinkLocalUnicast()', 'IP address "fe80::1%eth0" with zone value is not allowed'),
    (f'ip.isCanonical({ATTRS}.zoned)', 'IP address "fe80::1%eth0" with zone value is not allowed'),
    (f'cidr("::/0").containsIP(ip({ATTRS}.mapped))', 'IPv4-mapped IPv6 address "::ffff:1.2.3.4" is not allowed'),
])
def test_an_invalid_ip_is_an_error_not_false(expression: str, error: str) -> None:
    assert evaluate(expression) == SelectorResult(False, error)


def test_ip_type_errors_are_compile_errors() -> None:
    # ip_test.go: "passing cidr into isIP returns compile error"
    with pytest.raises(SelectorCompileError, match=r"found no matching overload for 'isIP' applied to '\(net.CIDR\)'"):
        compile_selector('isIP(cidr("192.168.0.0/24"))')
    with pytest.raises(SelectorCompileError, match="found no matching overload for '_==_'"):
        compile_selector('ip("1.2.3.4") == cidr("1.2.3.4/32")')  # different opaque types, as in cel-go


# -- CIDR --------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression", [
    # cidr_test.go TestCIDR
    'cidr("192.168.0.0/24") == cidr("192.168.0.0/24") && string(cidr("192.168.0.0/24")) == "192.168.0.0/24"',
    'cidr("192.168.0.0/24").containsIP(ip("192.168.0.1"))',
    '!cidr("192.168.0.0/24").containsIP(ip("192.168.1.1"))',
    'cidr("192.168.0.0/24").containsIP("192.168.0.1")',
    '!cidr("192.168.0.0/24").containsIP("192.168.1.1")',
    'cidr("192.168.0.0/24").containsCIDR(cidr("192.168.0.0/25"))',
    'cidr("192.168.0.0/24").containsCIDR(cidr("192.168.0.1/32"))',
    '!cidr("192.168.0.0/24").containsCIDR(cidr("192.168.0.0/23"))',
    '!cidr("192.168.0.0/24").containsCIDR(cidr("192.169.0.1/32"))',
    'cidr("192.168.0.0/24").containsCIDR("192.168.0.0/25")',
    '!cidr("192.168.0.0/24").containsCIDR("192.168.0.0/23")',
    'cidr("192.168.0.0/24").ip() == ip("192.168.0.0")',
    'cidr("192.168.0.0/24").masked() == cidr("192.168.0.0/24")',
    'cidr("192.168.0.1/24").masked() == cidr("192.168.0.0/24")',
    'cidr("192.168.0.0/24").prefixLength() == 24',
    'string(cidr("2001:db8::/32")) == "2001:db8::/32"',
    'cidr("2001:db8::/32").containsIP(ip("2001:db8::1"))',
    '!cidr("2001:db8::/32").containsIP(ip("2001:dc8::1"))',
    'cidr("2001:db8::/32").containsIP("2001:db8::1")',
    '!cidr("2001:db8::/32").containsIP("2001:dc8::1")',
    'cidr("2001:db8::/32").containsCIDR(cidr("2001:db8::/33"))',
    '!cidr("2001:db8::/32").containsCIDR(cidr("2001:db8::/31"))',
    'cidr("2001:db8::/32").containsCIDR("2001:db8::/33")',
    '!cidr("2001:db8::/32").containsCIDR("2001:db8::/31")',
    'cidr("2001:db8::/32").ip() == ip("2001:db8::")',
    'cidr("2001:db8::/32").masked() == cidr("2001:db8::/32")',
    'cidr("2001:db8:1::/32").masked() == cidr("2001:db8::/32")',
    'cidr("2001:db8::/32").prefixLength() == 32',
    'string(cidr("192.168.0.0/24")) == "192.168.0.0/24"',
    'type(cidr("192.168.0.0/24")) == net.CIDR',
    # cidr.go's examples
    'cidr("192.168.0.1/24").ip() == ip("192.168.0.1") && cidr("192.168.0.1/24").ip().family() == 4',
    'cidr("::1/128").ip() == ip("::1") && cidr("::1/128").ip().family() == 6',
    'cidr("192.168.0.0/24") == cidr("192.168.0.0/24").masked()',
    'cidr("192.168.0.1/24") != cidr("192.168.0.1/24").masked()',  # not in canonical form
    'cidr("192.168.0.0/16").prefixLength() == 16 && cidr("::1/128").prefixLength() == 128',
    'cidr("192.168.0.0/16").containsCIDR(cidr("192.168.10.0/24")) && !cidr("192.168.1.0/24").containsCIDR(cidr("192.168.2.0/24"))',
    'isCIDR("192.168.0.0/16") && isCIDR("::1/128") && !isCIDR("192.168.0.0/33") && !isCIDR("::1/129")',
    # validation_test.go "IP and CIDR"
    'type(cidr("2001:db8::/32").ip()) == net.IP',
    # netip_test.go TestParsePrefixError: none of these is a CIDR
    '!isCIDR("192.168.0.0") && !isCIDR("1.257.1.1/24") && !isCIDR("1.1.1.0/q") && !isCIDR("1.1.1.0/-1")',
    '!isCIDR("1.1.1.0/33") && !isCIDR("2001::/129") && !isCIDR("1.1.1.0%a/24") && !isCIDR("2001:db8::%a/32")',
    '!isCIDR("1.1.1.0/+32") && !isCIDR("1.1.1.0/-32") && !isCIDR("1.1.1.0/032") && !isCIDR("1.1.1.0/0032")',
    # cidr.go: "IPv4-mapped IPv6 addresses (e.g. ::ffff:1.2.3.4/24) are not allowed"
    '!isCIDR("::ffff:1.2.3.4/24")',
    # an attribute holding a CIDR or an IP, as a selector would use them
    f'cidr({ATTRS}.subnet).containsIP({ATTRS}.ip) && !cidr({ATTRS}.subnet).containsIP({ATTRS}.ip6)',
])
def test_cidr_library_answers_as_upstream_tests(expression: str) -> None:
    assert holds(expression)


_DOUBLE = "network address parse error during conversion from string: " * 2


@pytest.mark.parametrize("expression, error", [
    # cidr_test.go TestCIDR's runtime errors (upstream's message says its prefix twice)
    ('cidr("192.168.0.0/").prefixLength() == 0', _DOUBLE + 'netip.ParsePrefix("192.168.0.0/"): bad bits after slash: ""'),
    ('cidr("2001:db8::/").prefixLength() == 0', _DOUBLE + 'netip.ParsePrefix("2001:db8::/"): bad bits after slash: ""'),
    # containsCIDR passes the parse error on ...
    ('cidr("10.0.0.0/8").containsCIDR("10.0.0.0")', _DOUBLE + 'netip.ParsePrefix("10.0.0.0"): no \'/\''),
    # ... containsIP reports "no such overload" (cidr.go cidrContainsIP: MaybeNoSuchOverloadErr(arg))
    (f'cidr("10.0.0.0/8").containsIP({ATTRS}.zoned)', "no such overload"),
    ('cidr("::ffff:1.2.3.4/24").prefixLength() == 24',
     'network address parse error during conversion from string: IPv4-mapped IPv6 address "::ffff:1.2.3.4/24" is not allowed'),
])
def test_an_invalid_cidr_is_an_error_not_false(expression: str, error: str) -> None:
    assert evaluate(expression) == SelectorResult(False, error)


# -- URL ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression", [
    # validation_test.go "URL parsing" (and urls.go's examples)
    "url('/path').getScheme() == ''",
    "url('https://example.com/').getScheme() == 'https'",
    "url('https://example.com:80/').getHost() == 'example.com:80'",
    "url('https://example.com/').getHost() == 'example.com'",
    "url('https://[::1]:80/').getHost() == '[::1]:80'",
    "url('https://[::1]/').getHost() == '[::1]'",
    "url('/path').getHost() == ''",
    "url('https://example.com:80/').getHostname() == 'example.com'",
    "url('https://127.0.0.1/').getHostname() == '127.0.0.1'",
    "url('https://[::1]/').getHostname() == '::1'",
    "url('/path').getHostname() == ''",
    "url('https://example.com:80/').getPort() == '80'",
    "url('https://example.com/').getPort() == ''",
    "url('/path').getPort() == ''",
    "url('https://example.com/path').getEscapedPath() == '/path'",
    "url('https://example.com/with space/').getEscapedPath() == '/with%20space/'",
    "url('https://example.com').getEscapedPath() == ''",
    "url('https://example.com/path?k1=a&k2=b&k2=c').getQuery() == { 'k1': ['a'], 'k2': ['b', 'c']}",
    "url('https://example.com/path?key with spaces=value with spaces').getQuery() == { 'key with spaces': ['value with spaces']}",
    "url('https://example.com/path?').getQuery() == {}",
    "url('https://example.com/path').getQuery() == {}",
    f"url({ATTRS}.endpoint).getScheme() == 'https'",
    f"url({ATTRS}.endpoint).getHost() == 'kubernetes.io:80'",
    f"url({ATTRS}.endpoint).getHostname() == 'kubernetes.io'",
    f"url({ATTRS}.endpoint).getPort() == '80'",
    f"url({ATTRS}.endpoint).getEscapedPath() == '/docs/home'",
    f"url({ATTRS}.endpoint).getQuery() == {{'k1': ['a'], 'k2': ['b', 'c']}}",
    "isURL('https://user:pass@example.com:80/path?query=val#fragment')",
    "isURL('/path') == true",
    "isURL('https://a:b:c/') == false",
    "isURL('../relative-path') == false",
    "url('https:://kubernetes.io/').getHostname() != 'test'",  # validation_test.go's cost case
    # urls.go's examples
    "url('https://example.com/path with spaces/').getEscapedPath() == '/path%20with%20spaces/'",
    "url('https://127.0.0.1:80/').getHostname() == '127.0.0.1' && url('https://[::1]:80/').getHostname() == '::1'",
    # url.go Equal compares String(): the same URL however it was escaped
    "url('https://example.com/with space/') == url('https://example.com/with%20space/')",
    "url('https://example.com/a') != url('https://example.com/b')",
    # url_test.go parseRequestURLTests
    "isURL('http://foo.com') && isURL('http://foo.com/') && isURL('http://foo.com/path') && isURL('/')",
    "isURL('//not.a.user@not.a.host/just/a/path') && isURL('//not.a.user@%66%6f%6f.com/just/a/path/also')",
    "isURL('*') && isURL('http://192.168.0.1/') && isURL('http://192.168.0.1:8080/')",
    "isURL('http://[fe80::1]/') && isURL('http://[fe80::1]:8080/') && isURL('http://[fe80::1%25en0]/')",
    "isURL('http://[fe80::1%25en0]:8080/') && isURL('http://[fe80::1%25%65%6e%301-._~]/')",
    "isURL('https://[1:2:3:4:5:6:7:8]') && isURL('https://[2001:db8::a:b:c:d]') && isURL('https://[fe80::abc:def%254]')",
    "isURL('https://[2001:db8::1]/path') && isURL('https://[fe80::1%25eth0]/path?query=1')",
    "isURL('https://[::ffff:192.0.2.1]')",
    "!isURL('foo.html') && !isURL('../dir/') && !isURL(' http://foo.com') && !isURL('http://192.168.0.%31/')",
    "!isURL('http://[fe80::%31]/') && !isURL('http://[fe80::%31%25en0]/') && !isURL('http://[fe80::1%en0]/')",
    "!isURL('https://[:1] ') && !isURL('https://[1:2:3:4:5:6:7:8:9]') && !isURL('https://[1::1::1]')",
    "!isURL('https://[1:2:3:]') && !isURL('https://[ffff::127.0.0.4000]') && !isURL('https://[0:0::test.com]:80')",
    "!isURL('https://[2001:db8::test.com]') && !isURL('https://[test.com]')",
    # Kubernetes 1.35 is a Go 1.25 module: GODEBUG urlstrictcolons=0 (go/doc/godebug.md, Go 1.26),
    # so a port is what follows the last colon, and http://localhost:1:2 parses
    "isURL('http://localhost:1:2') && url('http://localhost:1:2').getHost() == 'localhost:1:2'",
    # url_test.go TestURLHostnameAndPort, through URLs with those hosts
    "url('http://foo.com:/').getHostname() == 'foo.com' && url('http://foo.com:/').getPort() == ''",
    "url('http://FOO.COM/').getHostname() == 'FOO.COM'",
    "url('http://[1:2:3:4::]:80/').getHostname() == '1:2:3:4::' && url('http://[::1]:/').getPort() == ''",
    "url('http://[2001:0db8:85a3:0000:0000:8a2e:0370:7334]:17000/').getHostname() == '2001:0db8:85a3:0000:0000:8a2e:0370:7334'",
])
def test_url_library_answers_as_upstream_tests(expression: str) -> None:
    assert holds(expression)


@pytest.mark.parametrize("expression, error", [
    # urls.go's examples: url('https://a:b:c/') and url('../relative-path') are errors
    ("url('https://a:b:c/').getHost() == ''",
     'URL parse error during conversion from string: parse "https://a:b:c/": invalid port ":c" after host'),
    (f"url({ATTRS}.relative).getHost() == ''",
     'URL parse error during conversion from string: parse "../relative-path": invalid URI for request'),
])
def test_an_invalid_url_is_an_error_not_false(expression: str, error: str) -> None:
    assert evaluate(expression) == SelectorResult(False, error)


# -- regex -------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression", [
    # validation_test.go "stdlib regex functions", on a device attribute
    f"{ATTRS}.text.find('[0-9]+') == '123'",
    f"{ATTRS}.text.find('[0-9]+') != '456'",
    f"{ATTRS}.text.find('xyz') == ''",
    f"{ATTRS}.text.findAll('[0-9]+') == ['123', '456']",
    f"{ATTRS}.text.findAll('[0-9]+', 0) == []",
    f"{ATTRS}.text.findAll('[0-9]+', 1) == ['123']",
    f"{ATTRS}.text.findAll('[0-9]+', 2) == ['123', '456']",
    f"{ATTRS}.text.findAll('[0-9]+', 3) == ['123', '456']",
    f"{ATTRS}.text.findAll('[0-9]+', -1) == ['123', '456']",
    f"{ATTRS}.text.findAll('xyz') == []",
    f"{ATTRS}.text.findAll('xyz', 1) == []",
    # regexp/find_test.go findTests (FindAllString of their index tables): empty matches move on
    # one character, and none is taken right after a previous match
    "'baaab'.findAll('a*') == ['', 'aaa', '']",
    "'x y'.findAll(r'\\b') == ['', '', '', ''] && 'xx yy'.findAll(r'\\B') == ['', '']",
    "'aa'.findAll('(|a)*') == ['', '', '']",
    "'abbaab'.findAll('ab*') == ['abb', 'a', 'ab']",
    "'日本語日本語'.findAll('[日本語]+') == ['日本語日本語'] && '日本語語語語'.find('日本語+') == '日本語語語語'",
    "'abcde'.findAll('$') == [''] && '/abc/'.find('/$') == '/' && '/abc'.findAll('/$') == []",
    "'\\n'.findAll('(?:(?:^).)') == [] && '\\n'.findAll('(?s)(?:(?:^).)') == ['\\n']",
    # RE2 syntax Python's re does not have: find_test.go's "RE2 tests" and escapes, parse_test.go
    "'abcd'.findAll(r'[^\\S\\s]') == [] && 'abcd'.findAll('[^\\\\D[:digit:]]') == []",
    "'x'.findAll(r'(?i)\\W') == [] && 'k'.findAll(r'(?i)\\W') == [] && 's'.findAll(r'(?i)\\W') == []",
    "'a+|*?{[b'.find(r'\\Q+|*?{[\\E') == '+|*?{['",
    r"'⠁a'.find('\\p{Braille}') == '⠁' && 'aB'.findAll(r'\p{Lu}') == ['B']",
    # parse_test.go: Go 1.25's class names, matched as unicode.IsUpper
    r"'aBcD'.findAll('\\p{Uppercase_Letter}') == ['B', 'D'] && 'aBcD'.findAll('\\p{upper case-let ter}') == ['B', 'D']",
    r"'a\u017f\u212a!é'.findAll('(?i)\\p{ascii}') == ['a', '\u017f', '\u212a', '!']",
])
def test_regex_library_answers_as_upstream_tests(expression: str) -> None:
    assert holds(expression)


def test_a_literal_pattern_that_does_not_compile_fails_the_compilation() -> None:
    # validation_test.go: "Invalid regex with a string constant regex pattern is compile time error"
    for expression in ["'x'.find(')') == ''", "'x'.findAll(')') == []", "'x'.findAll(')', 1) == []"]:
        with pytest.raises(SelectorCompileError) as info:
            compile_selector(expression)
        assert info.value.message == "compilation failed: program instantiation failed: error parsing regexp: unexpected ): `)`"


@pytest.mark.parametrize("pattern, error", [
    # regexp/all_test.go badRe, as regex.go reports a pattern that is not a literal
    ("*", "missing argument to repetition operator: `*`"),
    ("(abc", "missing closing ): `(abc`"),
    ("abc)", "unexpected ): `abc)`"),
    ("x[a-z", "missing closing ]: `[a-z`"),
    ("[z-a]", "invalid character class range: `z-a`"),
    ("a**", "invalid nested repetition operator: `**`"),
    ("a*+", "invalid nested repetition operator: `*+`"),
    ("\\x", "invalid escape sequence: `\\x`"),
    ("\\C", "invalid escape sequence: `\\C`"),  # Go's syntax has no \C (C++ RE2's has)
])
def test_a_bad_pattern_from_the_device_is_an_error(pattern: str, error: str) -> None:
    device = device_input(DRIVER, {"name": "d", "attributes": {"pattern": {"string": pattern}}})
    result = evaluate(f"'abc'.find({ATTRS}.pattern) == ''", device)
    assert result == SelectorResult(False, f"Illegal regex: error parsing regexp: {error}")
    assert evaluate(f"'abc'.findAll({ATTRS}.pattern).size() == 0 || true", device) == SelectorResult(True)


# -- named formats -----------------------------------------------------------------------------

_DNS1123_LABEL = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
                  "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
                  "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
_DNS1123_SUBDOMAIN = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                      "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                      "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_DNS1035_LABEL = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                  "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
                  "regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
_QUALIFIED_NAME = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
                   "an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for "
                   "validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
_LABEL_VALUE = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
                "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
                "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")


@pytest.mark.parametrize("call, text, errors", [
    # format_test.go TestFormat (None: optional.none(), the string is valid)
    ("format.dns1123Label()", "my-label-name", None),
    ("format.dns1123Subdomain()", "apiextensions.k8s.io", None),
    ("format.qualifiedName()", "apiextensions.k8s.io/v1beta1", None),
    ("format.dns1123LabelPrefix()", "my-label-prefix-", None),
    ("format.dns1123SubdomainPrefix()", "mysubdomain.prefix.-", None),
    ("format.dns1035LabelPrefix()", "my-label-prefix-", None),
    ("format.uri()", "http://example.com", None),
    ("format.uuid()", "123e4567-e89b-12d3-a456-426614174000", None),
    ("format.byte()", "aGVsbG8=", None),
    ("format.date()", "2021-01-01", None),
    ("format.datetime()", "2021-01-01T00:00:00Z", None),
    ("format.dns1123Label()", "contains a space", [_DNS1123_LABEL]),
    ("format.dns1123Subdomain()", "contains a space", [_DNS1123_SUBDOMAIN]),
    ("format.dns1035Label()", "contains a space", [_DNS1035_LABEL]),
    ("format.qualifiedName()", "contains a space", [_QUALIFIED_NAME]),
    ("format.dns1123LabelPrefix()", "contains a space-", [_DNS1123_LABEL]),
    ("format.dns1123SubdomainPrefix()", "contains a space-", [_DNS1123_SUBDOMAIN]),
    ("format.dns1035LabelPrefix()", "contains a space-", [_DNS1035_LABEL]),
    ("format.dns1123Subdomain()", "example.com", None),
    ("format.dns1035Label()", "my-label-name", None),
    ("format.qualifiedName()", "my.name", None),
    ("format.byte()", "aGVsbG8", ["invalid base64"]),
    ("format.date()", "2020-01-01", None),
    ("format.date()", "2020-01-32", ["invalid date"]),
    ("format.datetime()", "2020-01-01T00:00:00Z", None),
    ("format.datetime()", "2020-01-32T00:00:00Z", ["invalid datetime"]),
    ("format.labelValue()", "my-cool-label-Value", None),
    ("format.labelValue()", "my-cool-label-Value!!\n\n!!!", [_LABEL_VALUE]),
    # validation_test.go "format"
    ('format.named("dns1123Label").value()', "my-name", None),
])
def test_named_formats_validate_as_upstream_tests(call: str, text: str, errors: list[str] | None) -> None:
    device = device_input(DRIVER, {"name": "d", "attributes": {"text": {"string": text}}})
    if errors is None:
        assert evaluate(f"{call}.validate({ATTRS}.text) == optional.none()", device) == SelectorResult(True)
        assert evaluate(f"!{call}.validate({ATTRS}.text).hasValue()", device) == SelectorResult(True)
    else:
        assert evaluate(f"{call}.validate({ATTRS}.text).hasValue()", device) == SelectorResult(True)
        assert value(f"{call}.validate({json.dumps(text)}).value()") == errors


FORMATS = ["dns1123Label", "dns1123Subdomain", "dns1035Label", "qualifiedName", "dns1123LabelPrefix",
           "dns1123SubdomainPrefix", "dns1035LabelPrefix", "labelValue", "uri", "uuid", "byte", "date", "datetime"]


def test_format_lookup_and_comparison() -> None:
    # format_test.go TestFormat: every named format exists, is its constructor's, and no other's
    for name in FORMATS:
        assert holds(f'format.named("{name}").hasValue()')
        assert holds(f'format.named("{name}").value() == format.{name}()')
        for other in FORMATS:
            if other != name:
                assert holds(f"format.{name}() != format.{other}()")
    assert holds('!format.named("unknown").hasValue()')  # "unknown_format"
    # validation_test.go "format": the optionals compose as optionals
    assert value('format.dns1123Label().validate("contains a space").value()[0]') == _DNS1123_LABEL
    assert holds(f'format.named({ATTRS}.name).orValue(format.uri()).validate("http://example.com") == optional.none()')
    assert holds('[format.named("uuid"), format.named("nope")].filter(f, f.hasValue()).size() == 1')


def test_format_errors_and_types_are_upstreams() -> None:
    assert value('format.uri().validate("../relative-path").value()') == ['parse "../relative-path": invalid URI for request']
    assert holds('type(format.uuid()) == kubernetes.NamedFormat')
    with pytest.raises(SelectorCompileError, match="undeclared reference to 'validate'"):
        compile_selector('validate(format.uri(), "x").hasValue()')  # a member function only (format.go)
    # format.named's result is optional: using it as a Format is a type error, as in cel-go
    with pytest.raises(SelectorCompileError, match="found no matching overload for 'validate'"):
        compile_selector('format.named("uri").validate("x").hasValue()')
