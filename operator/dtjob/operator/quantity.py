"""Kubernetes resource quantities ("500m", "2", "1Gi", "1e3", or a bare number) as exact Decimals.

The API server accepts a quantity as a string or a number (`nvidia.com/gpu: 1` in YAML is an
integer); the kubernetes client's models take only strings. `stringify_quantities` turns every
quantity of a pod spec into its string form before the spec is sent, finding them through the
same vendored schema the CRD validates the template with, so no quantity field is missed
(resources of every container and of the pod, overhead, emptyDir sizeLimit, ephemeral volume
claims, resourceFieldRef divisors).
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from functools import cache
from typing import Any

from dtjob.api import k8s_schemas

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}


def parse_quantity(value: object) -> Decimal:
    """Parse a quantity (string or number); raises ValueError naming the bad value."""
    if isinstance(value, bool):
        raise ValueError(f"invalid resource quantity {value!r}: expected e.g. '2', '500m' or '1Gi'")
    text = quantity_string(value) if isinstance(value, int | float) else str(value).strip()
    try:
        for suffix, factor in _BINARY.items():
            if text.endswith(suffix):
                return Decimal(text[: -len(suffix)]) * factor
        if text and text[-1] in _DECIMAL:
            return Decimal(text[:-1]) * _DECIMAL[text[-1]]
        return Decimal(text)
    except InvalidOperation:
        raise ValueError(f"invalid resource quantity {value!r}: expected e.g. '2', '500m' or '1Gi'") from None


def quantity_string(value: int | float) -> str:
    """A number written as the quantity string of the same value: 1 -> "1", 0.5 -> "0.5"."""
    if isinstance(value, int):
        return str(value)
    return format(Decimal(repr(value)), "f")


def format_quantity(value: Decimal) -> str:
    """A quantity string the API server accepts: whole numbers plain, fractions in milli-units."""
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int((value * 1000).to_integral_value())}m"


@cache
def _pod_spec_schema() -> dict[str, Any]:
    schema: dict[str, Any] = k8s_schemas.load()["PodTemplateSpec"]["properties"]["spec"]
    return schema


def _is_quantity(schema: dict[str, Any]) -> bool:
    return (
        bool(schema.get("x-kubernetes-int-or-string"))
        and schema.get("pattern") == k8s_schemas.QUANTITY_PATTERN
    )


def _stringify(value: Any, schema: dict[str, Any]) -> Any:
    if _is_quantity(schema) and isinstance(value, int | float) and not isinstance(value, bool):
        return quantity_string(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                value[key] = _stringify(item, sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            value[i] = _stringify(item, schema["items"])
    return value


def stringify_quantities(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """Every quantity of a PodSpec written as a string, in place (and returned)."""
    _stringify(pod_spec, _pod_spec_schema())
    return pod_spec
