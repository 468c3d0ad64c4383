"""A small JSON client of the Kubernetes API for the kubelet and the tests.

Plain dicts in and out, and a watch that another thread can close at once (the official
client's watch only notices a stop on its next event)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"  # what kubectl get asks for


class ApiError(Exception):
    def __init__(self, status: int, body: Any):
        self.status = status
        self.body = body if isinstance(body, dict) else {"message": str(body)}
        self.reason = self.body.get("reason", "")
        super().__init__(f"{status} {self.reason}: {self.body.get('message', '')}")


def path(
    resource: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """`v1/pods` or `pipejob.dev/v1alpha1/pipelinejobs` -> the URL path of the collection/object."""
    group_version, plural = resource.rsplit("/", 1)
    parts = ["/api/v1" if group_version == "v1" else f"/apis/{group_version}"]
    if namespace:
        parts += ["namespaces", namespace]
    parts += [plural] + [p for p in (name, subresource) if p]
    return "/".join(parts)


class Api:
    # A request's bound: the emulator serves the operator, the node and the test on one
    # thread, and on 2 cores beside two worlds of containers it has stalled past 10 s.
    def __init__(self, url: str, timeout: float = 60.0):
        split = urlsplit(url)
        self.host, self.port = split.hostname or "127.0.0.1", split.port or 80
        self.timeout = timeout

    def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        params: dict | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> Any:
        if params:
            url += "?" + urlencode(params)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(
                method,
                url,
                body=None if body is None else json.dumps(body),
                headers={"Content-Type": content_type, "Accept": accept},
            )
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        payload = json.loads(data) if data else None
        if response.status >= 400:
            raise ApiError(response.status, payload)
        return payload

    def create(self, resource: str, obj: dict, namespace: str | None = None) -> dict:
        return self.request("POST", path(resource, namespace), obj)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict:
        return self.request("GET", path(resource, namespace, name))

    def find(self, resource: str, name: str, namespace: str | None = None) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return self.get(resource, name, namespace)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, resource: str, namespace: str | None = None, **params: str) -> list[dict]:
        return self.request("GET", path(resource, namespace), params=params)["items"]

    def patch(
        self,
        resource: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        subresource: str | None = None,
        content_type: str = MERGE_PATCH,
    ) -> dict:
        url = path(resource, namespace, name, subresource)
        return self.request("PATCH", url, patch, content_type=content_type)

    def delete(
        self,
        resource: str,
        name: str | None = None,
        namespace: str | None = None,
        options: dict | None = None,
        **params: Any,
    ) -> dict:
        """`options`: a DeleteOptions body (preconditions, gracePeriodSeconds)."""
        return self.request("DELETE", path(resource, namespace, name), options, params=params)

    def watch(self, resource: str, namespace: str | None = None, **params: str) -> Watch:
        return Watch(self, path(resource, namespace), {**params, "watch": "true"})

    def wait(self, what: str, check: Callable[[], Any], timeout: float, every: float = 0.2) -> Any:
        """Poll `check` until it returns something truthy; fail naming `what` at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(every)


class Watch:
    """Iterate over watch events; `close()` from any thread ends the iteration."""

    def __init__(self, api: Api, url: str, params: dict):
        self._conn = http.client.HTTPConnection(api.host, api.port, timeout=None)
        self._conn.request("GET", url + "?" + urlencode(params))
        self._response = self._conn.getresponse()
        if self._response.status >= 400:
            body = self._response.read()
            self._conn.close()
            raise ApiError(self._response.status, json.loads(body) if body else None)

    def __iter__(self) -> Iterator[dict]:
        try:
            for line in self._response:
                if line.strip():
                    yield json.loads(line)
        except (OSError, ValueError, http.client.HTTPException):
            return  # closed under us, or the server went away
        finally:
            self._conn.close()

    def close(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
