"""Device metadata (KEP-5304): each request's file (content, paths), the CDI devices that mount it,
the kubelet's answer, and the files' life on disk (orphans, rewrites). Crashes at every point are
test_device_state's and test_mig_prepare's; the official decoder reads these files in
test_devicemetadata_decode."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from cdispec import load_and_validate, validate_cdi_spec
from plugin_fixtures import DRIVER, NODE, claim, devices, driver_files, fake_root, result

from gpudra_driver import agent_cmd
from gpudra_driver.discovery import scan
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin import devicemetadata as dm
from gpudra_driver.plugin.cdi import CdiDir, cdi_spec, metadata_dir
from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.devicenodes import node_devices
from gpudra_driver.plugin.driverfiles import DriverFilesCache
from gpudra_driver.plugin.model import ClaimRef, MigPlacement, PreparedClaim
from gpudra_driver.plugin.plan import plan_prepare
from gpudra_driver.plugin.state import DeviceState

UID = "0c1d2e3f-0000-4000-8000-000000000001"
OTHER = "0c1d2e3f-0000-4000-8000-000000000002"
ROOT = Path("/var/lib/kubelet/plugins/gpu.gpudra.io/dra-device-metadata")
TEMPLATE_ANNOTATION = {dm.POD_CLAIM_NAME_ANNOTATION: "gpus"}


def prepared(*results: dict[str, Any], profile: str = "dgx-h100", annotations: dict[str, str] | None = None,
             name: str = "c1", uid: str = UID) -> PreparedClaim:
    obj = claim(uid, name=name, results=list(results))
    if annotations is not None:
        obj["metadata"]["annotations"] = annotations
    found = node_devices(scan(FakeNvml(load_profile(profile)), mig="dynamic").devices) if "dynamic" in profile \
        else devices(profile)
    return plan_prepare(ClaimRef("ns", name, uid), obj, found, Checkpoint("b"), node=NODE, driver=DRIVER,
                        device_metadata=True).claim


def stream(data: bytes) -> list[dict[str, Any]]:
    """The objects of a JSON stream, in order (what encoding/json's Decoder.More/Decode loop reads)."""
    decoder, text, at, objects = json.JSONDecoder(), data.decode(), 0, []
    while text[at:].strip():
        obj, end = decoder.raw_decode(text, at)
        objects.append(obj)
        at = end
        while at < len(text) and text[at].isspace():
            at += 1
    return objects


def test_a_gpus_file_is_its_object_in_v1beta1_then_v1alpha1_with_its_published_attributes() -> None:
    gpu = devices()["gpu-3"]
    objects = stream(dm.encode(prepared(result("gpu-3")), DRIVER, "gpu"))
    assert [o["apiVersion"] for o in objects] == ["metadata.resource.k8s.io/v1beta1",
                                                  "metadata.resource.k8s.io/v1alpha1"]
    assert objects[0] | {"apiVersion": ""} == objects[1] | {"apiVersion": ""}  # the same object in each version
    obj = objects[0]
    assert obj["kind"] == "DeviceMetadata" and "podClaimName" not in obj
    assert obj["metadata"] == {"name": "c1", "namespace": "ns", "uid": UID, "generation": 1}
    (request,) = obj["requests"]
    assert request["name"] == "gpu"
    (device,) = request["devices"]
    assert (device["driver"], device["pool"], device["name"]) == (DRIVER, NODE, "gpu-3")
    attributes = device["attributes"]
    assert attributes["uuid"] == {"string": gpu.uuid} and attributes["type"] == {"string": "gpu"}
    assert attributes["resource.kubernetes.io/pciBusID"]["string"].endswith(":00.0")
    assert attributes["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attributes["memory"] == {"int": gpu.memory}  # a capacity, in bytes
    assert attributes["cudaComputeCapability"] == {"version": "9.0.0"}
    assert all(len(value) == 1 for value in attributes.values()) and len(attributes) <= dm.MAX_ATTRIBUTES


def test_a_static_mig_devices_file_names_its_profile_and_parent() -> None:
    (device,) = stream(dm.encode(prepared(result("gpu-0-mig-1g10gb-9-0", request="mig"), profile="a100-80gb-mig"),
                                 DRIVER, "mig"))[0]["requests"][0]["devices"]
    attributes = device["attributes"]
    assert attributes["type"] == {"string": "mig"} and attributes["profile"] == {"string": "1g.10gb"}
    assert attributes["uuid"]["string"].startswith("MIG-")
    assert attributes["parentUUID"]["string"].startswith("GPU-")
    assert (attributes["gpuInstanceId"], attributes["computeInstanceId"]) == ({"int": 9}, {"int": 0})
    assert attributes["multiprocessors"]["int"] > 0 and attributes["memory"]["int"] > 0


def test_a_dynamic_mig_placement_gets_its_uuid_and_instance_ids_once_prepare_made_them() -> None:
    placement = prepared(result("gpu-0-mig-3g40gb-at4", request="mig"), profile="h100-dynamic-mig")
    (device,) = placement.devices
    assert device.uuid == "" and device.mig is not None and not device.mig.created
    before = dm.device_attributes(device)
    assert "uuid" not in before and "gpuInstanceId" not in before  # no instance yet
    assert before["profile"] == {"string": "3g.40gb"} and before["parentUUID"] == {"string": device.mig.parent_uuid}
    made = dataclasses.replace(device, uuid="MIG-1b2c3d4e-0000-5000-8000-000000000001",
                               mig=dataclasses.replace(device.mig, gi=2, ci=0))
    after = dm.device_attributes(made)
    assert after["uuid"] == {"string": made.uuid}
    assert (after["gpuInstanceId"], after["computeInstanceId"]) == ({"int": 2}, {"int": 0})


def test_a_share_names_its_share_id_and_what_it_consumes() -> None:
    share = prepared(result("gpu-3", shareID="5f0e7a1c-share", consumedCapacity={"memory": "20Gi"}))
    attributes = dm.device_attributes(share.devices[0])
    assert attributes["shareID"] == {"string": "5f0e7a1c-share"}
    assert attributes["consumedMemory"] == {"int": 20 * 2**30}
    assert attributes["memory"] == {"int": devices()["gpu-3"].memory}  # the device's, not the share's


def test_at_most_32_attributes_capacities_dropped_first() -> None:
    device = prepared(result("gpu-0-mig-1g10gb-9-0", request="mig"), profile="a100-80gb-mig").devices[0]
    many = dataclasses.replace(device, attributes=tuple(sorted(
        (*device.attributes, *((f"extra{i:02d}", dm.AttrValue.of_int(i)) for i in range(30))))))
    attributes = dm.device_attributes(many)
    assert len(attributes) == dm.MAX_ATTRIBUTES and "uuid" in attributes and "memory" not in attributes


def test_subrequests_are_named_whole_inside_and_stripped_in_paths_and_cdi_names() -> None:
    two = prepared(result("gpu-3", request="gpus/large"), result("gpu-5", request="gpus/large"),
                   result("gpu-6", request="other"))
    assert two.metadata is not None and two.metadata.requests == ("gpus/large", "other")
    (obj, _) = stream(dm.encode(two, DRIVER, "gpus/large"))
    assert obj["requests"][0]["name"] == "gpus/large"
    assert [d["name"] for d in obj["requests"][0]["devices"]] == ["gpu-3", "gpu-5"]
    assert dm.host_path(ROOT, UID, "gpus/large") == ROOT / f"{UID}_gpus.json"
    assert dm.claim_uid_of(f"{UID}_gpus.json") == UID and dm.claim_uid_of(f".{UID}_gpus.json.tmp-1") is None
    assert dm.cdi_device_name(UID, "gpus/large") == f"{UID}_gpus"


def test_paths_for_a_claim_named_by_the_pod_and_for_one_made_from_a_template() -> None:
    direct = prepared(result("gpu-3"), name="shared-gpu")
    templated = prepared(result("gpu-3"), name="pod-1-gpus-x7k2p", annotations=TEMPLATE_ANNOTATION)
    base = "/var/run/kubernetes.io/dra-device-attributes"
    assert dm.container_path(DRIVER, direct, "gpu") == f"{base}/resourceclaims/shared-gpu/gpu/{DRIVER}-metadata.json"
    assert dm.container_path(DRIVER, templated, "gpu") == \
        f"{base}/resourceclaimtemplates/gpus/gpu/{DRIVER}-metadata.json"
    assert stream(dm.encode(templated, DRIVER, "gpu"))[0]["podClaimName"] == "gpus"


@pytest.mark.parametrize("value", ["../../etc", "a/b", "UPPER", "", "x" * 64, 7, None])
def test_a_pod_claim_name_that_is_no_dns_label_is_ignored(value: object) -> None:
    annotations: Any = {dm.POD_CLAIM_NAME_ANNOTATION: value}
    claim_ = prepared(result("gpu-3"), name="c1", annotations=annotations)
    assert claim_.metadata is not None and claim_.metadata.pod_claim_name is None
    assert "/resourceclaims/c1/gpu/" in dm.container_path(DRIVER, claim_, "gpu")


def test_the_spec_mounts_each_requests_file_and_passes_the_cdi_validators(tmp_path: Path) -> None:
    claim_ = prepared(result("gpu-3", request="a"), result("gpu-5", request="a"), result("gpu-6", request="b"),
                      annotations=TEMPLATE_ANNOTATION)
    cdi = CdiDir(tmp_path / "cdi", DRIVER, DriverFilesCache(fake_root()), metadata_root=ROOT)
    spec = validate_cdi_spec(cdi_spec(claim_, DRIVER, cdi.files.current(), metadata_root=ROOT))
    meta = {d["name"]: d["containerEdits"] for d in spec["devices"] if "_" in d["name"]}
    assert meta == {f"{UID}_{r}": {"mounts": [{
        "hostPath": f"{ROOT}/{UID}_{r}.json", "options": ["ro", "bind"],
        "containerPath": f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/{r}/"
                         f"{DRIVER}-metadata.json"}]} for r in ("a", "b")}
    cdi.write(claim_)  # the official CDI library too (cdispec layer 4)
    load_and_validate(cdi.spec_path(UID))
    assert cdi.device_names(UID) == ["gpu-3", "gpu-5", "gpu-6"]  # what an adoption holds: no metadata device


def test_each_request_is_mounted_through_its_first_device_only() -> None:
    claim_ = prepared(result("gpu-3", request="a"), result("gpu-5", request="a"), result("gpu-6", request="b"))
    kind = f"k8s.{DRIVER}/claim"
    assert dm.answer_cdi_ids(claim_) == [(f"{kind}={UID}-gpu-3", f"{kind}={UID}_a"), (f"{kind}={UID}-gpu-5",),
                                         (f"{kind}={UID}-gpu-6", f"{kind}={UID}_b")]
    without = dataclasses.replace(claim_, metadata=None)
    assert dm.answer_cdi_ids(without) == [(d.cdi_device_id,) for d in claim_.devices]
    assert not any("_" in d["name"] for d in cdi_spec(without, DRIVER, driver_files().current())["devices"])


def test_the_record_round_trips_through_the_checkpoint_and_needs_version_5() -> None:
    claim_ = prepared(result("gpu-3", request="g/s"), annotations=TEMPLATE_ANNOTATION)
    saved = ckpt.decode(ckpt.encode(Checkpoint("b").started(claim_)))
    assert saved.claims[UID].claim == claim_
    assert json.loads(ckpt.encode(Checkpoint("b").started(claim_)))["version"] == 5
    plain = dataclasses.replace(claim_, metadata=None, devices=tuple(
        dataclasses.replace(d, attributes=()) for d in claim_.devices))
    assert json.loads(ckpt.encode(Checkpoint("b").started(plain)))["version"] == 1


def test_a_dynamic_mig_record_with_its_instance_round_trips() -> None:
    claim_ = prepared(result("gpu-0-mig-3g40gb-at4", request="mig"), profile="h100-dynamic-mig")
    device = claim_.devices[0]
    assert device.mig is not None
    made = dataclasses.replace(claim_, devices=(dataclasses.replace(
        device, uuid="MIG-x", mig=MigPlacement(device.mig.parent_uuid, "3g.40gb", 4, 4, 0, 2, 0)),))
    assert ckpt.decode(ckpt.encode(Checkpoint("b").started(made))).claims[UID].claim == made


def make(tmp_path: Path, *, device_metadata: bool = True, release: str = "this") -> DeviceState:
    """The agent's state, laid out as this release lays it out (the metadata files in the CDI
    directory, an earlier release's directory read for its claims) or as the one before did."""
    legacy = tmp_path / "plugin" / dm.LEGACY_SUBDIR
    if release == "this":
        cdi = CdiDir(tmp_path / "cdi", DRIVER, driver_files(), metadata_root=metadata_dir(tmp_path / "cdi", DRIVER),
                     legacy_metadata_roots=(legacy,))
    else:
        cdi = CdiDir(tmp_path / "cdi", DRIVER, driver_files(), metadata_root=legacy)
    state = DeviceState(tmp_path / "plugin", cdi, driver=DRIVER, node=NODE, boot_id="boot-1",
                        device_metadata=device_metadata)
    state.recover()
    state.set_devices(devices())
    return state


def metadata_file(tmp_path: Path, uid: str = UID, request: str = "gpu") -> Path:
    return metadata_dir(tmp_path / "cdi", DRIVER) / f"{uid}_{request}.json"


async def test_prepare_writes_the_files_and_unprepare_removes_them(tmp_path: Path) -> None:
    state = make(tmp_path)
    out = await state.prepare([(ClaimRef("ns", "c1", UID), claim(UID, results=[result("gpu-3")]))])
    assert out[UID].error is None and out[UID].claim is not None
    assert metadata_file(tmp_path).read_bytes() == dm.encode(out[UID].claim, DRIVER, "gpu")
    assert metadata_file(tmp_path).stat().st_mode & 0o777 == 0o644  # readable by any container user
    assert await state.unprepare([ClaimRef("ns", "c1", UID)]) == {UID: None}
    assert not metadata_file(tmp_path).exists()


async def test_a_claim_an_earlier_release_prepared_keeps_its_files_and_spec_until_it_is_unprepared(
        tmp_path: Path) -> None:
    """The release before put the files in the plugin directory: an upgrade leaves a running claim's
    spec and files as they are (no rewrite of every prepared claim at start-up, nor at the
    kubelet's repeated prepare), takes an orphan there with the others, and removes the claim's
    files from there at its unprepare; new claims get theirs beside the specs."""
    legacy = tmp_path / "plugin" / dm.LEGACY_SUBDIR
    old = make(tmp_path, release="before")
    ref, obj = ClaimRef("ns", "c1", UID), claim(UID, results=[result("gpu-3")])
    first = (await old.prepare([(ref, obj)]))[UID]
    spec, before = old.cdi.spec_path(UID), old.cdi.spec_path(UID).stat()
    assert (legacy / f"{UID}_gpu.json").is_file() and str(legacy) in spec.read_text()
    (legacy / f"{OTHER}_gpu.json").write_text("{}")  # what a crash of that release left

    new = make(tmp_path)  # the upgrade: start-up reconciles
    assert (spec.stat().st_ino, spec.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(p.name for p in legacy.iterdir()) == [f"{UID}_gpu.json"] and not metadata_file(tmp_path).exists()
    assert (await new.prepare([(ref, obj)]))[UID] == first  # the kubelet asks again: the same answer
    assert spec.stat().st_mtime_ns == before.st_mtime_ns
    fresh = (await new.prepare([(ClaimRef("ns", "c2", OTHER), claim(OTHER, name="c2", results=[result("gpu-4")]))]))
    assert fresh[OTHER].error is None and metadata_file(tmp_path, OTHER).is_file()
    assert str(metadata_dir(tmp_path / "cdi", DRIVER)) in new.cdi.spec_path(OTHER).read_text()

    assert await new.unprepare([ref]) == {UID: None}
    assert not spec.exists() and not list(legacy.iterdir())
    make(tmp_path)  # the next start: the earlier release's directory, empty, goes
    assert not legacy.exists() and (tmp_path / "plugin").is_dir()


async def test_start_up_writes_a_claims_files_where_its_rewritten_spec_mounts_them(tmp_path: Path) -> None:
    """A spec that must be written again (here: deleted) is written for this release's directory,
    and its files there with it, even while the earlier release's copies are in place."""
    legacy = tmp_path / "plugin" / dm.LEGACY_SUBDIR
    old = make(tmp_path, release="before")
    ref, obj = ClaimRef("ns", "c1", UID), claim(UID, results=[result("gpu-3")])
    await old.prepare([(ref, obj)])
    old.cdi.spec_path(UID).unlink()
    new = make(tmp_path)
    spec = load_and_validate(new.cdi.spec_path(UID))
    mounts = [m["hostPath"] for d in spec["devices"] for m in d["containerEdits"].get("mounts", [])]
    assert mounts == [str(metadata_file(tmp_path))] and metadata_file(tmp_path).is_file()
    assert await new.unprepare([ref]) == {UID: None}
    assert not metadata_file(tmp_path).exists() and not list(legacy.iterdir())


async def test_off_new_claims_get_none_and_claims_prepared_with_them_keep_them(tmp_path: Path) -> None:
    on = make(tmp_path)
    await on.prepare([(ClaimRef("ns", "c1", UID), claim(UID, results=[result("gpu-3")]))])
    off = make(tmp_path, device_metadata=False)  # a restart with --device-metadata=false
    assert metadata_file(tmp_path).is_file()
    assert any(d["name"] == f"{UID}_gpu" for d in load_and_validate(off.cdi.spec_path(UID))["devices"])
    out = await off.prepare([(ClaimRef("ns", "c2", OTHER), claim(OTHER, name="c2", results=[result("gpu-4")]))])
    assert out[OTHER].claim is not None and out[OTHER].claim.metadata is None
    assert not metadata_file(tmp_path, OTHER).exists()
    assert [d["name"] for d in load_and_validate(off.cdi.spec_path(OTHER))["devices"]] == [f"{OTHER}-gpu-4"]


async def test_a_deleted_or_changed_file_is_written_again_by_the_next_answer_and_by_start_up(tmp_path: Path) -> None:
    state = make(tmp_path)
    ref, obj = ClaimRef("ns", "c1", UID), claim(UID, results=[result("gpu-3")])
    first = (await state.prepare([(ref, obj)]))[UID]
    good = metadata_file(tmp_path).read_bytes()
    metadata_file(tmp_path).unlink()
    assert (await state.prepare([(ref, obj)]))[UID] == first  # the kubelet asks again: answered, file back
    assert metadata_file(tmp_path).read_bytes() == good
    metadata_file(tmp_path).write_text("{}")
    make(tmp_path)  # start-up: what differs from the record is rewritten
    assert metadata_file(tmp_path).read_bytes() == good


async def test_orphans_go_at_start_up_and_with_the_next_unprepare_kept_claims_files_stay(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare([(ClaimRef("ns", "c1", UID), claim(UID, results=[result("gpu-3")]))])
    orphan = metadata_file(tmp_path, OTHER)  # what a crash before its spec left
    orphan.write_text("{}")
    temp = metadata_file(tmp_path).with_name(f".{UID}_gpu.json.tmp-4242")  # an interrupted write's
    temp.write_text("{")
    make(tmp_path)
    assert not orphan.exists() and not temp.exists() and metadata_file(tmp_path).is_file()
    orphan.write_text("{}")
    third = "0c1d2e3f-0000-4000-8000-000000000003"
    assert await state.unprepare([ClaimRef("ns", "c3", third)]) == {third: None}  # any unprepare, under the lock
    assert not orphan.exists() and metadata_file(tmp_path).is_file()


async def test_a_corrupt_checkpoints_kept_specs_keep_their_files(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare([(ClaimRef("ns", "c1", UID), claim(UID, results=[result("gpu-3")]))])
    state.checkpoint_path.write_text("{torn")
    make(tmp_path)  # adopts the spec: its containers may restart, and mount the file again
    assert metadata_file(tmp_path).is_file()


def test_the_agent_flag_is_on_by_default_and_turns_off() -> None:
    parser = argparse.ArgumentParser()
    agent_cmd.add_parser(parser.add_subparsers())
    assert parser.parse_args(["agent"]).device_metadata is True
    assert parser.parse_args(["agent", "--no-device-metadata"]).device_metadata is False
