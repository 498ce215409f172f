#!/usr/bin/env python3
"""Check the repository's Markdown links without the network.

Every tracked `*.md` file is read; each inline link `[text](target)`, image `![alt](target)` and reference
definition `[label]: target` outside code is checked: a relative path must exist in the work tree, and an
`#anchor` into a Markdown file (the same file when the link is only `#anchor`) must name one of its headings by
GitHub's rule (lower case; punctuation other than `-` and `_` dropped; spaces become `-`; a repeated heading gets
`-1`, `-2`, ...) or an explicit `<a name=...>`/`id=...`. Links with a scheme (`https:`, `mailto:`, ...) are not
checked. Exits 1 naming each broken link as FILE:LINE: TARGET: WHY.

Usage: scripts/check-links.py [FILE.md ...]   (default: every Markdown file git tracks)
"""

import os
import re
import subprocess
import sys
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets (`[a [b] c](x)`).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files():
    out = subprocess.run(["git", "ls-files", "-z", "*.md"], cwd=ROOT, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p and os.path.exists(os.path.join(ROOT, p))]


def lines_outside_code(text):
    """(line number, line) for every line not inside a fenced code block."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            marker = m.group(1)
            if fence is None:
                fence = marker
                continue
            if marker[0] == fence[0] and len(marker) >= len(fence) and not line.strip()[len(marker):].strip():
                fence = None
                continue
        if fence is None:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("*", "").replace("~", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and _ of any script
    return text.replace(" ", "-")


_anchors = {}


def anchors(path):
    if path not in _anchors:
        found = set()
        seen = {}
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for _, line in lines_outside_code(text):
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
            for a in HTML_ANCHOR.findall(line):
                found.add(a)
        _anchors[path] = found
    return _anchors[path]


def check_target(source, target):
    """None if the link resolves, else why not."""
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1]
    if SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = urllib.parse.unquote(path_part.split("?", 1)[0])
    anchor = urllib.parse.unquote(anchor)
    if path_part == "":
        dest = source
    elif path_part.startswith("/"):
        dest = os.path.join(ROOT, path_part.lstrip("/"))
    else:
        dest = os.path.normpath(os.path.join(os.path.dirname(source), path_part))
    if not os.path.realpath(dest).startswith(ROOT + os.sep) and os.path.realpath(dest) != ROOT:
        return "points outside the repository"
    if not os.path.exists(dest):
        return "no such file"
    if anchor and dest.endswith(".md") and os.path.isfile(dest):
        if anchor not in anchors(dest):
            return f"no heading with anchor #{anchor} in {os.path.relpath(dest, ROOT)}"
    return None


def check_file(rel):
    path = os.path.join(ROOT, rel)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    broken = []
    for number, line in lines_outside_code(text):
        code_free = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        targets = [m.group(1) for m in INLINE_LINK.finditer(code_free)]
        m = REF_DEF.match(code_free)
        if m:
            targets.append(m.group(1))
        for target in targets:
            why = check_target(path, target)
            if why:
                broken.append(f"{rel}:{number}: {target}: {why}")
    return broken


def main(argv):
    files = argv or markdown_files()
    broken = []
    for rel in files:
        broken.extend(check_file(rel))
    for b in broken:
        print(b, file=sys.stderr)
    if broken:
        print(f"{len(broken)} broken Markdown link(s) in {len(files)} files", file=sys.stderr)
        return 1
    print(f"Markdown links: {len(files)} files, none broken")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
