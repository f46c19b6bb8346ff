"""toolreg tool: count words, lines and characters.

stdin:  {"text": str}
stdout: {"words": n, "lines": n, "chars": n}
"""

import json
import sys


def main() -> int:
    try:
        args = json.load(sys.stdin)
    except ValueError as exc:
        print(f"word_count: stdin is not JSON: {exc}", file=sys.stderr)
        return 2
    text = args.get("text") if isinstance(args, dict) else None
    if not isinstance(text, str):
        print('word_count: expected {"text": string}', file=sys.stderr)
        return 2
    result = {"words": len(text.split()), "lines": len(text.splitlines()), "chars": len(text)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
