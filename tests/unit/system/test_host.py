"""meshrun.system.machine.host: the interpreter probe's report, shared by the machine's meshrun processes.

The probe imports torch (1-3 CPU-s); every agent ran it when it started. A fake interpreter (a shell script that
counts its runs and prints a report) stands in for Python here, so what is counted is how often it is asked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshrun.system.machine import host

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the shared report is written by root only (agents)")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """(a fake interpreter, its run counter, its torch directory, the shared cache directory)."""
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    runs = tmp_path / "runs"
    report = {"python": "fake", "torch": "9.9", "gpus": 0, "torch_dir": str(torch_dir)}
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\necho run >> {runs}\necho '{json.dumps(report)}'\n")
    py.chmod(0o755)
    monkeypatch.setattr(host, "_cache", {})
    monkeypatch.delenv("PYTHONPATH", raising=False)
    return str(py), runs, torch_dir, tmp_path / "cache"


def asked(runs: Path) -> int:
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def fresh_process(monkeypatch) -> None:
    """What another meshrun process has: nothing kept in memory."""
    monkeypatch.setattr(host, "_cache", {})


def test_a_second_process_reads_the_report_the_first_one_probed(fake, monkeypatch):
    py, runs, _, cache = fake
    first = host.environment(py, shared=cache)
    assert first["torch"] == "9.9" and asked(runs) == 1
    (kept,) = cache.iterdir()
    assert kept.stat().st_mode & 0o777 == 0o644 and cache.stat().st_mode & 0o777 == 0o755
    fresh_process(monkeypatch)
    assert host.environment(py, shared=cache) == first and asked(runs) == 1


def test_a_changed_torch_an_untrusted_file_or_another_pythonpath_probes_again(fake, monkeypatch):
    py, runs, torch_dir, cache = fake
    host.environment(py, shared=cache)
    fresh_process(monkeypatch)
    os.utime(torch_dir, ns=(1, 1))  # torch reinstalled
    host.environment(py, shared=cache)
    assert asked(runs) == 2
    (kept,) = cache.iterdir()
    kept.chmod(0o666)  # anyone could have written it: not believed
    fresh_process(monkeypatch)
    host.environment(py, shared=cache)
    assert asked(runs) == 3
    fresh_process(monkeypatch)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")  # another torch may be imported
    host.environment(py, shared=cache)
    assert asked(runs) == 4 and len(list(cache.iterdir())) == 2


def test_an_interpreter_without_torch_or_a_failing_one_is_not_shared(fake, monkeypatch, tmp_path):
    py, runs, _, cache = fake
    plain = tmp_path / "plain"
    plain.write_text('#!/bin/sh\necho \'{"python": "plain", "torch": null}\'\n')
    plain.chmod(0o755)
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'no torch here' >&2\nexit 1\n")
    broken.chmod(0o755)
    assert host.environment(str(plain), shared=cache)["torch"] is None
    assert "no torch here" in host.environment(str(broken), shared=cache)["error"]
    assert not cache.exists() or not list(cache.iterdir())
