"""GpuConfig examples that the agent's decoder (gpudra_driver.gpuconfig) and the admission policy
(manifests/base/claim-config-admission-policy.yaml) must judge alike: tests/unit/test_gpuconfig.py
decodes them, tests/integration/test_claim_config_admission.py submits them to the API server.
Each bad example breaks exactly one rule, so both sides must name the same field for the same
reason. The examples in docs/sharing.md are read from there by both tests too."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[1]
SHARING_DOC = REPO / "docs" / "sharing.md"
DOC_DRIVER = "gpu.gpudra.io"  # the driver the docs' examples name
Obj = dict[str, Any]


def gpu_config(sharing: Any = None, **top: Any) -> Obj:
    body: Obj = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig", **top}
    if sharing is not None:
        body["sharing"] = sharing
    return body


def mps(**fields: Any) -> Obj:
    return gpu_config({"strategy": "MPS", "mps": fields})


def per_device(**entries: Any) -> Obj:
    return mps(perDevice=entries)


GOOD: dict[str, Obj] = {
    "no sharing": gpu_config(),
    "empty sharing": gpu_config({}),
    "exclusive": gpu_config({"strategy": "Exclusive"}),
    "time-slicing, default interval": gpu_config({"strategy": "TimeSlicing"}),
    **{f"time-slicing {interval}": gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}})
       for interval in ("Default", "Short", "Medium", "Long")},
    "time-slicing, empty block": gpu_config({"strategy": "TimeSlicing", "timeSlicing": {}}),
    "mps, no settings": gpu_config({"strategy": "MPS"}),
    "mps, empty block": mps(),
    "mps, bounds": mps(activeThreadPercentage=1, pinnedMemoryLimit="1Mi"),
    "mps, 100%": mps(activeThreadPercentage=100, pinnedMemoryLimit="80G"),
    "mps, limit in bytes as an integer": mps(pinnedMemoryLimit=1048576),
    "mps, limit as an exponent": mps(pinnedMemoryLimit="1e9"),
    "mps, exponent with leading zeros": mps(pinnedMemoryLimit="2e0006"),
    "mps, limit at the int64 maximum": mps(pinnedMemoryLimit="9223372036854775807"),
    # ParseQuantity caps a binary-suffixed value at the int64 maximum; the decoder reads it so too
    # (prepare then refuses a limit above the device's memory).
    "mps, binary limit the API server caps": mps(pinnedMemoryLimit="16Ei"),
    "mps, limit of 64 characters": mps(pinnedMemoryLimit="0" * 61 + "1Gi"),
    "mps, per device by name and UUID": mps(
        activeThreadPercentage=50, pinnedMemoryLimit="10Gi",
        perDevice={"gpu-0": {"pinnedMemoryLimit": "20Gi", "activeThreadPercentage": 75},
                   "GPU-4f5e6d7c-1a2b-3c4d-5e6f-a1b2c3d4e5f6": {"pinnedMemoryLimit": "5Gi"},
                   "gpu-1-mig-3g40gb-2-0": {},
                   "MIG-0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d": {"activeThreadPercentage": 10}}),
    # A number key is a DNS label: syntactically a device name. Only prepare can tell that no
    # device is called "0" (NVIDIA's API takes indexes here; ours does not).
    "mps, per-device key that names no real device": per_device(**{"0": {"pinnedMemoryLimit": "1Gi"}}),
    # the claim's /dev/shm; whether it is within the platform's maxShmSize only the node can tell
    "mps, shm size": mps(shmSize="256Mi"),
    "mps, shm size in bytes": mps(shmSize=1048576),
    "mps, shm size above any platform bound": mps(shmSize="1Ti"),
}


class Bad(NamedTuple):
    parameters: Any
    field: str  # the path inside the parameters
    reason: str


STRATEGIES = "must be one of Exclusive, TimeSlicing, MPS"
INTERVALS = "must be one of Default, Short, Medium, Long"
PERCENT = "must be an integer between 1 and 100"
MEMORY = ("must be a quantity from 1Mi to the int64 maximum (e.g. 10Gi), "
          "at most 64 characters with an exponent of at most 2 digits")
DEVICE_KEY = "must be a device name in the pool (gpu-0) or a GPU UUID"
OBJECT = "must be an object"
UNKNOWN = "unknown field"
FIELDS = "must have at most 8 fields"
ENTRIES = "must have at most 32 entries, one per device of the claim"
LONG_NAME = "gpu-" + "a" * 60  # 64 characters: one too many for a DNS label
NINE_FIELDS = {f"x{i}": i for i in range(7)}  # with two known fields, one more than an object may have

BAD: dict[str, Bad] = {
    "no apiVersion": Bad({"kind": "GpuConfig"}, "apiVersion", "must be gpudra.io/v1alpha1"),
    "NVIDIA's apiVersion": Bad(gpu_config(apiVersion="resource.nvidia.com/v1beta1"),
                               "apiVersion", "must be gpudra.io/v1alpha1"),
    "apiVersion a number": Bad(gpu_config(apiVersion=1), "apiVersion", "must be gpudra.io/v1alpha1"),
    "no kind": Bad({"apiVersion": "gpudra.io/v1alpha1"}, "kind", "must be GpuConfig"),
    "another kind": Bad(gpu_config(kind="MigDeviceConfig"), "kind", "must be GpuConfig"),
    "unknown top-level field": Bad(gpu_config(sharingg={"strategy": "MPS"}), "sharingg", UNKNOWN),
    "sharing a list": Bad(gpu_config(["MPS"]), "sharing", OBJECT),
    "sharing a string": Bad(gpu_config("MPS"), "sharing", OBJECT),
    "sharing null": Bad({**gpu_config(), "sharing": None}, "sharing", OBJECT),
    "NVIDIA's mpsConfig": Bad(gpu_config({"strategy": "MPS", "mpsConfig": {}}), "sharing.mpsConfig", UNKNOWN),
    "unknown strategy": Bad(gpu_config({"strategy": "Fabric"}), "sharing.strategy", STRATEGIES),
    "strategy in lower case": Bad(gpu_config({"strategy": "mps"}), "sharing.strategy", STRATEGIES),
    "strategy a number": Bad(gpu_config({"strategy": 2}), "sharing.strategy", STRATEGIES),
    "strategy null": Bad(gpu_config({"strategy": None}), "sharing.strategy", STRATEGIES),
    "timeSlicing with MPS": Bad(gpu_config({"strategy": "MPS", "timeSlicing": {"interval": "Long"}}),
                                "sharing.timeSlicing", "allowed only with strategy TimeSlicing"),
    "timeSlicing without a strategy": Bad(gpu_config({"timeSlicing": {}}),
                                          "sharing.timeSlicing", "allowed only with strategy TimeSlicing"),
    "mps with TimeSlicing": Bad(gpu_config({"strategy": "TimeSlicing", "mps": {}}),
                                "sharing.mps", "allowed only with strategy MPS"),
    "mps with Exclusive": Bad(gpu_config({"strategy": "Exclusive", "mps": {"activeThreadPercentage": 50}}),
                              "sharing.mps", "allowed only with strategy MPS"),
    "timeSlicing a string": Bad(gpu_config({"strategy": "TimeSlicing", "timeSlicing": "Long"}),
                                "sharing.timeSlicing", OBJECT),
    "unknown timeSlicing field": Bad(gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"timeslice": 1}}),
                                     "sharing.timeSlicing.timeslice", UNKNOWN),
    "unknown interval": Bad(gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": "VeryLong"}}),
                            "sharing.timeSlicing.interval", INTERVALS),
    "interval as nvidia-smi's number": Bad(gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": 2}}),
                                           "sharing.timeSlicing.interval", INTERVALS),
    "mps a number": Bad(gpu_config({"strategy": "MPS", "mps": 50}), "sharing.mps", OBJECT),
    "NVIDIA's MPS field": Bad(mps(defaultActiveThreadPercentage=50), "sharing.mps.defaultActiveThreadPercentage",
                              UNKNOWN),
    "percentage a string": Bad(mps(activeThreadPercentage="x"), "sharing.mps.activeThreadPercentage", PERCENT),
    "percentage a numeric string": Bad(mps(activeThreadPercentage="50"), "sharing.mps.activeThreadPercentage",
                                       PERCENT),
    "percentage 0": Bad(mps(activeThreadPercentage=0), "sharing.mps.activeThreadPercentage", PERCENT),
    "percentage 101": Bad(mps(activeThreadPercentage=101), "sharing.mps.activeThreadPercentage", PERCENT),
    "percentage a fraction": Bad(mps(activeThreadPercentage=50.5), "sharing.mps.activeThreadPercentage", PERCENT),
    # JSON 50.0 is a float to the API server's decoder as to Python's: not an integer either way.
    "percentage a float": Bad(mps(activeThreadPercentage=50.0), "sharing.mps.activeThreadPercentage", PERCENT),
    "percentage a boolean": Bad(mps(activeThreadPercentage=True), "sharing.mps.activeThreadPercentage", PERCENT),
    "limit not a quantity": Bad(mps(pinnedMemoryLimit="lots"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit with a unit quantities lack": Bad(mps(pinnedMemoryLimit="10GB"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit under 1Mi": Bad(mps(pinnedMemoryLimit="1023Ki"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit under 1Mi in bytes": Bad(mps(pinnedMemoryLimit=1048575), "sharing.mps.pinnedMemoryLimit", MEMORY),
    # Rounds up to 1Mi as a whole byte, but the rule is on the value as written, as the policy's compareTo is.
    "limit a fraction under 1Mi": Bad(mps(pinnedMemoryLimit="1048575.1"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit in milli-bytes under 1Mi": Bad(mps(pinnedMemoryLimit="1048575001m"), "sharing.mps.pinnedMemoryLimit",
                                          MEMORY),
    "limit negative": Bad(mps(pinnedMemoryLimit="-1Gi"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit a float": Bad(mps(pinnedMemoryLimit=1073741824.0), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit beyond int64": Bad(mps(pinnedMemoryLimit=10**20), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit a boolean": Bad(mps(pinnedMemoryLimit=True), "sharing.mps.pinnedMemoryLimit", MEMORY),
    # Parsed at once, but its integer has 300,001 digits: seconds to build, with the node's lock held.
    "limit with a huge exponent": Bad(mps(pinnedMemoryLimit="1e300000"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit with an int32 exponent": Bad(mps(pinnedMemoryLimit="1e2147483647"), "sharing.mps.pinnedMemoryLimit",
                                        MEMORY),
    "limit with a tiny exponent": Bad(mps(pinnedMemoryLimit="1e-2147483648"), "sharing.mps.pinnedMemoryLimit",
                                      MEMORY),
    "limit with a 3-digit exponent": Bad(mps(pinnedMemoryLimit="1e100"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    # ParseQuantity keeps the exponent as an int32, so this one is 2e6; three digits are refused all the same.
    "limit with an exponent that wraps": Bad(mps(pinnedMemoryLimit="2e4294967302"), "sharing.mps.pinnedMemoryLimit",
                                             MEMORY),
    "limit beyond int64 as a string": Bad(mps(pinnedMemoryLimit="9223372036854775808"),
                                          "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit beyond int64 as an exponent": Bad(mps(pinnedMemoryLimit="1e19"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit of 65 characters": Bad(mps(pinnedMemoryLimit="0" * 62 + "1Gi"), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "limit a long digit string": Bad(mps(pinnedMemoryLimit="9" * 9000), "sharing.mps.pinnedMemoryLimit", MEMORY),
    "perDevice a list": Bad(mps(perDevice=["gpu-0"]), "sharing.mps.perDevice", OBJECT),
    "perDevice key not a name": Bad(per_device(Bad_Key={}), "sharing.mps.perDevice.Bad_Key", DEVICE_KEY),
    "perDevice key too long": Bad(per_device(**{LONG_NAME: {}}), f"sharing.mps.perDevice.{LONG_NAME}", DEVICE_KEY),
    "perDevice key with a dot": Bad(per_device(**{"gpu-4f5e6d7c.x": {}}), "sharing.mps.perDevice.gpu-4f5e6d7c.x",
                                           DEVICE_KEY),
    "perDevice entry a quantity": Bad(per_device(**{"gpu-0": "20Gi"}), "sharing.mps.perDevice.gpu-0", OBJECT),
    "unknown perDevice field": Bad(per_device(**{"gpu-0": {"limit": "20Gi"}}), "sharing.mps.perDevice.gpu-0.limit",
                                   UNKNOWN),
    "perDevice percentage": Bad(per_device(**{"gpu-0": {"activeThreadPercentage": 0}}),
                                "sharing.mps.perDevice.gpu-0.activeThreadPercentage", PERCENT),
    "shm size below 1Mi": Bad(mps(shmSize="1Ki"), "sharing.mps.shmSize", MEMORY),
    "shm size a float": Bad(mps(shmSize=67108864.0), "sharing.mps.shmSize", MEMORY),
    "shm size with a huge exponent": Bad(mps(shmSize="1e300000"), "sharing.mps.shmSize", MEMORY),
    "shm size per device": Bad(per_device(**{"gpu-0": {"shmSize": "1Gi"}}),  # one /dev/shm per claim
                               "sharing.mps.perDevice.gpu-0.shmSize", UNKNOWN),
    "perDevice limit": Bad(per_device(**{"GPU-4f5e6d7c": {"pinnedMemoryLimit": "1Ki"}}),
                           "sharing.mps.perDevice.GPU-4f5e6d7c.pinnedMemoryLimit", MEMORY),
    "perDevice limit with a huge exponent": Bad(per_device(**{"gpu-0": {"pinnedMemoryLimit": "1e1000000"}}),
                                                "sharing.mps.perDevice.gpu-0.pinnedMemoryLimit", MEMORY),
    # A path shows at most 64 characters of a key.
    "perDevice key of 200 characters": Bad(per_device(**{"g" * 200: {}}), "sharing.mps.perDevice." + "g" * 61 + "...",
                                           DEVICE_KEY),
    "perDevice with an entry per device and one more": Bad(
        per_device(**{f"gpu-{i}": {} for i in range(33)}), "sharing.mps.perDevice", ENTRIES),
    "too many top-level fields": Bad(gpu_config(**NINE_FIELDS), "parameters", FIELDS),
    "too many sharing fields": Bad(gpu_config({"strategy": "MPS", "mps": {}, **NINE_FIELDS}), "sharing", FIELDS),
    "too many timeSlicing fields": Bad(gpu_config({"strategy": "TimeSlicing", "timeSlicing": {
        "interval": "Long", "y": 0, **NINE_FIELDS}}), "sharing.timeSlicing", FIELDS),
    "too many mps fields": Bad(mps(activeThreadPercentage=50, pinnedMemoryLimit="1Gi", **NINE_FIELDS),
                               "sharing.mps", FIELDS),
    "too many fields in a perDevice entry": Bad(per_device(**{"gpu-0": {"activeThreadPercentage": 5, "y": 0,
                                                                        **NINE_FIELDS}}),
                                                "sharing.mps.perDevice.gpu-0", FIELDS),
}


def policy_error(at: str, field: str, reason: str) -> str:
    """How the admission policy words a decoder error in the parameters at ``at``: the decoder
    calls the whole parameters "parameters", the policy names them by their path."""
    return f"{at if field == 'parameters' else f'{at}.{field}'}: {reason}"


# --- the examples in docs/sharing.md ------------------------------------------------------------
def doc_objects() -> list[Obj]:
    """Every Kubernetes object in the doc's ```yaml blocks."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", SHARING_DOC.read_text(), flags=re.M | re.S)
    return [d for block in blocks for d in yaml.safe_load_all(block) if isinstance(d, dict) and "kind" in d]


def opaque_configs(obj: Obj) -> list[Obj]:
    """The opaque configs of a DeviceClass, ResourceClaim or ResourceClaimTemplate."""
    kind = obj["kind"]
    if kind == "DeviceClass":
        configs = obj["spec"].get("config", [])
    elif kind == "ResourceClaim":
        configs = obj["spec"]["devices"].get("config", [])
    elif kind == "ResourceClaimTemplate":
        configs = obj["spec"]["spec"]["devices"].get("config", [])
    else:
        return []
    return [c["opaque"] for c in configs if "opaque" in c]


def doc_examples() -> list[Obj]:
    """The GpuConfig parameters of every config of ours in the doc."""
    return [o["parameters"] for obj in doc_objects() for o in opaque_configs(obj) if o["driver"] == DOC_DRIVER]
