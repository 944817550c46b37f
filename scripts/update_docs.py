"""Regenerate the documentation tables that come from code: the profile table, the config reference and the
map of the code (each package's and module's own docstring, and the import contract of pyproject.toml).

    python scripts/update_docs.py          # rewrite the pages in place
    python scripts/update_docs.py --check  # exit 1 when a page is stale (a test runs this)

Each table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers in its page under docs/;
everything outside the markers is written by hand.
"""

import ast
import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from launcher.config.profiles import table_markdown  # noqa: E402
from launcher.config.schema import reference_markdown  # noqa: E402


def _doc(path: str) -> str:
    """A module's docstring as Markdown: Sphinx roles and double backticks become code spans, arrows arrows."""
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    doc = re.sub(r":(?:mod|class|func|meth|attr):`~?\.?([^`]+)`", r"`\1`", doc)
    return " ".join(doc.replace("``", "`").replace("->", "→").split())


def _first_sentence(doc: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", doc)
    return m.group(1) if m else doc


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _module_file(name: str) -> str:
    """``launcher.plan`` -> its ``__init__.py``; ``launcher.log`` -> ``launcher/log.py``."""
    path = os.path.join(ROOT, *name.split("."))
    return os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"


def house_markdown() -> str:
    """The packages of ``launcher/`` in the order data flows through them (the layers of the import contract, top
    first), then each package's docstring and its modules' first sentences."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    out = ["| layer (imports only go down) | what it holds |", "| --- | --- |"]
    for layer in layers:
        names = [n.strip() for n in re.split(r"[|:]", layer)]
        heads = [_first_sentence(_doc(_module_file(n))) for n in names]
        heads = [re.split(r":\s", h)[0].rstrip(".") + "." for h in heads if h]
        out.append("| " + ", ".join(f"`{n}`" for n in names) + " | " + _cell(" ".join(heads)) + " |")
    pkg_root = os.path.join(ROOT, "launcher")
    for name in sorted(os.listdir(pkg_root)):
        folder = os.path.join(pkg_root, name)
        if not os.path.isfile(os.path.join(folder, "__init__.py")):
            continue
        out += ["", f"### `launcher/{name}/`", "", _doc(os.path.join(folder, "__init__.py")), "",
                "| module | what it does |", "| --- | --- |"]
        for dirpath, dirs, files in sorted(os.walk(folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py") and f != "__init__.py":
                    path = os.path.join(dirpath, f)
                    out.append(f"| `{os.path.relpath(path, ROOT)}` | {_cell(_first_sentence(_doc(path)))} |")
    return "\n".join(out)


# page (relative to the repository root) -> {marker name: function returning the Markdown}
PAGES = {
    "docs/profiles.md": {"profiles": table_markdown},
    "docs/reference/config.md": {"config-reference": reference_markdown},
    "docs/reference/code.md": {"house": house_markdown},
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
