"""The one table ``scripts/gpu_check.sh`` ends with: the device, each step, each GPU test, the benchmark figures.

    python scripts/gpu_summary.py OUT_DIR

Reads what the check wrote into OUT_DIR: ``device.txt``, ``steps.tsv`` (step, exit status, seconds),
``gpu_tests.xml``, ``megablocks_tests.xml`` and ``compile_tests.xml`` (pytest's JUnit reports) and the
benchmarks' JSON. Exit status 1 when a step or a test failed.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

BENCHMARKS = ("train_step.json", "moe_layer.json", "compile_bench.json")
TEST_REPORTS = ("gpu_tests.xml", "megablocks_tests.xml", "compile_tests.xml")  # tests/gpu: without megablocks, with
# it built, and compiled with Inductor


def steps(out: Path) -> list[tuple[str, int, int]]:
    rows = []
    path = out / "steps.tsv"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, status, seconds = line.split("\t")
        rows.append((name, int(status), int(seconds)))
    return rows


def tests(out: Path) -> list[tuple[str, str, str]]:
    """(test, PASS|FAIL|SKIP, reason) from the JUnit report."""
    rows = []
    cases = [case for name in TEST_REPORTS if (out / name).is_file()
             for case in ElementTree.parse(out / name).iter("testcase")]
    for case in cases:
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            rows.append((name, "FAIL", (failed.get("message") or "").splitlines()[0][:100] if failed.get("message")
                         else ""))
        elif skipped is not None:
            rows.append((name, "SKIP", (skipped.get("message") or "")[:100]))
        else:
            rows.append((name, "PASS", ""))
    return rows


def figures(out: Path) -> list[str]:
    """Each benchmark's rows as ``key=value`` lines (the benchmarks' JSON: a list of flat records)."""
    lines = []
    for name in BENCHMARKS:
        path = out / name
        if not path.is_file():
            lines.append(f"{name}: not written")
            continue
        data = json.loads(path.read_text())
        records = data if isinstance(data, list) else data.get("results", [data])
        for record in records:
            shown = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
                     if isinstance(v, int | float | str)]
            lines.append(f"{name.removesuffix('.json')}: " + ", ".join(shown))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/gpu_summary.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").is_file() else "unknown device"
    print(f"\n=== GPU check: {device} ===")
    step_rows, test_rows = steps(out), tests(out)
    print(f"{'step':<20} {'status':<10} {'seconds':>7}")
    for name, status, seconds in step_rows:
        print(f"{name:<20} {'ok' if status == 0 else f'FAILED ({status})':<10} {seconds:>7}")
    counts = {kind: sum(1 for _, k, _ in test_rows if k == kind) for kind in ("PASS", "FAIL", "SKIP")}
    print(f"\ntests/gpu: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    for name, kind, reason in test_rows:
        print(f"  {kind:<4} {name}" + (f"  ({reason})" if reason else ""))
    print("\nfigures:")
    for line in figures(out):
        print(f"  {line}")
    print(f"\nlogs and JSON: {out}")
    return 1 if counts["FAIL"] or any(status for _, status, _ in step_rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
