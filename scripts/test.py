"""The test suite as CI runs it: every test file in a pytest process of its own, two at a time.

numba never gives back what it compiled (LLVM's MCJIT keeps each module, with its bookkeeping, for
the life of the process), and a run on an empty kernel cache compiles hundreds of kernel variants:
a pytest-xdist worker that ran half the files grew to 12.8 GB and the kernel's OOM killer ended it.
A process a file returns its memory when the file ends; what it compiled stays in the disk cache
for the files after it.

    .venv/bin/python scripts/test.py                          # every file, one per core
    .venv/bin/python scripts/test.py tests/test_lanes.py -- -k Q6_K -x
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The files that take longest (20 daemon starts; transformers on SmolLM2; the MoE GGUF) start
# first: one that started last would end the run alone.
LONGEST_FIRST = ("test_alignment_smollm2.py", "test_alignment.py", "test_crash.py", "test_moe_gguf.py")
NO_TESTS_COLLECTED = 5  # pytest's exit code when a -k or -m selects nothing in a file
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def run_file(path: Path, pytest_args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), *pytest_args],
                          cwd=ROOT, capture_output=True, text=True)
    return done, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="test files (default: tests/test_*.py)")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="files run at once (default 2: one per core)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    options, pytest_args = parser.parse_args(argv[:split]), argv[split + 1:]  # after --: for every pytest run
    files = [path.resolve() for path in options.files] or sorted((ROOT / "tests").glob("test_*.py"))
    files.sort(key=lambda path: path.name not in LONGEST_FIRST)  # stable: the rest keep their order

    start, totals, failed = time.monotonic(), dict.fromkeys(["passed", "failed", "errors", "skipped"], 0), []
    with ThreadPoolExecutor(options.jobs) as pool:
        runs = {pool.submit(run_file, path, pytest_args): path for path in files}
        for finished in as_completed(runs):
            path, (done, seconds) = runs[finished], finished.result()
            summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
            for count, outcome in COUNTS.findall(summary):
                outcome = "errors" if outcome.startswith("error") else outcome
                totals[outcome] = totals.get(outcome, 0) + int(count)
            ok = done.returncode in (0, NO_TESTS_COLLECTED)
            print(f"{'ok  ' if ok else 'FAIL'} {path.name:32} {seconds:6.0f} s  {summary}", flush=True)
            if not ok:
                failed.append(path.name)
                print(done.stdout + done.stderr, flush=True)
    minutes = (time.monotonic() - start) / 60
    counts = ", ".join(f"{n} {outcome}" for outcome, n in totals.items() if n) or "no counts in pytest's summaries"
    print(counts, f"in {minutes:.1f} min;",
          f"files that failed: {', '.join(failed)}" if failed else f"{len(files)} files, none failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
