"""What this machine offers: its GPUs, its Python and torch, its free disk, its kernel's WireGuard."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
from pathlib import Path

from meshrun.errors import MeshrunError
from meshrun.system.files.statedir import atomic_write
from meshrun.system.machine import procs


def visible_gpus() -> int:
    """Number of CUDA devices a worker on this node would see (0 without a GPU)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = procs.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, procs.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


# What the interpreter that will run a job has; printed as JSON by that interpreter itself. Reading
# torch's version from its metadata costs nothing; the build, backends and GPUs need `import torch`
# (a second or two), so the result is cached per interpreter and torch installation.
PROBE = r"""
import json, os, platform, sys
out = {"python": sys.executable, "python_version": platform.python_version(), "torch": None}
try:
    from importlib.metadata import version
    out["torch"] = version("torch")
except Exception:
    pass
if out["torch"]:
    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    out.update(torch=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
               gloo=bool(dist.is_available() and dist.is_gloo_available()),
               gpus=torch.cuda.device_count() if cuda else 0, torch_dir=os.path.dirname(torch.__file__))
    out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
    if cuda and dist.is_nccl_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
print(json.dumps(out))
"""
_cache: dict[str, tuple[tuple, dict]] = {}
# Reports shared by every meshrun process of this machine, as root: the probe's torch import (1-3 CPU-s) is paid
# once per boot, interpreter, torch installation and GPU visibility, not by every agent that starts or restarts.
# Under /run: gone at reboot, when GPUs and drivers may have changed.
SHARED_CACHE = Path("/run/meshrun/host-probe")
# The variables that change which torch an interpreter imports, or which GPUs it sees (and so its report).
REPORT_ENV = ("PYTHONPATH", "PYTHONHOME", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _stamp(report: dict) -> tuple:
    """What invalidates a cached report: the interpreter or the torch installation changed."""
    stamp = []
    for path in (report.get("python"), report.get("torch_dir")):
        try:
            stamp.append(os.stat(path).st_mtime_ns if path else 0)
        except OSError:
            stamp.append(-1)
    return tuple(stamp)


def _shared_path(python: str, cache: Path) -> Path:
    """Where the shared report of `python`, as this process's environment and this boot see it, is kept."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    key = json.dumps([python, boot, [os.environ.get(v) for v in REPORT_ENV]])
    return cache / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read_shared(path: Path) -> dict | None:
    """The report kept at `path`, if this user wrote it, nobody else could, and it still describes the
    interpreter and torch installation (`_stamp`); None otherwise."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                return None
            kept = json.loads(f.read())
        report = kept["report"]
        return report if isinstance(report, dict) and list(kept["stamp"]) == list(_stamp(report)) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_shared(path: Path, report: dict) -> None:
    """Keep `report` at `path` for the other meshrun processes of this machine (root only: they run as root).
    Only a report of an interpreter with torch: without, nothing would notice torch being installed later (and
    that probe imports nothing)."""
    if os.geteuid() != 0 or not report.get("torch_dir"):
        return
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        st = path.parent.stat()
        if st.st_uid != 0 or st.st_mode & 0o022:
            return  # a directory somebody else could write to: nothing is shared through it
        atomic_write(path, json.dumps({"stamp": list(_stamp(report)), "report": report}), mode=0o644)
    except (OSError, MeshrunError):
        pass  # only a cache: the next process probes again


def environment(python: str, timeout: float = 60, shared: Path | None = SHARED_CACHE) -> dict:
    """The interpreter's Python, torch (version, build, NCCL, gloo) and GPUs, as EnvReport fields.

    Kept in this process, and under `shared` for every meshrun process of the machine (None: not shared), while
    the interpreter and its torch are unchanged. On failure the report holds an "error" (the interpreter cannot
    run, or the probe broke); an error is not kept.
    """
    cached = _cache.get(python)
    if cached is not None and cached[0] == _stamp(cached[1]):
        return dict(cached[1])
    path = _shared_path(python, shared) if shared is not None else None
    report = _read_shared(path) if path is not None else None
    if report is not None:
        _cache[python] = (_stamp(report), report)
        return dict(report)
    try:
        res = procs.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, procs.TimeoutExpired) as exc:
        return {"python": python, "error": str(exc)}
    if res.returncode != 0:
        return {"python": python, "error": (res.stderr.strip().splitlines() or ["exit " + str(res.returncode)])[-1]}
    try:
        report = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"python": python, "error": "the probe printed no report"}
    _cache[python] = (_stamp(report), report)
    if path is not None:
        _write_shared(path, report)
    return dict(report)


def free_bytes(path: Path) -> int | None:
    """Free space for an unprivileged writer where `path` lives (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def kernel_wireguard() -> bool | None:
    """Whether this kernel has WireGuard (loaded, built in, or a module on disk); None if it cannot tell."""
    if Path("/sys/module/wireguard").exists():
        return True
    release = os.uname().release
    if not (Path("/lib/modules") / release).is_dir():
        return False  # no modules for this kernel, and a built-in WireGuard would show in /sys/module
    found = None
    for name in ("modules.builtin", "modules.dep"):
        try:
            text = (Path("/lib/modules") / release / name).read_text(errors="replace")
        except OSError:
            continue
        found = bool(found) or "/wireguard.ko" in text
    return found


def data_bytes() -> int:
    """This process's data segment as the kernel counts it for RLIMIT_DATA (VmData), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


def cap_data(extra: int) -> None:
    """Let this process's data grow by at most `extra` bytes from now on (RLIMIT_DATA): past it,
    allocations fail (a C++ server answers std::bad_alloc for that request) instead of the machine
    running out of memory."""
    limit = data_bytes() + extra
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def proc_cgroups() -> str:
    """The kernel's cgroup controllers and the hierarchy each is bound to (/proc/cgroups); "" where unreadable."""
    try:
        return Path("/proc/cgroups").read_text()
    except OSError:
        return ""
