"""The console examples of the README and the tutorials, run against a real
server, their output compared with what the page shows.

Scope: README.md and docs/tutorials/*.md. Their console blocks are the tour
and the tutorials, which a new user types against a plain server. The other
pages' (how-tos, explanation) console blocks are excerpts of an operator's
setting: TLS certificates, an IdP sign-in, the console or MCP host in the
foreground, PostgreSQL, keys under /etc, a request id from an earlier step
shortened to `f11d898e...`; they are not run here (their policy and
manifest snippets are validated by test_snippets.py).

A console example is a fenced ```console block. `$ ` starts a command (a
trailing backslash continues it; a here-document takes the lines up to its
delimiter); the lines after it, up to the next `$ `, are its expected output,
less trailing lines that are blank or start with `#` (commentary). A line
that is only `...` stands for any number of lines. Output is stdout and
stderr together, each line's trailing spaces and the trailing blank lines
dropped; the exit status is not compared (the pages do not show it). A command
whose page shows no output must print nothing.

A block is left out, with its reason, by a first line `# not run: <reason>`,
by `<!-- not run: <reason> -->` on the line before its fence, or by `skip` in
its info string. Every one is listed in NOT_RUN below (test_not_run_is_listed
fails on one that is not, and on a listed one that is gone), and each shows
as a skipped test with its reason: none counts as passing.

One session per page, its steps in the page's order, as a reader at one
shell would do them:
- an empty temporary working directory, a fresh HOME and TMPDIR (a page's
  `mktemp -d` stays inside the tier's directory), `toolreg` (the checkout's
  .venv) first on PATH; no TOOLREG_* variable but TOOLREG_ADDRESS;
- each command runs with `bash -c` (timeout COMMAND_TIMEOUT_S) in the
  directory and with the shell variables the previous command left behind
  (`cd` and `request=$(...)` carry over);
- a ```yaml block whose first line is `# NAME.yaml` ("save this as NAME.yaml")
  is written to NAME.yaml in the current directory at its place in the page;
- the page's server is started where the page starts it: a `toolreg serve
  ...` (with or without `&`) or `make run` line, in a ```console block or a
  ```sh block ("in a second terminal"). The tier starts `toolreg serve` with
  the page's arguments (redirections and `&` dropped, `--port` made 0,
  `examples/...` and `/path/to/toolreg/...` read from the checkout, `make
  run` as `--tools examples/tools --data-dir .toolreg/data`) in the current
  directory, waits until it serves, and stops the one it ran before; the
  output a page shows for it is not compared. A page that starts no server
  gets `make run`'s before its first step. TOOLREG_ADDRESS names the running
  server, and so does 127.0.0.1:50051 / localhost:50051 written in a command.

Normalisations (normalise(), applied to the page's and the real output alike;
a page may write the placeholder itself where values vary):

| what                                   | pattern                                               | becomes       |
|----------------------------------------|-------------------------------------------------------|---------------|
| the session's working dir, HOME, repo  | their absolute paths                                  | <workdir> <home> <repo> |
| other temporary paths                  | /tmp/...                                              | <tmp>         |
| timestamps                             | ISO 8601 / `YYYY-MM-DD HH:MM:SS[ UTC]`; Unix seconds with a fraction | <time> |
| uuids                                  | 8-4-4-4-12 hex                                        | <id>          |
| sha256 digests (tools, arguments, container ids) | 64 hex                                      | <digest>      |
| request and execution ids              | 32 hex                                                | <id>          |
| short digests (registered, audit head) | 12 or 16 hex                                          | <digest>      |
| Ed25519 public keys                    | 43 base64 characters and `=`                          | <key>         |
| loopback addresses                     | 127.0.0.1 / localhost / 0.0.0.0 / [::1] :port         | <address>     |
| durations                              | `N ms`, `N.N s`, `"duration_ms": N`                   | <duration>    |
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from registry_server.cli.launcher import SERVING_LINE, ServerProcess, spawn_until
from tests.docs.blocks import ELLIPSIS, Block, Command, commands, fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the checkout's .venv/bin, where `toolreg` is
COMMAND_TIMEOUT_S = 60
DOC_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):50051\b")


def in_scope() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs" / "tutorials").glob("*.md"))]


# Every console block of the pages in scope that is not run, by page, with the
# reason the page gives (the test below keeps this list and the pages in step).
NOT_RUN: dict[str, list[str]] = {}  # none: every console block of README and tutorials runs

# --- normalisation -----------------------------------------------------------

_HEX = "0-9a-fA-F"
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"/tmp/[^\s'\"`:;,)]+"), "<tmp>"),
    (
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?"
            r"(?:Z|[+-]\d{2}:?\d{2}|\s?UTC)?"
        ),
        "<time>",
    ),
    (re.compile(r"\b1\d{9}\.\d+\b"), "<time>"),
    (
        re.compile(
            rf"(?<![{_HEX}])[{_HEX}]{{8}}(?:-[{_HEX}]{{4}}){{3}}-[{_HEX}]{{12}}(?![{_HEX}])"
        ),
        "<id>",
    ),
    (re.compile(rf"(?<![{_HEX}\w])[{_HEX}]{{64}}(?![{_HEX}\w])"), "<digest>"),
    (re.compile(rf"(?<![{_HEX}\w])[{_HEX}]{{32}}(?![{_HEX}\w])"), "<id>"),
    (re.compile(rf"(?<![{_HEX}\w])(?:[{_HEX}]{{16}}|[{_HEX}]{{12}})(?![{_HEX}\w])"), "<digest>"),
    (re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{43}="), "<key>"),
    (re.compile(r"(?:127\.0\.0\.1|localhost|0\.0\.0\.0|\[::1\]):\d+"), "<address>"),
    (re.compile(r"(\"duration_ms\":\s*)\d+"), r"\1<duration>"),
    (re.compile(r"\b\d+(?:\.\d+)?\s?ms\b|\b\d+\.\d+\s?s\b"), "<duration>"),
]


def normalise(text: str, paths: dict[str, Path]) -> str:
    """Replace what varies from run to run by its placeholder (the table above).
    ``paths``: placeholder name -> the session's absolute path for it."""
    for name, path in sorted(paths.items(), key=lambda item: -len(str(item[1]))):
        text = text.replace(str(path), f"<{name}>")
    for pattern, placeholder in _RULES:
        text = pattern.sub(placeholder, text)
    return text


def matches(expected: list[str], actual: list[str]) -> bool:
    """Line by line; a line `...` of ``expected`` takes any number of lines."""
    if not expected:
        return not actual
    if expected[0] == ELLIPSIS:
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


# --- the session ---------------------------------------------------------------


@dataclass
class Outcome:
    command: Command
    expected: list[str]
    actual: list[str]
    raw: str

    @property
    def ok(self) -> bool:
        return matches(self.expected, self.actual)


@dataclass
class Session:
    page: Path
    top: Path
    server: ServerProcess | None = None
    outcomes: dict[int, list[Outcome]] = field(default_factory=dict)  # by block line
    broken: str = ""  # why the rest of the page could not run
    broken_at: int = 0  # from this block on

    @property
    def work(self) -> Path:
        return self.top / "work"

    @property
    def state(self) -> Path:
        return self.top / "state"

    @property
    def paths(self) -> dict[str, Path]:
        return {"workdir": self.work, "home": self.top / "home", "repo": ROOT}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLREG_")}
        env.update(
            PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            HOME=str(self.top / "home"),
            COLUMNS="100",
            TERM="dumb",
            NO_COLOR="1",
            TMPDIR=str(self.top / "tmp"),
        )
        if self.server is not None:
            env["TOOLREG_ADDRESS"] = self.server.address
        return env

    def start(self, argv: list[str]) -> None:
        """The page's server (replacing the one running)."""
        self.stop()
        cwd = Path((self.state / "cwd").read_text().strip())
        self.server = ServerProcess(
            *spawn_until(argv, SERVING_LINE, what=shlex.join(argv), cwd=cwd, env=self.env())
        )

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def run(self, command: Command) -> str:
        text = command.text
        if self.server is not None:
            text = DOC_ADDRESS.sub(self.server.address, text)
        address = (
            f"export TOOLREG_ADDRESS={self.server.address}"
            if self.server is not None
            else "unset TOOLREG_ADDRESS"
        )
        script = _WRAPPER.format(state=shlex.quote(str(self.state)), address=address, command=text)
        proc = subprocess.Popen(
            ["bash", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.env(),
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"\n[tier: killed after {COMMAND_TIMEOUT_S} s]"
        return out


# Runs one command in the page's session: the directory and the shell variables
# the previous command left (new variables and exported ones) are restored first
# (TOOLREG_ADDRESS then set to the server running now) and saved again on exit,
# whatever the command does.
_WRAPPER = """\
cd "$(cat {state}/cwd)" || exit 97
. {state}/vars 2>/dev/null
{address}
__tier_save() {{
  pwd > {state}/cwd
  {{ declare -p $(compgen -v | grep -vxF -f {state}/base); export -p; }} > {state}/vars 2>/dev/null
}}
trap __tier_save EXIT
{command}
"""

_SERVE = re.compile(r"^\s*(?:toolreg\s+serve\b|make\s+run\b)")
_REDIRECT = re.compile(r"\s\d?>>?(?:&\d|\s*[^\s&]+)")
_CHECKOUT = "/path/to/toolreg/"  # how a page names the reader's checkout
_SAVED_AS = re.compile(r"^#\s*(?P<name>[\w.-]+\.ya?ml)\s*$")  # a yaml block's first line


def server_argv(text: str) -> list[str] | None:
    """The page's own server, as the tier starts it; None for other commands."""
    if not _SERVE.match(text):
        return None
    text = _REDIRECT.sub(" ", text.replace("\\\n", " ")).rstrip().removesuffix("&")
    words = shlex.split(text, comments=True)
    if words == ["make", "run"]:
        words = ["toolreg", "serve", "--tools", "examples/tools", "--data-dir", ".toolreg/data"]
    elif words[:2] != ["toolreg", "serve"]:
        return None
    argv = [str(BIN / "toolreg"), "serve", "--port", "0"]
    skip = False
    for word in words[2:]:
        if skip or word == "--port":
            skip = not skip
            continue
        if word.startswith(("examples/", _CHECKOUT)):
            word = str(ROOT / word.removeprefix(_CHECKOUT))
        argv.append(word)
    return argv


@dataclass
class Step:
    """One thing the page has the reader do, in the page's order."""

    block: Block
    command: Command | None = None  # a console command
    server: list[str] | None = None  # start the page's server
    save: str = ""  # write the block into this file


def steps(page: Path) -> list[Step]:
    found: list[Step] = []
    for block in fenced_blocks(page):
        if block.mark:
            continue
        if block.lang == "console":
            for command in commands(block):
                argv = server_argv(command.text)
                found.append(Step(block, server=argv) if argv else Step(block, command=command))
        elif block.lang in ("sh", "bash", "shell"):
            text = "\n".join(block.lines).replace("\\\n", " ")
            found += [Step(block, server=a) for a in map(server_argv, text.splitlines()) if a]
        elif block.lang in ("yaml", "yml") and (
            saved := _SAVED_AS.match(block.lines[0] if block.lines else "")
        ):
            found.append(Step(block, save=saved["name"]))
    if found and not any(step.server for step in found):
        found.insert(0, Step(found[0].block, server=server_argv("make run")))
    return found


def run_page(page: Path) -> Session:
    top = Path(tempfile.mkdtemp(prefix="toolreg-docs-"))
    session = Session(page, top)
    for sub in ("work", "home", "state", "tmp"):
        (top / sub).mkdir()
    (session.state / "cwd").write_text(str(session.work))
    base = subprocess.run(
        ["bash", "-c", "compgen -v"], capture_output=True, text=True, env=session.env(), check=True
    ).stdout
    (session.state / "base").write_text(base)
    (session.state / "vars").write_text("")
    try:
        for step in steps(page):
            outcomes = session.outcomes.setdefault(step.block.line, [])
            if step.server:
                session.start(step.server)
            elif step.save:
                cwd = Path((session.state / "cwd").read_text().strip())
                (cwd / step.save).write_text("\n".join(step.block.lines) + "\n")
            elif step.command:
                raw = session.run(step.command)
                paths = session.paths
                expected = normalise("\n".join(step.command.expected), paths)
                outcomes.append(
                    Outcome(step.command, expected.splitlines(), _lines(normalise(raw, paths)), raw)
                )
    except Exception as exc:  # the session cannot go on: each later block says why
        session.broken = f"{type(exc).__name__}: {exc}"
        session.broken_at = step.block.line
    finally:
        session.stop()
        shutil.rmtree(top, ignore_errors=True)
    return session


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def console_blocks(page: Path) -> list[Block]:
    return [b for b in fenced_blocks(page) if b.lang == "console"]


def _blocks() -> Iterator[object]:
    for page in in_scope():
        for block in console_blocks(page):
            yield pytest.param(page, block, id=block.where)


@pytest.fixture(scope="module")
def sessions(request: pytest.FixtureRequest) -> dict[Path, Session]:
    """The session of every page with a block selected to run, side by side
    (one thread, one server per page)."""
    selected = {
        params["page"]
        for item in request.session.items
        if (params := getattr(getattr(item, "callspec", None), "params", {}))
        and item.name.startswith("test_console_block")
        and not params["block"].mark
    }
    pages = [p for p in in_scope() if p in selected]
    with ThreadPoolExecutor(max_workers=max(1, len(pages))) as pool:
        return dict(zip(pages, pool.map(run_page, pages), strict=True))


# The first block's test also waits for every page's session (about 40 s here).
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("page", "block"), list(_blocks()))
def test_console_block(page: Path, block: Block, sessions: dict[Path, Session]) -> None:
    if block.mark:
        pytest.skip(f"{block.mark}: {block.reason}")
    session = sessions[page]
    failures = []
    for outcome in session.outcomes.get(block.line, []):
        if outcome.ok:
            continue
        diff = "\n".join(
            difflib.unified_diff(
                outcome.expected, outcome.actual, "the page shows", "the command printed",
                lineterm="",
            )
        )  # fmt: skip
        failures.append(
            f"{page.relative_to(ROOT)} line {outcome.command.line}: "
            f"$ {outcome.command.text}\n{diff}\n--- raw output ---\n{outcome.raw}"
        )
    if session.broken and block.line >= session.broken_at:
        failures.append(f"{page.relative_to(ROOT)}: the session broke: {session.broken}")
    assert not failures, "\n\n".join(failures)


def test_not_run_is_listed() -> None:
    """Every block left out is in NOT_RUN with its reason, and nothing else is."""
    found = {
        str(page.relative_to(ROOT)): sorted(b.reason for b in console_blocks(page) if b.mark)
        for page in in_scope()
    }
    listed = {page: sorted(reasons) for page, reasons in NOT_RUN.items()}
    found = {page: reasons for page, reasons in found.items() if reasons or page in listed}
    assert found == listed
