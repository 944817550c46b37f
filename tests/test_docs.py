"""The manuals: the README is a front page whose links resolve, the tables generated from the code are current,
the mkdocs site builds with warnings as errors, and every repository path the pages name exists."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata

import pytest

from helpers import ROOT

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 200
# Repository paths the pages name, in text or code, must exist (runs/, models/ and DIR are the reader's own; a path
# with a placeholder such as ds_configs/NAME.json is left out, and so are console transcripts, whose error examples
# name missing files on purpose).
REPO_PATH = re.compile(r"(?<![\w./-])((?:bench|configs|ds_configs|examples|launcher|scripts|tests)/[\w./-]*[\w/])")
PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b")


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs' default) gives a heading."""
    text = re.sub(r"`|\*\*|\*", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: str) -> set[str]:
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)  # no headings inside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def links(path: str) -> list[str]:
    """Relative Markdown link targets of a page (code blocks and spans left out)."""
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_readme_is_a_front_page():
    lines = open(README).read().splitlines()
    assert len(lines) < README_MAX_LINES, (f"README.md has {len(lines)} lines; rule: a front page under "
                                           f"{README_MAX_LINES}; fix: move the detail to a page under docs/")


def test_readme_links_resolve():
    targets = links(README)
    assert any(t.startswith("docs/") for t in targets), "README.md links to no page under docs/"
    broken = []
    for target in targets:
        file, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(ROOT, file)) if file else README
        if not os.path.exists(path):
            broken.append(f"{target}: no such file")
        elif anchor and path.endswith(".md") and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, "README.md links that resolve to nothing:\n  " + "\n  ".join(broken)


def test_generated_tables_are_current():
    """The profile table (docs/profiles.md) and the config reference (docs/reference/config.md) come from the
    code through scripts/update_docs.py."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "update_docs.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for page, marker, row in (("profiles.md", "profiles", "| `amp-fp16` |"),
                              (os.path.join("reference", "config.md"), "config-reference", "| `train.max_steps` |")):
        text = open(os.path.join(DOCS, page)).read()
        body = text.split(f"<!-- {marker}:start -->", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]
        assert row in body, f"docs/{page}: the generated table is empty or lacks {row!r}"


def test_pages_name_paths_that_exist():
    missing = []
    for page in sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)) + [README]:
        text = re.sub(r"```console\n.*?```", "", open(page).read(), flags=re.S)
        for path in REPO_PATH.findall(text):
            if not PLACEHOLDER.search(path) and not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{os.path.relpath(page, ROOT)}: {path}")
    assert not missing, "pages name repository paths that do not exist:\n  " + "\n  ".join(missing)


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed here (it comes with the test extra: pip install -e '.[test]')")
def test_mkdocs_build_strict(tmp_path):
    """Every page is in the nav, every link and anchor between pages resolves (mkdocs.yml makes those warnings,
    --strict makes warnings errors)."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    pages = glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)
    for page in pages:
        rel = os.path.relpath(page, DOCS)[: -len(".md")]
        html = "index.html" if rel == "index" else os.path.join(rel, "index.html")
        assert os.path.exists(tmp_path / "site" / html), f"docs/{rel}.md was not built"
