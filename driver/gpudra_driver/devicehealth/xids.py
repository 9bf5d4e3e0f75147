"""What an XID means, in one line, for Node events and logs.

From NVIDIA's XID catalogue (docs.nvidia.com/deploy/xid-errors); only the XIDs a GPU node commonly
reports are named, others read "see NVIDIA's XID catalogue". The informational default is the list
NVIDIA's own DRA driver ignores (k8s-dra-driver-gpu cmd/gpu-kubelet-plugin/device_health.go): XIDs
caused by an application, not by the device.
"""

from __future__ import annotations

# application errors, not device faults: an informational taint (effect None), never NoSchedule
DEFAULT_INFORMATIONAL = frozenset({13, 31, 43, 45, 68, 109})

# XIDs the hardware contains to the MIG instance NVML attributes them to; every other XID reaches
# the whole GPU, whatever instance IDs came with it (:mod:`.scope`). Sources:
# * 94, a contained uncorrectable ECC error: NVIDIA's "GPU Memory Error Management", "Error
#   Containment" and "Response to Uncorrectable Contained ECC Errors"
#   (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/): only the application that met the error is
#   hit, the others run on and new work may start without a GPU reset. Its uncontained twin, 95,
#   "might impact all the workloads being processed in the GPU" (same pages): GPU-wide.
# * 13, 31, 43, 45: the application's own channel faulted (graphics engine exception, memory page
#   fault, stopped processing, preemptive cleanup); NVIDIA's XID catalog
#   (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) resolves them by restarting the
#   application (RESTART_APP), nothing on the GPU; under MIG that application runs in one instance.
# Not here, so GPU-wide: 48 (double-bit ECC, XID form), 79 (fallen off the bus), 95, 119/120 (GSP),
# 154 (recovery action changed), NVLink and micro-controller errors, and any XID not named.
CONTAINED_IN_INSTANCE = frozenset({13, 31, 43, 45, 94})

MEANINGS = {
    13: "graphics engine exception (usually the application)",
    31: "GPU memory page fault (usually the application)",
    43: "GPU stopped processing (usually the application)",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure",
    68: "video decoder (NVDEC) exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    154: "GPU recovery action changed",
}


def contained(xid: int) -> bool:
    """Whether the hardware keeps XID ``xid`` inside the MIG instance it happened in."""
    return xid in CONTAINED_IN_INSTANCE


def meaning(xid: int) -> str:
    return MEANINGS.get(xid, "see NVIDIA's XID catalogue")


def parse_list(text: str) -> frozenset[int]:
    """``"13,31,43"`` -> the XIDs; an empty string is no XID at all (every XID is fatal)."""
    try:
        xids = frozenset(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of XID numbers") from None
    if any(x <= 0 for x in xids):
        raise ValueError(f"{text!r}: XIDs are positive numbers")
    return xids
