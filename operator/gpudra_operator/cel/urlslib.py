"""``url()`` and its members, as k8s.io/apiserver/pkg/cel/library/urls.go (Kubernetes 1.35, in every
base environment) declares them: ``url``, ``isURL``, and the members ``getScheme``, ``getHost``,
``getHostname``, ``getPort``, ``getEscapedPath`` and ``getQuery``.

``isURL`` is Go's ``url.ParseRequestURI`` succeeding; ``url`` checks with it and then keeps what
``url.Parse`` makes of the string (upstream parses twice: ParseRequestURI mistakes a fragment for
part of the path or query). Both are ported here from go/src/net/url/url.go with their error
messages. Bracketed hosts must hold an IPv6 address (netip, :mod:`.iplib`).

Which Go: Kubernetes 1.35 builds with ``godebug default=go1.25``, where a host's port is what
follows its *last* colon, for every scheme; 1.36 and later with ``default=go1.26``, whose
``urlstrictcolons`` makes an ``http``/``https`` host with more than one colon an error ("invalid
port"). :data:`strict_colons` says which, for the selector being run
(:class:`~gpudra_operator.cel.releases.CelRelease`); ``format.uri()`` parses the same way.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from cel_expr_python import cel

from gpudra_operator.cel import iplib
from gpudra_operator.cel.opaque import URL_TYPE, URLMessage

URL = cel.Type(URL_TYPE)

# Go 1.26's urlstrictcolons for the selector being run (cel-cpp calls this module's functions
# synchronously from inside the run, so the run sets it around itself).
strict_colons: ContextVar[bool] = ContextVar("strict_url_colons", default=False)

# url.go's encoding modes.
PATH, PATH_SEGMENT, HOST, ZONE, USER_PASSWORD, QUERY_COMPONENT, FRAGMENT = range(7)
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_HOST_EXTRA = frozenset("!$&'()*,;=:[]<>\"+")
_RESERVED = frozenset("$&+,/:;=?@")
_HEXDIGITS = frozenset("0123456789abcdefABCDEF")
_MAX_QUERY_PARAMETERS = 10000  # url.go defaultMaxParams (GODEBUG urlmaxqueryparams unset)


class URLError(ValueError):
    pass


def _should_escape(byte: int, mode: int) -> bool:
    """url.go shouldEscape (gen_encoding_table.go), for one byte."""
    c = chr(byte)
    if c in _ALNUM:
        return False
    if mode in (HOST, ZONE) and c in _HOST_EXTRA:
        return False
    if c in "-_.~":
        return False
    if c in _RESERVED:
        if mode == PATH:
            return c == "?"
        if mode == PATH_SEGMENT:
            return c in "/;,?"
        if mode == USER_PASSWORD:
            return c in "@/?:"
        if mode == QUERY_COMPONENT:
            return True
        if mode == FRAGMENT:
            return False
    if mode == FRAGMENT and c in "!()*":
        return False
    return True


def _escape(text: str, mode: int) -> str:
    """url.go escape: bytes that need it become %XX (upper case); a query component's spaces +."""
    out: list[str] = []
    for byte in text.encode(errors="surrogateescape"):
        if byte == 0x20 and mode == QUERY_COMPONENT:
            out.append("+")
        elif _should_escape(byte, mode):
            out.append(f"%{byte:02X}")
        else:
            out.append(chr(byte))
    return "".join(out)


def _unescape(text: str, mode: int) -> str:
    """url.go unescape, over the UTF-8 bytes (a %XX may be half a character; bytes that are no
    UTF-8 are kept as surrogate escapes, as Go keeps them in its string)."""
    raw = text.encode(errors="surrogateescape")
    i = 0
    while i < len(raw):
        byte = raw[i]
        if byte == 0x25:  # %
            chunk = raw[i:i + 3]
            if len(chunk) < 3 or chr(chunk[1]) not in _HEXDIGITS or chr(chunk[2]) not in _HEXDIGITS:
                raise URLError(f"invalid URL escape {iplib.go_quote(raw[i:i + 3].decode(errors='surrogateescape'))}")
            value = int(chunk[1:].decode(), 16)
            # RFC 3986: in a host %-encoding is for non-ASCII bytes only, bar %25 (RFC 6874 zones).
            if mode == HOST and int(chr(chunk[1]), 16) < 8 and chunk != b"%25":
                raise URLError(f"invalid URL escape {iplib.go_quote(chunk.decode())}")
            if mode == ZONE and chunk != b"%25" and value != 0x20 and _should_escape(value, HOST):
                raise URLError(f"invalid URL escape {iplib.go_quote(chunk.decode())}")
            i += 3
            continue
        if mode in (HOST, ZONE) and byte < 0x80 and _should_escape(byte, mode):
            raise URLError(f"invalid character {iplib.go_quote(chr(byte))} in host name")
        i += 1
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == 0x25:
            out.append(int(raw[i + 1:i + 3].decode(), 16))
            i += 3
            continue
        out.append(0x20 if raw[i] == 0x2B and mode == QUERY_COMPONENT else raw[i])
        i += 1
    return out.decode(errors="surrogateescape")


def _cel_text(text: str) -> str:
    """A Go string that is no UTF-8 as a CEL string: each stray byte U+FFFD, one character as Go
    counts one rune for it (CEL has no string that holds the byte itself)."""
    return "".join("\ufffd" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in text)


def _valid_optional_port(port: str) -> bool:
    return port == "" or (port[0] == ":" and all("0" <= c <= "9" for c in port[1:]))


def _valid_userinfo(text: str) -> bool:
    return all(c in _ALNUM or c in "-._:~!$&'()*+,;=%@" for c in text)


@dataclass
class ParsedURL:
    """The fields of Go's url.URL that String() and the getters read."""

    scheme: str = ""
    opaque: str = ""
    user: tuple[str, str | None] | None = None  # username, password (None: not set)
    host: str = ""
    path: str = ""
    raw_path: str = ""
    omit_host: bool = False
    force_query: bool = False
    raw_query: str = ""
    fragment: str = ""
    raw_fragment: str = ""

    def set_path(self, escaped: str) -> None:
        self.path = _unescape(escaped, PATH)
        self.raw_path = "" if _escape(self.path, PATH) == escaped else escaped

    def set_fragment(self, escaped: str) -> None:
        self.fragment = _unescape(escaped, FRAGMENT)
        self.raw_fragment = "" if _escape(self.fragment, FRAGMENT) == escaped else escaped

    def escaped_path(self) -> str:
        """url.URL.EscapedPath."""
        if _hint_holds(self.raw_path, self.path, PATH):
            return self.raw_path
        return "*" if self.path == "*" else _escape(self.path, PATH)

    def escaped_fragment(self) -> str:
        """url.URL.EscapedFragment."""
        return self.raw_fragment if _hint_holds(self.raw_fragment, self.fragment, FRAGMENT) else \
            _escape(self.fragment, FRAGMENT)

    def string(self) -> str:
        """url.URL.String."""
        out = f"{self.scheme}:" if self.scheme else ""
        if self.opaque:
            out += self.opaque
        else:
            if (self.scheme or self.host or self.user is not None) and not (
                    self.omit_host and not self.host and self.user is None):
                if self.host or self.path or self.user is not None:
                    out += "//"
                if self.user is not None:
                    username, password = self.user
                    out += _escape(username, USER_PASSWORD)
                    if password is not None:
                        out += ":" + _escape(password, USER_PASSWORD)
                    out += "@"
                out += _escape(self.host, HOST)
            path = self.escaped_path()
            if path and path[0] != "/" and self.host:
                out += "/"
            if not out and ":" in path.split("/", 1)[0]:
                out += "./"  # RFC 3986 4.2: a first segment with a colon would read as a scheme
            out += path
        if self.force_query or self.raw_query:
            out += "?" + self.raw_query
        if self.fragment:
            out += "#" + self.escaped_fragment()
        return out


def _hint_holds(raw: str, decoded: str, mode: int) -> bool:
    """Whether a RawPath/RawFragment hint is a valid escaping of what was decoded from it."""
    if not raw or not _valid_encoded(raw, mode):
        return False
    try:
        return _unescape(raw, mode) == decoded
    except URLError:
        return False


def _valid_encoded(text: str, mode: int) -> bool:
    for byte in text.encode():
        c = chr(byte)
        if c in "!$&'()*+,;=:@[]%":
            continue
        if _should_escape(byte, mode):
            return False
    return True


def _scheme(raw: str) -> tuple[str, str]:
    """url.go getScheme."""
    for i, c in enumerate(raw):
        if "a" <= c <= "z" or "A" <= c <= "Z":
            continue
        if "0" <= c <= "9" or c in "+-.":
            if i == 0:
                return "", raw
            continue
        if c == ":":
            if i == 0:
                raise URLError("missing protocol scheme")
            return raw[:i], raw[i + 1:]
        return "", raw
    return "", raw


def _parse_host(scheme: str, host: str) -> str:
    """url.go parseHost."""
    open_bracket = host.rfind("[")
    if open_bracket > 0:
        raise URLError("invalid IP-literal")
    if open_bracket == 0:
        close_bracket = host.rfind("]")
        if close_bracket < 0:
            raise URLError("missing ']' in host")
        colon_port = host[close_bracket + 1:]
        if not _valid_optional_port(colon_port):
            raise URLError(f"invalid port {iplib.go_quote(colon_port)} after host")
        colon_port = _unescape(colon_port, HOST)
        hostname = host[1:close_bracket]
        zone = hostname.find("%25")
        if zone >= 0:
            unescaped = _unescape(hostname[:zone], HOST) + _unescape(hostname[zone:], ZONE)
        else:
            unescaped = _unescape(hostname, HOST)
        try:
            address, _ = iplib.parse_addr(unescaped)
        except iplib.AddrError as error:
            raise URLError(f"invalid host: {error}") from None
        if len(address) == 4:
            raise URLError("invalid IP-literal")
        return f"[{unescaped}]{colon_port}"
    colon = host.rfind(":")  # the last colon, unless urlstrictcolons (see the module doc)
    if colon >= 0 and scheme in ("http", "https") and strict_colons.get():
        colon = host.find(":")
    if colon >= 0 and not _valid_optional_port(host[colon:]):
        raise URLError(f"invalid port {iplib.go_quote(host[colon:])} after host")
    return _unescape(host, HOST)


def _parse_authority(url: ParsedURL, authority: str) -> None:
    at = authority.rfind("@")
    url.host = _parse_host(url.scheme, authority[at + 1:] if at >= 0 else authority)
    if at < 0:
        return
    userinfo = authority[:at]
    if not _valid_userinfo(userinfo):
        raise URLError("net/url: invalid userinfo")
    if ":" not in userinfo:
        url.user = (_unescape(userinfo, USER_PASSWORD), None)
    else:
        username, password = userinfo.split(":", 1)
        url.user = (_unescape(username, USER_PASSWORD), _unescape(password, USER_PASSWORD))


def _parse(raw: str, via_request: bool) -> ParsedURL:
    """url.go parse."""
    if any(c < " " or c == "\x7f" for c in raw):
        raise URLError("net/url: invalid control character in URL")
    if raw == "" and via_request:
        raise URLError("empty url")
    url = ParsedURL()
    if raw == "*":
        url.path = "*"
        return url
    url.scheme, rest = _scheme(raw)
    url.scheme = url.scheme.lower()
    if rest.endswith("?") and rest.count("?") == 1:
        url.force_query, rest = True, rest[:-1]
    else:
        rest, _, url.raw_query = rest.partition("?")
    if not rest.startswith("/"):
        if url.scheme:
            url.opaque = rest  # a rootless path (RFC 3986) is opaque
            return url
        if via_request:
            raise URLError("invalid URI for request")
        if ":" in rest.split("/", 1)[0]:
            raise URLError("first path segment in URL cannot contain colon")
    if (url.scheme or not via_request and not rest.startswith("///")) and rest.startswith("//"):
        authority, slash, tail = rest[2:].partition("/")
        rest = slash + tail
        _parse_authority(url, authority)
    elif url.scheme and rest.startswith("/"):
        url.omit_host = True
    url.set_path(rest)
    return url


def _url_error(raw: str, error: URLError) -> URLError:
    return URLError(f"parse {iplib.go_quote(raw)}: {error}")  # url.Error


def parse_request_uri(raw: str) -> ParsedURL:
    """url.ParseRequestURI: an absolute URI or an absolute path; no fragment is split off."""
    try:
        return _parse(raw, True)
    except URLError as error:
        raise _url_error(raw, error) from None


def parse_url(raw: str) -> ParsedURL:
    """url.Parse: any URI reference; the fragment is cut off first."""
    head, hash_sign, fragment = raw.partition("#")
    try:
        url = _parse(head, False)
    except URLError as error:
        raise _url_error(head, error) from None
    if hash_sign and fragment:
        try:
            url.set_fragment(fragment)
        except URLError as error:
            raise _url_error(raw, error) from None
    return url


def _split_host_port(host: str) -> tuple[str, str]:
    """url.go splitHostPort: a valid port after the last colon, brackets off the host."""
    port = ""
    colon = host.rfind(":")
    if colon >= 0 and _valid_optional_port(host[colon:]):
        host, port = host[:colon], host[colon + 1:]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def query(raw_query: str) -> dict[str, list[str]]:
    """url.URL.Query: url.ParseQuery's values, malformed pairs left out."""
    values: dict[str, list[str]] = {}
    if raw_query.count("&") + 1 > _MAX_QUERY_PARAMETERS:
        return values
    for pair in raw_query.split("&") if raw_query else []:
        if ";" in pair or not pair:
            continue
        key, _, value = pair.partition("=")
        try:
            key, value = _unescape(key, QUERY_COMPONENT), _unescape(value, QUERY_COMPONENT)
        except URLError:
            continue
        values.setdefault(_cel_text(key), []).append(_cel_text(value))
    return values


def to_url(text: str) -> Any:
    """urls.go stringToUrl: checked by ParseRequestURI, kept as Parse makes it."""
    try:
        parse_request_uri(text)
        url = parse_url(text)
    except URLError as error:
        raise ValueError(f"URL parse error during conversion from string: {error}") from None
    return URLMessage(text=url.string(), scheme=url.scheme, host=_cel_text(url.host), escaped_path=url.escaped_path(),
                      raw_query=url.raw_query)


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """(function name, overloads), merged with the other libraries' by :mod:`.environment`."""
    T = cel.Type

    def getter(name: str, overload: str, result: cel.Type, impl: Any) -> tuple[str, list[cel.Overload]]:
        return name, [cel.Overload(overload, result, [URL], is_member=True, impl=impl)]

    return [
        ("url", [cel.Overload("string_to_url", URL, [T.STRING], impl=to_url)]),
        ("isURL", [cel.Overload("is_url_string", T.BOOL, [T.STRING], impl=iplib.parses(parse_request_uri))]),
        getter("getScheme", "url_get_scheme", T.STRING, lambda url: url.scheme),
        getter("getHost", "url_get_host", T.STRING, lambda url: url.host),
        getter("getHostname", "url_get_hostname", T.STRING, lambda url: _split_host_port(url.host)[0]),
        getter("getPort", "url_get_port", T.STRING, lambda url: _split_host_port(url.host)[1]),
        getter("getEscapedPath", "url_get_escaped_path", T.STRING, lambda url: url.escaped_path),
        getter("getQuery", "url_get_query", T.Map(T.STRING, T.List(T.STRING)), lambda url: query(url.raw_query)),
    ]
