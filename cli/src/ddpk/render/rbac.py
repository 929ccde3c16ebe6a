"""The least-privilege Role and RoleBinding for people who submit ddpk jobs to a namespace."""

from __future__ import annotations

from typing import Any

from ddpk.render.pod import APP

ROLE = "ddpk-submitter"

RULES = [
    # submit, replace and delete: the rendered Job and its headless Service
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # follow: pod phases, logs and the events that explain a pending or failed pod
    {"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["get", "list", "watch"]},
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
