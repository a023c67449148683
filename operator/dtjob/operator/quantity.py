"""Kubernetes resource quantities ("500m", "2", "1Gi", "1e3") as exact Decimals."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal(10**3),
            "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
            "E": Decimal(10**18)}  # fmt: skip


def parse_quantity(value: object) -> Decimal:
    """Parse a quantity; raises ValueError naming the bad value."""
    text = str(value).strip()
    try:
        for suffix, factor in _BINARY.items():
            if text.endswith(suffix):
                return Decimal(text[: -len(suffix)]) * factor
        if text and text[-1] in _DECIMAL:
            return Decimal(text[:-1]) * _DECIMAL[text[-1]]
        return Decimal(text)
    except InvalidOperation:
        raise ValueError(f"invalid resource quantity {value!r}: expected e.g. '2', '500m' or '1Gi'") from None


def format_quantity(value: Decimal) -> str:
    """A quantity string the API server accepts: whole numbers plain, fractions in milli-units."""
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int((value * 1000).to_integral_value())}m"
