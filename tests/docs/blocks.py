"""The fenced blocks of a Markdown page, and a console block's commands with
their expected output. The rules are the tier's (tests/docs/test_console_examples.py
says them to writers of the docs); this module only reads them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
# A block is left out with a reason, either by its first line (`# not run: why`,
# `# fragment: why`) or by an HTML comment on the line right before its fence
# (`<!-- not run: why -->`, invisible on the site).
MARK = re.compile(
    r"^\s*(?:#|<!--)\s*(?P<kind>not run|fragment)\s*:\s*(?P<reason>.*?)\s*(?:-->)?\s*$"
)
HEREDOC = re.compile(r"<<-?\s*(?P<q>['\"]?)(?P<word>[A-Za-z_][A-Za-z0-9_]*)(?P=q)")
ELLIPSIS = "..."  # an expected-output line of its own: any number of lines, none included


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str  # the info string's first word
    info: str  # the whole info string
    lines: list[str]  # the content, the fence's indentation removed
    mark: str = ""  # "not run" / "fragment" when left out
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


@dataclass
class Command:
    line: int  # of its `$ ` line in the page
    text: str  # as bash gets it (continuations and here-documents kept)
    expected: list[str] = field(default_factory=list)


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of the page, in order (indented fences included)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        info = opening["info"].strip()
        start, body = i, []
        i += 1
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if (
                closing
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            raw = lines[i]
            body.append(raw[indent:] if raw[:indent].strip() == "" else raw.lstrip())
            i += 1
        i += 1
        lang = info.split()[0].strip("{}.").lower() if info else ""
        block = Block(path, start + 1, lang, info, body)
        _mark(block, lines[start - 1] if start else "")
        blocks.append(block)
    return blocks


def _mark(block: Block, line_before: str) -> None:
    words = block.info.split()[1:]
    if "skip" in words:
        block.mark, block.reason = "not run", "marked `skip` in the info string"
    for candidate in (block.lines[0] if block.lines else "", line_before):
        if found := MARK.match(candidate):
            block.mark, block.reason = found["kind"], found["reason"]
            return


def commands(block: Block) -> list[Command]:
    """The commands of a console block with the output each expects.

    `$ ` starts a command; a trailing backslash continues it on the next line,
    and a here-document (`<<EOF`) takes the lines up to its delimiter. The lines
    after a command, up to the next `$ `, are its output, less trailing lines
    that are blank or start with `#` (commentary between commands). Lines
    starting with `#` before the first command are commentary too."""
    found: list[Command] = []
    lines = block.lines
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            if found:
                found[-1].expected.append(line.rstrip())
            i += 1
            continue
        number, text = block.line + 1 + i, line[2:]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text += "\n" + lines[i]
        if heredoc := HEREDOC.search(text):
            word = heredoc["word"]
            while i + 1 < len(lines):
                i += 1
                text += "\n" + lines[i]
                if lines[i].strip() == word:
                    break
        found.append(Command(number, text))
        i += 1
    for command in found:
        while command.expected and (
            not command.expected[-1].strip() or command.expected[-1].startswith("#")
        ):
            command.expected.pop()
    return found
