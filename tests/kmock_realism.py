"""TEST DOUBLE: a more realistic Kubernetes API on KMock's emulator, for the operator tests.

Not a Kubernetes API server. KMock's ``KubernetesEmulator`` stores objects and
streams watch events; without the API server's bookkeeping, kopf re-runs
handlers and collides with itself. This layer adds what kopf and the
operator rely on, and nothing else:

* ``metadata.resourceVersion`` (one counter for the whole server), ``uid``,
  ``generation`` (bumped when ``spec`` changes) and ``creationTimestamp``;
* ``201 Created`` on create, with the namespace taken from the URL and
  ``generateName`` honoured (kopf names its Events so);
* the status subresource: a write to the object ignores ``status``, a write
  to ``/status`` changes only ``status``; a ``resourceVersion`` in a patch is
  a precondition (``409 Conflict`` when stale);
* graceful pod deletion: a pod bound to a node gets ``deletionTimestamp``
  and stays until deleted again with grace 0 (as the kubelet does);
* label selectors (``a=b,c=d``) on list and watch, and watches that start
  after the ``resourceVersion`` they are given;
* declared resources, ``v1/namespaces`` among them (kopf needs it);
* one piece of pod validation: a container without an image is ``422 Invalid``;
* a log of the requests as RBAC sees them, ``(verb, group, resource)``, for the ClusterRole check.

The tests play the kubelet: they set pod phases and node readiness.
"""

from __future__ import annotations

import copy
import datetime
import uuid
from typing import Any, AsyncIterator

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts  # the emulator's own merge, to preview a patch (same semantics)
from kmock._internal.k8s import KubernetesError

RESOURCES = {
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False),
    "v1/nodes": kmock.ResourceInfo(kind="Node", namespaced=False, subresources={"status"}),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, subresources={"status"}),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True),
    "kopf.dev/v1/clusterkopfpeerings": kmock.ResourceInfo(kind="ClusterKopfPeering", namespaced=False),
    "tenplex.io/v1alpha1/tenplexjobs": kmock.ResourceInfo(kind="TenplexJob", namespaced=True,
                                                          subresources={"status"}),
}
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


def _selects(selector: str | None, obj: dict) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        key, sep, value = term.partition("=")
        if not sep or key.endswith("!"):
            raise KubernetesError(400, "BadRequest", f"this test double knows only key=value selectors: {term!r}")
        if labels.get(key) != value.lstrip("="):  # `a==b` is `a=b`
            return False
    return True


def _merge_diff(old: Any, new: Any) -> Any:
    """The merge patch that turns ``old`` into ``new`` (None removes a key)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    patch = {k: None for k in old if k not in new}
    patch.update({k: _merge_diff(old.get(k), v) for k, v in new.items() if old.get(k) != v})
    return patch


_VERBS = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
          kmock.action.CREATE: "create", kmock.action.UPDATE: "patch", kmock.action.DELETE: "delete"}


def _rbac(request) -> tuple[str, str, str]:
    """The request as an RBAC rule names it: verb, API group ("" for the core group), resource[/subresource]."""
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    return _VERBS.get(request.action, str(request.action)), request.resource.group or "", resource


def _rv(obj: dict) -> int:
    return int((obj.get("metadata") or {}).get("resourceVersion") or 0)


@attrs.define(kw_only=True)
class RealisticKubernetes(kmock.KubernetesEmulator):
    _version: int = attrs.field(default=0, init=False)  # the last resourceVersion handed out
    requests: list = attrs.field(factory=list, init=False)  # (verb, api group, resource[/subresource])

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in RESOURCES.items():
            self.resources[key] = attrs.evolve(info, verbs=VERBS)

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _stored(self, request) -> dict | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        return None

    async def _handle(self, request):
        if request.resource is None:
            return await super()._handle(request)
        if request.resource.plural:  # (not discovery, which RBAC grants everyone)
            self.requests.append(_rbac(request))
        info = next((i for k, i in RESOURCES.items() if request.resource == kmock.resource(k)), None)
        split = info is not None and "status" in info.subresources
        data = request.data if isinstance(request.data, dict) else None
        if request.action == kmock.action.CREATE and data is not None:
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            if info is not None and info.namespaced:
                meta["namespace"] = request.namespace
            meta.update(resourceVersion=self._next_version(), uid=str(uuid.uuid4()), generation=1,
                        creationTimestamp=datetime.datetime.now(datetime.timezone.utc).isoformat())
            if split:
                data.pop("status", None)  # status is written through /status only
            for i, container in enumerate((data.get("spec") or {}).get("containers") or []):
                if request.resource == kmock.resource("v1/pods") and not container.get("image"):
                    raise KubernetesError(422, "Invalid", f'Pod "{meta.get("name")}" is invalid: '
                                                          f"spec.containers[{i}].image: Required value")
            response = await super()._handle(request)
            if response.status == 200:
                response.set_status(201)
            return response
        old = self._stored(request) if request.name else None
        if request.action == kmock.action.UPDATE and isinstance(request.data, list) and old is not None:
            # A JSON patch (kopf adds finalizers so, guarded by a `test` of resourceVersion): as a merge patch.
            try:
                patched = jsonpatch.apply_patch(old, request.data)
            except jsonpatch.JsonPatchTestFailed as e:
                raise KubernetesError(409, "Conflict", f"the object changed: {e}") from None
            data = _merge_diff(old, patched)
            object.__setattr__(request, "data", data)  # KMock's Request is frozen; its reactions match on identity
        if request.action == kmock.action.UPDATE and data is not None and old is not None:
            wanted = (data.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != old["metadata"]["resourceVersion"]:
                raise KubernetesError(409, "Conflict", f"resourceVersion {wanted} is stale: the object changed")
            if split and request.subresource == "status":
                patch = {"status": data.get("status")}
            else:
                patch = {k: v for k, v in data.items() if not (split and k == "status")}
            preview = dicts.patch_dict(copy.deepcopy(old), patch)
            generation = old["metadata"].get("generation", 1) + (preview.get("spec") != old.get("spec"))
            patch["metadata"] = {**(patch.get("metadata") or {}), "resourceVersion": self._next_version(),
                                 "generation": generation}
            data.clear()
            data.update(patch)
        if request.action == kmock.action.DELETE and old is not None:
            key = (request.resource, request.namespace, request.name)
            grace = (data or {}).get("gracePeriodSeconds")
            grace = int(request.params.get("gracePeriodSeconds", 30 if grace is None else grace))
            bound = request.resource == kmock.resource("v1/pods") and (old.get("spec") or {}).get("nodeName")
            if bound and grace > 0:  # the kubelet stops it, then deletes it with grace 0
                if not old["metadata"].get("deletionTimestamp"):
                    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
                    async with self._lock:
                        self.objects[key].patch({"metadata": {"deletionTimestamp": now, "deletionGracePeriodSeconds":
                                                              grace, "resourceVersion": self._next_version()}})
                        await self._buses[request.resource].put({"type": "MODIFIED", "object": self.objects[key].raw})
                return aiohttp.web.json_response(self.objects[key].raw)
            self.objects[key].patch({"metadata": {"resourceVersion": self._next_version()}})
        return await super()._handle(request)

    async def _serve_list(self, request) -> dict:
        payload = await super()._serve_list(request)
        items = [o for o in payload["items"] if _selects(request.params.get("labelSelector"), o)]
        return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(self._version)},
                "items": items}

    async def _serve_watch(self, request) -> AsyncIterator[Any]:
        yield b""  # headers first, as KMock does
        since = int(request.params.get("resourceVersion") or 0)
        selector = request.params.get("labelSelector")
        async with self._lock:
            mark = await self._buses[request.resource].mark()
            existing = [o.raw for (res, ns, _), o in self.objects.items()
                        if res == request.resource and not o.deleted and request.namespace in (None, ns)]
        for obj in existing:  # changed after the list the watcher started from
            if _rv(obj) > since and _selects(selector, obj):
                yield {"type": "ADDED", "object": obj}
        async for event in self._buses[request.resource].stream(since=mark):
            obj = event.get("object") or {}
            ns = (obj.get("metadata") or {}).get("namespace")
            if _rv(obj) > since and request.namespace in (None, ns) and _selects(selector, obj):
                yield event
