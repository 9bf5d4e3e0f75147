"""The MPS supervisor's records of its daemons (pure parts): what makes a process the one it
started, and the daemon spec's /dev/shm size. The supervisor against a tenant runs in
tests/integration/test_mps_tenant.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from gpudra_driver.mpssupervisor import (ProcessRecord, observe, open_recorded, same_process, shm_size_of,
                                         start_time_of)
from gpudra_driver.plugin.mps import DEFAULT_SHM_SIZE, DaemonSpec

UID = "0c1d2e3f-0000-4000-8000-0000000000aa"


def test_the_start_time_is_field_22_whatever_the_command_name_holds() -> None:
    fields = " ".join(str(n) for n in range(3, 53))  # fields 3..52 hold their own numbers
    assert start_time_of(f"4242 (a) b) c) {fields}".encode()) == 22  # comm "a) b) c"
    assert start_time_of(f"7 (sleep) {fields}\n".encode()) == 22


def test_a_process_is_its_pid_start_time_and_executable() -> None:
    record = ProcessRecord(100, 5000, "/driver-root/usr/bin/nvidia-cuda-mps-control")
    assert same_process(record, record)
    assert same_process(record, ProcessRecord(100, 5000, record.exe + " (deleted)"))  # replaced on disk since
    assert not same_process(record, None)  # gone
    assert not same_process(record, ProcessRecord(100, 5001, record.exe))  # the PID reused
    assert not same_process(record, ProcessRecord(100, 5000, "/usr/bin/sleep"))
    assert not same_process(record, ProcessRecord(101, 5000, record.exe))


def test_a_record_is_read_strictly() -> None:
    record = ProcessRecord(100, 5000, "/bin/x")
    assert ProcessRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    for bad in ({"pid": "100", "startTime": 5000, "exe": "/bin/x"}, {"pid": 0, "startTime": 5000, "exe": "/bin/x"},
                {"pid": 100, "startTime": True, "exe": "/bin/x"}, {"pid": 100, "startTime": 1}, [100], "100\n"):
        with pytest.raises(ValueError):
            ProcessRecord.from_json(bad)


def test_only_the_recorded_process_is_opened() -> None:
    process = subprocess.Popen(["sleep", "60"])
    try:
        seen = observe(process.pid)
        assert seen is not None and seen.exe == os.path.realpath(shutil.which("sleep") or "")
        fd = open_recorded(seen)
        assert fd is not None
        os.close(fd)
        assert open_recorded(ProcessRecord(seen.pid, seen.start_time + 1, seen.exe)) is None  # not that one
    finally:
        process.kill()
        process.wait()
    assert observe(process.pid) is None and open_recorded(seen) is None  # gone


def test_a_daemon_spec_carries_its_shm_size_only_when_set() -> None:
    plain = DaemonSpec(UID, ("GPU-1",))
    assert "shmBytes" not in plain.to_json()  # a spec written before stays byte-identical
    sized = DaemonSpec(UID, ("GPU-1",), shm_size=256 * 2**20)
    assert DaemonSpec.from_json(json.loads(sized.encode())) == sized
    assert DEFAULT_SHM_SIZE == 64 * 2**20
    for bad in (0, -1, "64Mi", 2**63, True):
        with pytest.raises(ValueError, match="shmBytes"):
            DaemonSpec.from_json(plain.to_json() | {"shmBytes": bad})


def test_a_claims_shm_size_is_its_own_within_the_bound_or_the_platforms_default() -> None:
    mib = 2**20
    assert shm_size_of(DaemonSpec(UID, ("GPU-1",)), 64 * mib, 1024 * mib) == 64 * mib
    assert shm_size_of(DaemonSpec(UID, ("GPU-1",), shm_size=1024 * mib), 64 * mib, 1024 * mib) == 1024 * mib
    with pytest.raises(ValueError, match=r"sharing\.mps\.shmSize: 2Gi is more than 1Gi, .*spec\.sharing\.mps\.maxShmSize"):
        shm_size_of(DaemonSpec(UID, ("GPU-1",), shm_size=2048 * mib), 64 * mib, 1024 * mib)
