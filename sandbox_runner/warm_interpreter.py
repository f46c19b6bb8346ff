"""Warm interpreters: a tool's Python started ahead of its call, still single-use.

A tool whose manifest says ``prestart: python`` has its interpreter started in the
warm container before the call: the init (init/toolreg_init.c, ``--prestart``) execs
``python3 [FLAGS] -c STUB_SOURCE PRELOAD MODE TARGET [ARG...]`` in the held process
at once instead of at release. The stub below is toolreg's, not the tool's: it imports
the manifest's ``preload`` modules, compiles the tool's script (compiling runs
nothing), tells the init it is ready, and then does exactly what the init's held C
process does: it blocks reading the go byte from fd 0 and reports on the same pipe,
with the same records. Once released it runs the tool's code in-process, as
``python3 [FLAGS] SCRIPT|-c CODE|-m MODULE [ARG...]`` would have, in a fresh
``__main__``. The container still serves that one call and is removed after it.

Nothing here talks to an engine: the registry validates manifests with
``parse_python_command`` and ``preload_problem``; the Docker backend builds the
container's command with ``stub_command``.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MAX_PRELOAD",
    "MAX_PRELOAD_CHARS",
    "PRESTART_KINDS",
    "PRESTART_PYTHON",
    "STUB_SOURCE",
    "SUPPORTED_FLAGS",
    "PythonCommand",
    "parse_python_command",
    "preload_problem",
    "stub_command",
]

PRESTART_PYTHON: Final = "python"
PRESTART_KINDS: Final = ("", PRESTART_PYTHON)  # "": started at release, as without prestart
MAX_PRELOAD: Final = 32  # modules one tool may preload
MAX_PRELOAD_CHARS: Final = 128  # characters of one preloaded module's dotted name
# Flags the stub's interpreter is started with as the tool's would be; each changes only
# how the interpreter behaves, never what it runs. Others (-W, -X, -O, combined -Bu)
# are refused: what they mean before the stub runs was not checked.
SUPPORTED_FLAGS: Final = ("-B", "-E", "-I", "-P", "-S", "-s", "-u")

_INTERPRETER: Final = re.compile(r"^(?:/[^\0]*/)?python3?(?:\.[0-9]+)?$")
_MODULE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")

SCRIPT: Final = "script"
CODE: Final = "code"
MODULE: Final = "module"


@dataclass(frozen=True, slots=True)
class PythonCommand:
    """A tool's command in the one shape the stub can stand in for."""

    interpreter: str  # e.g. "python3" or "/usr/bin/python3.11"
    flags: tuple[str, ...]  # of SUPPORTED_FLAGS
    mode: str  # SCRIPT, CODE or MODULE
    target: str  # the script's path, the code, or the module's name
    args: tuple[str, ...]  # the rest: sys.argv[1:]


def parse_python_command(command: tuple[str, ...] | list[str]) -> PythonCommand:
    """``command`` as a PythonCommand, or ValueError saying which forms are supported."""
    forms = (
        "the command must be [python3, SCRIPT, ARG...], [python3, -c, CODE, ARG...] or"
        f" [python3, -m, MODULE, ARG...], with any of {', '.join(SUPPORTED_FLAGS)}"
        " before SCRIPT, -c or -m"
    )
    program = command[0] if command else ""
    if not _INTERPRETER.match(program):
        return _refuse(
            f"{forms}; its program must be a Python interpreter (python3, python3.11 or an"
            f" absolute path to one), not {program!r}"
        )
    rest = list(command[1:])
    flags: list[str] = []
    while rest and rest[0] in SUPPORTED_FLAGS:
        flags.append(rest.pop(0))
    if not rest:
        return _refuse(f"{forms}; it names no script, -c or -m")
    head = rest.pop(0)
    if head in ("-c", "-m"):
        if not rest:
            return _refuse(f"{forms}; {head} needs an argument")
        target = rest.pop(0)
        mode = CODE if head == "-c" else MODULE
        if mode == MODULE and not _MODULE.match(target):
            return _refuse(f"{forms}; {target!r} is not a module name")
    elif head.startswith("-"):
        return _refuse(f"{forms}; {head!r} is not supported")
    else:
        if not posixpath.isabs(head):
            return _refuse(f"{forms}; the script must be an absolute path, not {head!r}")
        mode, target = SCRIPT, head
    return PythonCommand(command[0], tuple(flags), mode, target, tuple(rest))


def _refuse(message: str) -> PythonCommand:
    raise ValueError(message)


def preload_problem(name: object) -> str | None:
    """Why ``name`` cannot be preloaded (None: it can): a dotted Python identifier."""
    if not isinstance(name, str) or not name:
        return "each entry must be a module name such as json or xml.etree.ElementTree"
    if len(name) > MAX_PRELOAD_CHARS:
        return f"each entry at most {MAX_PRELOAD_CHARS} characters"
    if not _MODULE.match(name):
        return f"{name!r} is not a dotted Python module name (letters, digits, _ and .)"
    return None


def stub_command(command: tuple[str, ...], preload: tuple[str, ...]) -> list[str]:
    """The container's command (after ``toolreg-init --prestart``) for a tool whose own
    command is ``command``: its interpreter, with its flags, running the stub."""
    for name in preload:
        problem = preload_problem(name)
        if problem is not None:
            raise ValueError(f"preload: {problem}")
    cmd = parse_python_command(command)
    return [
        cmd.interpreter, *cmd.flags, "-c", STUB_SOURCE,
        ",".join(preload), cmd.mode, cmd.target, *cmd.args,
    ]  # fmt: skip


# The stub, run with `-c` so it works in any image with a Python 3.8+ (nothing to bake
# in, nothing in the image to keep in step with the server). It imports nothing the
# interpreter has not loaded at start (os, sys, time; atexit is built in) until its
# preloads, and runpy only for -m. Its report records are toolreg_init.c's `struct
# report` (int kind, int value, long long usec; native byte order): fd 3 is the init's
# report pipe, fd 4 the read end of the sized input's pipe (both set up by the init's
# --prestart).
# Kinds: 1 RELEASED, 2 NOT_RELEASED, 3 EXEC_FAILED, 5 PRESTART_FAILED (value: the length
# of the message that follows), 6 PRESTART_READY.
STUB_SOURCE: Final = r"""
import atexit, os, sys, time
def _rep(kind, value, extra=b''):
    o = sys.byteorder
    os.write(3, kind.to_bytes(4, o, signed=True) + value.to_bytes(4, o, signed=True)
             + (time.time_ns() // 1000).to_bytes(8, o, signed=True) + extra)
# How the tool's run ends. The interpreter exits as python3's would: SystemExit's
# message or an uncaught exception's traceback printed, non-daemon threads joined,
# atexit handlers run, by CPython itself. Then _end, the first atexit handler
# registered (before any preload) and so the last run, flushes sys.stdout and
# sys.stderr as Py_FinalizeEx does next and leaves with os._exit: the rest of it
# (collecting every object, tearing down every module) took most of a warm call's
# time under the cautious level's half CPU, and the container is removed after this
# one call anyway. Skipped with it: __del__ methods still pending, and files other
# than the standard streams left unflushed, as after any os._exit.
_status, _sigint = 1, False  # 1 (as python3's) should the stub itself fail uncaught
_os_exit, _kill, _getpid = os._exit, os.kill, os.getpid  # before the tool can rebind them
def _exit_status(e):
    # pythonrun.c _Py_HandleSystemExit: None 0, an int as a C long (-1 when it is
    # beyond one), anything else 1 (CPython prints it).
    try:
        c = e.code
    except BaseException:
        return 1
    if c is None:
        return 0
    if isinstance(c, int):
        c = int.__index__(c)
        return c & 0xFF if -2 ** 63 <= c < 2 ** 63 else 255
    return 1
def _flush():
    ok = True
    for _n in ('stdout', 'stderr'):
        _f = getattr(sys, _n, None)
        try:
            if _f is None or _f.closed:
                continue
            _f.flush()
        except BaseException as _x:
            ok = False
            if _n == 'stdout':  # as PyErr_WriteUnraisable(sys.stdout) words it
                try:
                    import traceback
                    sys.stderr.write('Exception ignored in: %r\n%s' % (_f, ''.join(
                        traceback.format_exception(type(_x), _x, _x.__traceback__.tb_next))))
                except BaseException:
                    pass
    # The streams the interpreter started with, where the tool swapped them: a normal
    # exit flushes them when it frees them.
    for _f in (sys.__stdout__, sys.__stderr__):
        try:
            if _f is not None and _f is not sys.stdout and _f is not sys.stderr and not _f.closed:
                _f.flush()
        except BaseException:
            pass
    return ok
def _end():
    try:
        sys._getframe(1)
        return  # called from Python code (atexit._run_exitfuncs): not the exit
    except ValueError:
        pass
    status = _status if _flush() else 120
    if _sigint:  # Py_RunMain after an uncaught KeyboardInterrupt: die of SIGINT
        try:
            import _signal
            _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
            _kill(_getpid(), _signal.SIGINT)
        except BaseException:
            pass
        status = 130
    _os_exit(status)
atexit.register(_end)
_preload, _mode, _target, _args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
for _name in filter(None, _preload.split(',')):
    try:
        __import__(_name)
    except BaseException as _e:
        _msg = ('prestart: preload %r failed: %s' % (_name, _e)).encode('utf-8', 'replace')[:1000]
        _rep(5, len(_msg), _msg)
        os._exit(125)
_code = None
try:
    if _mode == 'module':
        import runpy
    elif _mode == 'code':
        _code = compile(_target, '<string>', 'exec')
    else:
        with open(_target, 'rb') as _f:
            _code = compile(_f.read(), _target, 'exec')
except BaseException:
    _code = None  # reported as python would, once released
_rep(6, 0)
_b = os.read(0, 1)
_go = _b[0] if _b else -1
if _go not in (71, 83):
    _rep(2, _go)
    os._exit(125)
_rep(1, _go)
try:
    if _go == 83:
        os.dup2(4, 0)
    os.close(4)
except OSError as _e:
    _rep(3, _e.errno or 5)
    os._exit(127)
os.close(3)
_isolated = sys.flags.isolated or getattr(sys.flags, 'safe_path', False)
try:
    if _mode == 'module':
        sys.argv = ['-m'] + _args
        if not _isolated:
            sys.path[0] = os.getcwd()
        # What python3 -m calls (its frames in a traceback, its message for a missing
        # module, argv[0] the module's path), in a fresh __main__.
        _m = type(sys)('__main__')
        _m.__builtins__ = __builtins__
        _m.__annotations__ = {}
        sys.modules['__main__'] = _m
        runpy._run_module_as_main(_target)
    else:
        _m = type(sys)('__main__')
        _m.__builtins__ = __builtins__
        _m.__annotations__ = {}
        if _mode == 'code':
            sys.argv = ['-c'] + _args
            _m.__loader__ = __loader__
        else:
            sys.argv = [_target] + _args
            _m.__file__, _m.__cached__ = _target, None
            _m.__loader__ = sys.modules['_frozen_importlib_external'].SourceFileLoader(
                '__main__', _target)
            if not _isolated:
                sys.path[0] = os.path.dirname(os.path.realpath(_target))
            if _code is None:
                try:
                    _f = open(_target, 'rb')
                except OSError as _e:
                    _prog = getattr(sys, 'orig_argv', [sys.executable])[0]
                    print("%s: can't open file %r: [Errno %d] %s"
                          % (_prog, _target, _e.errno, _e.strerror), file=sys.stderr)
                    sys.exit(2)
        sys.modules['__main__'] = _m
        if _code is None:
            _code = compile(_target if _mode == 'code' else _f.read(), _m.__dict__.get(
                '__file__', '<string>'), 'exec')
        exec(_code, _m.__dict__)
    _status = 0
except SystemExit as _e:
    _status = _exit_status(_e)
    raise
except BaseException as _e:
    _tb = _e.__traceback__
    _e = _e.with_traceback(_tb.tb_next if _tb is not None else None)  # not the stub's frame
    _sigint = type(_e) is KeyboardInterrupt  # exactly: as pythonrun.c checks it
    sys.last_type, sys.last_value, sys.last_traceback = type(_e), _e, _e.__traceback__
    sys.excepthook(type(_e), _e, _e.__traceback__)
    _status = 1
    sys.exit(1)
"""
