"""`toolreg policy test` and `toolreg policy explain` as an operator runs
them: in real processes, the example policy passes its own tests (exit 0)
and explain shows the example policy's decision for a prod deploy. The rest
(a wrong expectation's FAIL lines and exit 1, a malformed tests file's exit
2 naming the file, the line and the field, explain's other decisions and its
bad options) run in process, with the same exit codes and streams: one
process each would cost half a second."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from registry_server.cli import app

ROOT = Path(__file__).resolve().parents[2]
TOOLREG = Path(sys.executable).parent / "toolreg"
POLICY = ROOT / "examples" / "policy.yaml"
TESTS = ROOT / "examples" / "policy.tests.yaml"


REAL = {
    "test": ["policy", "test", str(POLICY), str(TESTS)],
    "explain prod": ["policy", "explain", str(POLICY), "--client", "agent-1",
                     "--tool", "deploy", "--args", '{"env": "prod"}'],
}  # fmt: skip


@pytest.fixture(scope="module")
def real() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The real processes, all started at once: each is mostly the
    interpreter's start-up, which two cores run side by side."""
    started = {name: _start(args) for name, args in REAL.items()}
    yield started
    for proc in started.values():
        if proc.poll() is None:  # a test failed before reading it
            proc.kill()
            proc.communicate()


def _start(args: list[str]) -> subprocess.Popen[str]:
    out = subprocess.PIPE
    return subprocess.Popen([str(TOOLREG), *args], stdout=out, stderr=out, text=True, cwd=ROOT)


def toolreg(real: dict[str, subprocess.Popen[str]], name: str) -> tuple[int, str, str]:
    """The exit code, stdout and stderr of the real process ``name``."""
    out, err = real[name].communicate(timeout=60)
    return real[name].returncode, out, err


def in_process(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"TOOLREG_POLICY_FILE": None})


def test_the_example_policy_passes_its_tests(real: dict[str, subprocess.Popen[str]]) -> None:
    code, out, err = toolreg(real, "test")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[-1].startswith(f"{len(lines) - 1} passed, 0 failed")
    assert all(line.startswith("PASS  ") for line in lines[:-1])
    assert "PASS  a deploy to prod needs two approvers from sre" in lines


WRONG = """\
cases:
  - name: prod needs one approver
    call:
      tool: {name: deploy, level: dangerous}
      args: {env: prod}
      client: agent-1
    expect: {decision: approval, approvals: 1, groups: []}
  - name: staging needs one approver
    call:
      tool: {name: deploy, level: dangerous}
      args: {env: staging}
      client: agent-1
    expect: {decision: approval, approvals: 1}
  - name: drop table is allowed
    call:
      tool: {name: run_sql, level: cautious}
      args: {sql: DROP TABLE users}
      client: agent-1
    expect: {decision: allowed}
"""


def test_a_wrong_expectation_fails_with_the_difference(tmp_path: Path) -> None:
    tests = tmp_path / "wrong.tests.yaml"
    tests.write_text(WRONG)
    ran = in_process("policy", "test", str(POLICY), str(tests))
    assert ran.exit_code == 1, ran.output
    out = ran.stdout
    assert (
        f"FAIL  prod needs one approver ({tests} line 2): approvals: expected 1, got 2;"
        " groups: expected [], got [sre]"
    ) in out
    assert "got approval (APPROVAL_REQUIRED): 2 approval(s) from sre and 1" in out
    assert "PASS  staging needs one approver" in out
    assert "FAIL  drop table is allowed" in out and "decision: expected allowed, got denied" in out
    assert "1 passed, 2 failed" in out


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (WRONG.replace("client: agent-1\n    expect: {decision: allowed}",
                       "client: agent-1\n      colour: red\n    expect: {decision: allowed}"),
         "line 19: cases[2].call.colour: unknown key"),
        (WRONG.replace("decision: allowed", "decision: permitted"),
         "line 19: cases[2].expect.decision: unknown decision 'permitted'"),
        (WRONG.replace("{decision: approval, approvals: 1}", "{decision: denied, approvals: 1}"),
         "line 13: cases[1].expect: approvals: only with decision approval"),
        (WRONG.replace("level: cautious}", "level: risky}"),
         "line 16: cases[2].call.tool.level: unknown safety level 'risky'"),
        (WRONG.replace("staging needs", "prod needs"),
         "line 8: cases[1].name: duplicate name 'prod needs one approver'"),
        ("cases:\n  - name: x\n    name: y\n", "line 3: cases[0].name: duplicate key 'name'"),
        ("cases: [\n", "not valid YAML"),
    ],
)  # fmt: skip
def test_a_malformed_tests_file_names_the_file_line_and_field(
    tmp_path: Path, text: str, needle: str
) -> None:
    tests = tmp_path / "bad.tests.yaml"
    tests.write_text(text)
    ran = in_process("policy", "test", str(POLICY), str(tests))
    assert ran.exit_code == 2, ran.output
    assert f"{tests} " in ran.stderr and needle in ran.stderr, ran.stderr
    assert ran.stdout == ""


def test_a_case_the_policy_cannot_make_is_an_error_line(tmp_path: Path) -> None:
    tests = tmp_path / "groups.tests.yaml"
    tests.write_text(
        WRONG.replace("args: {env: staging}", "args: {env: staging}\n      groups: [sre]")
    )
    ran = in_process("policy", "test", str(POLICY), str(tests))
    assert ran.exit_code == 1
    assert f"ERROR staging needs one approver: {tests} line 12: cases[1].call.groups:" in ran.stdout


def test_a_policy_that_does_not_load_is_exit_2(tmp_path: Path) -> None:
    broken = tmp_path / "policy.yaml"
    broken.write_text(POLICY.read_text().replace("groups: [ops, sre]", "groups: [ops]"))
    ran = in_process("policy", "test", str(broken), str(TESTS))
    assert ran.exit_code == 2
    assert "unsatisfiable rule" in ran.stderr


def explain_in_process(*args: str) -> str:
    ran = in_process("policy", "explain", str(POLICY), "--client", "agent-1", *args)
    assert ran.exit_code == 0, ran.output
    return str(ran.stdout)


def test_explain_prod_needs_two_from_sre_staging_one_from_anyone(
    real: dict[str, subprocess.Popen[str]],
) -> None:
    code, prod, err = toolreg(real, "explain prod")
    assert code == 0, err
    assert "decision: APPROVAL (APPROVAL_REQUIRED)" in prod
    assert "2 approval(s) from sre and 1 approval(s) from any approver" in prod
    assert "sre-prod: 2 from sre: bob, carol" in prod
    assert "APPLIES  sre-prod" in prod and 'when args.env == "prod": true' in prod

    staging = explain_in_process("--tool", "deploy", "--args", '{"env": "staging"}')
    assert (
        "decision: APPROVAL (APPROVAL_REQUIRED)\n          1 approval(s) from any approver\n"
        in staging
    )
    assert 'when args.env == "prod": false' in staging
    assert "APPLIES  sre-prod" not in staging


def test_explain_drop_table_shows_the_deny_rule() -> None:
    out = explain_in_process(
        "--tool", "run_sql", "--level", "cautious", "--args", '{"sql": "drop table users"}'
    )
    assert "decision: DENIED (POLICY_DENIED)" in out
    assert "denied by policy rule no-drop-table: run_sql may not drop tables" in out
    assert "DENIES   no-drop-table" in out


def test_explain_with_the_example_manifests() -> None:
    ran = in_process(
        "policy", "explain", str(POLICY), "--client", "agent-1",
        "--manifest", str(ROOT / "examples" / "tools"), "--tool", "write_file",
        "--args", '{"path": "a.txt", "content": "x"}', "--at", "2025-06-02T09:00:00Z",
    )  # fmt: skip
    assert ran.exit_code == 0, ran.output
    out = ran.stdout
    assert "tool:     write_file (dangerous; categories files)" in out
    assert "arguments:      valid against the manifest's JSON Schema" in out
    assert "write-file: 2 from security: alice, bob" in out
    assert "tokens may live at most 600 s" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tool", "deploy", "--args", "[1]"], "args: "),
        (["--tool", "deploy", "--level", "risky"], "--level: unknown safety level"),
        (["--tool", "deploy", "--at", "2025-06-02T09:00:00"], "--at: give the time zone"),
        (["--tool", "deploy", "--group", "sre"], "--group: client 'agent-1' is a client"),
        (["--manifest", "examples/tools", "--tool", "nope"], "has no tool 'nope'"),
        (["--manifest", "examples/tools/echo.yaml", "--level", "safe"], "--level: the manifest"),
        (["--args", "{}"], "--tool: required"),
    ],
)
def test_explain_refuses_what_it_cannot_explain(args: list[str], needle: str) -> None:
    ran = in_process("policy", "explain", str(POLICY), "--client", "agent-1", *args)
    assert ran.exit_code == 2 and needle in ran.stderr, ran.output


def test_explain_reads_the_servers_policy_variable() -> None:
    args = ["policy", "explain", "--tool", "deploy", "--client", "agent-1"]
    ran = CliRunner().invoke(app, args, env={"TOOLREG_POLICY_FILE": str(POLICY)})
    assert ran.exit_code == 0, ran.output
    assert f"policy:   {POLICY}" in ran.stdout
    unset = in_process(*args)
    assert unset.exit_code == 2 and "give FILE or set TOOLREG_POLICY_FILE" in unset.stderr
