"""`gpudra render`: the objects the operator would create, from a file and no cluster, and errors
that name the document, the field or the DeviceClass template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpudra_operator.allocatorhelper import available_minors
from gpudra.cli import main
from gpudra_operator.render import render
from gpudra_operator.crd import default_object

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


def gpudra_render(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["render", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("sample", ["gpudraconfig.yaml", "gpudraconfig-minimal.yaml", "gpudraconfig-mig.yaml",
                                    "gpudraconfig-sharing.yaml"])
def test_every_sample_renders_to_what_the_operator_would_apply(capsys, sample: str) -> None:
    code, out, err = gpudra_render(capsys, "-f", str(SAMPLES / sample))
    assert (code, err) == (0, "")
    objects = list(yaml.safe_load_all(out))
    body = yaml.safe_load((SAMPLES / sample).read_text())
    expected = render({**default_object(body), "metadata": {**body["metadata"], "generation": 1}}).objects
    assert objects == expected
    daemonsets = ["DaemonSet"] * (2 if "mps" in (body["spec"].get("sharing") or {}) else 1)  # + the MPS supervisor
    assert [o["kind"] for o in objects] == daemonsets + ["DeviceClass"] * len(body["spec"]["deviceClasses"])
    assert all("ownerReferences" not in o["metadata"] for o in objects)  # a file has no UID


def test_defaults_come_from_the_crd(capsys) -> None:
    code, out, _ = gpudra_render(capsys, "-f", str(SAMPLES / "gpudraconfig-minimal.yaml"))
    daemonset = next(yaml.safe_load_all(out))
    assert daemonset["metadata"]["namespace"] == "gpudra-system"
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/gpudra/gpudra:0.1.0"  # no CRD default: this release's image
    assert container["args"][:3] == ["agent", "--driver", "gpu.gpudra.io"]


def test_json_output_is_a_list(capsys) -> None:
    code, out, _ = gpudra_render(capsys, "-f", str(SAMPLES / "gpudraconfig.yaml"), "-o", "json")
    document = json.loads(out)
    assert code == 0 and document["kind"] == "List" and document["apiVersion"] == "v1"
    assert [o["metadata"]["name"] for o in document["items"]][1:] == [
        "gpu.gpudra.io", "gpu-full.gpudra.io", "mig.gpudra.io", "gpu-64gi.gpudra.io"]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


CONFIG = """apiVersion: gpudra.io/v1alpha1
kind: GpuDraConfig
metadata:
  name: team
spec:
"""


def test_schema_errors_name_the_field_and_print_nothing(capsys, tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG + "  driverName: Not_DNS\n  agnet: {}\n  agent:\n    imagePullPolicy: Sometimes\n"
                 "  deviceClasses:\n  - name: a.gpudra.io\n    template: all\n")
    code, out, err = gpudra_render(capsys, "-f", path)
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert len(lines) == 3
    assert all(line.startswith(f"gpudra render: {path}: document 1 (GpuDraConfig 'team'): ") for line in lines)
    assert "spec.driverName: driverName must be a DNS subdomain" in lines[0]
    assert lines[1].endswith("spec.agnet: unknown field")
    assert 'spec.agent.imagePullPolicy: must be one of "Always", "IfNotPresent", "Never", got "Sometimes"' in lines[2]


def test_template_errors_name_the_class_and_template(capsys, tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG + "  deviceClasses:\n  - name: ok.gpudra.io\n    template: all\n"
                 "  - name: big.gpudra.io\n    template: min-memory\n    parameters: {memory: lots}\n"
                 "  - name: mine.gpudra.io\n    inline: '{{ nope.x }}'\n")
    code, out, err = gpudra_render(capsys, "-f", path)
    assert code == 1 and out == ""
    big, mine = err.splitlines()
    assert "spec.deviceClasses[1] (DeviceClass 'big.gpudra.io', template 'min-memory'): " in big and "lots" in big
    assert "spec.deviceClasses[2] (DeviceClass 'mine.gpudra.io', inline template): " in mine and "'nope' is undefined" in mine


def test_selectors_are_compiled_by_each_releases_cel(capsys, tmp_path: Path) -> None:
    inline = ("{apiVersion: resource.k8s.io/v1, kind: DeviceClass, metadata: {name: '{{ name }}'}, "
              "spec: {selectors: [{cel: {expression: {{ params.expression | yaml_string }}}}]}}")
    broken = 'device.attributes[\\"gpu.gpudra.io\\"].productName == \\"x\\" &&'
    path = write(tmp_path, CONFIG + "  deviceClasses:\n  - name: ok.gpudra.io\n    template: all\n"
                 f"  - name: bad.gpudra.io\n    inline: \"{inline}\"\n    parameters:\n      expression: \"{broken}\"\n")
    code, out, err = gpudra_render(capsys, "-f", path)
    assert code == 1 and out == "", err
    lines = err.splitlines()
    assert len(lines) == len(available_minors()) and all("DeviceClass 'bad.gpudra.io': spec.selectors[0]" in line
                                                       and "Syntax error" in line for line in lines), err
    code, out, err = gpudra_render(capsys, "-f", path, "--kubernetes-version", "1.36")
    assert code == 1 and "(Kubernetes 1.36)" in err and err.count("\n") == 1, err


def test_other_documents_and_broken_files(capsys, tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG + "  deviceClasses: []\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    code, _, err = gpudra_render(capsys, "-f", path)
    assert code == 1 and "document 2: apiVersion/kind must be gpudra.io/v1alpha1 GpuDraConfig, got v1 ConfigMap" in err
    code, _, err = gpudra_render(capsys, "-f", write(tmp_path, "a: [b\n"))
    assert code == 1 and "not valid YAML" in err
    code, _, err = gpudra_render(capsys, "-f", str(tmp_path / "missing.yaml"))
    assert code == 1 and "missing.yaml: No such file or directory" in err


def test_console_script_reads_stdin() -> None:
    text = (SAMPLES / "gpudraconfig-minimal.yaml").read_text()
    result = subprocess.run([sys.executable, "-m", "gpudra.cli", "render", "-f", "-", "-o", "json"],
                            input=text, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert [o["kind"] for o in json.loads(result.stdout)["items"]] == ["DaemonSet", "DeviceClass"]


def test_consumable_capacity_is_checked_and_reaches_the_agent_flags(capsys, tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG + "  sharing:\n    consumableCapacity: {memoryStep: 1 Gi, shares: 2000}\n")
    code, out, err = gpudra_render(capsys, "-f", path)
    assert code == 1 and out == ""
    step, shares = err.splitlines()
    assert step.endswith('spec.sharing.consumableCapacity.memoryStep: must match ' +
                         r'^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|'
                         r'(\.[0-9]+))))?$, got "1 Gi"')
    assert shares.endswith("spec.sharing.consumableCapacity.shares: must be <= 1000, got 2000")
    # the pattern takes 0; the parser (as the API server's CEL rule) does not
    path = write(tmp_path, CONFIG + "  sharing:\n    consumableCapacity: {memoryStep: '0'}\n")
    code, out, err = gpudra_render(capsys, "-f", path)
    assert code == 1 and "spec.sharing.consumableCapacity.memoryStep: '0' is not a positive whole number" in err
    path = write(tmp_path, CONFIG + "  sharing:\n    consumableCapacity: {}\n")
    code, out, err = gpudra_render(capsys, "-f", path)
    (container,) = next(yaml.safe_load_all(out))["spec"]["template"]["spec"]["containers"]
    assert code == 0 and "--consumable-memory-step" in container["args"]
    assert container["args"][container["args"].index("--consumable-memory-step") + 1] == "1Gi"  # the CRD default
