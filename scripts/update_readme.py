"""Regenerate the README sections that come from code: the profile table and the config reference.

    python scripts/update_readme.py          # rewrite README.md in place
    python scripts/update_readme.py --check  # exit 1 when README.md is stale (a test runs this)
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.config import reference_markdown  # noqa: E402
from launcher.profiles import table_markdown  # noqa: E402

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
SECTIONS = {"profiles": table_markdown, "config-reference": reference_markdown}


def render(text: str) -> str:
    for name, fn in SECTIONS.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- {name}:start --> ... <!-- {name}:end --> markers")
        text = pattern.sub(lambda m: m.group(1) + fn() + m.group(2), text)
    return text


def main() -> int:
    text = open(README).read()
    new = render(text)
    if "--check" in sys.argv:
        if new != text:
            print("README.md is stale: run `python scripts/update_readme.py`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        open(README, "w").write(new)
        print("README.md updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
