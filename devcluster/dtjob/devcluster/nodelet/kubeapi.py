"""A small async client for the Kubernetes REST API, authenticated by a kubeconfig's client cert.

The nodelet needs a handful of verbs (get, create, patch, delete, list+watch), so it talks JSON to
the API server over aiohttp instead of pulling in a generated client.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Server-side watch timeout: the API server closes a watch after this and we resume from the last
# resourceVersion; a short value keeps a silently dead connection from going unnoticed for long.
WATCH_TIMEOUT_S = 240
# Pause between attempts when the API server is unreachable or answers with an error.
RETRY_DELAY_S = 1.0


class ApiError(Exception):
    def __init__(self, status: int, body: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (HTTP 410 Gone): list again."""


def _material(entry: dict[str, Any], key: str, tmp: Path) -> str | None:
    """Path of a certificate/key given either as `key` (a path) or `key-data` (base64)."""
    if entry.get(key):
        return str(entry[key])
    data = entry.get(f"{key}-data")
    if not data:
        return None
    path = tmp / key
    path.write_bytes(base64.b64decode(data))
    path.chmod(0o600)
    return str(path)


def ssl_context_from_kubeconfig(kubeconfig: Path) -> tuple[str, ssl.SSLContext]:
    """(server URL, TLS context with the cluster CA and the client certificate) of the current context."""
    cfg = yaml.safe_load(kubeconfig.read_text())
    ctx_name = cfg.get("current-context") or cfg["contexts"][0]["name"]
    context = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in cfg["users"] if u["name"] == context["user"])
    tmp = Path(tempfile.mkdtemp(prefix="dtjob-nodelet-kubeconfig-"))
    try:
        ca = _material(cluster, "certificate-authority", tmp)
        tls = ssl.create_default_context(cafile=ca)
        cert = _material(user, "client-certificate", tmp)
        key = _material(user, "client-key", tmp)
        if cert is None or key is None:
            raise ValueError(
                f"kubeconfig {kubeconfig}: the nodelet needs a client-certificate and client-key"
            )
        tls.load_cert_chain(cert, key)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return str(cluster["server"]).rstrip("/"), tls


class KubeApi:
    def __init__(self, server: str, tls: ssl.SSLContext) -> None:
        self.server = server
        self.tls = tls
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_kubeconfig(cls, kubeconfig: Path) -> KubeApi:
        return cls(*ssl_context_from_kubeconfig(kubeconfig))

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.tls, limit=20))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Obj | None = None,
        params: dict[str, str] | None = None,
        patch: str = "merge",
    ) -> Obj:
        """One API call; returns the decoded JSON answer or raises ApiError."""
        headers = {"Accept": "application/json"}
        if body is not None:
            kinds = {"merge": "merge-patch", "strategic": "strategic-merge-patch"}
            headers["Content-Type"] = (
                f"application/{kinds[patch]}+json" if method == "PATCH" else "application/json"
            )
        data = None if body is None else json.dumps(body)
        timeout = aiohttp.ClientTimeout(total=30)
        async with self.session.request(
            method, self.server + path, data=data, params=params, headers=headers, timeout=timeout
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(resp.status, text, f"{method} {path}")
            return json.loads(text) if text else {}

    async def get(self, path: str, params: dict[str, str] | None = None) -> Obj:
        return await self.request("GET", path, params=params)

    async def watch(self, path: str, params: dict[str, str]) -> AsyncIterator[Obj]:
        """Yields watch events ({type, object}) until the server ends the watch."""
        query = {
            **params,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_read=WATCH_TIMEOUT_S + 30)
        async with self.session.get(self.server + path, params=query, timeout=timeout) as resp:
            if resp.status == 410:
                raise WatchExpired(path)
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text(), f"WATCH {path}")
            async for line in _lines(resp.content):
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object", {})
                    if status.get("code") == 410:
                        raise WatchExpired(path)
                    raise ApiError(int(status.get("code") or 500), json.dumps(status), f"WATCH {path}")
                yield event


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Newline-separated chunks of a response of any line length (watch events can be large)."""
    buf = b""
    async for chunk in stream.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if buf.strip():
        yield buf


async def list_and_watch(
    api: KubeApi,
    path: str,
    params: dict[str, str],
    on_list: Callable[[list[Obj]], Awaitable[None]],
    on_event: Callable[[str, Obj], Awaitable[None]],
    stop: asyncio.Event,
) -> None:
    """The informer loop: list, hand the full list over, then watch from its resourceVersion; list
    again when the watch expires (410). Errors are logged and retried, never fatal."""
    while not stop.is_set():
        try:
            listing = await api.get(path, params)
            await on_list(listing.get("items", []))
            rv = listing["metadata"]["resourceVersion"]
            while not stop.is_set():
                async for event in api.watch(path, {**params, "resourceVersion": rv}):
                    obj = event["object"]
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if event["type"] != "BOOKMARK":
                        await on_event(event["type"], obj)
        except WatchExpired:
            log.info("watch %s expired; listing again", path)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken connection or API error must not kill the nodelet
            log.warning("list/watch %s: %s; retrying", path, e)
            await asyncio.sleep(RETRY_DELAY_S)
