"""Kubernetes core schemas (PodTemplateSpec, VolumeSource) for the CRD, derived from the API server.

The CRD validates `spec.template` as a real PodTemplateSpec, so a misspelt field such as
`containres` is rejected under kubectl's strict field validation. The schema comes from the API
server's own OpenAPI v3 document (k8s.io/kubernetes, api/openapi-spec/v3/api__v1_openapi.json),
rewritten into the structural form that CRDs require and vendored as `k8s_schemas.json`:

- every `$ref` / single-element `allOf` is inlined (PodTemplateSpec has no recursive type);
- IntOrString becomes `x-kubernetes-int-or-string: true`; Quantity as well, plus the pattern
  Kubernetes uses to parse it, so `cpu: "2 cores"` is refused;
- descriptions are dropped (about two thirds of the bytes; the CRD must stay well below the
  256 KiB limit of kubectl apply's last-applied annotation), as are `default`s (the CRD would
  otherwise fill template fields the user never wrote) and the strategic-merge and list-type
  extensions (they would require every list-map key to be required or defaulted);
- the template's `metadata` keeps only the fields that matter for a pod template.

Regenerate after a Kubernetes upgrade with
`python -m dtjob.api.k8s_schemas [path/to/api__v1_openapi.json]`.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

KUBERNETES_VERSION = "v1.37.2"
OPENAPI_DOC = (
    Path.home()
    / f"go/pkg/mod/k8s.io/kubernetes@{KUBERNETES_VERSION}/api/openapi-spec/v3/api__v1_openapi.json"
)
VENDORED = Path(__file__).with_name("k8s_schemas.json")

_CORE = "io.k8s.api.core.v1."
_INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# The regular expression of k8s.io/apimachinery/pkg/api/resource (the one controller-gen emits).
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^(\+|-)?{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUMBER}))?$"
# Formats a CRD schema accepts (apiextensions validation); the document uses only these.
_KEPT_FORMATS = {"int32", "int64", "byte", "date-time"}
_KEPT_KEYS = {"type", "format", "required", "enum", "minimum", "maximum", "pattern", "maxLength"}
# ObjectMeta fields that a pod template may carry; the others are set by the system.
_TEMPLATE_META_FIELDS = ("name", "namespace", "generateName", "labels", "annotations", "finalizers")


def _ref_name(node: dict[str, Any]) -> str | None:
    if "$ref" in node:
        return str(node["$ref"]).rsplit("/", 1)[-1]
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and "$ref" in all_of[0]:
        return str(all_of[0]["$ref"]).rsplit("/", 1)[-1]
    return None


def structural(node: dict[str, Any], schemas: dict[str, Any], seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Inline `node` into a structural schema without descriptions or defaults."""
    name = _ref_name(node)
    if name is not None:
        if name in seen:
            raise ValueError(f"recursive type {name} via {' -> '.join(seen)}: cannot inline")
        if name == _INT_OR_STRING:
            return {"x-kubernetes-int-or-string": True}
        if name == _QUANTITY:
            return {"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}
        if name == _OBJECT_META:
            return template_metadata(schemas)
        return structural(schemas[name], schemas, (*seen, name))
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "format" and value not in _KEPT_FORMATS:
            continue
        if key in _KEPT_KEYS:
            out[key] = value
        elif key == "properties":
            out["properties"] = {k: structural(v, schemas, seen) for k, v in sorted(value.items())}
        elif key in {"items", "additionalProperties"} and isinstance(value, dict):
            out[key] = structural(value, schemas, seen)
        elif key == "oneOf":
            raise ValueError(f"unexpected oneOf outside IntOrString/Quantity under {seen}")
    if "properties" in out:
        out.setdefault("type", "object")
    return out


def template_metadata(schemas: dict[str, Any]) -> dict[str, Any]:
    meta = schemas[_OBJECT_META]["properties"]
    props = {k: structural(meta[k], schemas) for k in _TEMPLATE_META_FIELDS}
    # `kubectl create --dry-run -o yaml` writes `creationTimestamp: null`; accept what it writes.
    props["creationTimestamp"] = {"type": "string", "format": "date-time", "nullable": True}
    return {"type": "object", "properties": dict(sorted(props.items()))}


def derive(openapi: dict[str, Any]) -> dict[str, Any]:
    """The vendored document: PodTemplateSpec and VolumeSource (a Volume without its name)."""
    schemas = openapi["components"]["schemas"]
    volume = structural(schemas[_CORE + "Volume"], schemas)
    volume["properties"].pop("name")
    volume.pop("required", None)
    return {
        "source": f"k8s.io/kubernetes@{KUBERNETES_VERSION} api/openapi-spec/v3/api__v1_openapi.json",
        "PodTemplateSpec": structural(schemas[_CORE + "PodTemplateSpec"], schemas),
        "VolumeSource": volume,
    }


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


@cache
def load() -> dict[str, Any]:
    """The vendored schemas, keyed by type name."""
    document: dict[str, Any] = json.loads(VENDORED.read_text())
    return document


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else OPENAPI_DOC
    if not source.is_file():
        print(
            f"k8s_schemas: {source} not found; download it with "
            f"`GOFLAGS=-mod=mod go mod download -json k8s.io/kubernetes@{KUBERNETES_VERSION}`",
            file=sys.stderr,
        )
        return 2
    text = render(derive(json.loads(source.read_text())))
    VENDORED.write_text(text)
    print(f"wrote {VENDORED} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
