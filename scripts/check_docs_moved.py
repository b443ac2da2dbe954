"""Check that splitting the README into docs/ lost nothing, and that its links resolve.

    git show 83a7ff3:README.md > /tmp/old_README.md   # the README before the split (main at the time)
    python scripts/check_docs_moved.py /tmp/old_README.md

1. Every `##`-`####` heading of OLD_README.md (by its text, any level) is a heading of
   README.md or some docs/*.md; every table row of OLD_README.md is a line of one of them.
2. Every other non-blank line of OLD_README.md is too, verbatim; those that are not (lines
   whose links were rewritten) are printed for a reader to compare.
3. Every relative link in README.md and docs/*.md names a file that exists, and a `#anchor`
   a heading of that file (GitHub's slug rule).
Exit status 1 if 1 or 3 fails.
"""
import re
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
new_files = [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def lines_outside_fences(text):
    fence = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
            yield line, True
            continue
        yield line, fence


def headings(text):
    return [re.sub(r"^#+ ", "", l).strip() for l, f in lines_outside_fences(text) if not f and re.match(r"^#{1,6} ", l)]


def slug(h):
    h = h.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


old = Path(sys.argv[1]).read_text()
new_text = {p: p.read_text() for p in new_files}
all_new_lines = set()
all_new_heads = set()
for t in new_text.values():
    all_new_lines.update(t.split("\n"))
    all_new_heads.update(headings(t))

bad = 0
old_heads = [re.sub(r"^#+ ", "", l).strip() for l, f in lines_outside_fences(old) if not f and re.match(r"^#{2,4} ", l)]
missing_heads = [h for h in old_heads if h not in all_new_heads]
rows = [l for l, f in lines_outside_fences(old) if not f and l.startswith("|")]
new_rows = [l for l in all_new_lines if l.startswith("|")]


def cells(row):
    return [c.strip() for c in row.strip("|").split(" | ")]


edited, missing_rows = [], []
for r in rows:
    if r in all_new_lines:
        continue
    # The same row with a cross-reference rewritten into a link: same first cell, same cell count.
    twins = [n for n in new_rows if cells(n)[0] == cells(r)[0] and len(cells(n)) == len(cells(r))]
    (edited if twins else missing_rows).append((r, twins))
print(f"headings: {len(old_heads)} in the old README, {len(missing_heads)} missing")
for h in missing_heads:
    print("  MISSING HEADING:", h)
print(f"table rows: {len(rows)} in the old README, {len(rows) - len(edited) - len(missing_rows)} verbatim, "
      f"{len(edited)} with a cross-reference edited, {len(missing_rows)} missing")
for r, twins in edited:
    print("  EDITED:", r[:150])
    for n in twins:
        print("      ->", n[:150])
for r, _ in missing_rows:
    print("  MISSING ROW:", r[:150])
bad += bool(missing_heads or missing_rows)

other = [l for l in old.split("\n") if l.strip() and l not in all_new_lines]
print(f"other lines: {sum(1 for l in old.split(chr(10)) if l.strip())} non-blank, {len(other)} not found verbatim (edited links):")
for l in other:
    print("  ~", l[:150])

link_re = re.compile(r"\]\(([^)\s]+)\)")
broken = []
for p, t in new_text.items():
    for line, f in lines_outside_fences(t):
        if f:
            continue
        for target in link_re.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (p.parent / path).resolve() if path else p
            if not dest.exists():
                broken.append(f"{p.relative_to(root)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest.read_text())}:
                broken.append(f"{p.relative_to(root)}: {target} (no such heading)")
# A target already broken in the old README (the same target text, seen from the repository
# root) is reported, not counted: this split did not make it.
pre = [b for b in broken if b.split(": ", 1)[1].split(" (")[0].replace("../", "") in old]
new_broken = [b for b in broken if b not in pre]
print(f"links: {len(new_broken)} broken, {len(pre)} broken already in the old README")
for b in broken:
    print("  BROKEN:" if b in new_broken else "  BROKEN BEFORE:", b)
bad += bool(new_broken)
sys.exit(1 if bad else 0)
