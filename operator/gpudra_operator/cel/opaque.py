"""The Kubernetes CEL value types DRA selectors use, as protobuf messages.

cel-cpp's Python binding carries only CEL's own values and protobuf messages, so ``Quantity``
(k8s.io/apiserver/pkg/cel/quantity.go), ``Semver`` (semver.go), ``net.IP`` (ip.go), ``net.CIDR``
(cidr.go), ``kubernetes.URL`` (url.go) and ``kubernetes.NamedFormat`` (format.go) are messages
built here from descriptors, no generated code. The last four keep upstream's type names, so
``type(ip("1.2.3.4")) == net.IP`` holds as it does there. The fields are chosen so that CEL's
message equality is upstream's ``Equal``:

* ``Quantity.value`` is the exact value in canonical decimal form, so ``quantity("1Gi") ==
  quantity("1024Mi")`` holds, as ``resource.Quantity.Equal`` (``Cmp == 0``) says;
* ``Semver`` keeps major, minor, patch and the pre-release, not the build metadata, which
  ``semver.Version.EQ`` ignores;
* ``IP`` is the address's 4 or 16 bytes (``netip.Addr`` equality: the value and the family; the
  library refuses zones and IPv4-mapped addresses, the rest of an ``Addr``);
* ``CIDR`` is the unmasked address and the prefix length (``netip.Prefix`` equality, so
  ``cidr("10.0.0.1/8") != cidr("10.0.0.0/8")``, as upstream);
* ``URL`` is ``url.URL.String()``, which upstream's ``Equal`` compares, plus the parts its getters
  return; those parts are spelled out by the string, so they never make equal strings unequal;
* ``NamedFormat`` is the format's name, which upstream's ``Equal`` compares.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "gpudra.cel"
QUANTITY_TYPE = f"{PACKAGE}.Quantity"
SEMVER_TYPE = f"{PACKAGE}.Semver"
IP_TYPE = "net.IP"
CIDR_TYPE = "net.CIDR"
URL_TYPE = "kubernetes.URL"
FORMAT_TYPE = "kubernetes.NamedFormat"

_Field = descriptor_pb2.FieldDescriptorProto


def _message(file: descriptor_pb2.FileDescriptorProto, name: str, fields: list[tuple[str, int]]) -> None:
    message = file.message_type.add(name=name)
    for number, (field, kind) in enumerate(fields, start=1):
        message.field.add(name=field, number=number, type=kind, label=_Field.LABEL_OPTIONAL)


def _pool() -> descriptor_pool.DescriptorPool:
    file = descriptor_pb2.FileDescriptorProto(name="gpudra/cel/opaque.proto", package=PACKAGE,
                                              syntax="proto3")
    quantity = file.message_type.add(name="Quantity")
    quantity.field.add(name="value", number=1, type=_Field.TYPE_STRING, label=_Field.LABEL_OPTIONAL)
    semver = file.message_type.add(name="Semver")
    for number, name in enumerate(("major", "minor", "patch"), start=1):
        semver.field.add(name=name, number=number, type=_Field.TYPE_UINT64, label=_Field.LABEL_OPTIONAL)
    semver.field.add(name="pre", number=4, type=_Field.TYPE_STRING, label=_Field.LABEL_OPTIONAL)
    # Upstream's type names: ip.go and cidr.go declare "net.IP" and "net.CIDR", url.go and
    # format.go "kubernetes.URL" and "kubernetes.NamedFormat".
    net = descriptor_pb2.FileDescriptorProto(name="gpudra/cel/net.proto", package="net", syntax="proto3")
    _message(net, "IP", [("address", _Field.TYPE_BYTES)])
    _message(net, "CIDR", [("address", _Field.TYPE_BYTES), ("prefix_length", _Field.TYPE_INT64)])
    kubernetes = descriptor_pb2.FileDescriptorProto(name="gpudra/cel/kubernetes.proto", package="kubernetes",
                                                    syntax="proto3")
    text = _Field.TYPE_STRING
    _message(kubernetes, "URL", [("text", text), ("scheme", text), ("host", text), ("escaped_path", text),
                                 ("raw_query", text)])
    _message(kubernetes, "NamedFormat", [("name", text)])
    pool = descriptor_pool.DescriptorPool()
    for each in (file, net, kubernetes):
        pool.Add(each)
    return pool


POOL = _pool()
QuantityMessage: Any = message_factory.GetMessageClass(POOL.FindMessageTypeByName(QUANTITY_TYPE))
SemverMessage: Any = message_factory.GetMessageClass(POOL.FindMessageTypeByName(SEMVER_TYPE))
IPMessage: Any = message_factory.GetMessageClass(POOL.FindMessageTypeByName(IP_TYPE))
CIDRMessage: Any = message_factory.GetMessageClass(POOL.FindMessageTypeByName(CIDR_TYPE))
URLMessage: Any = message_factory.GetMessageClass(POOL.FindMessageTypeByName(URL_TYPE))
FormatMessage: Any = message_factory.GetMessageClass(POOL.FindMessageTypeByName(FORMAT_TYPE))


def canonical_decimal(value: Decimal) -> str:
    """One spelling per number (``1``, ``1.0`` and ``1e0`` are all ``"1"``)."""
    if value.is_zero():
        return "0"
    return f"{value.normalize():f}"


def quantity_message(value: Decimal) -> Any:
    return QuantityMessage(value=canonical_decimal(value))


def quantity_of(message: Any) -> Decimal:
    return Decimal(message.value)
