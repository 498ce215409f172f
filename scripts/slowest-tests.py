#!/usr/bin/env python3
"""The slowest tests of the last nextest run, from its JUnit report (.config/nextest.toml writes it).

    scripts/slowest-tests.py [N] [REPORT]     N (default 15) tests, slowest first, as a Markdown table

REPORT defaults to target/nextest/default/junit.xml (under $CARGO_TARGET_DIR when set).
"""
import os
import sys
import xml.etree.ElementTree as ET

n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
target = os.environ.get("CARGO_TARGET_DIR", os.path.join(os.path.dirname(__file__), "..", "target"))
report = sys.argv[2] if len(sys.argv) > 2 else os.path.join(target, "nextest", "default", "junit.xml")
try:
    root = ET.parse(report).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"slowest-tests: cannot read {report}: {e}")
rows = []
for case in root.iter("testcase"):
    outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else "passed"
    if case.find("skipped") is not None:
        continue
    rows.append((float(case.get("time", "0")), case.get("classname", ""), case.get("name", ""), outcome))
rows.sort(reverse=True)
total = sum(r[0] for r in rows)
print(f"{len(rows)} tests, {total:.0f} s of test time in all; the {min(n, len(rows))} slowest:\n")
print("| test | seconds | outcome |")
print("|---|---|---|")
for secs, cls, name, outcome in rows[:n]:
    print(f"| `{cls} {name}` | {secs:.1f} | {outcome} |")
