"""JSON in, JSON out: the operator's calls on pods, nodes and Services without the kubernetes
client's models.

The generated client validates every request body into its pydantic model and turns every
response into one; the operator then turned them back into dicts. Measured here (3 runs, loaded
2-core machine): a list of 1,024 worker pods deserialized into V1Pod and sanitized back took
1.9-2.1 s of CPU, the same list parsed as JSON 0.03-0.07 s; validating 1,024 pod bodies another
0.2-0.3 s. These calls go through the same ApiClient (its configuration, credentials and
connection pool) as plain JSON, and fail with the client's own ApiException, so errors read the
same wherever they come from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, cast
from urllib.parse import quote

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"


def quoted(*parts: str) -> str:
    return "/".join(quote(p, safe="") for p in parts)


class RawApi:
    """Requests on the API server's JSON paths (`/api/v1/namespaces/NS/pods`, ...)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def _send(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None,
        body: Any,
        content_type: str,
        timeout: float | tuple[float, float] | None,
    ) -> Any:
        headers = {"Accept": JSON}
        if body is not None:
            headers["Content-Type"] = content_type
        params = [(k, v) for k, v in (query or {}).items() if v is not None]
        request = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=params,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(
                http_resp=response, body=(response.data or b"").decode(errors="replace"), data=None
            )
        return response

    def call(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = JSON,
        timeout: float | tuple[float, float] | None = None,
    ) -> dict[str, Any]:
        """One request; the response body as a dict ({} when it is empty)."""
        response = self._send(method, path, query, body, content_type, timeout)
        data = response.read()
        return cast(dict[str, Any], json.loads(data)) if data else {}

    def watch(
        self, path: str, query: Mapping[str, Any], timeout: float | tuple[float, float] | None = None
    ) -> tuple[Any, Iterator[dict[str, Any]]]:
        """A watch on a collection: the open response (close it to end the watch from another
        thread) and its events as dicts ({"type": ..., "object": {...}})."""
        response = self._send("GET", path, {**query, "watch": "true"}, None, JSON, timeout)
        raw = response.response

        def events() -> Iterator[dict[str, Any]]:
            try:
                for line in iter_resp_lines(raw):
                    if line:
                        yield cast(dict[str, Any], json.loads(line))
            finally:
                raw.release_conn()

        return raw, events()
