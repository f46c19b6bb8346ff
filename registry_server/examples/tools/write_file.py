"""toolreg tool: write a text file inside the workspace.

stdin:  {"path": str, "content": str}
stdout: {"path": <path relative to the workspace>, "bytes": n}
The workspace is $TOOLREG_WORKSPACE (default /workspace). The path is walked one
component at a time with O_NOFOLLOW relative to the previous directory, so `..`,
absolute paths outside the workspace and symlinks anywhere on the path are
refused rather than followed. Missing parent directories are created.
Errors go to stderr with exit code 2.
"""

import contextlib
import json
import os
import stat
import sys

WORKSPACE_DEFAULT = "/workspace"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in the workspace must not hang the tool.
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Refused(Exception):
    """The request is not allowed; the message is for the caller."""


def relative_parts(path: str, workspace: str) -> list[str]:
    """Split the requested path into components below the workspace."""
    if "\0" in path:
        raise Refused("path contains a NUL byte")
    if os.path.isabs(path):
        root = os.path.normpath(workspace)
        norm = os.path.normpath(path)
        if not norm.startswith(root.rstrip("/") + "/"):
            raise Refused(f"absolute path {path!r} is outside the workspace {workspace}")
        path = norm[len(root.rstrip("/")) + 1 :]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"path {path!r} contains '..'")
    if not parts:
        raise Refused("path names the workspace itself, not a file")
    return parts


def open_parent(workspace: str, dirs: list[str]) -> int:
    """Open (creating as needed) the parent directory without following symlinks."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for i, name in enumerate(dirs):
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=fd)
            nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            where = "/".join(dirs[: i + 1])
            raise Refused(f"{where!r} is a symlink or not a directory ({exc.strerror})") from exc
        finally:
            os.close(fd)
        fd = nxt
    return fd


def write_file(workspace: str, path: str, content: str) -> dict[str, object]:
    parts = relative_parts(path, workspace)
    data = content.encode("utf-8")
    parent = open_parent(workspace, parts[:-1])
    try:
        try:
            fd = os.open(parts[-1], FILE_FLAGS, 0o644, dir_fd=parent)
        except OSError as exc:
            raise Refused(
                f"cannot open {'/'.join(parts)!r} (symlink or special file?): {exc.strerror}"
            ) from exc
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{'/'.join(parts)!r} is not a regular file")
        if st.st_nlink > 1:  # a hard link could point at a file outside the workspace
            raise Refused(f"{'/'.join(parts)!r} has several hard links")
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return {"path": "/".join(parts), "bytes": len(data)}


def main() -> int:
    try:
        args = json.load(sys.stdin)
        if (
            not isinstance(args, dict)
            or not isinstance(args.get("path"), str)
            or not isinstance(args.get("content"), str)
        ):
            raise Refused('expected {"path": string, "content": string}')
        result = write_file(
            os.environ.get("TOOLREG_WORKSPACE", WORKSPACE_DEFAULT), args["path"], args["content"]
        )
    except ValueError as exc:
        print(f"write_file: stdin is not JSON: {exc}", file=sys.stderr)
        return 2
    except Refused as exc:
        print(f"write_file: refused: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"write_file: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
