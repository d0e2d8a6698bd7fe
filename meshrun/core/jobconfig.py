"""Job files for `meshrun train --config job.toml` (see configs/job.example.toml).

A job file holds the same settings as `meshrun train`'s options, under their long names with
underscores (`nproc_per_node`, `max_restarts`, ...) plus `script`, `args` and an `[env]` table.
Options given on the command line win over the file; `--env` pairs are merged over the file's
`[env]`; a script given on the command line replaces the file's script and its `args`.
Pure: the caller reads the file (meshrun.system.files.statedir.read_user_file).
"""

from __future__ import annotations

import sys
from typing import Any

from meshrun.core import presets
from meshrun.core.launch import WORKER_KINDS
from meshrun.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# key -> (JobSpec field, check, what the value must be, an example)
KEYS: dict[str, tuple[str, Any, str, str]] = {
    "script": ("script", lambda v: isinstance(v, str) and v != "", "a non-empty string", 'script = "train.py"'),
    "args": ("script_args", _str_list, "a list of strings", 'args = ["--epochs", "3"]'),
    "module": ("module", lambda v: isinstance(v, bool), "true or false", "module = false"),
    "nnodes": ("nnodes", lambda v: isinstance(v, str) or _is_int(v), 'a number or "MIN:MAX"', 'nnodes = "2:4"'),
    "nproc_per_node": ("nproc_per_node", _is_int, "an integer", "nproc_per_node = 1"),
    "max_restarts": ("max_restarts", _is_int, "an integer", "max_restarts = 1"),
    "rdzv_timeout": ("rdzv_timeout", _is_int, "an integer (seconds)", "rdzv_timeout = 900"),
    "nodes": ("nodes", _str_list, "a list of node names", 'nodes = ["gpu-a", "gpu-b"]'),
    "python": ("python", lambda v: isinstance(v, str) and v != "", "a non-empty string", 'python = "python3"'),
    "timeout": (
        "wait_timeout",
        lambda v: (_is_int(v) or isinstance(v, float)) and v > 0,
        "a positive number (seconds)",
        "timeout = 120",
    ),
    "no_sync": ("no_sync", lambda v: isinstance(v, bool), "true or false", "no_sync = false"),
    "with_coordinator": ("with_coordinator", lambda v: isinstance(v, bool), "true or false", "with_coordinator = true"),
    "site_fabric": ("site_fabric", lambda v: isinstance(v, bool), "true or false", "site_fabric = true"),
    "compression": (
        "compression",
        lambda v: v in presets.CHOICES,
        f"one of {', '.join(repr(c) for c in presets.CHOICES)}",
        'compression = "auto"',
    ),
    "model_size": (
        "model_size",
        lambda v: (isinstance(v, str) and v != "") or (_is_int(v) and v > 0),
        'a parameter count (1300000000, or "1.3B", "350M")',
        'model_size = "1.3B"',
    ),
    "step_time": (
        "step_time",
        lambda v: (_is_int(v) or isinstance(v, float)) and v > 0,
        "a positive number (seconds per inner step)",
        "step_time = 0.8",
    ),
    "mixed_accelerators": (
        "mixed_accelerators",
        lambda v: isinstance(v, bool),
        "true or false",
        "mixed_accelerators = true",
    ),
    "workers": (
        "workers",
        lambda v: v in WORKER_KINDS,
        f"one of {', '.join(repr(k) for k in WORKER_KINDS)}",
        'workers = "cold"',
    ),
    "sync_limit": ("sync_limit_mb", _is_int, "an integer (MiB)", "sync_limit = 50"),
    "job_id": ("job_id", lambda v: isinstance(v, str) and v != "", "a non-empty string", 'job_id = "exp7"'),
    "project": ("project", lambda v: isinstance(v, str) and v != "", "a non-empty string", 'project = "charlm"'),
    "env": (
        "env",
        lambda v: isinstance(v, dict)
        and all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v.values()),
        'a table of NAME = "value"',
        'NCCL_DEBUG = "WARN" under [env]',
    ),
}


FLAGS = (
    "no_sync",
    "dry_run",
    "module",
    "with_coordinator",
    "detach",
    "skip_preflight",
    "site_fabric",
    "mixed_accelerators",
)


def _shown(value: Any) -> str:
    """A value as TOML spells it (true, not Python's True)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def parse(text: str, source: str = "job file") -> dict[str, Any]:
    """JobSpec fields (meshrun.core.jobspec) from a job file's text; UsageError naming the bad key or value."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(
            f"{source} is not valid TOML: {exc}", "fix the syntax (see configs/job.example.toml)"
        ) from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in KEYS:
            raise UsageError(f"{source}: unknown key {key!r}", f"use one of: {', '.join(KEYS)}")
        field, ok, must, example = KEYS[key]
        if not ok(value):
            raise UsageError(f"{source}: {key} = {_shown(value)} must be {must}", f"e.g. {example}")
        if key == "nnodes":
            value = str(value)
        elif key == "env":
            value = {str(k): str(v) for k, v in value.items()}
        elif key in ("args", "nodes"):
            value = list(value)
        elif key == "model_size":
            value = presets.parse_model_size(value)
        out[field] = value
    return out


def merge(from_file: dict[str, Any], cli: dict[str, Any]) -> dict[str, Any]:
    """The command line's values (None = not given) over the file's; a CLI script brings its own args."""
    out = dict(from_file)
    if cli.get("script") is not None:
        out.pop("script_args", None)
    for key, value in cli.items():
        if key == "env":
            out["env"] = {**from_file.get("env", {}), **(value or {})}
        elif key in FLAGS:  # on if either turns them on
            out[key] = bool(value) or bool(from_file.get(key))
        elif value is not None:
            out[key] = value
    if not out.get("script"):
        raise UsageError("no training script given", 'pass SCRIPT, or set script = "..." in the --config job file')
    if out["script"].startswith("-"):
        raise UsageError(
            f"unknown option {out['script']!r}", "meshrun's options come before the script (see `meshrun train --help`)"
        )
    return out
