"""A small Kubernetes API server over real HTTP, for the kubernetes scheduler's tests.

It speaks the documented REST shapes for what ddpk uses, and nothing more:

- server-side apply: ``PATCH`` with ``Content-Type: application/apply-patch+yaml``,
  ``fieldManager`` required, ``force``, ``dryRun=All``; creates (201) or updates (200);
  a Job's pod template is immutable; new Jobs get the controller-uid selector and labels;
- ``GET`` of one object (404 Status when missing) and of collections with an
  equality-based ``labelSelector`` (items carry no kind/apiVersion, as the API sends them);
- ``DELETE`` with ``propagationPolicy`` (query or DeleteOptions body); Background or
  Foreground removes the Job's pods, Orphan keeps them;
- pod logs with ``container``, ``timestamps``, ``follow``, ``sinceTime``, ``sinceSeconds``
  and ``tailLines``, chunked; 400 while the container waits to start; a follow stream can
  be made to drop mid-line;
- 403 Status objects for namespaces the user may not touch.

It runs no controllers: tests play the Job controller and kubelet by adding pods,
log lines and conditions through the methods below.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import yaml

ROUTES = [
    (re.compile(r"^/api/v1/namespaces/([^/]+)/(pods|services)(?:/([^/]+))?(/log)?$"), "v1"),
    (re.compile(r"^/apis/batch/v1/namespaces/([^/]+)/(jobs)(?:/([^/]+))?()$"), "batch/v1"),
]
KINDS = {"pods": "Pod", "services": "Service", "jobs": "Job"}
GROUPS = {"pods": "", "services": "", "jobs": "batch"}


def rfc3339(ns: int) -> str:
    seconds, frac = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


def parse_time(text: str) -> int:
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z$", text)
    if not m:
        raise ValueError(text)
    base = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    return int(base.timestamp()) * 1_000_000_000 + int((m.group(2) or "").ljust(9, "0"))


def status_object(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "details": details or {}, "code": code}


def matches(labels: dict, selector: str) -> bool:
    """Equality-based label selectors: k=v, k==v, k!=v, k, !k (comma = and)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def write_kubeconfig(path, server: str, namespace: str = "default") -> str:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "dev", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "dev", "namespace": namespace}}],
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


class PodLog:
    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []
        self.drops: list[int] = []
        """For each future follow connection, drop it after this many lines (then half a line)."""


class FakeApiServer:
    def __init__(self, forbidden_namespaces: tuple[str, ...] = ()):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.logs: dict[tuple[str, str], PodLog] = {}
        self.requests: list[dict] = []
        self.forbidden = set(forbidden_namespaces)
        self.lock = threading.Condition()
        self._rv = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                server._handle(self, "GET")

            def do_PATCH(self) -> None:
                server._handle(self, "PATCH")

            def do_DELETE(self) -> None:
                server._handle(self, "DELETE")

            def do_POST(self) -> None:
                server._handle(self, "POST")

            def do_PUT(self) -> None:
                server._handle(self, "PUT")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    # --- lifecycle -----------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> "FakeApiServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def kubeconfig(self, path, namespace: str = "default") -> str:
        return write_kubeconfig(path, self.url, namespace)

    # --- what tests do as the controllers ----------------------------------------


    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        with self.lock:
            obj = self.objects.get((resource, namespace, name))
            return copy.deepcopy(obj) if obj else None

    def add_pod(self, job: str, index: int, namespace: str = "default", phase: str = "Running",
                conditions: list | None = None, exit_code: int | None = None) -> str:
        """A pod as the Job controller creates it (labels, index annotation, owner), in ``phase``."""
        with self.lock:
            owner = self.objects[("jobs", namespace, job)]
            labels = dict(owner["spec"]["template"]["metadata"]["labels"])
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
            name = f"{job}-{index}-{uuid.uuid4().hex[:5]}"
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": name, "namespace": namespace, "labels": labels,
                    "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
                    "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": job,
                                         "uid": owner["metadata"]["uid"], "controller": True}],
                },
                "spec": copy.deepcopy(owner["spec"]["template"]["spec"]),
                "status": {},
            }
            pod["spec"]["hostname"] = f"{job}-{index}"
            self._store("pods", namespace, name, pod)
            self.logs[(namespace, name)] = PodLog()
        self.set_pod_phase(name, phase, namespace, conditions, exit_code)
        return name

    def set_pod_phase(self, name: str, phase: str, namespace: str = "default",
                      conditions: list | None = None, exit_code: int | None = None) -> None:
        with self.lock:
            pod = self.objects[("pods", namespace, name)]
            state: dict = {"waiting": {"reason": "ContainerCreating"}}
            if phase == "Running":
                state = {"running": {"startedAt": rfc3339(time.time_ns())[:19] + "Z"}}
            elif phase in ("Succeeded", "Failed"):
                state = {"terminated": {"exitCode": exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)}}
            pod["status"] = {
                "phase": phase,
                "conditions": conditions or [],
                "containerStatuses": [{"name": "trainer", "state": state, "restartCount": 0, "ready": phase == "Running"}],
            }
            self._bump(pod)
            self.lock.notify_all()

    def log(self, pod: str, text: str, namespace: str = "default") -> None:
        """The container writes a line (kubelet stamps it)."""
        with self.lock:
            self.logs[(namespace, pod)].lines.append((time.time_ns(), text))
            self.lock.notify_all()

    def drop_next_follow(self, pod: str, after_lines: int, namespace: str = "default") -> None:
        with self.lock:
            self.logs[(namespace, pod)].drops.append(after_lines)

    def set_job_condition(self, job: str, kind: str, reason: str = "", message: str = "",
                          namespace: str = "default") -> None:
        """What the Job controller writes through the status subresource."""
        with self.lock:
            obj = self.objects[("jobs", namespace, job)]
            now = rfc3339(time.time_ns())[:19] + "Z"
            status = obj.setdefault("status", {})
            status.setdefault("startTime", now)
            status.setdefault("conditions", []).append(
                {"type": kind, "status": "True", "reason": reason, "message": message,
                 "lastProbeTime": now, "lastTransitionTime": now})
            if kind == "Complete":
                status["completionTime"] = now
            self._bump(obj)
            self.lock.notify_all()

    def requests_to(self, method: str, path_part: str) -> list[dict]:
        with self.lock:
            return [r for r in self.requests if r["method"] == method and path_part in r["path"]]

    def wait_for(self, predicate, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("the fake API server never saw what the test waited for")
                self.lock.wait(min(remaining, 0.1))

    # --- the API ---------------------------------------------------------------------

    def _bump(self, obj: dict) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)

    def _store(self, resource: str, namespace: str, name: str, obj: dict) -> None:
        self._bump(obj)
        self.objects[(resource, namespace, name)] = obj

    def _send_json(self, h: BaseHTTPRequestHandler, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        with self.lock:
            self.requests.append({"method": method, "path": url.path, "query": query,
                                  "headers": dict(h.headers), "body": body.decode("utf-8", "replace")})
            self.lock.notify_all()
        for pattern, api_version in ROUTES:
            m = pattern.match(url.path)
            if m:
                break
        else:
            return self._send_json(h, 404, status_object(404, "NotFound", "the server could not find the requested resource"))
        namespace, resource, name, log = m.groups()
        if namespace in self.forbidden:
            group = GROUPS[resource]
            verb = {"GET": "get" if name else "list", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
            what = f"{resource}.{group}" if group else resource
            message = (f'{what} "{name}" is forbidden: ' if name else f"{what} is forbidden: ") + (
                f'User "dev" cannot {verb} resource "{resource}" in API group "{group}" in the namespace "{namespace}"')
            return self._send_json(h, 403, status_object(403, "Forbidden", message,
                                                         {"name": name or "", "group": group, "kind": resource}))
        if log:
            if method != "GET":
                return self._send_json(h, 405, status_object(405, "MethodNotAllowed", "method not allowed"))
            return self._pod_log(h, namespace, name, query)
        if method == "GET":
            return self._get(h, api_version, namespace, resource, name, query)
        if method == "PATCH" and name:
            return self._apply(h, api_version, namespace, resource, name, query, body)
        if method == "DELETE" and name:
            return self._delete(h, namespace, resource, name, query, body)
        return self._send_json(h, 405, status_object(405, "MethodNotAllowed", f"{method} is not supported here"))

    def _not_found(self, resource: str, name: str) -> dict:
        group = GROUPS[resource]
        what = f"{resource}.{group}" if group else resource
        return status_object(404, "NotFound", f'{what} "{name}" not found', {"name": name, "group": group, "kind": resource})

    def _get(self, h, api_version, namespace, resource, name, query) -> None:
        with self.lock:
            if name:
                obj = self.objects.get((resource, namespace, name))
                if obj is None:
                    return self._send_json(h, 404, self._not_found(resource, name))
                return self._send_json(h, 200, obj)
            selector = query.get("labelSelector", "")
            if any(op in selector for op in (" in ", " notin ", "(")):
                return self._send_json(h, 400, status_object(400, "BadRequest", "only equality-based selectors here"))
            items = []
            for (res, ns, _), obj in sorted(self.objects.items()):
                if res == resource and ns == namespace and matches(obj["metadata"].get("labels") or {}, selector):
                    item = copy.deepcopy(obj)
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
                    items.append(item)
            body = {"kind": KINDS[resource] + "List", "apiVersion": api_version,
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}
            return self._send_json(h, 200, body)

    def _apply(self, h, api_version, namespace, resource, name, query, body) -> None:
        content_type = h.headers.get("Content-Type", "")
        if content_type.split(";")[0].strip() != "application/apply-patch+yaml":
            return self._send_json(h, 415, status_object(415, "UnsupportedMediaType",
                                                         "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"))
        if not query.get("fieldManager"):
            return self._send_json(h, 422, status_object(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required for apply patch'))
        try:
            obj = yaml.safe_load(body)
        except yaml.YAMLError as exc:
            return self._send_json(h, 400, status_object(400, "BadRequest", f"error decoding YAML: {exc}"))
        if not isinstance(obj, dict) or obj.get("apiVersion") != api_version or obj.get("kind") != KINDS[resource]:
            return self._send_json(h, 400, status_object(400, "BadRequest", f"the body is not a {api_version} {KINDS[resource]}"))
        meta = obj.setdefault("metadata", {})
        if meta.get("name") != name:
            return self._send_json(h, 400, status_object(400, "BadRequest", f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"))
        if meta.get("namespace", namespace) != namespace:
            return self._send_json(h, 400, status_object(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request"))
        meta["namespace"] = namespace
        dry_run = query.get("dryRun") == "All"
        with self.lock:
            old = self.objects.get((resource, namespace, name))
            if old is not None:
                if resource == "jobs":
                    new_template = copy.deepcopy(obj["spec"]["template"])
                    old_template = copy.deepcopy(old["spec"]["template"])
                    for key in ("controller-uid", "batch.kubernetes.io/controller-uid", "job-name", "batch.kubernetes.io/job-name"):
                        old_template["metadata"]["labels"].pop(key, None)
                    if new_template != old_template:
                        return self._send_json(h, 422, status_object(422, "Invalid", f'Job.batch "{name}" is invalid: spec.template: Invalid value: field is immutable'))
                    obj["spec"]["template"] = old["spec"]["template"]
                    obj["spec"]["selector"] = old["spec"]["selector"]
                merged = copy.deepcopy(old)
                merged["metadata"]["labels"] = meta.get("labels", {})
                merged["spec"] = obj["spec"]
                code, result = 200, merged
            else:
                meta.update(uid=str(uuid.uuid4()), creationTimestamp=rfc3339(time.time_ns())[:19] + "Z", generation=1)
                meta["managedFields"] = [{"manager": query["fieldManager"], "operation": "Apply",
                                          "apiVersion": api_version, "fieldsType": "FieldsV1"}]
                if resource == "jobs":
                    selector = {"batch.kubernetes.io/controller-uid": meta["uid"]}
                    obj["spec"]["selector"] = {"matchLabels": selector}
                    obj["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(
                        {**selector, "controller-uid": meta["uid"], "batch.kubernetes.io/job-name": name, "job-name": name})
                    obj["status"] = {}
                code, result = 201, obj
            if not dry_run:
                self._store(resource, namespace, name, result)
            self.lock.notify_all()
            return self._send_json(h, code, result)

    def _delete(self, h, namespace, resource, name, query, body) -> None:
        options = json.loads(body) if body else {}
        policy = query.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
        with self.lock:
            obj = self.objects.pop((resource, namespace, name), None)
            if obj is None:
                return self._send_json(h, 404, self._not_found(resource, name))
            if resource == "jobs" and policy in ("Background", "Foreground"):
                uid = obj["metadata"]["uid"]
                for key in [k for k, o in self.objects.items()
                            if k[0] == "pods" and (o["metadata"].get("labels") or {}).get("batch.kubernetes.io/controller-uid") == uid]:
                    del self.objects[key]
            self.lock.notify_all()
        return self._send_json(h, 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                        "details": {"name": name, "group": GROUPS[resource], "kind": resource, "uid": obj["metadata"]["uid"]}})

    def _pod_log(self, h, namespace, name, query) -> None:
        with self.lock:
            pod = self.objects.get(("pods", namespace, name))
            if pod is None:
                return self._send_json(h, 404, self._not_found("pods", name))
            container = query.get("container") or "trainer"
            if container not in [c["name"] for c in pod["spec"]["containers"]]:
                return self._send_json(h, 400, status_object(400, "BadRequest", f"container {container} is not valid for pod {name}"))
            if pod["status"].get("phase") == "Pending":
                return self._send_json(h, 400, status_object(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'))
            plog = self.logs[(namespace, name)]
            follow = query.get("follow") == "true"
            drop_after = plog.drops.pop(0) if follow and plog.drops else None
        since_ns = None
        if "sinceTime" in query:
            since_ns = parse_time(query["sinceTime"])
        elif "sinceSeconds" in query:
            since_ns = time.time_ns() - int(query["sinceSeconds"]) * 1_000_000_000
        stamps = query.get("timestamps") == "true"

        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(data: bytes) -> None:
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        def render(ts: int, text: str) -> bytes:
            return ((rfc3339(ts) + " ") if stamps else "").encode() + text.encode() + b"\n"

        with self.lock:
            lines = [(ts, t) for ts, t in plog.lines if since_ns is None or ts >= since_ns]
        if "tailLines" in query:
            lines = lines[-int(query["tailLines"]):] if int(query["tailLines"]) > 0 else []
        sent = 0
        position = len(plog.lines)
        try:
            for ts, text in lines:
                if drop_after is not None and sent == drop_after:
                    return self._drop(h, render(ts, text))
                chunk(render(ts, text))
                sent += 1
            while follow:
                with self.lock:
                    while len(plog.lines) == position and self._running(namespace, name):
                        self.lock.wait(0.1)
                    fresh = plog.lines[position:]
                    position = len(plog.lines)
                    running = self._running(namespace, name)
                for ts, text in fresh:
                    if drop_after is not None and sent == drop_after:
                        return self._drop(h, render(ts, text))
                    chunk(render(ts, text))
                    sent += 1
                if not running and not fresh:
                    break
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True

    def _running(self, namespace: str, name: str) -> bool:
        pod = self.objects.get(("pods", namespace, name))
        return pod is not None and pod["status"].get("phase") in ("Pending", "Running")

    def _drop(self, h, next_line: bytes) -> None:
        """The connection breaks in the middle of a line, without the chunked terminator."""
        half = next_line[: max(1, len(next_line) // 2)]
        h.wfile.write(f"{len(next_line):x}\r\n".encode() + half)
        h.wfile.flush()
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)
