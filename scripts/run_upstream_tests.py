"""Run a framework's own checkpoint tests twice, stock and with datastates plugged in, and print
how many pass in each run and which tests pass stock only.

    python scripts/run_upstream_tests.py lightning /tmp/lightning-src
    python scripts/run_upstream_tests.py dcp /tmp/pytorch-src

SRC is a checkout (or ``git archive``) of the framework's sources at the installed version;
their tests are not on PyPI (the ``lightning`` sdist ships no ``tests/``). The swap itself is
the pytest plug-in ``scripts/upstream_swap.py``. ``--files`` replaces the default selection
(paths relative to SRC); anything after ``--`` goes to pytest.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_SRC = os.path.join(os.path.dirname(HERE), "src")

#: framework: (the directory put on sys.path, relative to SRC; the default test files)
SUITES = {
    "lightning": ("tests", ["tests/tests_pytorch/checkpointing"]),
    "dcp": (
        "test",
        [
            "test/distributed/checkpoint/test_file_system_checkpoint.py",
            "test/distributed/checkpoint/test_fsspec.py",
        ],
    ),
}


def run(
    framework: str, src: str, files: list[str], swap: str, extra: list[str], timeout: float
) -> dict[str, str]:
    """``{test id: outcome}`` of one pytest run (outcome: passed, failed, skipped)."""
    path_dir, _ = SUITES[framework]
    with tempfile.TemporaryDirectory(prefix="upstream-") as tmp:
        report = os.path.join(tmp, "report.xml")
        env = dict(
            os.environ,
            DATASTATES_SWAP=swap,
            PYTHONPATH=os.pathsep.join(
                [HERE, REPO_SRC, os.path.join(src, path_dir), os.environ.get("PYTHONPATH", "")]
            ),
        )
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "upstream_swap",
            f"--junitxml={report}",
            "-o",
            "addopts=",
            *files,
            *extra,
        ]
        subprocess.run(
            cmd,
            cwd=src,
            env=env,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not os.path.exists(report):
            raise SystemExit(
                f"{swap} run of {files} wrote no report (pytest could not start; "
                f"run `{' '.join(cmd)}` in {src} to see why)"
            )
        outcomes = {}
        for case in ET.parse(report).iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            outcomes[name] = (
                "failed"
                if kinds & {"failure", "error"}
                else "skipped"
                if "skipped" in kinds
                else "passed"
            )
        return outcomes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("framework", choices=sorted(SUITES))
    parser.add_argument("src", help="the framework's sources at the installed version")
    parser.add_argument("--files", nargs="+", help="test files or directories, relative to src")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    args = parser.parse_args(argv)
    src = os.path.abspath(args.src)
    files = args.files or SUITES[args.framework][1]
    missing = [f for f in files if not os.path.exists(os.path.join(src, f))]
    if missing:
        raise SystemExit(
            f"not found under {src}: {', '.join(missing)} (expected the "
            f"{args.framework} sources at the installed version)"
        )
    stock = run(args.framework, src, files, "stock", extra, args.timeout)
    ours = run(args.framework, src, files, args.framework, extra, args.timeout)
    passed_stock = {t for t, o in stock.items() if o == "passed"}
    passed_ours = {t for t, o in ours.items() if o == "passed"}
    print(f"{args.framework} {' '.join(files)}")
    print(f"stock:      {len(passed_stock)} passed of {len(stock)}")
    print(
        f"datastates: {len(passed_ours & passed_stock)} of those {len(passed_stock)} pass "
        f"({len(passed_ours)} passed of {len(ours)})"
    )
    for test in sorted(passed_stock - passed_ours):
        print(f"  stock only: {test} ({ours.get(test, 'not run')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
