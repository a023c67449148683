"""Generate the DistributedTrainingJob CRD from the pydantic models (`dtjob crd` prints it).

pydantic's JSON schema is turned into the structural OpenAPI v3 schema that CRDs require: `$ref`s
are inlined, `anyOf [T, null]` (Optional) becomes just T (the field is optional), titles are dropped,
and the PodTemplateSpec / VolumeSource markers are replaced by the vendored Kubernetes schemas
(see k8s_schemas.py). CEL rules come from rules.py.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from dtjob.api import k8s_schemas, rules
from dtjob.api.models import (
    GROUP,
    K8S_SCHEMA_KEY,
    KIND,
    PLURAL,
    SHORT_NAME,
    SINGULAR,
    VERSION,
    DistributedTrainingJob,
    DistributedTrainingJobSpec,
    DistributedTrainingJobStatus,
)

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{GROUP}_{PLURAL}.yaml"
# Keywords of pydantic's output that a CRD schema accepts as they are.
_KEPT_KEYS = {
    "type",
    "format",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "pattern",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "required",
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Job phase"},
    {"name": "Current", "type": "integer", "jsonPath": ".status.replicas", "description": "World size now"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired world size"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Latest training step"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "description": "Gang restarts"},
    {
        "name": "Goodput",
        "type": "number",
        "jsonPath": ".status.goodput.ratio",
        "description": "Kept-step time over wall time",
    },
    # string: kubectl prints a date column as an age, and a time in the future as <invalid>
    {"name": "ETA", "type": "string", "jsonPath": ".status.eta", "description": "Estimated completion"},
    {
        "name": "Processes",
        "type": "integer",
        "jsonPath": ".status.worldSize",
        "priority": 1,
        "description": "Trainer processes now (workers x nprocPerWorker)",
    },
    {
        "name": "Generation",
        "type": "integer",
        "jsonPath": ".status.generation",
        "priority": 1,
        "description": "Gang generation",
    },
    {"name": "Min", "type": "integer", "jsonPath": ".spec.elastic.minReplicas", "priority": 1},
    {"name": "Max", "type": "integer", "jsonPath": ".spec.elastic.maxReplicas", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def structural(node: dict[str, Any], defs: dict[str, Any], k8s: bool = True) -> dict[str, Any]:
    """pydantic JSON schema -> structural CRD schema. `k8s=False` leaves the markers in place."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        outer = {k: v for k, v in node.items() if k != "$ref"}
        return structural({**target, **outer}, defs, k8s)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"only Optional[T] unions are supported, got {node['anyOf']}")
        outer = {k: v for k, v in node.items() if k != "anyOf"}
        if outer.get("default", 0) is None:
            del outer["default"]
        return structural({**variants[0], **outer}, defs, k8s)
    if K8S_SCHEMA_KEY in node:
        if not k8s:
            return {K8S_SCHEMA_KEY: node[K8S_SCHEMA_KEY], "description": node.get("description", "")}
        schema = copy.deepcopy(k8s_schemas.load()[node[K8S_SCHEMA_KEY]])
        schema["description"] = node["description"]
        return schema
    out = {k: v for k, v in sorted(node.items()) if k in _KEPT_KEYS}
    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {name: structural(prop, defs, k8s) for name, prop in node["properties"].items()}
    if "items" in node:
        out["items"] = structural(node["items"], defs, k8s)
    if "additionalProperties" in node and node["additionalProperties"] not in (False, True):
        out["additionalProperties"] = structural(node["additionalProperties"], defs, k8s)
    # Read like kubebuilder's output: what it is first, then its constraints, then its children.
    head: dict[str, Any] = {k: out.pop(k) for k in ("type", "description") if k in out}
    return {**head, **out}


def _model_schema(model: type[DistributedTrainingJobSpec | DistributedTrainingJobStatus], k8s: bool) -> Any:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return structural(schema, schema.get("$defs", {}), k8s)


def openapi_schema(k8s: bool = True) -> dict[str, Any]:
    """The `openAPIV3Schema` of the CRD's only version."""
    fields = DistributedTrainingJob.model_fields
    spec = _model_schema(DistributedTrainingJobSpec, k8s)
    spec["description"] = fields["spec"].description  # the field's text, not the class docstring
    spec["x-kubernetes-validations"] = rules.cel_validations()
    status = _model_schema(DistributedTrainingJobStatus, k8s)
    status["description"] = fields["status"].description
    return {
        "type": "object",
        "description": " ".join((DistributedTrainingJob.__doc__ or "").split()),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "training.dtjob.io/v1alpha1"},
            "kind": {"type": "string", "description": "DistributedTrainingJob"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            {
                "rule": rules.NAME_CEL,
                # No fieldPath: the API server refuses one into metadata; the message names the field.
                "message": rules.NAME_MESSAGE,
                "reason": "FieldValueInvalid",
            }
        ],
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "dtjob", "app.kubernetes.io/part-of": "dtjob"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
                "categories": ["all"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def render() -> str:
    header = (
        "# Generated by `dtjob crd` (make crds) from operator/dtjob/api/models.py and rules.py.\n"
        "# Do not edit by hand: change the models and run `make crds`.\n"
    )
    return header + yaml.safe_dump(crd(), sort_keys=False, width=1_000_000)


def main(argv: list[str]) -> int:
    if argv and argv[0] in {"-h", "--help"}:
        print("usage: dtjob crd   (prints the DistributedTrainingJob CRD YAML)")
        return 0
    if argv:
        print(f"dtjob crd: unexpected argument {argv[0]!r} (it takes none)", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
