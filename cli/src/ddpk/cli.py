"""The ``ddpk`` command: render, submit, status, logs, list, delete, wait.

Job options map one to one to JobSpec fields; the config file sets their
defaults and the scheduler's. Every failure becomes an exit code in ``main``:
0 ok, 1 the job failed, 2 bad input, 3 cluster or engine unreachable,
130 interrupted. Schedulers and their SDKs are imported only by the commands
that use them, so ``--help``, ``render`` and ``submit --dry-run`` start fast.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import secrets
import sys
import traceback
from typing import Annotated, Any, Optional

import typer

from ddpk.config import load_config
from ddpk.errors import EXIT_INTERRUPTED, BadInput, DdpkError
from ddpk.spec import JobSpec

try:
    from typer._click.exceptions import ClickException
except ImportError:  # typer releases before click was vendored
    from click.exceptions import ClickException

SCHEDULERS = ("local", "docker", "kubernetes")
OUTPUTS = ("table", "json", "yaml")
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
"""Kubernetes' own alphabet for generated name suffixes: no vowels, no look-alikes."""

app = typer.Typer(
    name="ddpk",
    help="Render, submit, follow and recover PyTorch DDP jobs on Kubernetes, Docker or this machine.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# --- job options: one flag per JobSpec field ---------------------------------

JOB_PANEL = "Job options (defaults: ddpk.toml, then JobSpec)"


@dataclasses.dataclass(frozen=True)
class JobFlag:
    field: str
    flags: tuple[str, ...]
    type: Any
    help: str


JOB_FLAGS = (
    JobFlag("name", ("--name",), str, "Job name, a DNS-1123 label; pods are <name>-<index>. Default: ddpk-<random>."),
    JobFlag("image", ("--image",), str, "Container image holding ddpk-trainer (docker, kubernetes)."),
    JobFlag("image_pull_policy", ("--image-pull-policy",), str, "Always, IfNotPresent or Never."),
    JobFlag("replicas", ("--replicas",), int, "Number of pods (nodes)."),
    JobFlag("nproc_per_node", ("--nproc-per-node",), str, "Ranks per pod: auto (one per GPU, else 1) or N."),
    JobFlag("gpus_per_replica", ("--gpus",), int, "nvidia.com/gpu per pod; 0 trains on CPU with gloo."),
    JobFlag("cpu_request", ("--cpu",), str, "CPU request per pod (500m, 4)."),
    JobFlag("cpu_limit", ("--cpu-limit",), str, "CPU limit per pod."),
    JobFlag("memory_request", ("--memory",), str, "Memory request per pod (4Gi)."),
    JobFlag("memory_limit", ("--memory-limit",), str, "Memory limit per pod."),
    JobFlag("env", ("--env", "-e"), list[str], "Extra environment K=V (repeatable)."),
    JobFlag("env_from_secrets", ("--env-from-secret",), list[str], "Secret whose keys become env vars (repeatable; kubernetes)."),
    JobFlag("data_pvc", ("--data-pvc",), str, "Dataset volume, read-only: a PVC, a docker volume, or an absolute host path."),
    JobFlag("data_mount", ("--data-mount",), str, "Where the data volume is mounted."),
    JobFlag("checkpoint_pvc", ("--checkpoint-pvc",), str, "Checkpoint volume: a PVC, a docker volume, or an absolute host path."),
    JobFlag("checkpoint_mount", ("--checkpoint-mount",), str, "Where checkpoints and metrics go."),
    JobFlag("shm_size", ("--shm-size",), str, "Size of /dev/shm (2Gi)."),
    JobFlag("node_selector", ("--node-selector",), list[str], "Pod nodeSelector K=V (repeatable)."),
    JobFlag("tolerations", ("--toleration",), list[str], "Toleration key[=value]:Effect (repeatable)."),
    JobFlag("priority_class", ("--priority-class",), str, "Pod priorityClassName."),
    JobFlag("queue", ("--queue",), str, "Kueue LocalQueue name."),
    JobFlag("service_account", ("--service-account",), str, "Pod serviceAccountName (its token is not mounted)."),
    JobFlag("max_restarts", ("--max-restarts",), int, "Whole-gang restarts from the last checkpoint before the job fails."),
    JobFlag("active_deadline_s", ("--active-deadline",), int, "Seconds the job may run in all."),
    JobFlag("ttl_after_finished_s", ("--ttl",), int, "Seconds a finished job is kept (kubernetes)."),
    JobFlag("port", ("--port",), int, "Rendezvous port on the master pod."),
    JobFlag("rdzv_timeout_s", ("--rdzv-timeout",), int, "Seconds ddpk-launch waits for the master."),
)
FLAG_OF = {f.field: f.flags[0] for f in JOB_FLAGS} | {"namespace": "--namespace", "trainer_args": "trainer arguments"}
FIELD_OF_FLAG = {flag: field for field, flag in FLAG_OF.items()}
_MULTI = {"env": "dict", "node_selector": "dict", "env_from_secrets": "list", "tolerations": "list"}


def with_job_options(fn):
    """Add one keyword parameter per JobFlag to a command (typer reads the signature)."""
    sig = inspect.signature(fn, eval_str=True)
    params = list(sig.parameters.values())
    annotations = {p.name: p.annotation for p in params}
    extra = []
    for jf in JOB_FLAGS:
        annotation = Annotated[Optional[jf.type], typer.Option(*jf.flags, help=jf.help, rich_help_panel=JOB_PANEL)]
        extra.append(inspect.Parameter(jf.field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation))
        annotations[jf.field] = annotation
    # The function collects these through **job; typer sees them as named options.
    head = [p for p in params if p.kind != inspect.Parameter.VAR_KEYWORD]
    fn.__signature__ = sig.replace(parameters=head + extra)
    fn.__annotations__ = annotations
    return fn


def generate_name() -> str:
    return "ddpk-" + "".join(secrets.choice(NAME_ALPHABET) for _ in range(5))


def build_spec(flags: dict[str, Any], namespace: str | None, trainer_args: list[str] | None,
               config: dict[str, Any], config_path: Any) -> JobSpec:
    """Flags over the config file over JobSpec defaults, validated; errors name the flag or the file and key."""
    from ddpk.spec import parse_env_pairs, validate

    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, value in config.items():
        if key != "scheduler":
            values[key] = value
            source[key] = f"{config_path}: {key}"
    given = dict(flags)
    given["namespace"] = namespace
    given["trainer_args"] = trainer_args or None
    for key, value in given.items():
        if value is None:
            continue
        if _MULTI.get(key) == "dict":
            value = {**values.get(key, {}), **parse_env_pairs(value, FLAG_OF[key])}
        values[key] = value
        source[key] = FLAG_OF[key]
    if "name" not in values:
        values["name"] = generate_name()
    try:
        return validate(JobSpec(**values))
    except BadInput as exc:
        field = FIELD_OF_FLAG.get(exc.field)
        if field in source and source[field] != exc.field:
            raise BadInput(source[field], exc.message) from None
        raise


# --- common options ----------------------------------------------------------

Scheduler = Annotated[Optional[str], typer.Option("--scheduler", "-s", help="local, docker or kubernetes. Default: the config's scheduler, else local.")]
Namespace = Annotated[Optional[str], typer.Option("--namespace", "-n", help="Kubernetes namespace.")]
Context = Annotated[Optional[str], typer.Option("--context", help="kubeconfig context.")]
Kubeconfig = Annotated[Optional[str], typer.Option("--kubeconfig", help="kubeconfig file (KUBECONFIG is honoured too).")]
Config = Annotated[Optional[str], typer.Option("--config", help="Config file. Default: ./ddpk.toml, then the user config dir.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
Output = Annotated[str, typer.Option("--output", "-o", help="table, json or yaml.")]
JobName = Annotated[str, typer.Argument(metavar="JOB", help="Job name.")]


@dataclasses.dataclass
class Common:
    scheduler: str
    namespace: str
    context: str | None
    kubeconfig: str | None
    config: dict[str, Any]
    config_path: Any


def common(scheduler: str | None, namespace: str | None, context: str | None, kubeconfig: str | None,
           config_file: str | None) -> Common:
    config, path = load_config(config_file)
    chosen = scheduler or config.get("scheduler") or "local"
    if chosen not in SCHEDULERS:
        flag = "--scheduler" if scheduler else f"{path}: scheduler"
        raise BadInput(flag, f"{chosen!r} is not one of {', '.join(SCHEDULERS)}")
    return Common(chosen, namespace or config.get("namespace") or "default", context, kubeconfig, config, path)


def open_scheduler(c: Common, validate: str = "client"):
    from ddpk.schedulers.base import Options, get_scheduler

    return get_scheduler(c.scheduler, Options(c.namespace, c.context, c.kubeconfig, validate))


def check_output(output: str) -> None:
    if output not in OUTPUTS:
        raise BadInput("--output", f"{output!r} is not one of {', '.join(OUTPUTS)}")


def say(text: str) -> None:
    typer.echo(text, err=True)


# --- commands ----------------------------------------------------------------


@app.callback()
def _root(debug: Debug = False) -> None:
    """Render, submit, follow and recover PyTorch DDP jobs."""


@app.command()
@with_job_options
def render(
    target: Annotated[str, typer.Option("--target", "-t", help="indexedjob, pytorchjob, jobset or slurm.")] = "indexedjob",
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", help="Write one file per object here instead of stdout.")] = None,
    slurm_container: Annotated[bool, typer.Option("--slurm-container", help="slurm: run in --image through pyxis --container-image.")] = False,
    trainer_args: Annotated[Optional[list[str]], typer.Argument(metavar="[-- TRAINER_ARGS]", help="Passed to ddpk-train.")] = None,
    namespace: Namespace = None,
    config: Config = None,
    debug: Debug = False,
    **job: Any,
) -> None:
    """Print the manifests (or sbatch script) for a job, without contacting anything."""
    from ddpk import render as renderer

    c = common(None, namespace, None, None, config)
    spec = build_spec(job, namespace, trainer_args, c.config, c.config_path)
    options = {"container": True} if slurm_container and target == "slurm" else {}
    out = renderer.render(spec, target, **options)
    if output_dir is not None:
        for path in renderer.write_dir(out, output_dir):
            typer.echo(str(path))
    else:
        typer.echo(out if isinstance(out, str) else renderer.to_yaml(out), nl=False)


@app.command()
@with_job_options
def submit(
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream logs, then exit with the job's result.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be applied or run; change nothing.")] = False,
    replace: Annotated[bool, typer.Option("--replace", help="Delete a job of the same name first.")] = False,
    validate: Annotated[str, typer.Option("--validate", help="client, or server: a server-side dry run first (kubernetes).")] = "client",
    trainer_args: Annotated[Optional[list[str]], typer.Argument(metavar="[-- TRAINER_ARGS]", help="Passed to ddpk-train.")] = None,
    scheduler: Scheduler = None,
    namespace: Namespace = None,
    context: Context = None,
    kubeconfig: Kubeconfig = None,
    config: Config = None,
    debug: Debug = False,
    **job: Any,
) -> int:
    """Submit a job; the first line says where it goes. Trainer arguments follow `--`."""
    from ddpk.render import validate_for
    from ddpk.schedulers.base import result

    if validate not in ("client", "server"):
        raise BadInput("--validate", f"{validate!r} is not one of client, server")
    c = common(scheduler, namespace, context, kubeconfig, config)
    spec = validate_for(build_spec(job, namespace, trainer_args, c.config, c.config_path))
    sched = open_scheduler(c, validate)
    plan = sched.dryrun(spec)
    if dry_run:
        typer.echo(f"{spec.name} -> {plan.where} (dry run: nothing is changed)")
        typer.echo(plan.text)
        return 0
    typer.echo(f"{spec.name} -> {plan.where}")
    sched.schedule(plan, replace=replace)
    if not follow:
        say(f"follow it with: ddpk logs -f {spec.name} -s {c.scheduler}")
        return 0
    return follow_job(sched, spec.name, rank=None, since_s=None, tail=None, timestamps=False, result=result)


def follow_job(sched, name: str, rank, since_s, tail, timestamps: bool, result) -> int:
    """Stream the job's logs until it ends, then exit with its result; Ctrl-C is the scheduler's to handle."""
    from ddpk.logs import print_lines

    try:
        print_lines(sched.logs(name, rank=rank, follow=True, since_s=since_s, tail=tail), timestamps=timestamps)
        status = sched.wait(name)
    except KeyboardInterrupt:
        message = sched.interrupted(name)
        if message:
            say(message)
        return EXIT_INTERRUPTED
    say(f"{name}: {status.phase}" + (f" ({status.reason})" if status.reason else ""))
    return result(status)


@app.command()
def status(
    job_name: JobName,
    output: Output = "table",
    scheduler: Scheduler = None,
    namespace: Namespace = None,
    context: Context = None,
    kubeconfig: Kubeconfig = None,
    config: Config = None,
    debug: Debug = False,
) -> None:
    """Phase, per-replica state and restarts, start and finish times, and the last error reason."""
    check_output(output)
    c = common(scheduler, namespace, context, kubeconfig, config)
    st = open_scheduler(c).describe(job_name)
    if output != "table":
        typer.echo(dump(st.to_dict(), output), nl=False)
        return
    lines = [
        f"job:       {st.name} ({st.scheduler})",
        f"phase:     {st.phase}",
        f"started:   {st.start_time or '-'}",
        f"finished:  {st.completion_time or '-'}",
    ]
    if st.reason:
        lines.append(f"reason:    {st.reason}")
    typer.echo("\n".join(lines))
    print_table(
        ["RANK", "STATE", "RESTARTS", "EXIT", "WHERE"],
        [[str(r.index), r.state, str(r.restarts), "-" if r.exit_code is None else str(r.exit_code), r.detail]
         for r in st.replicas],
    )


@app.command()
def logs(
    job_name: JobName,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming until the job ends; exit with its result.")] = False,
    rank: Annotated[Optional[int], typer.Option("--rank", help="Only this replica's lines.")] = None,
    since: Annotated[Optional[str], typer.Option("--since", help="Only lines newer than this (30s, 10m, 1h).")] = None,
    tail: Annotated[Optional[int], typer.Option("--tail", help="Only the last N lines of each rank to start with.")] = None,
    timestamps: Annotated[bool, typer.Option("--timestamps", help="Show each line's timestamp.")] = False,
    scheduler: Scheduler = None,
    namespace: Namespace = None,
    context: Context = None,
    kubeconfig: Kubeconfig = None,
    config: Config = None,
    debug: Debug = False,
) -> int:
    r"""All ranks in one stream, each line prefixed with \[rank i]."""
    from ddpk.logs import parse_duration, print_lines
    from ddpk.schedulers.base import result

    since_s = parse_duration(since, "--since") if since is not None else None
    if tail is not None and tail < 0:
        raise BadInput("--tail", f"must be at least 0, got {tail}")
    c = common(scheduler, namespace, context, kubeconfig, config)
    sched = open_scheduler(c)
    st = sched.describe(job_name)
    if rank is not None and not 0 <= rank < len(st.replicas):
        raise BadInput("--rank", f"{rank} is out of range: job {job_name} has ranks 0..{len(st.replicas) - 1}")
    if follow:
        return follow_job(sched, job_name, rank, since_s, tail, timestamps, result)
    print_lines(sched.logs(job_name, rank=rank, follow=False, since_s=since_s, tail=tail), timestamps=timestamps)
    return 0


@app.command("list")
def list_jobs(
    output: Output = "table",
    scheduler: Scheduler = None,
    namespace: Namespace = None,
    context: Context = None,
    kubeconfig: Kubeconfig = None,
    config: Config = None,
    debug: Debug = False,
) -> None:
    """Jobs ddpk submitted, on the chosen scheduler."""
    check_output(output)
    c = common(scheduler, namespace, context, kubeconfig, config)
    jobs = open_scheduler(c).list()
    if output != "table":
        typer.echo(dump([j.to_dict() for j in jobs], output), nl=False)
        return
    print_table(
        ["NAME", "PHASE", "REPLICAS", "RESTARTS", "STARTED", "REASON"],
        [[j.name, j.phase, str(len(j.replicas)), str(max((r.restarts for r in j.replicas), default=0)),
          j.start_time or "-", j.reason or ""] for j in jobs],
    )


@app.command()
def delete(
    job_name: JobName,
    volumes: Annotated[bool, typer.Option("--volumes", help="docker: remove the job's named checkpoint volume too.")] = False,
    scheduler: Scheduler = None,
    namespace: Namespace = None,
    context: Context = None,
    kubeconfig: Kubeconfig = None,
    config: Config = None,
    debug: Debug = False,
) -> None:
    """Stop the job and remove what it created."""
    c = common(scheduler, namespace, context, kubeconfig, config)
    open_scheduler(c).delete(job_name, volumes=volumes)
    say(f"deleted {job_name}")


@app.command()
def wait(
    job_name: JobName,
    timeout: Annotated[Optional[str], typer.Option("--timeout", help="Give up after this long (90s, 10m); default: never.")] = None,
    scheduler: Scheduler = None,
    namespace: Namespace = None,
    context: Context = None,
    kubeconfig: Kubeconfig = None,
    config: Config = None,
    debug: Debug = False,
) -> int:
    """Exit 0 if the job succeeded, 1 if it failed."""
    from ddpk.logs import parse_duration
    from ddpk.schedulers.base import result

    seconds = parse_duration(timeout, "--timeout") if timeout is not None else None
    c = common(scheduler, namespace, context, kubeconfig, config)
    st = open_scheduler(c).wait(job_name, timeout=seconds)
    say(f"{job_name}: {st.phase}" + (f" ({st.reason})" if st.reason else ""))
    return result(st)


# --- output --------------------------------------------------------------------


def dump(data: Any, output: str) -> str:
    if output == "json":
        return json.dumps(data, indent=2) + "\n"
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_edge=False)
    for h in headers:
        table.add_column(h, overflow="fold")
    for row in rows:
        table.add_row(*row)
    Console(highlight=False, width=200 if not sys.stdout.isatty() else None).print(table)


# --- entry point ---------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Run the CLI and turn every outcome into one exit code and at most one line."""
    args = sys.argv[1:] if argv is None else list(argv)
    own = args[: args.index("--")] if "--" in args else args
    debug = "--debug" in own
    try:
        rv = app(args=args, prog_name="ddpk", standalone_mode=False)
    except DdpkError as exc:
        if debug:
            traceback.print_exc()
        say(f"error: {exc}")
        sys.exit(exc.exit_code)
    except ClickException as exc:
        if debug:
            traceback.print_exc()
        say(f"error: {exc.format_message()}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        say("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    code = rv if isinstance(rv, int) else 0
    if code == EXIT_INTERRUPTED:
        say("interrupted")
    sys.exit(code)


if __name__ == "__main__":
    main()
