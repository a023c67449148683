"""python -m dtjob.devcluster.nodelet --name NODE ... (see config.py): run one node."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from dtjob.devcluster.nodelet.cleanup import kill_node
from dtjob.devcluster.nodelet.config import NodeletConfig, parse_args
from dtjob.devcluster.nodelet.dns import DnsWatcher
from dtjob.devcluster.nodelet.kubeapi import KubeApi
from dtjob.devcluster.nodelet.logs_server import LogsServer
from dtjob.devcluster.nodelet.manager import PodManager
from dtjob.devcluster.nodelet.node import NodeAgent
from dtjob.devcluster.nodelet.state import NodeState

log = logging.getLogger("dtjob.devcluster.nodelet")

# Until the API server answers, registration is retried at this period.
REGISTER_RETRY_S = 1.0


async def run(cfg: NodeletConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    api = KubeApi.from_kubeconfig(cfg.kubeconfig)
    node = NodeAgent(api, cfg)
    while not stop.is_set():
        try:
            await node.register()
            break
        except Exception as e:
            log.warning("registering node %s: %s; retrying", cfg.name, e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REGISTER_RETRY_S)
    manager = PodManager(api, cfg, NodeState(cfg.state_dir))
    server = LogsServer(cfg, manager)
    await server.start()
    tasks = [
        asyncio.create_task(node.heartbeat(stop)),
        asyncio.create_task(manager.run(stop)),
        asyncio.create_task(DnsWatcher(api, manager.on_dns).run(stop)),
    ]
    await stop.wait()
    log.info("stopping node %s", cfg.name)
    await manager.shutdown()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.stop()
    await api.close()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {cfg.name} %(levelname)s %(name)s: %(message)s"
    )
    # Whatever an earlier run of this node left (it may have been SIGKILLed) goes first.
    kill_node(cfg.state_dir)
    asyncio.run(run(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
