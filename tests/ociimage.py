"""Container images without a registry or an image builder: OCI image-layout tars written with the
standard library alone, which ``ctr -n k8s.io images import`` (and ``podman load``) read.

An image is one uncompressed layer (a tar of the files given), its config, its manifest and an
``index.json`` naming it with ``org.opencontainers.image.ref.name`` (the name containerd gives the
imported image). Everything is deterministic: no timestamps, root-owned files, sorted entries.

:func:`busybox_image` is the e2e tests' image: Debian's static ``/bin/busybox`` (package
busybox-static) with the applets the tests run as symlinks. The pause image is the same with
``sleep`` as its entrypoint: a sandbox only has to stay alive until it is killed.

``python tests/ociimage.py OUT.tar NAME [pause]`` writes one from the command line."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
BUSYBOX_FIX = "apt-get install -y busybox-static (or: hack/debian-packages.sh)"
APPLETS = ("sh", "ls", "env", "cat", "sleep", "echo", "true", "grep", "head", "mkdir", "ps", "mount", "stat")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class Entry:
    """A file (``data``), a symlink (``link``) or a directory (neither) of the layer."""

    path: str
    data: bytes | None = None
    link: str | None = None
    mode: int = 0o755


def layer_tar(entries: list[Entry]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(entries, key=lambda e: e.path):
            info = tarfile.TarInfo(entry.path.strip("/"))
            info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = entry.mode, 0, 0, 0, "root", "root"
            if entry.link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, entry.link
                tar.addfile(info)
            elif entry.data is not None:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
            else:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
    return buffer.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def write_image(out: Path, name: str, entries: list[Entry], *, entrypoint: list[str] | None = None,
                cmd: list[str] | None = None, env: list[str] | None = None) -> Path:
    """Write the OCI image-layout tar ``out`` of one image called ``name`` (a full reference such
    as ``localhost/gpudra-e2e/busybox:1``). Returns ``out``."""
    layer = layer_tar(entries)
    diff_id = f"sha256:{hashlib.sha256(layer).hexdigest()}"
    config = {"architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
              "config": {"Env": env or [f"PATH={PATH}"], "Entrypoint": entrypoint, "Cmd": cmd, "WorkingDir": "/"},
              "rootfs": {"type": "layers", "diff_ids": [diff_id]},
              "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "tests/ociimage.py"}]}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        layer_desc = {"mediaType": LAYER, **_blob(tar, layer)}
        config_desc = {"mediaType": CONFIG, **_blob(tar, _json(config))}
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "config": config_desc, "layers": [layer_desc]}
        manifest_desc = {"mediaType": MANIFEST, **_blob(tar, _json(manifest)),
                         "platform": {"architecture": "amd64", "os": "linux"},
                         "annotations": {"org.opencontainers.image.ref.name": name,
                                         "io.containerd.image.name": name}}
        for file_name, value in (("oci-layout", {"imageLayoutVersion": "1.0.0"}),
                                 ("index.json", {"schemaVersion": 2, "mediaType": INDEX,
                                                 "manifests": [manifest_desc]})):
            data = _json(value)
            info = tarfile.TarInfo(file_name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return out


def busybox_entries(busybox: Path = BUSYBOX) -> list[Entry]:
    if not busybox.is_file():
        raise AssertionError(f"no static busybox at {busybox}: {BUSYBOX_FIX}")
    data = busybox.read_bytes()
    if b"/lib64/ld-linux" in data[:4096]:
        raise AssertionError(f"{busybox} is dynamically linked; the test image needs the static one: {BUSYBOX_FIX}")
    dirs = ("bin", "dev", "etc", "proc", "sys", "usr", "usr/bin", "var")
    return [*(Entry(d) for d in dirs), Entry("tmp", mode=0o1777), Entry("bin/busybox", data),
            *(Entry(f"bin/{applet}", link="busybox") for applet in APPLETS),
            Entry("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", mode=0o644),
            Entry("etc/group", b"root:x:0:\n", mode=0o644)]


def busybox_image(out: Path, name: str) -> Path:
    """The test image: static busybox, ``sh`` as its command."""
    return write_image(out, name, busybox_entries(), cmd=["/bin/sh"])


def pause_image(out: Path, name: str) -> Path:
    """A sandbox (pause) image: busybox sleeping until it is killed."""
    return write_image(out, name, busybox_entries(), entrypoint=["/bin/sleep", "2147483647"])


if __name__ == "__main__":
    target, ref = Path(sys.argv[1]), sys.argv[2]
    (pause_image if sys.argv[3:] == ["pause"] else busybox_image)(target, ref)
    print(target)
