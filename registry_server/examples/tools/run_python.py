"""toolreg tool: run a Python snippet in this interpreter.

stdin:  {"code": str, "stdin"?: str}
The snippet runs in this very process (the manifest's `prestart: python` has it
started and its imports done before the call; the container serves this one call
and is removed after it, so nothing of the snippet outlives the call), as the
main program: in a fresh `__main__` namespace, with sys.argv == ["-c"], the
"stdin" string as sys.stdin (empty when not given), in the temp directory
(/tmp, the only writable place in the sandbox), without writing bytecode.
What it prints goes to our stdout/stderr. Its exit code becomes ours: 0 when it
ends, SystemExit's code as Python gives it (None 0, an int that int, any other
value printed to stderr and 1), 1 with a traceback on stderr for an uncaught
exception; 128+N when a signal N kills the process.
"""

import io
import json
import os
import sys
import traceback


def _fail(message: str) -> int:
    print(f"run_python: {message}", file=sys.stderr)
    return 2


def _run(code: str, stdin_text: str) -> int:
    try:
        compiled = compile(code, "<code>", "exec")
    except (SyntaxError, ValueError):  # as python3 -c reports them: no frames of ours
        traceback.print_exc(limit=0)
        return 1
    main = type(sys)("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin_text.encode("utf-8")), encoding="utf-8")
    sys.dont_write_bytecode = True
    os.chdir(os.environ.get("TMPDIR") or "/tmp")
    try:
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException as exc:  # the snippet's, reported as python does
        # Without this frame: the traceback starts at the snippet.
        frames = exc.__traceback__
        traceback.print_exception(exc.with_traceback(frames.tb_next if frames else None))
        return 1
    return 0


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main() -> int:
    try:
        args = json.load(sys.stdin)
    except ValueError as exc:
        return _fail(f"stdin is not JSON: {exc}")
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        return _fail('expected {"code": string, "stdin"?: string}')
    stdin_text = args.get("stdin", "")
    if not isinstance(stdin_text, str):
        return _fail('"stdin" must be a string')
    return _run(args["code"], stdin_text)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.exit(status)
