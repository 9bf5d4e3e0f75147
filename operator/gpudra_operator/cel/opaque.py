"""The two Kubernetes CEL value types DRA selectors use, as protobuf messages.

cel-cpp's Python binding carries only CEL's own values and protobuf messages, so ``Quantity``
(k8s.io/apiserver/pkg/cel/quantity.go) and ``Semver`` (k8s.io/apiserver/pkg/cel/semver.go) are
messages built here from a descriptor, no generated code. Their fields are chosen so that CEL's
message equality is upstream's ``Equal``:

* ``Quantity.value`` is the exact value in canonical decimal form, so ``quantity("1Gi") ==
  quantity("1024Mi")`` holds, as ``resource.Quantity.Equal`` (``Cmp == 0``) says;
* ``Semver`` keeps major, minor, patch and the pre-release, not the build metadata, which
  ``semver.Version.EQ`` ignores.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "gpudra.cel"
QUANTITY_TYPE = f"{PACKAGE}.Quantity"
SEMVER_TYPE = f"{PACKAGE}.Semver"

_Field = descriptor_pb2.FieldDescriptorProto


def _pool() -> descriptor_pool.DescriptorPool:
    file = descriptor_pb2.FileDescriptorProto(name="gpudra/cel/opaque.proto", package=PACKAGE,
                                              syntax="proto3")
    quantity = file.message_type.add(name="Quantity")
    quantity.field.add(name="value", number=1, type=_Field.TYPE_STRING, label=_Field.LABEL_OPTIONAL)
    semver = file.message_type.add(name="Semver")
    for number, name in enumerate(("major", "minor", "patch"), start=1):
        semver.field.add(name=name, number=number, type=_Field.TYPE_UINT64, label=_Field.LABEL_OPTIONAL)
    semver.field.add(name="pre", number=4, type=_Field.TYPE_STRING, label=_Field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool


POOL = _pool()
QuantityMessage: Any = message_factory.GetMessageClass(POOL.FindMessageTypeByName(QUANTITY_TYPE))
SemverMessage: Any = message_factory.GetMessageClass(POOL.FindMessageTypeByName(SEMVER_TYPE))


def canonical_decimal(value: Decimal) -> str:
    """One spelling per number (``1``, ``1.0`` and ``1e0`` are all ``"1"``)."""
    if value.is_zero():
        return "0"
    return f"{value.normalize():f}"


def quantity_message(value: Decimal) -> Any:
    return QuantityMessage(value=canonical_decimal(value))


def quantity_of(message: Any) -> Decimal:
    return Decimal(message.value)
