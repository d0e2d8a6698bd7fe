"""What `meshrun train` turns its options into: a job spec to submit, a dry-run plan, or a local share.

The job itself is run by its supervisor on the coordinator (meshrun.jobs.supervisor); this module
only builds and checks what the command line hands it, and plans `--local` shares (for batch
schedulers that start every node themselves).
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from meshrun.core import codeset, launch, preflight, presets
from meshrun.core.jobspec import JobSpec, check_job_id
from meshrun.core.model import Network
from meshrun.errors import LaunchError, StateError, UsageError
from meshrun.jobs.planning import ask_health, candidates, check_environments, code_dir, placements, plan
from meshrun.mesh import member
from meshrun.mesh.coordinator import admin
from meshrun.system.files import archive, joblogs
from meshrun.system.files.projects import check_project
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine import host, procs

# The latest `meshrun bench` result (its --json, plus "measured_at"), kept in the coordinator's state
# directory by meshrun.bench.run; `--compression auto` chooses from it.
BENCH_RESULT = "bench-latest.json"


def job_spec(options: dict, cwd: Path) -> JobSpec:
    """The job spec to submit from `meshrun train`'s merged options (JobSpec's field names; a key that is
    absent or None takes JobSpec's default, keys that are not JobSpec fields, such as dry_run, are
    ignored): the caller's NCCL_/GLOO_/TORCH_ variables under --env, a fresh job id unless one was given,
    the project named after the code's directory unless one was given. UsageError for a bad value, and for
    an interface pin (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) this shell sets but the job does not ask for
    (options["use_shell_ifname"] allows it)."""
    fields = {k: v for k, v in options.items() if k in JobSpec.__dataclass_fields__ and v is not None}
    if not fields.get("script"):
        raise UsageError("no training script given", "e.g. meshrun train train.py")
    fields["job_id"] = fields.get("job_id") or new_job_id(fields["script"])
    fields["env"] = user_env(fields.get("env") or {}, bool(options.get("use_shell_ifname")))
    fields["script_args"] = list(fields.get("script_args") or [])
    fields["cwd"] = str(cwd)
    if fields.get("project"):
        check_project(fields["project"])
    if fields.get("workers") is not None and fields["workers"] not in launch.WORKER_KINDS:
        raise UsageError(
            f"--workers {fields['workers']!r} is not one of {', '.join(launch.WORKER_KINDS)}",
            "use --workers warm (the default) or --workers cold",
        )
    if fields.get("compression") is not None:
        presets.check_choice(fields["compression"])
    if fields.get("model_size") is not None:
        fields["model_size"] = presets.parse_model_size(fields["model_size"])
    step = fields.get("step_time")
    if step is not None and not (isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0):
        raise UsageError(f"--step-time {step!r} is not a positive number of seconds", "e.g. --step-time 0.8")
    spec = JobSpec(**fields)
    if not spec.project:
        where = Path(cwd) if spec.no_sync or spec.module else (Path(cwd) / spec.script).parent
        spec.project = codeset.project_name(where.absolute().name)
    return spec


def user_env(extra: dict[str, str], allow_pins: bool = False) -> dict[str, str]:
    """The caller's NCCL_*/GLOO_*/TORCH_* variables plus `extra` (--env, the job file): they override meshrun's
    defaults. UsageError for an interface pin from the shell alone, unless `allow_pins` (see launch.shell_env)."""
    report = launch.shell_env(os.environ, extra, allow_pins)
    if report.refused:
        k = report.refused[0]
        raise UsageError(
            f"this shell sets {k}={os.environ[k]}, which would pin every worker off the overlay (meshrun pins "
            f"{k} to its interface; a profile left from single-VPC work brings back the cross-datacenter hang)",
            f"unset {k}; or, on purpose, --env {k}={os.environ[k]} (or --use-shell-ifname)",
        )
    return {**report.forwarded, **extra}


def shell_notice(options: dict) -> str:
    """What the caller's shell passes to every worker, for the terminal before the job starts ("" if nothing)."""
    return launch.shell_env(os.environ, options.get("env") or {}, bool(options.get("use_shell_ifname"))).notice()


def parse_env_pairs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k or not k.replace("_", "a").isalnum():
            raise UsageError(f"--env {p!r} is not KEY=VALUE", "e.g. --env NCCL_DEBUG=INFO")
        out[k] = v
    return out


def new_job_id(script: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(script).stem)[:24] or "job"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def resumed(state: StateDir, job_id: str) -> tuple[dict, Path]:
    """`meshrun train --resume JOB`: JOB's options as JobSpec fields (its project included, so the
    new job runs where JOB left its checkpoints) and the directory JOB was submitted from."""
    d = joblogs.job_dir(state, check_job_id(job_id)).path
    if not (d / "spec.json").exists():
        raise UsageError(
            f"there is no job {job_id!r} on this coordinator to resume", "see the jobs with `meshrun jobs`"
        )
    old = JobSpec.from_dict(StateDir(d).read_json("spec.json"))
    fields = {
        k: getattr(old, k)
        for k in (
            "script",
            "script_args",
            "nnodes",
            "nproc_per_node",
            "max_restarts",
            "nodes",
            "wait_timeout",
            "no_sync",
            "sync_limit_mb",
            "python",
            "module",
            "rdzv_timeout",
            "with_coordinator",
            "skip_preflight",
            "site_fabric",
            "compression",
            "model_size",
            "step_time",
            "mixed_accelerators",
            "workers",
        )
    }
    fields["env"] = dict(old.env)
    fields["project"] = old.project or old.job_id
    fields["run_id"] = old.run_id or old.job_id  # a resume of a resume continues the same run
    return fields, Path(old.cwd)


def measured_link(state: StateDir) -> presets.Link | None:
    """The cross-site bandwidth of the latest `meshrun bench` on this member (BENCH_RESULT), or None."""
    if not (state / BENCH_RESULT).exists():
        return None
    try:
        return presets.link_from_bench(state.read_json(BENCH_RESULT))
    except StateError:
        return None  # unreadable: as if there were none, and auto says so


def choose_compression(state: StateDir, spec: JobSpec, workers: int) -> presets.Choice | None:
    """Decide `spec.compression` (None: nothing asked) for `workers` DiLoCo workers and record it in
    `spec.preset`; `auto` reads the latest `meshrun bench` result kept in `state`."""
    if spec.compression is None:
        spec.preset = None
        return None
    link = measured_link(state) if spec.compression == "auto" else None
    choice = presets.decide(spec.compression, link, spec.model_size, workers, spec.step_time)
    spec.preset = choice.to_dict()
    return choice


def check(state: StateDir, spec: JobSpec) -> tuple[Network, list]:
    """Validate a job against this network before it is submitted: the nodes it names exist, there
    is one at least, the code is there to ship and within --sync-limit. Returns the network and the
    candidate shares."""
    network, members = admin.members(state)
    rec, _ = member.load(state)
    shares = candidates(state, spec, network, members, rec)
    if not shares:
        raise LaunchError("no node has joined this network yet", "run `meshrun join TOKEN` on the GPU machines")
    if not spec.no_sync:
        sel = archive.select_files(code_dir(spec), exclude=[state.path])
        if sel.bytes > spec.sync_limit_mb * 1024 * 1024:
            archive.pack(sel, spec.sync_limit_mb)  # raises the error naming the largest entries
    return network, shares


def dry_run(state: StateDir, spec: JobSpec) -> list[str]:
    """What every node would run, as shell lines, after the pre-flight table of the nodes that answer.

    The nodes are asked for their GPUs, interpreter and environment (nothing is shipped or started);
    a node that does not answer is planned with 0 GPUs and python3.
    """
    network, shares = check(state, spec)
    sites = placements(shares, admin.sites(state))
    _, hi = spec.bounds(len(shares))
    shares = shares[:hi]
    with ThreadPoolExecutor(max_workers=len(shares)) as pool:
        healths = dict(zip((s.name for s in shares), pool.map(ask_health, shares)))
    answering = [s for s in shares if healths[s.name] is not None]
    lines = []
    if not spec.no_sync:
        sel = archive.select_files(code_dir(spec), exclude=[state.path])
        lines += ["# code", *(f"#   {line}" for line in sel.summary(spec.sync_limit_mb))]
        if sel.bytes > spec.sync_limit_mb * 1024 * 1024:
            lines.append(f"#   over --sync-limit {spec.sync_limit_mb} MiB: the job would be refused")
    lines.append(
        f"# runs in project {spec.project!r}: <state>/projects/{spec.project}/work on every node "
        "($MESHRUN_OUTPUT_DIR, kept for the next job of the project)"
    )
    choice = choose_compression(state, spec, len(shares))
    if choice is not None:
        lines.append(f"# {choice.line()}")
    if not spec.skip_preflight and answering:
        # Nothing is shipped by a dry run: only --no-sync's copies can be compared.
        reports, here = check_environments(spec, answering, healths, spec.job_id, spec.project)
        findings = preflight.compare(
            reports,
            codeset.digest(here) if here is not None else None,
            spec.nproc_per_node is None,
            reference_files=here,
            mixed_accelerators=spec.mixed_accelerators,
        )
        lines += ["# pre-flight", *(f"#   {line}" for line in preflight.table(reports, findings))]
    lines.append(
        f"# the job's rendezvous store listens on {network.coordinator_ip}, on the first free port from "
        f"{network.rdzv_port + 1}"
    )
    workdir = spec.cwd if spec.no_sync else f"<state>/projects/{spec.project}/work"
    ready = [(s.name, s.overlay_ip, healths[s.name] or {}) for s in shares]
    for p in plan(spec, network, ready, network.rdzv_port + 1, sites=sites):
        lines += [f"# {p.node}", f"cd {workdir} && {p.shell()}"]
    return lines


def local_launch(state: StateDir, spec: JobSpec) -> launch.NodeLaunch:
    """`meshrun train --local`: this node's torchrun command (every other node runs the same; they meet at
    the coordinator's store for --local shares, `meshrun local-store start`). Its workers get
    ``MESHRUN_SITE`` when the node joined with ``--site`` and no other site variable (see docs/howto/sites.md)."""
    rec, network = member.load(state)
    if not spec.nnodes:
        raise UsageError(
            "--local needs --nnodes: how many nodes take part in total",
            "e.g. meshrun train --local --nnodes 2 --job-id exp7 train.py",
        )
    opts = spec.launch_options(network, network.rdzv_port, shipped=False)
    opts = replace(opts, python=spec.python or sys.executable)
    me = launch.NodeInfo(rec["name"], rec["overlay_ip"], host.visible_gpus())
    (p,) = launch.plan([me], opts, spec.env, local=True)
    site = str(rec.get("site") or "")
    if site and "MESHRUN_SITE" not in p.env:
        # A --local share sees no other node: the site it joined with is all it knows (no rank, count, address).
        p = launch.NodeLaunch(p.node, p.argv, {**p.env, "MESHRUN_SITE": site})
    return p


def local_job_id(given: str | None) -> str:
    """The job id of a --local share: --job-id, else $MESHRUN_JOB_ID or $SLURM_JOB_ID (the same on every node)."""
    job_id = given or os.environ.get("MESHRUN_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise UsageError(
            "--local needs --job-id, the same on every node (or MESHRUN_JOB_ID / SLURM_JOB_ID set)",
            "e.g. meshrun train --local --nnodes 2 --job-id exp7 train.py",
        )
    return job_id


def exec_local(p: launch.NodeLaunch) -> None:
    """Become this node's torchrun (it owns signals and exit codes from here)."""
    procs.exec_replace(p.argv, p.env)
