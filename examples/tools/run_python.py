"""toolreg tool: run a Python snippet with this interpreter.

stdin:  {"code": str, "stdin"?: str}
The snippet's stdout/stderr go straight to ours and its exit code becomes ours
(128+N when killed by signal N). It runs in the temp directory (/tmp, the only
writable place in the sandbox), without writing bytecode.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile


def main() -> int:
    try:
        args = json.load(sys.stdin)
    except ValueError as exc:
        print(f"run_python: stdin is not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        print('run_python: expected {"code": string, "stdin"?: string}', file=sys.stderr)
        return 2
    child_stdin = args.get("stdin", "")
    if not isinstance(child_stdin, str):
        print('run_python: "stdin" must be a string', file=sys.stderr)
        return 2

    workdir = tempfile.mkdtemp(prefix="run_python_")
    try:
        # A file, not `-c`: argv strings are capped at 128 KiB by the kernel.
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(args["code"])
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HOME=tempfile.gettempdir())
        sys.stdout.flush()
        proc = subprocess.run(
            [sys.executable, "-B", script],
            input=child_stdin.encode("utf-8"),
            cwd=tempfile.gettempdir(),
            env=env,
            check=False,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


if __name__ == "__main__":
    sys.exit(main())
