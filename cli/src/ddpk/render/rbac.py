"""The least-privilege Role and RoleBinding for people who submit ddpk jobs to a namespace."""

from __future__ import annotations

from typing import Any

from ddpk.render.pod import APP

ROLE = "ddpk-submitter"

RULES = [
    # submit (server-side apply: patch, and create for a new object), status, list, wait, delete, --replace
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "create", "patch", "delete"]},
    # submit and delete: the headless Service, never read back
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "patch", "delete"]},
    # status, logs, wait, list and --replace list the job's pods; logs read each one's log. ddpk polls: no watch.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
]


def rbac(namespace: str = "default", group: str = "ddpk-submitters") -> list[dict[str, Any]]:
    """A Role with only what ``ddpk submit/logs/list/delete`` use, bound to ``group``."""
    labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/part-of": APP, "app.kubernetes.io/managed-by": APP}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": ROLE, "namespace": namespace, "labels": labels},
            "rules": RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": ROLE, "namespace": namespace, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}],
        },
    ]
