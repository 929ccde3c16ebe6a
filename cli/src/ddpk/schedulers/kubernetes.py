"""Run a job on Kubernetes: server-side apply of the rendered Indexed Job and Service.

The official client is imported only when a command talks to a cluster; it
provides configuration (kubeconfig, in-cluster) and transport, while requests
use the API's own paths so the shapes stay exactly the documented ones:
server-side apply (``PATCH`` as ``application/apply-patch+yaml`` with
``fieldManager=ddpk``), label-selected lists, background-propagated deletes
and followed pod logs resumed by timestamp.

Status codes map to exit codes here: 401/403 mean this user cannot use the
cluster and, like a refused connection, exit 3; a 422 from server validation
is bad input (2).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from ddpk.errors import BadInput, DdpkError, Unreachable
from ddpk.logs import LogLine, follow_resumable, format_timestamp, iter_lines, parse_timestamp
from ddpk.schedulers.base import (
    FAILED,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PENDING,
    RUNNING,
    SUCCEEDED,
    JobStatus,
    Plan,
    ReplicaStatus,
    Scheduler,
)
from ddpk.spec import JobSpec

FIELD_MANAGER = "ddpk"
CONTAINER = "trainer"
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
REQUEST_TIMEOUT_S = 30
FOLLOW_POLL_S = 1.0
DRAIN_TIMEOUT_S = 30.0
REPLACE_TIMEOUT_S = 120.0

RESOURCES = {("v1", "Service"): "services", ("v1", "Pod"): "pods", ("batch/v1", "Job"): "jobs"}
"""The kinds ddpk applies or reads, and their REST resource names."""


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """The REST path of a namespaced object (or of its collection when ``name`` is None)."""
    try:
        resource = RESOURCES[(api_version, kind)]
    except KeyError:
        raise BadInput("--target", f"the kubernetes scheduler cannot apply {api_version} {kind}") from None
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{resource}"
    return path if name is None else f"{path}/{name}"


class NotFound(DdpkError):
    """The API answered 404."""


class BadRequest(DdpkError):
    """The API answered 400, e.g. for the log of a container that has not started."""


def api_error(status: int, body: bytes, method: str, path: str) -> DdpkError:
    """One clear error for an API failure, from the Status object the server returns."""
    try:
        message = json.loads(body).get("message") or ""
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace").strip()
    message = message or http.client.responses.get(status, "error")
    if status in (401, 403):
        what = "unauthorized" if status == 401 else "forbidden"
        return Unreachable(f"Kubernetes API {what}: {message} (the verbs ddpk needs are in k8s/rbac.yaml)")
    if status == 404:
        return NotFound(message)
    if status == 400:
        return BadRequest(f"Kubernetes API {method} {path}: {message}")
    if status == 422:
        return BadInput("manifest", f"the API server rejected it: {message}")
    return DdpkError(f"Kubernetes API {method} {path} answered {status}: {message}")


def condition(job: dict, kind: str) -> dict | None:
    for cond in job.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return cond
    return None


def pod_index(pod: dict) -> int | None:
    meta = pod.get("metadata", {})
    value = (meta.get("labels") or {}).get(INDEX_KEY) or (meta.get("annotations") or {}).get(INDEX_KEY)
    return int(value) if value is not None and str(value).isdigit() else None


def pod_waiting_reason(pod: dict) -> str | None:
    """Why a pod is not running yet, in the scheduler's or kubelet's words."""
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{cond.get('reason', 'Unschedulable')}: {cond.get('message', '')}".strip()
    for cs in pod.get("status", {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return f"{waiting['reason']}: {waiting.get('message', '')}".strip().rstrip(":")
    return None


def _trainer_status(pod: dict) -> dict:
    for cs in pod.get("status", {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            return cs
    return {}


def replica_status(index: int, pods: list[dict]) -> ReplicaStatus:
    """One index's state from its pods: the newest decides, every earlier one was a restart."""
    if not pods:
        return ReplicaStatus(index=index, state=PENDING)
    pods = sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp", ""))
    latest = pods[-1]
    cs = _trainer_status(latest)
    terminated = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
    phase = latest.get("status", {}).get("phase", PENDING)
    detail = latest["metadata"]["name"]
    reason = pod_waiting_reason(latest)
    if reason and phase == PENDING:
        detail = f"{detail}: {reason}"
    return ReplicaStatus(
        index=index,
        state=phase,
        restarts=len(pods) - 1 + int(cs.get("restartCount", 0)),
        exit_code=terminated.get("exitCode") if terminated else None,
        detail=detail,
    )


def job_status(job: dict, pods: list[dict]) -> JobStatus:
    """Phase from the Job's conditions, replicas from its pods, and the reason it failed or waits."""
    meta, spec, st = job["metadata"], job.get("spec", {}), job.get("status", {})
    by_index: dict[int, list[dict]] = {}
    for pod in pods:
        index = pod_index(pod)
        if index is not None:
            by_index.setdefault(index, []).append(pod)
    replicas = [replica_status(i, by_index.get(i, [])) for i in range(int(spec.get("completions") or 1))]
    reason = None
    completion = st.get("completionTime")
    done = condition(job, "Complete") or condition(job, "SuccessCriteriaMet")
    failed = condition(job, "Failed") or condition(job, "FailureTarget")
    if done:
        phase = SUCCEEDED
    elif failed:
        phase = FAILED
        reason = f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".strip().rstrip(":")
        completion = completion or failed.get("lastTransitionTime")
    elif condition(job, "Suspended"):
        phase, reason = PENDING, "suspended (waiting for admission, e.g. by a Kueue queue)"
    else:
        running = any(r.state == RUNNING for r in replicas)
        phase = RUNNING if running else PENDING
        waits = [p for p in pods if p.get("status", {}).get("phase") == PENDING and pod_waiting_reason(p)]
        if waits:
            reason = f"{waits[0]['metadata']['name']}: {pod_waiting_reason(waits[0])}"
    return JobStatus(
        name=meta["name"],
        scheduler="kubernetes",
        phase=phase,
        replicas=replicas,
        start_time=st.get("startTime"),
        completion_time=completion,
        reason=reason,
    )


def _dropped() -> tuple[type[BaseException], ...]:
    """What a log stream raises when the connection breaks (it is then resumed)."""
    import urllib3

    return (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)


def check_kubeconfig(path: str | None) -> None:
    if path and not os.path.isfile(os.path.expanduser(path)):
        raise BadInput("--kubeconfig", f"{path}: no such file")


class Api:
    """The official client's configuration and transport, with JSON in and out and errors mapped."""

    def __init__(self, kubeconfig: str | None, context: str | None):
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        cfg = client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        files = [os.path.expanduser(p) for p in path.split(os.pathsep) if p]
        check_kubeconfig(kubeconfig)
        try:
            if any(os.path.isfile(f) for f in files):
                config.load_kube_config(config_file=path, context=context, client_configuration=cfg, persist_config=False)
            else:
                config.load_incluster_config(client_configuration=cfg)
        except ConfigException as exc:
            if context and "context" in str(exc).lower():
                raise BadInput("--context", str(exc)) from None
            raise Unreachable(
                f"no Kubernetes configuration: {exc} (set --kubeconfig or KUBECONFIG, or run in a cluster)"
            ) from None
        # A refused connection should fail fast, not after urllib3's default retries.
        cfg.retries = 1
        self.host = cfg.host
        self.client = client.ApiClient(cfg)

    def request(self, method: str, path: str, query: list[tuple[str, Any]] | None = None, body: Any = None,
                content_type: str = "application/json", stream: bool = False):
        import urllib3

        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, _ = self.client.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            resp = self.client.call_api(
                method, url, header_params=headers, body=body,
                _request_timeout=None if stream else REQUEST_TIMEOUT_S,
            )
        except urllib3.exceptions.HTTPError as exc:
            reason = getattr(exc, "reason", None) or exc
            raise Unreachable(f"cannot reach the Kubernetes API at {self.host}: {reason} (check --context or --kubeconfig)") from None
        if not 200 <= resp.status <= 299:
            raise api_error(resp.status, resp.read(), method, path)
        if stream:
            return resp.response
        return json.loads(resp.read() or b"{}")

    def get(self, path: str, query: list[tuple[str, Any]] | None = None) -> dict:
        return self.request("GET", path, query)


class KubernetesScheduler(Scheduler):
    name = "kubernetes"

    def __init__(self, options=None):
        super().__init__(options)
        self._api: Api | None = None

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = Api(self.options.kubeconfig, self.options.context)
        return self._api

    @property
    def ns(self) -> str:
        return self.options.namespace

    # --- plan and apply ---

    def dryrun(self, spec: JobSpec) -> Plan:
        from ddpk.render import render, to_yaml

        check_kubeconfig(self.options.kubeconfig)
        objects = render(spec, "indexedjob")
        # Every object is checked (a known kind, in this namespace) before the first call.
        for obj in objects:
            object_path(obj["apiVersion"], obj["kind"], spec.namespace, obj["metadata"]["name"])
        where = f"kubernetes (namespace {spec.namespace}"
        where += f", context {self.options.context})" if self.options.context else ")"
        return Plan(scheduler=self.name, spec=spec, where=where, text=to_yaml(objects), payload=objects)

    def apply(self, obj: dict, dry_run: bool = False) -> dict:
        import yaml

        meta = obj["metadata"]
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace", self.ns), meta["name"])
        return self.api.request("PATCH", path, query, body=yaml.safe_dump(obj, sort_keys=False),
                                content_type="application/apply-patch+yaml")

    def schedule(self, plan: Plan, replace: bool = False) -> str:
        name = plan.spec.name
        existing = self._job_or_none(name)
        if existing is not None:
            if not replace:
                phase = job_status(existing, []).phase
                raise BadInput("--name", f"job {name} already exists in namespace {self.ns} ({phase}); "
                                         f"use --replace or ddpk delete {name} -s kubernetes")
            self.delete(name)
            self._wait_gone(name, existing["metadata"].get("uid"))
        if self.options.validate == "server":
            for obj in plan.payload:
                self.apply(obj, dry_run=True)
        for obj in plan.payload:
            self.apply(obj)
        return name

    def _wait_gone(self, name: str, uid: str | None) -> None:
        """Pods keep their hostnames across jobs of one name: let the old ones go before new ones start."""
        deadline = time.monotonic() + REPLACE_TIMEOUT_S
        while self._job_or_none(name) is not None or (uid and self._pods(uid)):
            if time.monotonic() > deadline:
                raise DdpkError(f"the old job {name} was still being deleted after {REPLACE_TIMEOUT_S:g}s")
            time.sleep(1)

    # --- read ---

    def _job_or_none(self, name: str) -> dict | None:
        try:
            return self.api.get(object_path("batch/v1", "Job", self.ns, name))
        except NotFound:
            return None

    def _job(self, name: str) -> dict:
        job = self._job_or_none(name)
        if job is None:
            raise BadInput("JOB", f"no job named {name!r} in namespace {self.ns} (ddpk list -s kubernetes shows the jobs)")
        return job

    def _pods(self, uid: str) -> list[dict]:
        path = object_path("v1", "Pod", self.ns)
        return self.api.get(path, [("labelSelector", f"{JOB_UID_LABEL}={uid}")]).get("items", [])

    def describe(self, name: str) -> JobStatus:
        job = self._job(name)
        return job_status(job, self._pods(job["metadata"]["uid"]))

    def list(self) -> list[JobStatus]:
        selector = [("labelSelector", f"{MANAGED_BY_LABEL}={MANAGED_BY}")]
        jobs = self.api.get(object_path("batch/v1", "Job", self.ns), selector).get("items", [])
        pods = self.api.get(object_path("v1", "Pod", self.ns), selector).get("items", [])
        by_uid: dict[str, list[dict]] = {}
        for pod in pods:
            by_uid.setdefault((pod["metadata"].get("labels") or {}).get(JOB_UID_LABEL, ""), []).append(pod)
        return [job_status(job, by_uid.get(job["metadata"].get("uid", ""), [])) for job in jobs]

    # --- logs ---

    def _log_query(self, follow: bool, since: str | None, since_s: float | None, tail: int | None):
        query: list[tuple[str, Any]] = [("container", CONTAINER), ("timestamps", "true")]
        if follow:
            query.append(("follow", "true"))
        if since is not None:
            # sinceTime has second precision; the repeated lines are dropped by their full timestamps.
            query.append(("sinceTime", format_timestamp(parse_timestamp(since))[:19] + "Z"))
        elif since_s is not None:
            query.append(("sinceSeconds", max(1, int(since_s))))
        if tail is not None and since is None:
            query.append(("tailLines", tail))
        return query

    def _stream(self, pod: str, query) -> Iterator[str]:
        path = object_path("v1", "Pod", self.ns, pod) + "/log"
        resp = self.api.request("GET", path, query, stream=True)
        try:
            yield from iter_lines(resp.stream(4096))
        finally:
            resp.release_conn()

    def logs(self, name: str, rank: int | None = None, follow: bool = False,
             since_s: float | None = None, tail: int | None = None) -> Iterator[LogLine]:
        job = self._job(name)
        uid = job["metadata"]["uid"]
        if not follow:
            yield from self._logs_once(uid, rank, since_s, tail)
            return
        yield from self._follow(name, uid, rank, since_s, tail)

    def _logs_once(self, uid: str, rank: int | None, since_s: float | None, tail: int | None) -> Iterator[LogLine]:
        lines = []
        for pod in sorted(self._pods(uid), key=lambda p: p["metadata"].get("creationTimestamp", "")):
            index = pod_index(pod)
            if index is None or (rank is not None and index != rank):
                continue
            try:
                for raw in self._stream(pod["metadata"]["name"], self._log_query(False, None, since_s, tail)):
                    ts, _, text = raw.partition(" ")
                    lines.append(LogLine(index, text, ts))
            except BadRequest:
                continue  # its container has not started: nothing to show yet
        yield from sorted(lines, key=lambda ln: parse_timestamp(ln.ts) if ln.ts else 0)

    def _follow(self, name: str, uid: str, rank: int | None, since_s: float | None,
                tail: int | None) -> Iterator[LogLine]:
        """Every pod of the job, as they appear or restart, until the Job is Complete or Failed."""
        out: queue.Queue = queue.Queue()
        followers: dict[str, threading.Thread] = {}
        finished: dict[str, bool] = {}
        errors: list[BaseException] = []
        told: set[str] = set()

        def follow_pod(pod_name: str, index: int) -> None:
            first = True

            def open_stream(since: str | None):
                nonlocal first
                query = self._log_query(True, since, since_s if first else None, tail if first else None)
                first = False
                try:
                    yield from self._stream(pod_name, query)
                except (BadRequest, NotFound):
                    return  # not started yet, or gone; finished() decides whether to come back

            try:
                for ts, text in follow_resumable(open_stream, lambda: finished.get(pod_name, False), _dropped()):
                    out.put(LogLine(index, text, ts))
            except BaseException as exc:  # handed to the consumer
                errors.append(exc)

        while True:
            job = self._job(name)
            pods = self._pods(uid)
            status = job_status(job, pods)
            for pod in pods:
                pod_name, index = pod["metadata"]["name"], pod_index(pod)
                if index is None or (rank is not None and index != rank):
                    continue
                phase = pod.get("status", {}).get("phase")
                finished[pod_name] = phase in (SUCCEEDED, FAILED)
                waiting = pod_waiting_reason(pod) if phase == PENDING else None
                if waiting and f"{pod_name}:{waiting}" not in told:
                    told.add(f"{pod_name}:{waiting}")
                    out.put(LogLine(index, f"ddpk: {pod_name} is pending: {waiting}"))
                if pod_name not in followers:
                    followers[pod_name] = threading.Thread(target=follow_pod, args=(pod_name, index), daemon=True)
                    followers[pod_name].start()
            for pod_name in set(followers) - {p["metadata"]["name"] for p in pods}:
                finished[pod_name] = True  # deleted: nothing more will come
            if status.terminal:
                for pod_name in followers:
                    finished[pod_name] = True
            yield from _drain(out)
            if errors:
                raise errors[0]
            if status.terminal:
                deadline = time.monotonic() + DRAIN_TIMEOUT_S
                for t in followers.values():
                    t.join(timeout=max(0.0, deadline - time.monotonic()))
                yield from _drain(out)
                return
            time.sleep(FOLLOW_POLL_S)

    # --- delete ---

    def delete(self, name: str, volumes: bool = False) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        query = [("propagationPolicy", "Background")]
        found = False
        for api_version, kind in (("batch/v1", "Job"), ("v1", "Service")):
            try:
                self.api.request("DELETE", object_path(api_version, kind, self.ns, name), query, body=body)
                found = True
            except NotFound:
                pass
        if not found:
            raise BadInput("JOB", f"no job named {name!r} in namespace {self.ns}")


def _drain(q: queue.Queue) -> Iterator[LogLine]:
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


SCHEDULER = KubernetesScheduler
