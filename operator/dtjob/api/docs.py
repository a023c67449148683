"""The README's API section, generated from the models (via the CRD schema they produce).

`python -m dtjob.api.docs` rewrites the section between the markers in README.md; a unit test
fails when the README differs from what this module generates.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dtjob import generated
from dtjob.api import rules
from dtjob.api.crd import PRINTER_COLUMNS, openapi_schema
from dtjob.api.models import API_VERSION, K8S_SCHEMA_KEY, KIND, SHORT_NAME
from dtjob.api.rules import MAX_JOB_NAME_LENGTH

BEGIN = "<!-- api:begin -->"
END = "<!-- api:end -->"
README = Path(__file__).resolve().parents[3] / "README.md"


def _type(schema: dict[str, Any]) -> str:
    if K8S_SCHEMA_KEY in schema:
        return str(schema[K8S_SCHEMA_KEY])
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if schema.get("type") == "array":
        return "[]" + _type(schema["items"])
    if "format" in schema:
        return f"{schema.get('type', 'any')} ({schema['format']})"
    return str(schema.get("type", "any"))


def _default(schema: dict[str, Any], required: bool) -> str:
    if required:
        return "**required**"
    if "default" not in schema or schema["default"] == {}:
        return ""
    return f"`{json.dumps(schema['default'])}`"


def _rows(schema: dict[str, Any], path: str) -> list[str]:
    rows = []
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        field = f"{path}.{name}"
        description = prop.get("description", "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{field}` | {_type(prop)} | {_default(prop, name in required)} | {description} |")
        rows += _rows(prop.get("items", prop), field + ("[]" if "items" in prop else ""))
    return rows


def api_section() -> str:
    schema = openapi_schema(k8s=False)
    header = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    columns = ", ".join(c["name"] for c in PRINTER_COLUMNS if not c.get("priority"))
    wide = ", ".join(c["name"] for c in PRINTER_COLUMNS if c.get("priority"))
    lines = [
        "## API: DistributedTrainingJob",
        "",
        f"`apiVersion: {API_VERSION}`, `kind: {KIND}` (short name `{SHORT_NAME}`, namespaced). "
        "Generated from `operator/dtjob/api/models.py` by `python -m dtjob.api.docs`; the CRD "
        "(`make crds`) comes from the same models. `kubectl explain dtj.spec` shows the same text.",
        "",
        f"`kubectl get dtj` shows {columns} (`-o wide` adds {wide}). `kubectl scale dtj/NAME "
        "--replicas=N` changes `spec.replicas` within the elastic bounds. The job name must be a "
        f"DNS-1035 label of at most {MAX_JOB_NAME_LENGTH} characters.",
        "",
        "### Spec",
        "",
        *header,
        *_rows(schema["properties"]["spec"], "spec"),
        "",
        "Rules the API server enforces (CEL) and the operator checks again (`validate_job`):",
        "",
        *[f"- `spec.{r.field}`: {r.message} (`{r.cel}`)" for r in rules.RULES],
        *[f"- `spec.{r.field}`: {r.message}: {r.why}" for r in rules.TRANSITION_RULES],
        "",
        "### Status (written by the operator)",
        "",
        *header,
        *_rows(schema["properties"]["status"], "status"),
    ]
    return "\n".join(lines)


def with_api_section(readme: str) -> str:
    """`readme` with the text between the markers replaced (the markers appended if absent)."""
    return generated.replace_between(readme, BEGIN, END, api_section())


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else README
    path.write_text(with_api_section(path.read_text()))
    print(f"updated the API section of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
