"""The docs cannot go stale unnoticed: the CLI reference, the commands they name, the job file example, the links.

- docs/cli.md is what `python -m meshrun.cli.reference` writes (the commands' own `--help`);
- every `meshrun COMMAND [SUBCOMMAND] --option` that README.md, SECURITY.md, docs/**/*.md (code blocks and
  inline code), configs/** and examples/** (inline code, indented command lines, systemd's ExecStart) name is
  a command of the click tree with options that command has. `meshrun train`'s arguments after the script
  are the script's (train does not read options after its first argument), and so are not checked;
- every key of configs/job.example.toml, its commented-out ones and the "Other keys" it lists, is one the job
  file parser (meshrun.core.jobconfig) accepts, and the file parses with its examples switched on;
- every relative Markdown link in README.md, SECURITY.md and docs/ points at a file that exists, and a
  `#fragment` at a heading of that file.

Each checker is a function of text, so the tests below can feed it made-up stale text and see it fail.
"""

from __future__ import annotations

import bisect
import re
from functools import cache
from pathlib import Path

import pytest
from support import REPO_ROOT

from meshrun.cli import reference
from meshrun.core import jobconfig

MARKDOWN = [REPO_ROOT / "README.md", REPO_ROOT / "SECURITY.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
OTHER = [
    p
    for top in ("configs", "examples")
    for p in sorted((REPO_ROOT / top).rglob("*"))
    if p.is_file()
    and p.suffix in (".py", ".toml", ".env", ".service", ".sh", ".md", ".txt")
    and "data" not in p.relative_to(REPO_ROOT).parts  # examples/data: a corpus, not docs
]
JOB_EXAMPLE = REPO_ROOT / "configs" / "job.example.toml"

# `meshrun` where a command starts (a line's start, after a pipe, `;`, `&&`, `(` or a backtick, or at a
# comment's start, `# or: meshrun ...`), after a prompt, sudo, VAR=value or `ssh HOST`; not meshrun0, meshrun.x,
# meshrun-agent, `meshrun:` (its own output) or prose that mentions meshrun mid-sentence.
INVOCATION = re.compile(
    r"(?:^|[|;(`]|&&|\$\(|#(?:\s*[\w-]+:)?)"
    r"\s*(?:\$\s+)?(?:sudo\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:ssh\s+\S+\s+)?"
    r"(?:[\w.~/-]*/)?meshrun(?=[ \t]+\S)"
)
SHELL_END = re.compile(r"\s#|[|;<>)`]|&&")  # where a command line's own words end
COMMAND_WORD = re.compile(r"[a-z][a-z0-9-]*")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
CODE_LANGUAGES_SKIPPED = {"python", "py", "toml", "json"}  # `from meshrun import x` is no command


# --- the click tree -------------------------------------------------------------------------------


@cache
def tree() -> dict[tuple[str, ...], tuple[object, dict[str, object]]]:
    """{("coordinator", "add"): (click command, {every option string: its click parameter})}, hidden ones too."""
    out = {}
    for path, cmd, ctx in reference.commands(hidden=True):
        opts = {o: p for p in cmd.get_params(ctx) for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
        out[path[1:]] = (cmd, opts)
    return out


def _takes_value(param) -> bool:
    return param.param_type_name == "option" and not param.is_flag and not getattr(param, "count", False)


def check_invocation(words: list[str]) -> list[str]:
    """What is wrong with `meshrun WORDS...` (the words after `meshrun`, up to the end of the command)."""
    path: tuple[str, ...] = ()
    cmd, opts = tree()[path]
    i = 0
    while i < len(words):
        word = words[i].strip("[]{}")
        i += 1
        if not word:
            continue
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            if name not in opts:
                where = "meshrun " + " ".join(path) if path else "meshrun"
                return [f"`{where}` has no option {name}"]
            if _takes_value(opts[name]) and "=" not in word:
                i += 1  # its value
            continue
        if getattr(cmd, "commands", None) is not None:  # a group: the word names a subcommand
            m = COMMAND_WORD.match(word)
            if not m:
                return []  # a placeholder (COMMAND, [OPTIONS]) or prose: nothing more to check
            if path + (m.group(0),) not in tree():
                return [f"`meshrun {' '.join((*path, m.group(0)))}` is no command"]
            path += (m.group(0),)
            cmd, opts = tree()[path]
            if m.group(0) != word:  # `meshrun train's`, `meshrun doctor:`: prose follows
                return []
            continue
        # A positional argument. Where options after it are not the command's (`train SCRIPT ARGS...`), stop.
        if not cmd.context_settings.get("allow_interspersed_args", cmd.allow_interspersed_args):
            return []
    return []


def command_lines(text: str, markdown: bool) -> list[tuple[int, str]]:
    """(line number, text) of every piece of `text` that may name a meshrun command: in Markdown, the lines
    of code blocks (Python's and data formats' aside) and inline code; elsewhere, inline code, indented
    command lines (a docstring's or comment's usage) and systemd's ExecStart."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    prose = []  # (line number, line) outside code blocks
    fence, skip, pending = None, False, ""
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line) if markdown else None
        if m and fence is None:
            fence, skip = m.group(1), m.group(2).lower() in CODE_LANGUAGES_SKIPPED
            continue
        if m and fence is not None and m.group(1).startswith(fence[0]) and not m.group(2):
            fence = None
            continue
        if fence is not None:
            if not skip:
                pending += line
                if line.endswith("\\"):  # a continued shell line
                    pending = pending[:-1] + " "
                    continue
                out.append((n, pending))
            pending = ""
            continue
        prose.append((n, line))
        if not markdown:
            bare = re.sub(r"^\s*#", "", line)
            if pending or re.match(r"\s{2,}(\$ |sudo )?meshrun\s", bare) or re.match(r"ExecStart=\S*meshrun\s", line):
                pending += bare
                if pending.endswith("\\"):  # continued on the next line
                    pending = pending[:-1] + " "
                    continue
                out.append((n, re.sub(r"^ExecStart=", "", pending)))
                pending = ""
    # Inline code may wrap a line: match spans over the prose, then map each back to its line.
    joined = "\n".join(line for _, line in prose)
    starts = [0]
    for _, line in prose:
        starts.append(starts[-1] + len(line) + 1)
    for m in SPAN.finditer(joined):
        if "\n\n" in m.group(2):
            continue
        k = bisect.bisect_right(starts, m.start()) - 1
        out.append((prose[min(k, len(prose) - 1)][0], " ".join(m.group(2).split())))
    return out


def stale_commands(path: Path, text: str) -> list[str]:
    """`file:line: problem` for every meshrun command or option `text` names that does not exist."""
    rel = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)
    out = []
    for n, line in command_lines(text, markdown=path.suffix == ".md"):
        for m in INVOCATION.finditer(line):
            rest = line[m.end() :]
            end = SHELL_END.search(rest)
            words = (rest[: end.start()] if end else rest).split()
            out += [f"{rel}:{n}: {problem} (in: {line.strip()[:100]})" for problem in check_invocation(words)]
    return out


# --- links ----------------------------------------------------------------------------------------


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _outside_code(text: str, spans: bool = False) -> str:
    """`text` without its code blocks, and without its inline code unless `spans`."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (fence is None or (m.group(1).startswith(fence[0]) and not m.group(2))):
            fence = m.group(1) if fence is None else None
            continue
        if fence is None:
            out.append(line if spans else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def anchors(text: str) -> set[str]:
    """GitHub's fragment for every heading of a Markdown text (lower case, punctuation dropped, spaces to
    hyphens, repeats numbered)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code(text, spans=True).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(path: Path, text: str) -> list[str]:
    """`file: target` for every relative link in `text` whose file, or whose heading, does not exist."""
    rel = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)
    out = []
    for m in LINK.finditer(_outside_code(text)):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{rel}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            out.append(f"{rel}: {target} (no such heading)")
    return out


# --- the job file example -------------------------------------------------------------------------


def job_example_problems(text: str) -> list[str]:
    """Keys of a job file example that the parser does not accept, and the parser's own complaints about the
    file as it is and with its commented-out `# key = value` examples switched on."""
    out = []
    switched_on = []
    in_table = False
    for line in text.splitlines():
        in_table = in_table or line.startswith("[")
        m = re.match(r"#\s?(\w+\s*=\s*\S.*)$", line)
        switched_on.append(m.group(1) if m and not in_table else line)
        if m := re.match(r"#\s*Other keys:(.*)$", line):
            for key in re.findall(r"(?:^|,)\s*(\w+)", re.sub(r"\([^)]*\)", "", m.group(1))):
                if key not in jobconfig.KEYS:
                    out.append(f"the comment lists {key!r}, which the job file parser does not accept")
    for variant, what in ((text, "as it is"), ("\n".join(switched_on), "with its examples switched on")):
        try:
            jobconfig.parse(variant, "configs/job.example.toml")
        except Exception as exc:  # the parser's UsageError, or a key check
            out.append(f"{what}: {exc}")
    return out


# --- the tests ------------------------------------------------------------------------------------


def test_the_cli_reference_is_what_the_commands_say():
    assert (REPO_ROOT / "docs" / "cli.md").read_text() == reference.render(), (
        "docs/cli.md is stale: run `.venv/bin/python -m meshrun.cli.reference > docs/cli.md`"
    )
    assert reference.main(["--check", str(REPO_ROOT / "docs" / "cli.md")]) == 0


def test_the_reference_check_fails_on_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text(reference.render().replace("--nproc-per-node", "--nprocs-per-node"))
    assert reference.main(["--check", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err


def test_the_reference_covers_every_visible_command_and_option():
    page = reference.render()
    for path, (cmd, opts) in tree().items():
        if cmd.hidden:
            assert f"## meshrun {' '.join(path)}\n" not in page
            continue
        assert f"## {' '.join(('meshrun', *path))}\n" in page
        assert all(o in page for o, p in opts.items() if not getattr(p, "hidden", False)), path


def test_every_command_and_option_the_docs_name_exists():
    stale = [s for p in MARKDOWN + OTHER for s in stale_commands(p, p.read_text())]
    assert not stale, "commands or options named in the docs that do not exist:\n" + "\n".join(stale)


def test_the_docs_name_commands_at_all():
    # A checker that finds nothing passes everything: these pages name dozens.
    def found(name: str) -> int:
        lines = command_lines((REPO_ROOT / name).read_text(), markdown=True)
        return sum(1 for _, line in lines for _ in INVOCATION.finditer(line))

    assert found("README.md") >= 10 and found("docs/quickstart.md") >= 20 and found("SECURITY.md") >= 20


@pytest.mark.parametrize(
    "text, problem",
    [
        ("Run `meshrun train --no-such-option train.py`.", "`meshrun train` has no option --no-such-option"),
        ("```sh\nmeshrun trian train.py\n```", "`meshrun trian` is no command"),
        ("```sh\nmeshrun coordinator ad gpu-b\n```", "`meshrun coordinator ad` is no command"),
        ("```sh\nmeshrun site trust fra --force\n```", "`meshrun site trust` has no option --force"),
        ("```sh\n$ meshrun logs JOB --follow --head 5\n```", "`meshrun logs` has no option --head"),
        ("```sh\nmeshrun train --nnodes 2 \\\n    --nproc 4 train.py\n```", "`meshrun train` has no option --nproc"),
        ("`meshrun token create | meshrun join - --nmae gpu-a`", "`meshrun join` has no option --nmae"),
        ("`meshrun --verbos status`", "`meshrun` has no option --verbos"),
    ],
)
def test_a_command_or_option_that_does_not_exist_is_reported(text, problem):
    found = stale_commands(REPO_ROOT / "docs" / "x.md", text)
    assert len(found) == 1 and problem in found[0], found


def test_an_indented_command_line_in_code_is_checked():
    text = '"""Usage:\n\n    meshrun train --epochs 3 x.py\n"""\n'
    assert stale_commands(REPO_ROOT / "examples" / "x.py", text) == [
        "examples/x.py:3: `meshrun train` has no option --epochs (in: meshrun train --epochs 3 x.py)"
    ]
    unit = "ExecStart=/usr/local/bin/meshrun up --foreground --sate-dir /var/lib/meshrun\n"
    assert "has no option --sate-dir" in stale_commands(REPO_ROOT / "configs" / "x.service", unit)[0]


@pytest.mark.parametrize(
    "text",
    [
        "`meshrun train train.py --epochs 3 --no-such-option`",  # after the script: the script's
        "`meshrun train --nnodes 2:4 --env A=1 --module pkg.main --lr 3`",
        "```sh\nmeshrun join - --name gpu-a < token   # or: meshrun join --token-file F\n```",
        "`meshrun leave` / `meshrun down` `[--purge]`, `meshrun jobs [--json] [--prune-project P]`",
        "```text\nmeshrun: error: the code is 57 MiB\nmeshrun doctor: node dc3-a in network meshrun\n```",
        "`meshrun0`, `meshrun.train.diloco`, `meshrun-agent.service`, `MESHRUN_SITE`, `meshrun train`'s",
        "```python\nfrom meshrun import train\n```",
        "`meshrun coordinator add gpu-b --endpoint 198.51.100.7`, `meshrun -v status --json | jq .`",
    ],
)
def test_what_exists_is_not_reported(text):
    assert stale_commands(REPO_ROOT / "docs" / "x.md", text) == []


def test_every_key_of_the_job_file_example_is_accepted():
    assert job_example_problems(JOB_EXAMPLE.read_text()) == []


def test_a_job_file_key_the_parser_does_not_know_is_reported():
    example = JOB_EXAMPLE.read_text()
    assert any("'nproc'" in p for p in job_example_problems("nproc = 2\n" + example))
    assert any("'nproc'" in p for p in job_example_problems("# nproc = 2\n" + example))
    assert any("'sync_limit_mb'" in p for p in job_example_problems("# Other keys: timeout (s), sync_limit_mb.\n"))


def test_every_relative_link_in_the_docs_resolves():
    broken = [b for p in MARKDOWN for b in broken_links(p, p.read_text())]
    assert not broken, "links to files or headings that do not exist:\n" + "\n".join(broken)


def test_a_broken_link_is_reported():
    doc = REPO_ROOT / "docs" / "x.md"
    assert broken_links(doc, "[x](howto/no-such-page.md)") == ["docs/x.md: howto/no-such-page.md (no such file)"]
    assert broken_links(doc, "[x](ha.md#no-such-heading)") == ["docs/x.md: ha.md#no-such-heading (no such heading)"]
    assert broken_links(doc, "[x](ha.md#limits), [y](https://example.com/z.md), `[z](nope.md)`") == []
