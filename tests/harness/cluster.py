"""The ApiServer serving HTTP on 127.0.0.1 from a background thread, and a kubeconfig for it."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import aiohttp.web
import yaml

from harness.apiserver import ApiServer, Faults
from harness.client import Api


class Cluster:
    """`with Cluster(tmpdir) as c:` serves an empty cluster at `c.url`; `c.kubeconfig` logs in.

    Unmodified clients (kopf, kubectl, the kubernetes client) reach it through the kubeconfig."""

    def __init__(self, workdir: Path, namespace: str = "default", request_log: bool = True):
        self.workdir = Path(workdir)
        self.namespace = namespace
        self.request_log = request_log  # kmock's log of every request (ApiServer.request_log)
        self.kubeconfig = self.workdir / "kubeconfig"
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = Api(self.url)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="apiserver", daemon=True)
        self._failure: BaseException | None = None
        self.mutators: list = []  # the API server's mutating admission hooks (apiserver.py)
        self.faults = Faults()  # `faults.fail_for(seconds)`: the server away for the operator

    def __enter__(self) -> Cluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig.write_text(yaml.safe_dump(self.kubeconfig_dict()))
        self._thread.start()
        if not self._ready.wait(10) or self._failure:
            raise RuntimeError(f"the API server did not start: {self._failure!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._loop and self._stop and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def kubeconfig_dict(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator-accepts-anything"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {
                        "cluster": "emulator",
                        "user": "tester",
                        "namespace": self.namespace,
                    },
                }
            ],
            "current-context": "emulator",
        }

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported to __enter__ if it happens during start-up
            self._failure = e
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = ApiServer(mutators=self.mutators, faults=self.faults, request_log=self.request_log)
        async with server as handler:
            # Short shutdown: open watches would otherwise hold the stop for a minute.
            runner = aiohttp.web.ServerRunner(aiohttp.web.Server(handler), shutdown_timeout=1.0)
            await runner.setup()
            await aiohttp.web.SockSite(runner, self._sock).start()
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()
