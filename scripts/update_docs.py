"""Regenerate the documentation tables that come from code: the profile table and the config reference.

    python scripts/update_docs.py          # rewrite the pages in place
    python scripts/update_docs.py --check  # exit 1 when a page is stale (a test runs this)

Each table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers in its page under docs/;
everything outside the markers is written by hand.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from launcher.config import reference_markdown  # noqa: E402
from launcher.profiles import table_markdown  # noqa: E402

# page (relative to the repository root) -> {marker name: function returning the Markdown}
PAGES = {
    "docs/profiles.md": {"profiles": table_markdown},
    "docs/reference/config.md": {"config-reference": reference_markdown},
}


def escape_html(markdown: str) -> str:
    """Escape ``<`` and ``>`` outside code spans: help texts such as ``<model>-<timestamp>`` would otherwise
    be read as HTML tags and vanish from the page."""
    parts = markdown.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside backticks
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def render(text: str, sections: dict, page: str) -> str:
    for name, fn in sections.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{page} has no <!-- {name}:start --> ... <!-- {name}:end --> markers")
        body = escape_html(fn())
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for page, sections in PAGES.items():
        path = os.path.join(ROOT, page)
        with open(path) as f:
            text = f.read()
        new = render(text, sections, page)
        if new == text:
            continue
        if check:
            stale.append(page)
        else:
            with open(path, "w") as f:
                f.write(new)
            print(f"{page} updated")
    if stale:
        print(f"stale: {', '.join(stale)}; run `python scripts/update_docs.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
