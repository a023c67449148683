"""The kubelet API, as far as `kubectl logs` needs it: the API server proxies
GET /containerLogs/{namespace}/{pod}/{container} here, over TLS with the node's serving certificate;
clients must present a certificate of the cluster CA (the API server's kubelet-client one).

Query parameters: follow, tailLines, limitBytes, previous. Log files hold no per-line times, so
`timestamps` and `sinceSeconds` are accepted and ignored.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

from aiohttp import web

from dtjob.devcluster.nodelet.config import NodeletConfig
from dtjob.devcluster.nodelet.manager import PodManager

log = logging.getLogger(__name__)

# `logs -f` polls the file this often for new output.
FOLLOW_POLL_S = 0.2
# tailLines reads at most this much of the end of a log.
TAIL_WINDOW = 16 * 2**20


def tail_lines(data: bytes, n: int) -> bytes:
    """The last n lines of data (a final line without a newline counts as a line)."""
    if n <= 0:
        return b""
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:])


def read_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


def initial_chunk(path: Path, tail: int | None) -> tuple[bytes, int]:
    """(what to send first, file offset after it)."""
    size = path.stat().st_size
    if tail is None:
        return read_from(path, 0), size
    start = max(0, size - TAIL_WINDOW)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(size - start)
    return tail_lines(data, tail), size


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "false").lower() in ("true", "1")


def _int(request: web.Request, name: str) -> int | None:
    value = request.query.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise web.HTTPBadRequest(text=f"query parameter {name}={value!r} is not an integer\n") from None


class LogsServer:
    def __init__(self, cfg: NodeletConfig, manager: PodManager) -> None:
        self.cfg = cfg
        self.manager = manager
        self.runner: web.AppRunner | None = None

    def tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.cfg.ca_cert))
        ctx.load_cert_chain(str(self.cfg.serving_cert), str(self.cfg.serving_key))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self.container_logs)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.node_ip, self.cfg.kubelet_port, ssl_context=self.tls())
        await site.start()
        log.info("kubelet API on https://%s:%d", self.cfg.node_ip, self.cfg.kubelet_port)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def container_logs(self, request: web.Request) -> web.StreamResponse:
        ns, pod, container = (request.match_info[k] for k in ("namespace", "pod", "container"))
        worker = self.manager.find(ns, pod)
        if worker is None:
            raise web.HTTPNotFound(text=f"pod {ns}/{pod} is not on node {self.cfg.name}\n")
        if container not in worker.container_names():
            raise web.HTTPBadRequest(text=f"container {container!r} is not valid for pod {pod!r}\n")
        previous, follow = _flag(request, "previous"), _flag(request, "follow")
        target = worker.log_target(container, previous)
        if target is None:
            raise web.HTTPBadRequest(
                text=f"previous terminated container {container!r} in pod {pod!r} not found\n"
            )
        path, attempt = target
        while not path.exists():
            if not (follow and worker.still_writing(container, attempt)):
                raise web.HTTPBadRequest(text=f"container {container!r} in pod {pod!r} is waiting to start\n")
            await asyncio.sleep(FOLLOW_POLL_S)
        limit = _int(request, "limitBytes")
        chunk, offset = initial_chunk(path, _int(request, "tailLines"))
        response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
        await response.prepare(request)
        sent = 0

        async def send(data: bytes) -> bool:
            """Sends data within limitBytes; False once the limit is reached."""
            nonlocal sent
            if limit is not None:
                data = data[: max(0, limit - sent)]
            if data:
                await response.write(data)
                sent += len(data)
            return limit is None or sent < limit

        more = await send(chunk)
        while follow and more:
            writing = worker.still_writing(container, attempt)
            data = read_from(path, offset)
            offset += len(data)
            more = await send(data)
            if not data and not writing:
                break
            if not data:
                await asyncio.sleep(FOLLOW_POLL_S)
        await response.write_eof()
        return response
