"""The API server of the tests: kmock's KubernetesEmulator plus the apiserver behaviour that the
operator, the kubelet and kubectl rely on and kmock lacks.

kmock already gives: an aiohttp server on loopback, request parsing into resource/namespace/
name/subresource, discovery of its bundled builtin resources (and of declared ones), an object
store with history, fetch, Kubernetes `Status` errors. On top of that, this module adds:

- metadata stamping: uid, creationTimestamp, resourceVersion (one global counter), generation,
  generateName;
- writes with apiserver semantics: merge patch (strategic merge is treated as merge), JSON patch
  whose failed `test` is a 422, resourceVersion and uid preconditions (409), PUT, no-op writes that
  change nothing, the `status` subresource isolated from the main resource;
- deletion: finalizers, graceful deletion of pods bound to a node (the kubelet finishes it),
  ownerReference garbage collection (background; also of dependents whose owner is gone),
  deletecollection;
- lists and watches with label and field selectors and list kinds (a selector that pins a
  label's values reads only the objects labelled so, from an index); lists in chunks
  (`limit`, `continue`); watches that replay from a
  resourceVersion (kmock's lose the events between its snapshot and its stream) and honour
  timeoutSeconds;
- mutating admission: hooks that change objects on create, as webhooks do (`mutators`);
- CRDs: creating one serves its resource (discovery, status subresource, short names,
  categories, printer columns) and marks it Established;
- pods/binding; server-side tables for `kubectl get`; OpenAPI v3 and strict field validation
  of custom resources for `kubectl apply` and `kubectl explain`;
- protobuf request bodies of Secrets and ConfigMaps (helm's release records), and a /version
  of a Kubernetes with CEL rules (1.31; kmock says 1.26), for `helm install`.

Not emulated (a real cluster checks these): schema/CEL validation and schema defaulting,
validating admission, RBAC, namespaces' existence, strategic-merge list semantics,
server-side apply."""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import random
import secrets
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock

from harness import openapi, protobuf, tables
from harness.selectors import SelectorError, field_selector, label_selector, required_values

CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
PODS = kmock.resource("", "v1", "pods")
CRD_VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
MERGE_PATCHES = {
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",  # lists replace rather than merge: good enough
    "application/json",
}

Key = tuple[kmock.resource, str | None, str]
Obj = dict[str, Any]


@attrs.define
class Faults:
    """An API server that is away for a while, for the clients whose User-Agent contains one
    of `agents` (by default the operator's: kopf's and the Kubernetes client's, so the test's
    own client and the kubelet still see the cluster): their requests get HTTP 500, and their
    open watches end, as when the server restarts."""

    agents: tuple[str, ...] = ("kopf/", "OpenAPI-Generator/")
    until: float = 0.0  # time.monotonic() until which the server is away
    refused: int = 0  # requests answered with an error so far
    # What an away server does to a request (benchmarks/chaos.py varies them): answer `code`
    # (500; 429 with Retry-After; 409 Conflict to updates only, PATCH and PUT: to a create it
    # would say "already exists"; 410 Gone to watches only; 0: serve it)
    # to a `share` of them drawn at random, after `delay` seconds (slow answers).
    code: int = 500
    share: float = 1.0
    delay: float = 0.0
    rng: random.Random = attrs.field(factory=random.Random)

    def fail_for(self, seconds: float, code: int = 500, share: float = 1.0, delay: float = 0.0):
        self.code, self.share, self.delay = code, share, delay
        self.until = time.monotonic() + seconds

    def hits(self, user_agent: str | None) -> bool:
        return time.monotonic() < self.until and any(a in (user_agent or "") for a in self.agents)

    def answer(self, method: str, watch: bool) -> int:
        """The error code a request of the operator's gets while the server is away; 0: none."""
        if self.code == 409 and method not in ("PUT", "PATCH"):
            return 0
        if self.code == 410 and not watch:
            return 0
        return self.code if self.rng.random() < self.share else 0


_REASONS = {500: "InternalError", 429: "TooManyRequests", 409: "Conflict", 410: "Expired"}


def _injected(code: int) -> aiohttp.web.Response:
    """An injected error answer, as the API server words it: 429 with Retry-After; 410 to a
    watch as the API server says a resourceVersion expired, a watch's ERROR event."""
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": _REASONS.get(code, "InternalError"),
        "message": f"the API server is away (injected {code})",
    }
    if code == 410:
        event = json.dumps({"type": "ERROR", "object": body}) + "\n"
        return aiohttp.web.Response(text=event, content_type="application/json")
    headers = {"Retry-After": "1"} if code == 429 else None
    return aiohttp.web.json_response(body, status=code, headers=headers)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; never mutates its arguments."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    _revisions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    _revision: int = attrs.field(default=0, init=False)
    _history: dict[kmock.resource, list[tuple[int, Obj]]] = attrs.field(
        factory=lambda: defaultdict(list), init=False
    )
    _columns: dict[kmock.resource, list[Obj]] = attrs.field(factory=dict, init=False)
    _schemas: dict[kmock.resource, Obj] = attrs.field(factory=dict, init=False)
    # The live objects by label, (resource, key, value) -> {their keys: None}, and each key's
    # place in the store: a LIST by a label's value (the operator's pods of one job) reads
    # what it returns, in the store's order, as a real API server's watch cache serves it.
    _labelled: dict[tuple[kmock.resource, str, str], dict[Key, None]] = attrs.field(
        factory=lambda: defaultdict(dict), init=False
    )
    _order: dict[Key, int] = attrs.field(factory=dict, init=False)
    # The live objects' uids, and their dependents by owner uid: the garbage collector's
    # checks read these, not every object of every kind.
    _uids: set[str] = attrs.field(factory=set, init=False)
    _dependents: dict[str, dict[Key, None]] = attrs.field(
        factory=lambda: defaultdict(dict), init=False
    )
    # Mutating admission, as a webhook does it: each is called with (resource, object) on
    # every create, before the object is stored (tests/harness/kueue.py gates pods so).
    mutators: list[Callable[[kmock.resource, Obj], None]] = attrs.field(factory=list)
    faults: Faults = attrs.field(factory=Faults)
    # kmock keeps every request for tests that assert on them and matches each new one against
    # all of them, so its cost per request grows with those served: off, it keeps none.
    request_log: bool = True

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock reads its bundle with a deprecated call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()  # builtin kinds as served by a recent k3s

    # --- dispatch ---------------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """A protobuf body (client-go sends built-in kinds so, e.g. helm's release Secret) is
        read as the JSON it stands for (protobuf.py); one it cannot read gets 415. While
        `faults` says the server is away for this client, it gets 500."""
        if self.faults.hits(raw.headers.get("User-Agent")):
            await asyncio.sleep(self.faults.delay)
            code = self.faults.answer(raw.method, raw.query.get("watch") in ("true", "1"))
            if code:
                self.faults.refused += 1
                return _injected(code)
        if "protobuf" in raw.content_type:
            raw = raw.clone(headers={**raw.headers, "Content-Type": "application/json"})
            try:
                obj = protobuf.decode(await raw.read())
            except ValueError as e:
                return aiohttp.web.json_response(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "code": 415,
                        "reason": "UnsupportedMediaType",
                        "message": str(e),
                    },
                    status=415,
                )
            raw._read_bytes = json.dumps(obj).encode()  # what kmock's parser reads
        return await super().__call__(raw)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if not self.request_log:
            self._requests[:] = [request]  # the one being served must stay matchable
        res = request.resource
        if res is None or res.plural is None:  # discovery, /version, openapi
            if request.url.path.startswith("/openapi/"):
                doc = openapi.serve(request.url.path, self.resources, self._schemas)
                return aiohttp.web.json_response(doc)
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        method = request.method
        if method == "POST" and request.subresource == "binding":
            return await self._locked(self._bind, request)
        if method == "POST" and request.name is None:
            return await self._locked(self._create, request, status=201)
        if method in ("PATCH", "PUT") and request.name is not None:
            return await self._locked(self._update, request)
        if method == "DELETE":
            return await self._locked(self._delete_request, request)
        if method == "GET":  # list, watch, fetch: kmock's fallbacks, overridden below
            self._info(res)
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        raise error(405, "MethodNotAllowed", f"{method} is not supported on {request.url.path}")

    async def _locked(self, fn: Any, request: kmock.Request, status: int = 200) -> Any:
        async with self._lock:
            result = await fn(request)
        return aiohttp.web.json_response(result, status=status)

    # --- the store --------------------------------------------------------------------------

    def _info(self, res: kmock.resource) -> kmock.ResourceInfo:
        if res not in self.resources:
            raise error(404, "NotFound", f"the server could not find the requested resource {res}")
        return self.resources[res]

    def _live(self, key: Key) -> Obj | None:
        if key in self._objects and not self._objects[key].deleted:
            return self._objects[key].raw
        return None

    def _live_items(self, res: kmock.resource, namespace: str | None) -> list[Obj]:
        return [
            obj.raw
            for (r, ns, _), obj in self._objects.items()
            if r == res and (namespace is None or ns == namespace) and not obj.deleted
        ]

    def _index(self, key: Key, old: Obj | None, new: Obj | None) -> None:
        """Move `key` from the label buckets and owners' dependents of its old version to
        those of its new one (None: removed), and keep the live uids."""
        for index, before, after in (
            (self._labelled, _label_items(key, old), _label_items(key, new)),
            (self._dependents, _owner_uids(old), _owner_uids(new)),
        ):
            for item in before - after:
                bucket = index[item]
                bucket.pop(key, None)
                if not bucket:
                    del index[item]
            for item in after - before:
                index[item][key] = None
        if old is not None:
            self._uids.discard(old["metadata"].get("uid"))
        if new is not None and new["metadata"].get("uid"):
            self._uids.add(new["metadata"]["uid"])

    def _selected(self, request: kmock.Request, namespace: str | None) -> list[Obj]:
        """The live objects of the request's resource in `namespace` (None: every one) that
        its selectors match: read from the label index where the label selector pins a
        label's values, else by walking the resource's objects."""
        matches = self._selector(request)  # a bad selector is a 400 before anything is read
        keys = self._pinned(request.resource, request.params.get("labelSelector"))
        if keys is None:
            items = self._live_items(request.resource, namespace)
        else:
            items = [self._objects[k].raw for k in keys if namespace is None or k[1] == namespace]
        return [o for o in items if matches(o)]

    def _pinned(self, res: kmock.resource, selector: str | None) -> list[Key] | None:
        """The keys, in the store's order, of the objects carrying one of the values the
        selector allows for its most selective pinned label; None if it pins none."""
        pinned = required_values(selector)
        if not pinned:
            return None
        buckets = min(
            (
                [self._labelled.get((res, label, v), {}) for v in values]
                for label, values in pinned.items()
            ),
            key=lambda found: sum(map(len, found)),
        )
        return sorted({k for bucket in buckets for k in bucket}, key=self._order.__getitem__)

    async def _publish(self, key: Key, kind: str, obj: Obj) -> Obj:
        """Store a new version (or the removal) with the next resourceVersion and announce it."""
        rv = next(self._revisions)
        self._revision = rv
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(rv)}}
        self._index(key, self._live(key), None if kind == "DELETED" else obj)
        self._order.setdefault(key, len(self._order))
        if kind == "DELETED":
            self._objects[key].delete()
        elif key in self._objects:
            self._objects[key].create(obj)  # appends a version: a whole-object replacement
        else:
            self._objects[key] = obj
        event = {"type": kind, "object": obj}
        self._history[key[0]].append((rv, event))
        await self._buses[key[0]].put(event)
        if key[0] == CRDS:
            self._serve_crd(obj, served=kind != "DELETED")
        return obj

    # --- create -----------------------------------------------------------------------------

    async def _create(self, request: kmock.Request) -> Obj:
        res = request.resource
        info = self._info(res)
        if not isinstance(request.data, dict):
            raise error(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(request.data)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise error(422, "Invalid", "metadata.name: Required value: name or generateName")
        namespace = request.namespace if info.namespaced else None
        if info.namespaced and not namespace:
            raise error(400, "BadRequest", f"{res.plural} are namespaced: POST to a namespace")
        if meta.get("namespace", namespace) != namespace:
            raise error(400, "BadRequest", "the namespace of the body does not match the URL")
        key = (res, namespace, meta["name"])
        self._validate(request, obj)
        if self._live(key) is not None:
            raise error(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
        obj.setdefault("apiVersion", f"{res.group}/{res.version}".lstrip("/"))
        obj.setdefault("kind", info.kind)
        if namespace:
            meta["namespace"] = namespace
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(field, None)
        if "status" in info.subresources:
            obj.pop("status", None)  # the status is written through /status only
        if res == PODS:
            obj.setdefault("spec", {}).setdefault("restartPolicy", "Always")
            obj["spec"].setdefault("terminationGracePeriodSeconds", 30)
            obj["status"] = {"phase": "Pending"}
        if res == CRDS:
            obj["status"] = _crd_status(obj)
        for mutate in self.mutators:
            mutate(res, obj)
        obj = await self._publish(key, "ADDED", obj)
        if not self._owners_alive(obj):  # the garbage collector removes orphans at once
            await self._delete(key, grace=None)
        return obj

    def _validate(self, request: kmock.Request, obj: Obj) -> None:
        """`fieldValidation=Strict` (kubectl's default): a custom resource's fields must all
        be in its CRD's schema. Types, formats and CEL rules are not checked."""
        schema = self._schemas.get(request.resource)
        if request.params.get("fieldValidation") == "Strict" and schema:
            unknown = openapi.unknown_fields(obj, schema)
            if unknown:
                fields = ", ".join(f'unknown field "{f}"' for f in unknown)
                raise error(400, "BadRequest", f"strict decoding error: {fields}")

    def _owners_alive(self, obj: Obj) -> bool:
        owners = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
        return not owners or bool(owners & self._uids)

    async def _bind(self, request: kmock.Request) -> Obj:
        key = (request.resource, request.namespace, request.name)
        pod = self._live(key)
        if pod is None:
            raise error(404, "NotFound", f'pods "{request.name}" not found')
        if pod.get("spec", {}).get("nodeName"):
            raise error(409, "Conflict", f"pod {request.name} is already assigned to a node")
        uid = (request.data or {}).get("metadata", {}).get("uid")
        if uid and uid != pod["metadata"]["uid"]:  # the pod of that name is another one now
            raise error(409, "Conflict", f"Precondition failed: UID in precondition: {uid}")
        node = (request.data or {}).get("target", {}).get("name")
        await self._publish(key, "MODIFIED", merge_patch(pod, {"spec": {"nodeName": node}}))
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    # --- update -----------------------------------------------------------------------------

    async def _update(self, request: kmock.Request) -> Obj:
        res, sub = request.resource, request.subresource
        info = self._info(res)
        key = (res, request.namespace if info.namespaced else None, request.name)
        old = self._live(key)
        if old is None:
            raise error(404, "NotFound", f'{res.plural} "{request.name}" not found')
        if sub not in (None, "status") or (sub == "status" and "status" not in info.subresources):
            raise error(404, "NotFound", f"the subresource {sub!r} is not served here")
        new = self._apply(request, old)
        self._validate(request, new)
        uid = new.get("metadata", {}).get("uid")  # a write naming another object (reused name)
        if uid and uid != old["metadata"]["uid"]:
            raise error(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {uid}, UID"
                f" in object meta: {old['metadata']['uid']}",
            )
        rv = new.get("metadata", {}).get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise error(
                409,
                "Conflict",
                "the object has been modified; please apply your"
                " changes to the latest version and try again",
            )
        if sub == "status":
            new = {**old, "status": new.get("status")}
        elif "status" in info.subresources:
            new = {**new, "status": old.get("status")}
        new = {k: v for k, v in new.items() if v is not None}
        keep = (
            "uid",
            "name",
            "namespace",
            "creationTimestamp",
            "generation",
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        )
        new["metadata"] = {
            **{k: v for k, v in new.get("metadata", {}).items() if k not in keep},
            **{k: old["metadata"][k] for k in keep if k in old["metadata"]},
        }
        if new == old:
            return old  # a no-op write changes nothing, not even the resourceVersion
        if _spec_of(new) != _spec_of(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 0) + 1
        new = await self._publish(key, "MODIFIED", new)
        if _releasable(new):  # the last finalizer is gone: complete the deletion
            return await self._remove(key, new)
        return new

    def _apply(self, request: kmock.Request, old: Obj) -> Obj:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        body = request.data
        if request.method == "PUT":
            new = copy.deepcopy(body)
        elif content_type == "application/json-patch+json" and isinstance(body, list):
            try:
                new = jsonpatch.apply_patch(old, body)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                raise error(422, "Invalid", f"the JSON patch cannot be applied: {e}") from None
        elif content_type in MERGE_PATCHES:
            new = merge_patch(old, body)
        else:
            raise error(415, "UnsupportedMediaType", f"patch type {content_type!r} not supported")
        if not isinstance(new, dict):
            raise error(400, "BadRequest", "the result of the write is not an object")
        return new

    # --- delete -----------------------------------------------------------------------------

    async def _delete_request(self, request: kmock.Request) -> Obj:
        info = self._info(request.resource)
        namespace = request.namespace if info.namespaced else None
        options = request.data if isinstance(request.data, dict) else {}
        grace = request.params.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        grace = None if grace is None else int(grace)
        orphan = "Orphan" in (
            request.params.get("propagationPolicy"),
            options.get("propagationPolicy"),
        )
        if request.name is not None:
            key = (request.resource, namespace, request.name)
            self._check_preconditions(key, options.get("preconditions") or {})
            return await self._delete(key, grace, orphan)
        deleted = [
            await self._delete(
                (request.resource, namespace, obj["metadata"]["name"]), grace, orphan
            )
            for obj in self._selected(request, namespace)
        ]
        return {
            "apiVersion": "v1",
            "kind": f"{info.kind}List",
            "items": deleted,
            "metadata": {"resourceVersion": str(self._revision)},
        }

    def _check_preconditions(self, key: Key, preconditions: dict) -> None:
        obj = self._live(key)
        for field in ("uid", "resourceVersion"):
            wanted = preconditions.get(field)
            if obj and wanted and wanted != obj["metadata"][field]:
                actual = obj["metadata"][field]
                raise error(409, "Conflict", f"Precondition failed: {field} {wanted} != {actual}")

    async def _delete(self, key: Key, grace: int | None, orphan: bool = False) -> Obj:
        obj = self._live(key)
        if obj is None:
            raise error(404, "NotFound", f'{key[0].plural} "{key[2]}" not found')
        meta = obj["metadata"]
        graceful = key[0] == PODS and obj.get("spec", {}).get("nodeName") and grace != 0
        if graceful or meta.get("finalizers"):
            if meta.get("deletionTimestamp") and (graceful or grace != 0):
                return obj  # already terminating
            if graceful:  # the kubelet stops the containers, then deletes with grace 0
                grace = (
                    obj["spec"].get("terminationGracePeriodSeconds", 30) if grace is None else grace
                )
            patch = {
                "deletionTimestamp": meta.get("deletionTimestamp") or now(),
                "deletionGracePeriodSeconds": grace or 0,
            }
            obj = await self._publish(key, "MODIFIED", merge_patch(obj, {"metadata": patch}))
            if not _releasable(obj):
                return obj
        return await self._remove(key, obj, orphan)

    async def _remove(self, key: Key, obj: Obj, orphan: bool = False) -> Obj:
        obj = await self._publish(key, "DELETED", obj)
        if not orphan:  # the garbage collector: dependents go with their owner
            uid = obj["metadata"]["uid"]
            for dependent_key in sorted(self._dependents.get(uid, ()), key=self._order.get):
                dependent = self._live(dependent_key)  # (an earlier dependent may have taken it)
                refs = (dependent or {}).get("metadata", {}).get("ownerReferences") or []
                if any(ref.get("uid") == uid for ref in refs):
                    await self._delete(dependent_key, grace=None)
        return obj

    # --- read: kmock's list/watch/fetch fallbacks, with selectors, kinds and tables ------------

    def _selector(self, request: kmock.Request) -> Any:
        try:
            labels = label_selector(request.params.get("labelSelector"))
            fields = field_selector(request.params.get("fieldSelector"))
        except SelectorError as e:
            raise error(400, "BadRequest", str(e)) from None
        name = request.name
        return lambda o: labels(o) and fields(o) and (name is None or o["metadata"]["name"] == name)

    async def _serve_list(self, request: kmock.Request) -> Obj:
        info = self._info(request.resource)
        items = self._selected(request, request.namespace)
        if tables.wants_table(request.headers.get("Accept")):
            columns = self._columns.get(request.resource)
            return tables.table(items, columns, str(self._revision))
        meta = {"resourceVersion": str(self._revision)}
        if request.params.get("limit", "0") not in ("", "0"):
            items, meta["continue"], meta["resourceVersion"] = _page(
                items, request.params, self._revision
            )
        return {
            "apiVersion": f"{request.resource.group}/{request.resource.version}".lstrip("/"),
            "kind": f"{info.kind}List",
            "items": items,
            "metadata": meta,
        }

    async def _serve_fetch(self, request: kmock.Request) -> Obj:
        info = self._info(request.resource)
        key = (request.resource, request.namespace if info.namespaced else None, request.name)
        obj = self._live(key)
        if obj is None:
            raise error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        if tables.wants_table(request.headers.get("Accept")):
            return tables.table([obj], self._columns.get(request.resource), str(self._revision))
        return obj

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now: a watch may stay silent for long
        res, namespace = request.resource, request.namespace
        matches = self._selector(request)
        since = request.params.get("resourceVersion", "")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        bus = self._buses[res]
        async with self._lock:  # nothing may happen between the replay and the live stream
            mark = await bus.mark()
            if since.isdigit() and int(since) > 0:
                replay = [e for rv, e in self._history[res] if rv > int(since)]
            else:
                replay = [{"type": "ADDED", "object": o} for o in self._selected(request, None)]
        agent = request.headers.get("User-Agent")
        pending: asyncio.Future | None = None  # the next event, awaited across looks
        try:
            stream = aiter(bus.stream(since=mark))
            while True:
                if replay:
                    event = replay.pop(0)
                else:
                    left = (
                        None if deadline is None else deadline - asyncio.get_running_loop().time()
                    )
                    if (left is not None and left <= 0) or (
                        self.faults.hits(agent) and self.faults.code
                    ):
                        return  # timed out, or dropped while the server is away
                    pending = pending or asyncio.ensure_future(anext(stream))
                    done, _ = await asyncio.wait({pending}, timeout=min(left or 0.5, 0.5))
                    if not done:
                        continue
                    try:
                        event = pending.result()
                    except StopAsyncIteration:
                        return
                    pending = None
                obj = event["object"]
                if (namespace is None or obj["metadata"].get("namespace") == namespace) and matches(
                    obj
                ):
                    yield event
        finally:
            if pending is not None:
                pending.cancel()
            await bus.unmark(mark)

    async def _serve_server_version(self, request: kmock.Request) -> Obj:
        """/version: a Kubernetes that has what this emulator serves (CRDs' CEL rules, which
        pipejob's chart requires with kubeVersion >=1.28); kmock says 1.26."""
        return await super()._serve_server_version(request) | {
            "minor": "31",
            "gitVersion": "v1.31.0",
        }

    async def _serve_version(self, request: kmock.Request) -> Obj:
        """kmock's resource list, fixed: the core group version is `v1` (kmock says `/v1`, which
        kubectl drops), and subresources have no short names or categories (kubectl would
        resolve `pj` or `pipejob` to `pipelinejobs/status`)."""
        listing = await super()._serve_version(request)
        listing["groupVersion"] = listing["groupVersion"].lstrip("/")
        for entry in listing["resources"]:
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
        return listing

    # --- CRDs -------------------------------------------------------------------------------

    def _serve_crd(self, crd: Obj, served: bool) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            res = kmock.resource(spec["group"], version["name"], names["plural"])
            if not (served and version.get("served", True)):
                self.resources.pop(res, None)
                continue
            self.resources[res] = kmock.ResourceInfo(
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                verbs=CRD_VERBS,
                shortnames=names.get("shortNames", []),
                categories=names.get("categories", []),
                subresources={"status"} if "status" in version.get("subresources", {}) else set(),
            )
            self._columns[res] = version.get("additionalPrinterColumns") or []
            self._schemas[res] = version.get("schema", {}).get("openAPIV3Schema", {})


def _page(items: list[Obj], params: Any, revision: int) -> tuple[list[Obj], str, str]:
    """A list's chunk (`limit`, `continue`): up to `limit` items in key order after the one
    the token names, the token of the next chunk ("" after the last), and the list's
    resourceVersion: the first chunk's, in every chunk, so a watch from it misses nothing.
    Each chunk is read from the live store (the API server reads them all at that version;
    a watch from it replays what changed since)."""
    try:
        limit = int(params["limit"])
        token = json.loads(params["continue"]) if params.get("continue") else [revision]
        since, after = int(token[0]), tuple(token[1:])
    except (ValueError, TypeError, IndexError):
        raise error(400, "BadRequest", "limit must be a number, continue a token") from None

    def key(o: Obj) -> tuple[str, str]:
        return o["metadata"].get("namespace") or "", o["metadata"]["name"]

    ordered = sorted((o for o in items if key(o) > after), key=key)
    page = ordered[:limit]
    more = len(ordered) > limit
    return page, json.dumps([since, *key(page[-1])]) if more else "", str(since)


def _label_items(key: Key, obj: Obj | None) -> set[tuple[kmock.resource, str, str]]:
    """An object's labels as (its resource, label, value); a value that is no string matches
    no selector's value, so it is not indexed."""
    labels = ((obj or {}).get("metadata") or {}).get("labels")
    if not isinstance(labels, dict):
        return set()
    return {(key[0], k, v) for k, v in labels.items() if isinstance(v, str)}


def _owner_uids(obj: Obj | None) -> set[str]:
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return {ref["uid"] for ref in refs if isinstance(ref, dict) and isinstance(ref.get("uid"), str)}


def _spec_of(obj: Obj) -> Obj:
    """What a change of bumps metadata.generation: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _releasable(obj: Obj) -> bool:
    """Marked for deletion, no finalizer left, and no kubelet still to confirm it."""
    meta = obj["metadata"]
    return bool(
        meta.get("deletionTimestamp")
        and not meta.get("finalizers")
        and not meta.get("deletionGracePeriodSeconds")
    )


def _crd_status(crd: Obj) -> Obj:
    condition = {"status": "True", "lastTransitionTime": now()}
    storage = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
    return {
        "acceptedNames": crd["spec"]["names"],
        "storedVersions": storage,
        "conditions": [
            {"type": "NamesAccepted", "reason": "NoConflicts", **condition},
            {"type": "Established", "reason": "InitialNamesAccepted", **condition},
        ],
    }
