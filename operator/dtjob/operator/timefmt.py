"""Kubernetes' timestamps (RFC 3339, UTC, whole seconds) to and from datetimes."""

from __future__ import annotations

from datetime import UTC, datetime


def to_rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_rfc3339(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
