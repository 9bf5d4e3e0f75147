"""Validation of every CDI spec the tests see, in three layers:

1. the official CDI JSON schema (``schema/schema.json`` + ``schema/defs.json`` of the CDI project),
   fetched once from the Go module proxy at a pinned version and SHA-256 and cached;
2. gpudra's extra rules, which the CDI library enforces beyond that schema: strict parsing (unknown
   fields rejected, tests/cdi/strict-rules.json), unique device names, no empty device edits;
3. ``cdiVersion`` equal to the minimum its content needs, determined here from the CDI spec's
   version history, independently of the driver's own ``minimum_version``;
4. the official CDI Go library itself (``validate_with_cdi_library``: hack/cdi-tools' cdi-validate,
   the code containerd, CRI-O and podman load specs and inject devices with): each file read and
   validated, all loaded into one CDI cache without errors, and each device injected alone into an
   empty OCI runtime spec, which stats the host path of every device node the spec leaves untyped.

``python tests/cdispec.py`` fetches the schema into the cache (``make cdi-schema`` runs it) and
prints its directory. Validation never skips: without the schema it fails with that command, and
without cdi-validate with ``make cdi-tools``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

TESTS = Path(__file__).resolve().parent
STRICT_RULES = TESTS / "cdi" / "strict-rules.json"

# The schema's own module (tags.cncf.io/container-device-interface/schema) has never been released:
# upstream requires it as v0.0.0 with a replace, and the module proxy serves no version of it. Up to
# v0.8.x the root module's zip carries schema/; from v1.0.0 schema/ is a nested module that the zip
# leaves out. So the newest released zip that ships the schema is the root module's v0.8.1
# (`@v/list`: v0.7.2 v0.8.1 v1.0.1 v1.1.0 v1.1.1 v1.1.2). Its go.sum line, which `go mod download`
# checked against sum.golang.org, is h1:c0jN4Mt6781jD67NdPajmZlD1qrqQyov/Xfoab37lj0=.
SCHEMA_MODULE = "tags.cncf.io/container-device-interface"
SCHEMA_VERSION = "v0.8.1"
SCHEMA_ZIP_SHA256 = "51598427e62bdd749ecaa8a1ef3b9ce4711f950eb9f8f9a3f5fe8448f13ccb26"
SCHEMA_FILES = ("schema.json", "defs.json")
DEFAULT_PROXY = "https://proxy.golang.org"
# upstream's schema.go loads them under these URIs, so schema.json's "defs.json#/..." resolves alike
_BASE = "file:///"

EARLIEST_VERSION = "0.3.0"  # the CDI library's vEarliest: what a spec using no later field declares


class SchemaUnavailable(RuntimeError):
    pass


def cache_root() -> Path:
    """The same root as hack/kube-bin.sh and hack/helm-bin.sh."""
    if os.environ.get("GPUDRA_CACHE"):
        return Path(os.environ["GPUDRA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpudra"


def schema_dir() -> Path:
    return cache_root() / "cdi-schema" / SCHEMA_VERSION


def proxies() -> list[str]:
    """The URL entries of $GOPROXY in order ("direct" needs a VCS, so it is skipped)."""
    value = os.environ.get("GOPROXY", "")
    if value.strip() == "off":
        return []
    urls = [p.strip().rstrip("/") for p in value.replace("|", ",").split(",")]
    return [u for u in urls if u.split(":", 1)[0] in ("http", "https", "file")] or [DEFAULT_PROXY]


def fix_command() -> str:
    return f"cd {TESTS.parent} && {sys.executable} tests/cdispec.py"


def _zip_url(proxy: str) -> str:
    return f"{proxy}/{SCHEMA_MODULE}/@v/{SCHEMA_VERSION}.zip"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def _verified(data: bytes) -> bool:
    return hashlib.sha256(data).hexdigest() == SCHEMA_ZIP_SHA256


def _download(urls: list[str]) -> bytes:
    failures = [] if urls else ["GOPROXY=off allows no download: unset it or name a proxy"]
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=20) as response:
                data = response.read()
        except (OSError, ValueError) as error:  # URLError and HTTPError are OSErrors
            failures.append(f"{url}: {error}")
            continue
        if _verified(data):
            return data
        failures.append(f"{url}: SHA-256 {hashlib.sha256(data).hexdigest()}, pinned {SCHEMA_ZIP_SHA256}")
    raise SchemaUnavailable(
        f"the official CDI JSON schema ({SCHEMA_MODULE}@{SCHEMA_VERSION}, schema/schema.json and "
        "schema/defs.json) could not be fetched:\n  " + "\n  ".join(failures)
        + "\nEvery CDI spec the tests write is validated against it. Make the Go module proxy reachable "
        f"(or set GOPROXY to a mirror), then run:\n  {fix_command()}")


def fetch_schema() -> dict[str, bytes]:
    """The official schema files (name -> bytes) from the pinned module zip, downloaded into the
    cache if it is not there yet (or does not match the pin); the files are extracted beside it."""
    directory = schema_dir()
    zip_path = directory / f"{SCHEMA_VERSION}.zip"
    data = zip_path.read_bytes() if zip_path.is_file() else b""
    if not _verified(data):
        data = _download([_zip_url(p) for p in proxies()])
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(zip_path, data)
    prefix = f"{SCHEMA_MODULE}@{SCHEMA_VERSION}/schema/"
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        files = {name: archive.read(prefix + name) for name in SCHEMA_FILES}
    for name, content in files.items():  # for people and other tools; validation uses the bytes above
        path = directory / name
        if not path.is_file() or path.read_bytes() != content:
            _write_atomic(path, content)
    return files


_unavailable: list[SchemaUnavailable] = []  # one failed fetch per process: no retry (and wait) per spec


@cache
def _registry() -> Registry:
    if _unavailable:
        raise _unavailable[0]
    try:
        files = fetch_schema()
    except SchemaUnavailable as error:
        _unavailable.append(error)
        raise
    resources = []
    for name, content in files.items():
        document = json.loads(content)
        jsonschema.Draft7Validator.check_schema(document)
        resources.append((_BASE + name, Resource.from_contents(document, default_specification=DRAFT7)))
    return Registry().with_resources(resources)


@cache
def official_validator(ref: str = "schema.json") -> jsonschema.Draft7Validator:
    """A validator for the official schema, or for one of its definitions (``defs.json#/...``)."""
    return jsonschema.Draft7Validator({"$ref": _BASE + ref}, registry=_registry())


@cache
def _strict_validator() -> jsonschema.Draft7Validator:
    rules = json.loads(STRICT_RULES.read_text())
    jsonschema.Draft7Validator.check_schema(rules)
    return jsonschema.Draft7Validator(rules)


def _is_letter(char: str) -> bool:  # the CDI parser's IsLetter: ASCII only
    return "a" <= char <= "z" or "A" <= char <= "Z"


def _kind_class(spec: dict[str, Any]) -> str:
    """The class of ``vendor/class`` (the CDI parser's ParseQualifier; "" unless both are there)."""
    vendor, _, cdi_class = str(spec.get("kind", "")).partition("/")
    return cdi_class if vendor and cdi_class else ""


def _edits(spec: dict[str, Any]) -> list[dict[str, Any]]:
    devices = spec.get("devices") or []
    return [spec.get("containerEdits") or {}, *(d.get("containerEdits") or {} for d in devices)]


# The CDI SPEC.md "Released versions" table: what each version added. A spec using a field needs at
# least that version; 0.8.0 and 1.0.0 changed only the Go API, so no content requires them. Go's
# zero values count as unused (the loader decodes into Go structs), except intelRdt: any non-null
# object is a non-nil pointer. Newest first; each entry: version, what needs it, the test.
_ADDED: list[tuple[str, str, Callable[[dict[str, Any]], bool]]] = [
    ("1.1.0", "netDevices", lambda s: any(e.get("netDevices") for e in _edits(s))),
    ("1.1.0", "intelRdt schemata/enableMonitoring",
     lambda s: any(isinstance(e.get("intelRdt"), dict) and (e["intelRdt"].get("schemata") is not None
                                                            or e["intelRdt"].get("enableMonitoring"))
                   for e in _edits(s))),
    ("0.7.0", "intelRdt", lambda s: any(e.get("intelRdt") is not None for e in _edits(s))),
    ("0.7.0", "additionalGids", lambda s: any(e.get("additionalGids") for e in _edits(s))),
    ("0.6.0", "annotations", lambda s: bool(s.get("annotations"))
     or any(d.get("annotations") for d in s.get("devices") or [])),
    ("0.6.0", "a '.' in the kind's class", lambda s: "." in _kind_class(s)),
    ("0.5.0", "a device name not starting with a letter",
     lambda s: any(d.get("name") and not _is_letter(d["name"][0]) for d in s.get("devices") or [])),
    ("0.5.0", "deviceNodes hostPath",
     lambda s: any(n.get("hostPath") for e in _edits(s) for n in e.get("deviceNodes") or [])),
    ("0.4.0", "mounts type", lambda s: any(m.get("type") for e in _edits(s) for m in e.get("mounts") or [])),
]


def required_version(spec: dict[str, Any]) -> tuple[str, str]:
    """The lowest cdiVersion that accepts ``spec``'s content, and the feature that needs it."""
    for version, feature, used in _ADDED:
        if used(spec):
            return version, feature
    return EARLIEST_VERSION, "nothing newer than the earliest version"


def validate_cdi_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Raise (ValidationError, AssertionError, SchemaUnavailable) unless a CDI runtime would load
    ``spec`` and it declares exactly the cdiVersion it needs; returns it."""
    official_validator().validate(spec)
    # Extra rules. The official schema.json leaves the spec-wide containerEdits undeclared (so
    # unchecked); the CDI library decodes it as the same ContainerEdits a device has.
    if "containerEdits" in spec:
        official_validator("defs.json#/definitions/containerEdits").validate(spec["containerEdits"])
    _strict_validator().validate(spec)
    names = [d["name"] for d in spec["devices"]]
    assert len(names) == len(set(names)), f"duplicate CDI device names {names}"
    for device in spec["devices"]:
        edits = device["containerEdits"]
        assert any(edits.get(k) for k in edits), f"device {device['name']}: empty device edits"
    needed, feature = required_version(spec)
    assert spec["cdiVersion"] == needed, (
        f"cdiVersion {spec['cdiVersion']}, but its content needs exactly {needed} ({feature})")
    return spec


class CdiToolsUnavailable(RuntimeError):
    pass


CDI_TOOLS = TESTS.parent / "hack" / "cdi-tools"
CDI_TOOLS_SOURCES = ("go.mod", "go.sum", "main.go")  # what hack/cdi-tools-bin.sh keys its cache on


def cdi_tools_dir() -> Path:
    """$GPUDRA_CDI_TOOLS_DIR when it has cdi-validate, else where hack/cdi-tools-bin.sh caches the
    build of the current hack/cdi-tools sources (``<cache>/cdi-tools/<sha256 of them>[:16]``)."""
    given = os.environ.get("GPUDRA_CDI_TOOLS_DIR")
    if given and (Path(given) / "cdi-validate").is_file():
        return Path(given)
    digest = hashlib.sha256(b"".join((CDI_TOOLS / n).read_bytes() for n in CDI_TOOLS_SOURCES)).hexdigest()
    return cache_root() / "cdi-tools" / digest[:16]


@cache
def cdi_library_version() -> str:
    """The pinned tags.cncf.io/container-device-interface version (hack/cdi-tools/go.mod)."""
    found = re.search(rf"^\s*(?:require\s+)?{re.escape(SCHEMA_MODULE)} (v\S+)",
                      (CDI_TOOLS / "go.mod").read_text(), re.MULTILINE)
    return found.group(1) if found else "?"


def cdi_validate() -> Path:
    binary = cdi_tools_dir() / "cdi-validate"
    if not os.access(binary, os.X_OK):
        given = os.environ.get("GPUDRA_CDI_TOOLS_DIR")
        raise CdiToolsUnavailable(
            f"cdi-validate (the official CDI Go library {SCHEMA_MODULE}@{cdi_library_version()}, "
            f"hack/cdi-tools) is not built: no {binary}"
            + (f" (and $GPUDRA_CDI_TOOLS_DIR={given} has none)" if given else "")
            + f". Every CDI spec the tests write is checked with it. Build it (Go >= 1.23, the Go module "
            f"proxy or a warm module cache):\n  cd {TESTS.parent} && make cdi-tools")
    return binary


def validate_with_cdi_library(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Run the official CDI library on the spec files ``paths`` as a runtime would load them from
    one spec directory: each read and validated, all in one cache without errors (a device name
    defined twice in a kind conflicts), each device injected alone into an empty OCI runtime spec.
    Returns qualified device name (``vendor/class=name``) -> the OCI spec that injection made of
    an empty one (``process.env``, ``mounts``, ``linux.devices``, ``linux.resources.devices``,
    ``hooks``, ...). Raises AssertionError with the library's messages when anything fails, and
    CdiToolsUnavailable (never a skip) when cdi-validate is not built."""
    assert paths, "no CDI spec files to validate"
    command = [str(cdi_validate()), "--json", *(str(p) for p in paths)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise AssertionError(
            f"the official CDI library ({SCHEMA_MODULE}@{cdi_library_version()}) rejects "
            f"{', '.join(map(str, paths))} (exit {result.returncode}):\n{result.stderr.strip()}")
    injected: dict[str, dict[str, Any]] = json.loads(result.stdout)
    return injected


def load_and_validate(path: Path) -> dict[str, Any]:
    spec = validate_cdi_spec(json.loads(path.read_text()))
    validate_with_cdi_library([path])
    return spec


def validate_claim_spec(cdi_dir: Path, claim_uid: str, cdi_device_ids: list[str]) -> dict[str, Any]:
    """The spec file the CDI device IDs a prepare returned point to (CDI's transient spec name
    ``<vendor>-<class>_<claimUID>.json``), validated, defining every one of those devices."""
    assert cdi_device_ids, f"claim {claim_uid}: prepared without CDI device IDs"
    kinds = {cdi_id.partition("=")[0] for cdi_id in cdi_device_ids}
    assert len(kinds) == 1, f"claim {claim_uid}: CDI device IDs of several kinds {sorted(kinds)}"
    (kind,) = kinds
    vendor, _, cdi_class = kind.partition("/")
    spec = load_and_validate(cdi_dir / f"{vendor}-{cdi_class}_{claim_uid}.json")
    defined = {f"{spec['kind']}={d['name']}" for d in spec["devices"]}
    assert set(cdi_device_ids) <= defined, f"claim {claim_uid}: {cdi_device_ids} not all in {sorted(defined)}"
    return spec


def validate_prepared(cdi_dir: Path, response: Any) -> dict[str, dict[str, Any]]:
    """After a NodePrepareResources call: claim UID -> validated spec, for every claim the response
    reports prepared."""
    return {uid: validate_claim_spec(cdi_dir, uid, [i for d in result.devices for i in d.cdi_device_ids])
            for uid, result in response.claims.items() if not result.error}


if __name__ == "__main__":
    try:
        fetch_schema()
    except SchemaUnavailable as error:
        sys.exit(f"cdi-schema: {error}")
    print(schema_dir())
