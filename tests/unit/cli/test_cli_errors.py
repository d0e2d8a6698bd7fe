"""CLI error paths: one stderr line naming the problem, the right exit code, nothing left behind.

None of these need root: every command here fails before it would touch the system. Where a
command checks for root before validating its options, the root message is asserted instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from support import REPO_ROOT
from typer.testing import CliRunner

from meshrun import __version__
from meshrun.cli import app
from meshrun.core.token import JoinToken
from meshrun.errors import HostError
from meshrun.system.kernel import net

FIX_COPY = "copy the whole token again from the output of `meshrun token create` on the coordinator"


def _has_admin() -> bool:
    try:
        net.require_admin()
        net.require_tools("ip", "wg")
    except HostError:
        return False
    return True


HAS_ADMIN = _has_admin()


@pytest.fixture
def state(tmp_path):
    return tmp_path / "state"


@pytest.fixture
def run(state):
    runner = CliRunner()

    def invoke(*args: str):
        res = runner.invoke(
            app, list(args), env={"MESHRUN_STATE_DIR": str(state), "MESHRUN_DEBUG": ""}, catch_exceptions=False
        )
        return res

    return invoke


def head() -> str:
    """This checkout's commit as `git` says it (+changes when files differ): what `--version` names here."""
    git = ["git", "-C", str(REPO_ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "."]).returncode == 1
    return commit + ("+changes" if dirty else "")


def one_error_line(res) -> str:
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("meshrun: error: ")
    assert "Traceback" not in res.stderr
    return lines[0][len("meshrun: error: ") :]


def valid_token() -> str:
    return JoinToken("lab", ("203.0.113.1:51820",), "ab" * 32, "abcde12345", bytes(32)).encode()


class TestJoin:
    def test_garbage(self, run, state):
        res = run("join", "garbage")
        assert res.exit_code == 1
        assert one_error_line(res) == f"this is not a meshrun join token (it must start with 'mr1.'); {FIX_COPY}"
        assert res.stdout == ""
        assert not state.exists()

    @pytest.mark.parametrize("drop", [1, 2, 7])
    def test_truncated(self, run, state, drop):
        tok = valid_token()
        res = run("join", tok[:-drop])
        assert res.exit_code == 1
        msg = one_error_line(res)
        assert msg in (
            f"the join token is truncated or garbled (its checksum does not match); {FIX_COPY}",
            f"the join token is garbled (it is not valid base64url); {FIX_COPY}",
        )
        assert tok[4:-drop] not in res.stderr  # never echo the token (it carries a secret)
        assert not state.exists()

    def test_wrong_version(self, run, state):
        res = run("join", "mr7.abcdef")
        assert one_error_line(res) == (
            "join token version mr7 is not supported by this meshrun (it reads mr1); "
            "use the same meshrun version on the node as on the coordinator"
        )
        assert not state.exists()

    def test_bad_name(self, run, state):
        res = run("join", valid_token(), "--name", "Bad_Name")
        assert res.exit_code == 2
        assert one_error_line(res) == (
            "--name 'Bad_Name' is not a valid name; use 1-32 lower-case letters, "
            "digits and '-', starting with a letter or digit, e.g. --name gpu-a"
        )
        assert not state.exists()

    @pytest.mark.parametrize("wait", ["0", "-5", "7200"])
    def test_bad_wait(self, run, state, wait):
        res = run("join", valid_token(), "--name", "gpu-a", "--wait", wait)
        assert res.exit_code == 2
        assert one_error_line(res) == (
            f"--wait {float(wait):g} is out of range; give the seconds to wait for the agent, 1 to 3600"
        )
        assert not state.exists()

    @pytest.mark.parametrize("tunnels", ["0", "9"])
    def test_bad_tunnels(self, run, state, tunnels):
        res = run("join", valid_token(), "--name", "gpu-a", "--tunnels", tunnels)
        assert res.exit_code == 2
        assert one_error_line(res) == (
            f"--tunnels {tunnels} is out of range; give 1 (the overlay interface alone) to 8 tunnels per "
            "same-site pair, e.g. --tunnels 4"
        )
        assert not state.exists()

    def test_bad_endpoint(self, run, state):
        res = run("join", valid_token(), "--name", "gpu-a", "--endpoint", "a b")
        assert res.exit_code == 2
        assert one_error_line(res) == (
            "--endpoint 'a b' is not HOST or HOST:PORT (endpoint host 'a b' is not an "
            "address or DNS name); give this node's public address, "
            "e.g. --endpoint 198.51.100.7"
        )
        assert not state.exists()

    @pytest.mark.parametrize("endpoint", ["2001:db8::7", "[2001:db8::7]:51820"])
    def test_ipv6_endpoint_is_refused(self, run, state, endpoint):
        res = run("join", valid_token(), "--name", "gpu-a", "--endpoint", endpoint)
        assert res.exit_code == 2
        assert one_error_line(res) == (
            f"--endpoint {endpoint!r} is an IPv6 address; meshrun's underlay is IPv4 "
            "only; give this machine's public IPv4 address, or a DNS name with an A record"
        )
        assert not state.exists()


class TestToken:
    def test_list_without_state(self, run, state):
        res = run("token", "list")
        assert res.exit_code == 1
        assert one_error_line(res) == f"no meshrun state in {state}; run `meshrun init` first, or pass --state-dir"
        assert not state.exists()

    def test_list_on_a_node(self, run, state):
        state.mkdir()
        (state / "member.json").write_text('{"role": "node"}')
        res = run("token", "list")
        assert (
            one_error_line(res)
            == f"{state} belongs to a node, not the coordinator; run this command on the coordinator"
        )

    def test_list_with_corrupt_state(self, run, state):
        state.mkdir()
        (state / "member.json").write_text('{"role": "coordi')
        res = run("token", "list")
        assert res.exit_code == 1
        msg = one_error_line(res)
        assert msg.startswith(f"{state}/member.json is corrupt (")
        assert (state / "member.json").read_text() == '{"role": "coordi'

    def test_create_bad_ttl_before_state(self, run, state):
        res = run("token", "create", "--ttl", "5y")
        assert res.exit_code == 2
        assert one_error_line(res) == (
            "--ttl '5y' is not a duration between 1s and 30d; write it as a number and "
            "a unit, e.g. --ttl 12h, 30m or 2d"
        )

    def test_create_bad_uses(self, run):
        res = run("token", "create", "--uses", "0")
        assert res.exit_code == 2
        assert one_error_line(res) == "--uses 0 must be at least 1; leave it out for unlimited uses until expiry"

    def test_revoke_garbled_token(self, run, state):
        res = run("token", "revoke", valid_token()[:-3] + "AAA")
        assert res.exit_code == 1
        assert one_error_line(res).startswith("the join token is")
        assert not state.exists()


class TestInit:
    @pytest.mark.parametrize(
        "args,message",
        [
            (
                ["--cidr", "10.0.0.0/33"],
                "--cidr '10.0.0.0/33' is not a network address ('10.0.0.0/33' does not appear "
                "to be an IPv4 or IPv6 network); give the network's first address and a prefix, "
                "e.g. --cidr 10.213.0.0/16",
            ),
            (
                ["--cidr", "8.8.8.0/24"],
                "--cidr '8.8.8.0/24' is not a private range; pick a range from 10.0.0.0/8, "
                "172.16.0.0/12 or 192.168.0.0/16, e.g. 10.213.0.0/16",
            ),
            (
                ["--mtu", "100"],
                "--mtu 100 is outside 1280..9000; use 1420 for a 1500-byte underlay, 1280 for the smallest paths",
            ),
            (
                ["--interface", "a-name-far-too-long"],
                "--interface 'a-name-far-too-long' is not a valid interface name; "
                "use 1-15 letters, digits or -_.=+, e.g. --interface meshrun0",
            ),
            (
                ["--ttl", "5y"],
                "--ttl '5y' is not a duration between 1s and 30d; write it as a number and a unit, "
                "e.g. --ttl 12h, 30m or 2d",
            ),
            (["--port", "0"], "--port 0 is not a usable port; pick 1-65534, e.g. --port 51820"),
            (
                ["--name", "HQ_1"],
                "--name 'HQ_1' is not a valid name; use 1-32 lower-case letters, digits and '-', starting with a "
                "letter or digit, e.g. --name gpu-a",
            ),
            (
                ["--endpoint", "[2001:db8::1]:51820"],
                "--endpoint '[2001:db8::1]:51820' is an IPv6 address; meshrun's "
                "underlay is IPv4 only; give this machine's public IPv4 address, "
                "or a DNS name with an A record",
            ),
            (
                ["--network", "Bad"],
                "--network 'Bad' is not a valid name; use 1-32 lower-case letters, digits and '-', "
                "starting with a letter or digit, e.g. --network gpu-a",
            ),
            (["--uses", "0"], "--uses 0 must be at least 1; leave it out for unlimited uses until expiry"),
        ],
    )
    def test_usage_errors(self, run, state, args, message):
        res = run("init", "--endpoint", "203.0.113.1", *args)
        msg = one_error_line(res)
        if HAS_ADMIN:
            assert (res.exit_code, msg) == (2, message)
        else:  # the root/tool check runs first
            assert res.exit_code == 1 and ("needs root" in msg or "is not installed" in msg), msg
        assert not state.exists()

    def test_existing_state(self, run, state):
        state.mkdir()
        (state / "member.json").write_text('{"role": "node"}')
        res = run("init", "--endpoint", "203.0.113.1")
        assert res.exit_code == 1
        assert one_error_line(res) == (
            f"{state} already holds a meshrun node; start it with `meshrun up`, or remove "
            "it with `meshrun down --purge` first"
        )


class TestOtherCommands:
    @pytest.mark.parametrize("args", [["status"], ["up"], ["remove", "gpu-a"]])
    def test_no_state(self, run, state, args):
        res = run(*args)
        assert res.exit_code == 1
        msg = one_error_line(res)
        assert str(state) in msg
        assert not state.exists()

    def test_unknown_option_is_click_usage_error(self, run):
        res = run("init", "--no-such-option")
        assert res.exit_code == 2
        assert "No such option: --no-such-option" in res.stderr

    @pytest.mark.parametrize("since", ["yesterday", "0s", "31d"])
    def test_logs_since_names_the_bad_duration_before_reading_anything(self, run, state, since):
        res = run("logs", "some-job", "--since", since)
        assert res.exit_code != 0
        msg = one_error_line(res)
        assert f"--since {since!r}" in msg and "e.g. --since 12h" in msg
        assert not state.exists()

    def test_logs_tail_is_not_negative(self, run):
        res = run("logs", "some-job", "--tail", "-1")
        assert res.exit_code == 2 and "'--tail'" in res.stderr and "greater than or equal to 0" in res.stderr

    def test_version(self, run):
        res = run("--version")
        assert (res.exit_code, res.stdout, res.stderr) == (0, f"meshrun {__version__} (commit {head()})\n", "")

    def test_the_shell_completes_commands_and_options(self, tmp_path):
        """Completion is on (`meshrun --install-completion`): what bash asks of the installed command."""
        exe = Path(sys.executable).with_name("meshrun")

        def complete(words: str) -> list[str]:
            env = {**os.environ, "_MESHRUN_COMPLETE": "complete_bash", "COMP_WORDS": words}
            env["COMP_CWORD"] = str(len(words.split()) - 1)
            return subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60).stdout.split()

        assert "logs" in complete("meshrun lo") and "--tail" in complete("meshrun logs JOB --ta")
        script = subprocess.run(
            [str(exe), "--show-completion", "bash"], capture_output=True, text=True, timeout=60, env=dict(os.environ)
        ).stdout
        assert "_MESHRUN_COMPLETE=complete_bash" in script

    def test_version_via_python_m(self, tmp_path):
        res = subprocess.run(
            [sys.executable, "-m", "meshrun", "--version"],
            capture_output=True,
            text=True,
            env={**os.environ, "MESHRUN_STATE_DIR": str(tmp_path / "s")},
            timeout=60,
        )
        assert (res.returncode, res.stdout, res.stderr) == (0, f"meshrun {__version__} (commit {head()})\n", "")

    def test_join_garbage_via_python_m(self, tmp_path):
        res = subprocess.run(
            [sys.executable, "-m", "meshrun", "join", "hello"],
            capture_output=True,
            text=True,
            env={**os.environ, "MESHRUN_STATE_DIR": str(tmp_path / "s")},
            timeout=60,
        )
        assert res.returncode == 1 and res.stdout == ""
        assert res.stderr == (
            f"meshrun: error: this is not a meshrun join token (it must start with 'mr1.'); {FIX_COPY}\n"
        )
        assert not (tmp_path / "s").exists()


def _commands():
    root = typer.main.get_command(app)
    out = []

    def walk(group, path):
        for name, cmd in sorted(group.commands.items()):
            if hasattr(cmd, "commands"):  # a group (typer may not use click's own class)
                walk(cmd, path + [name])
            elif not cmd.hidden:
                out.append(path + [name])

    walk(root, [])
    return out


COMMANDS = _commands()


def test_command_tree_is_what_we_expect():
    names = {" ".join(c) for c in COMMANDS}
    assert {
        "init",
        "join",
        "status",
        "leave",
        "down",
        "up",
        "remove",
        "train",
        "token create",
        "token list",
        "token revoke",
    } <= names


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_help_has_an_example(run, cmd):
    res = run(*cmd, "--help")
    assert res.exit_code == 0, res.stderr
    assert "Example" in res.stdout
    assert f"meshrun {' '.join(cmd)}" in res.stdout  # the example shows the command itself
