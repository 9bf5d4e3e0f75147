"""What a prepare writes is assembled from per-device fragments encoded once (the checkpoint entry's
devices, the device metadata files' devices, the CDI spec's devices); assembled or not, the bytes
must be exactly those of the plain definition: ``json.dumps`` of ``to_json()`` with sorted keys
(what every reader of the checkpoint re-canonicalises to check its checksum, older agents
included), ``json.dumps`` of :func:`devicemetadata.metadata_object` (the file the decoders read)
and of :func:`cdi.cdi_spec` (its ``cdiVersion`` included). Hypothesis varies every
field that changes where a member goes: adminAccess (sorts before the attributes), shares,
sharing, MIG placements and instances, metadata and pod-claim names, and attribute values
with quotes, escapes and non-ASCII text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_fixtures import DRIVER, NODE, claim, devices, driver_files, result

from gpudra_core.devicemodel import AttrValue
from gpudra_driver.plugin import cdi
from gpudra_driver.plugin import devicemetadata as dm
from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.model import (MPS, TIME_SLICING, ClaimMetadata, ClaimRef, DeviceSharing, MigModeOff,
                                        MigPlacement, PreparedClaim, PreparedDevice)
from gpudra_driver.plugin.plan import plan_prepare

UID = "0c1d2e3f-0000-4000-8000-0000000000e1"
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
NAMES = st.from_regex(r"[a-z][a-zA-Z0-9]{0,10}", fullmatch=True)
VALUES = st.one_of(TEXT.map(AttrValue.of_string), st.integers(-2**63, 2**63 - 1).map(AttrValue.of_int),
                   st.booleans().map(AttrValue.of_bool), st.just(AttrValue.of_version("1.2.3")))


def base_device() -> PreparedDevice:
    planned = plan_prepare(ClaimRef("ns", "c", UID), claim(UID, name="c", results=[result("gpu-3")]), devices(),
                           Checkpoint("b"), node=NODE, driver=DRIVER, device_metadata=True).claim
    return planned.devices[0]


BASE = base_device()


@st.composite
def prepared_devices(draw: st.DrawFn) -> PreparedDevice:
    attributes = draw(st.one_of(st.just(BASE.attributes), st.dictionaries(NAMES, VALUES, max_size=40).map(
        lambda found: tuple(sorted(found.items())))))
    share = draw(st.booleans())
    mig = draw(st.sampled_from([None, MigPlacement("GPU-p", "1g.10gb", 3, 1, 0),
                                MigPlacement("GPU-p", "3g.40gb", 4, 4, 0, gi=draw(st.integers(0, 14)), ci=0)]))
    return dataclasses.replace(
        BASE, requests=tuple(draw(st.lists(st.sampled_from(["gpu", "other", "x"]), min_size=1, max_size=3,
                                           unique=True))),
        uuid=draw(st.sampled_from([BASE.uuid, "", "MIG-\u00e9"])), admin_access=draw(st.booleans()),
        share_id=draw(TEXT) if share else None,
        consumed=tuple(sorted(draw(st.dictionaries(st.sampled_from(["memory", "multiprocessors", "theirs"]),
                                                   st.integers(0, 2**40), max_size=3)).items())) if share else (),
        sharing=draw(st.sampled_from([BASE.sharing, DeviceSharing(TIME_SLICING, timeslice=2),
                                      DeviceSharing(MPS, active_thread_percentage=50)])),
        mig=mig, mig_mode_off=draw(st.sampled_from([None, MigModeOff(), MigModeOff(({"a": 1},))])),
        attributes=attributes)


@st.composite
def prepared_claims(draw: st.DrawFn) -> PreparedClaim:
    found = draw(st.lists(prepared_devices(), max_size=4))
    metadata = draw(st.sampled_from([None, ClaimMetadata(("gpu", "other/sub"), None),
                                     ClaimMetadata(("gpu",), "pod-claim")]))
    return PreparedClaim(ClaimRef(draw(st.sampled_from(["ns", "n\u00e9"])), draw(st.sampled_from(["c", 'q"uote'])),
                                  UID), tuple(found), metadata)


def canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


@settings(max_examples=300, deadline=None)
@given(device=prepared_devices())
def test_a_devices_entry_is_the_canonical_json_of_its_record(device: PreparedDevice) -> None:
    assert device.canonical_json() == canonical(device.to_json())


@settings(max_examples=200, deadline=None)
@given(prepared=prepared_claims())
def test_a_claims_entry_is_the_canonical_json_of_its_record(prepared: PreparedClaim) -> None:
    assert prepared.canonical_json == canonical(prepared.to_json())
    assert PreparedClaim.from_json(UID, json.loads(prepared.canonical_json)) == prepared


@settings(max_examples=200, deadline=None)
@given(prepared=prepared_claims(), request=st.sampled_from(["gpu", "other/sub", "x"]))
def test_a_metadata_file_is_json_dumps_of_its_object_in_each_version(prepared: PreparedClaim, request: str) -> None:
    if prepared.metadata is None:
        prepared = dataclasses.replace(prepared, metadata=ClaimMetadata((request,), None))
    expected = "".join(json.dumps(dm.metadata_object(prepared, DRIVER, request, version), separators=(",", ":")) + "\n"
                       for version in dm.VERSIONS)
    assert dm.encode(prepared, DRIVER, request).decode() == expected


FILES = driver_files().current()
UIDS = st.sampled_from([UID, "fc1d2e3f-0000-4000-8000-0000000000e1"])  # a name starting with a digit, a letter


@settings(max_examples=200, deadline=None)
@given(prepared=prepared_claims(), uid=UIDS, device_root=st.sampled_from(["", "/run/nvidia/driver"]),
       nodes=st.lists(st.sampled_from(["/dev/nvidia0", "/dev/nvidia3", "/dev/nvidia-caps/nvidia-cap21"]),
                      max_size=3, unique=True))
def test_a_cdi_spec_is_json_dumps_of_its_definition(prepared: PreparedClaim, uid: str, device_root: str,
                                                    nodes: list[str]) -> None:
    prepared = dataclasses.replace(prepared, ref=dataclasses.replace(prepared.ref, uid=uid), devices=tuple(
        dataclasses.replace(d, device_nodes=tuple(nodes)) for d in prepared.devices))
    files = dataclasses.replace(FILES, device_root=device_root)
    root = Path("/var/run/cdi") / "k8s.gpu.gpudra.io-device-metadata"
    if not prepared.devices:
        with pytest.raises(ValueError):
            cdi.encode_spec(prepared, DRIVER, files, None, root)
        return
    expected = json.dumps(cdi.cdi_spec(prepared, DRIVER, files, metadata_root=root), separators=(",", ":")) + "\n"
    assert cdi.encode_spec(prepared, DRIVER, files, None, root).decode() == expected
