"""Just enough of a Kubernetes client for the devcluster's own checks (/readyz and the node list),
over the standard library, with the admin client certificate."""

from __future__ import annotations

import datetime
import json
import ssl
import urllib.error
import urllib.request
from typing import Any

from dtjob.devcluster.layout import APISERVER_PORT, Layout


class ApiClient:
    def __init__(self, layout: Layout, timeout: float = 5.0) -> None:
        self.base = f"https://127.0.0.1:{APISERVER_PORT}"
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=str(layout.ca_cert))
        self.context.load_cert_chain(str(layout.pki / "admin.crt"), str(layout.pki / "admin.key"))

    def get(self, path: str) -> tuple[int, str]:
        """(HTTP status, body); status 0 when the server cannot be reached."""
        try:
            with urllib.request.urlopen(self.base + path, timeout=self.timeout, context=self.context) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (OSError, ssl.SSLError) as e:
            return 0, str(e)

    def create(self, path: str, obj: dict[str, Any]) -> int:
        """POSTs obj to the collection at path; returns the HTTP status (409: it already exists)."""
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(obj).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return e.code

    def apply(self, path: str, obj: dict[str, Any]) -> int:
        """Server-side apply of obj at its own path (.../<name>), taking over fields other managers
        set; returns the HTTP status (200 or 201 on success)."""
        request = urllib.request.Request(
            f"{self.base}{path}?fieldManager=dtjob-devcluster&force=true",
            data=json.dumps(obj).encode(),
            method="PATCH",
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return e.code

    def ready(self) -> bool:
        status, body = self.get("/readyz")
        return status == 200 and body.strip() == "ok"

    def node_ready(self, since: float | None = None) -> dict[str, bool]:
        """Node name -> whether its Ready condition is True ({} when the server does not answer).
        With `since` (a time.time()), the condition's lastHeartbeatTime must also be no older."""
        status, body = self.get("/api/v1/nodes")
        if status != 200:
            return {}
        nodes: list[dict[str, Any]] = json.loads(body).get("items", [])
        return {
            n["metadata"]["name"]: any(_ready(c, since) for c in n.get("status", {}).get("conditions", []))
            for n in nodes
        }


def _ready(condition: dict[str, Any], since: float | None) -> bool:
    if condition.get("type") != "Ready" or condition.get("status") != "True":
        return False
    if since is None:
        return True
    stamp = condition.get("lastHeartbeatTime") or ""
    try:
        beat = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return False
    # Kubernetes timestamps have whole seconds: compare against `since` rounded down.
    return beat.timestamp() >= int(since)
