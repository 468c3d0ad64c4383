"""A minimal Deployment controller: keeps `spec.replicas` Pods of each Deployment's template,
owned by the Deployment (so deleting it deletes them), and reports the replica counts.

No ReplicaSets, no rollouts: a changed template replaces the pods at once (as `Recreate`),
which is what the operator chart asks for with one replica."""

from __future__ import annotations

import hashlib
import json
import secrets

from harness.client import Api
from harness.controller import Controller

DEPLOYMENTS = "apps/v1/deployments"
HASH_LABEL = "pod-template-hash"


class DeploymentController(Controller):
    name = "deployment-controller"

    def __init__(self, api: Api, every: float = 0.5):
        super().__init__(every)
        self.api = api

    def _tick(self) -> None:
        for deployment in self.api.list(DEPLOYMENTS):
            if not deployment["metadata"].get("deletionTimestamp"):
                self._reconcile(deployment)

    def _reconcile(self, deployment: dict) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        template = spec["template"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        pods = [
            p
            for p in self.api.list("v1/pods", meta["namespace"])
            if any(o["uid"] == meta["uid"] for o in p["metadata"].get("ownerReferences", []))
            and not p["metadata"].get("deletionTimestamp")
        ]
        current = [p for p in pods if p["metadata"]["labels"].get(HASH_LABEL) == digest]
        for pod in pods:
            if pod not in current:
                self.api.delete("v1/pods", pod["metadata"]["name"], meta["namespace"])
        for _ in range(spec.get("replicas", 1) - len(current)):
            self.api.create("v1/pods", self._pod(deployment, digest), meta["namespace"])
        ready = sum(p.get("status", {}).get("phase") == "Running" for p in current)
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": len(current),
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        if deployment.get("status", {}) | status != deployment.get("status", {}):
            self.api.patch(
                DEPLOYMENTS,
                meta["name"],
                {"status": status},
                meta["namespace"],
                subresource="status",
            )

    def _pod(self, deployment: dict, digest: str) -> dict:
        meta, template = deployment["metadata"], deployment["spec"]["template"]
        labels = {**template.get("metadata", {}).get("labels", {}), HASH_LABEL: digest}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{digest}-{secrets.token_hex(3)[:5]}",
                "labels": labels,
                "annotations": template.get("metadata", {}).get("annotations", {}),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template["spec"],
        }
