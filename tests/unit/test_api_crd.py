"""The generated CRD: current on disk, structural, documented; the README section is current."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from dtjob.api import crd, docs, k8s_schemas, rules

ROOT = Path(__file__).resolve().parents[2]
CRD_PATHS = [ROOT / "crds" / crd.CRD_FILE, ROOT / "helm" / "dtjob" / "crds" / crd.CRD_FILE]
# kubectl apply (client side) stores the object in an annotation limited to 256 KiB.
LAST_APPLIED_LIMIT = 256 * 1024


@pytest.mark.parametrize("path", CRD_PATHS, ids=lambda p: str(p.relative_to(ROOT)))
def test_crd_on_disk_is_current(path: Path) -> None:
    assert path.is_file(), f"{path} is missing: run `make crds`"
    assert path.read_text() == crd.render(), f"{path} differs from the models: run `make crds`"


def test_dtjob_crd_prints_it() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert crd.main([]) == 0
    assert yaml.safe_load(out.getvalue()) == crd.crd()
    assert crd.main(["--bogus"]) == 2


def _nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from _nodes(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_schema_is_structural() -> None:
    forbidden = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "const", "title", "additionalItems"}
    for path, node in _nodes(_schema()):
        assert not forbidden & node.keys(), f"{path or '<root>'}: {forbidden & node.keys()}"
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path}: no type"
        if "properties" in node:
            assert node["type"] == "object", path
        if node.get("type") == "array":
            assert "items" in node, path


def test_every_api_field_has_a_description() -> None:
    schema = crd.openapi_schema(k8s=False)
    for top in ("spec", "status"):
        for path, node in _nodes(schema["properties"][top], top):
            if not path.endswith("[]"):  # list items are described by their list
                assert node.get("description"), f"{path} has no description"


def test_the_template_is_a_real_pod_template_spec() -> None:
    template = _schema()["properties"]["spec"]["properties"]["template"]
    pod_spec = template["properties"]["spec"]
    assert pod_spec["required"] == ["containers"]
    container = pod_spec["properties"]["containers"]["items"]
    assert {"name", "image", "command", "args", "env", "resources", "volumeMounts"} <= container[
        "properties"
    ].keys()
    assert "x-kubernetes-preserve-unknown-fields" not in json.dumps(template)
    cpu = container["properties"]["resources"]["properties"]["requests"]["additionalProperties"]
    assert cpu == {"x-kubernetes-int-or-string": True, "pattern": k8s_schemas.QUANTITY_PATTERN}
    assert set(template["properties"]["metadata"]["properties"]) >= {"labels", "annotations"}
    volume = _schema()["properties"]["spec"]["properties"]["checkpoint"]["properties"]["volume"]
    assert {"persistentVolumeClaim", "hostPath", "emptyDir", "nfs"} <= volume["properties"].keys()
    assert "name" not in volume["properties"]


def test_defaults_and_enums_reach_the_crd() -> None:
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["masterPort"]["default"] == 29500
    assert (spec["masterPort"]["minimum"], spec["masterPort"]["maximum"]) == (1, 65534)  # + 1: the agent
    assert spec["elastic"]["default"] == {} and spec["runPolicy"]["default"] == {}
    assert spec["elastic"]["properties"]["maxRestarts"] == {
        "type": "integer",
        "description": spec["elastic"]["properties"]["maxRestarts"]["description"],
        "default": 3,
        "minimum": 0,
    }
    assert spec["runPolicy"]["properties"]["cleanPodPolicy"]["enum"] == ["None", "Running", "All"]
    assert spec["elastic"]["properties"]["restartPolicy"]["enum"] == ["OnFailure", "ExitCode", "Never"]
    assert _schema()["properties"]["spec"]["required"] == ["replicas", "template"]


def test_cel_rules_and_subresources() -> None:
    version = crd.crd()["spec"]["versions"][0]
    validations = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    assert len(validations) == len(rules.RULES) + len(rules.TRANSITION_RULES)
    assert {
        "rule": "self.masterPort == oldSelf.masterPort",
        "message": "masterPort is immutable",
        "fieldPath": ".masterPort",
        "reason": "FieldValueInvalid",
    } in validations
    for v in validations:
        assert v["fieldPath"].startswith(".") and v["message"]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    names = crd.crd()["spec"]["names"]
    assert (names["plural"], names["shortNames"], names["categories"]) == (
        "distributedtrainingjobs",
        ["dtj"],
        ["all"],
    )
    assert crd.crd()["spec"]["scope"] == "Namespaced"
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:5] == ["Phase", "Current", "Desired", "Step", "Restarts"] and columns[-1] == "Age"


def test_crd_fits_kubectl_apply() -> None:
    compact = json.dumps(crd.crd(), separators=(",", ":"))
    assert len(compact) < LAST_APPLIED_LIMIT / 2, len(compact)


def test_readme_api_section_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    assert docs.BEGIN in readme and docs.END in readme
    assert docs.with_api_section(readme) == readme, (
        "README API table is stale: run `python -m dtjob.api.docs`"
    )


def test_readme_section_lists_every_field() -> None:
    section = docs.api_section()
    for path, _ in list(_nodes(crd.openapi_schema(k8s=False)["properties"]["spec"], "spec"))[1:]:
        assert path.endswith("[]") or f"| `{path}` |" in section, path
    assert "| `spec.masterPort` | integer | `29500` |" in section


def test_with_api_section_replaces_only_between_markers() -> None:
    text = f"# title\n\nbefore\n{docs.BEGIN}\nold table\n{docs.END}\nafter\n"
    updated = docs.with_api_section(text)
    assert updated.startswith("# title\n\nbefore\n") and updated.endswith(f"{docs.END}\nafter\n")
    assert "old table" not in updated and "| `spec.replicas` |" in updated
    assert docs.with_api_section("# bare\n").endswith(f"{docs.END}\n")


@pytest.mark.skipif(not k8s_schemas.OPENAPI_DOC.is_file(), reason="k8s.io/kubernetes module not downloaded")
def test_vendored_k8s_schemas_match_the_api_server_document() -> None:
    derived = k8s_schemas.derive(json.loads(k8s_schemas.OPENAPI_DOC.read_text()))
    assert k8s_schemas.render(derived) == k8s_schemas.VENDORED.read_text(), (
        "run `python -m dtjob.api.k8s_schemas`"
    )


def test_structural_inlines_refs_and_int_or_string() -> None:
    schemas = {
        "io.k8s.api.core.v1.Port": {
            "description": "dropped",
            "properties": {
                "port": {
                    "allOf": [
                        {"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.util.intstr.IntOrString"}
                    ]
                },
                "n": {"type": "integer", "format": "int32", "default": 0},
            },
            "required": ["port"],
            "x-kubernetes-map-type": "atomic",
        },
        "Loop": {"properties": {"again": {"$ref": "#/components/schemas/Loop"}}},
    }
    out = k8s_schemas.structural({"$ref": "#/components/schemas/io.k8s.api.core.v1.Port"}, schemas)
    assert out == {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "format": "int32"},
            "port": {"x-kubernetes-int-or-string": True},
        },
        "required": ["port"],
    }
    with pytest.raises(ValueError, match="recursive type Loop"):
        k8s_schemas.structural({"$ref": "#/components/schemas/Loop"}, schemas)
