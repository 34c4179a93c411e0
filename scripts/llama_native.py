"""Native llama.cpp for the benchmarks: llama-bench, llama-quantize, llama-server and llama-perplexity,
built on demand.

The binaries are built (cmake, GGML_NATIVE: this CPU's instruction set) from the llama.cpp sources
that the llama-cpp-python sdist vendors, so the version is pinned by LLAMA_CPP_PYTHON, into a cache
folder: $LLAMA_NATIVE if set, else $XDG_CACHE_HOME/ellm/llama-native. Nothing is rebuilt once the
binaries are there (a binary added to BINARIES later is built alone and joins them). A build takes 10-15 minutes on 2 cores and needs cmake, a C++ compiler and
network access to PyPI; benchmarks only, never tests.

    .venv/bin/python scripts/llama_native.py            # build if missing, print the bin folder
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
BINARIES = ("llama-bench", "llama-quantize", "llama-server", "llama-perplexity")
# ggml's AMX kernels (compiled in by -march=native on CPUs with AMX) crash this llama.cpp's prompt
# processing of Q8_0 and Q4_K weights (SIGSEGV, SIGILL) on the machine these figures come from;
# explicit -mno-* flags win over -march=native in GCC, so the AVX-512/VNNI kernels serve instead.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def native_root() -> Path:
    """The cache folder of the native build ($LLAMA_NATIVE, else the user cache)."""
    if os.environ.get("LLAMA_NATIVE"):
        return Path(os.environ["LLAMA_NATIVE"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ellm" / "llama-native"


def _missing(root: Path) -> list[str]:
    return [name for name in BINARIES if not (root / "bin" / name).is_file()]


def is_built(root: Path) -> bool:
    return not _missing(root)


def build(root: Path, log=print) -> Path:
    """Build the BINARIES missing from root/bin; returns root/bin."""
    missing = _missing(root)
    if not missing:
        return root / "bin"
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} on PATH")
    with tempfile.TemporaryDirectory(prefix="llama-src-") as tmp:
        log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (its vendored llama.cpp sources)")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = src / "build"
        log(f"building {', '.join(missing)} (GGML_NATIVE; 10-15 minutes on 2 cores) into {root / 'bin'}")
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                        f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build_dir), f"-j{os.cpu_count() or 1}", "--target", *missing],
                       check=True, stdout=subprocess.DEVNULL)
        root.mkdir(parents=True, exist_ok=True)
        partial = root / "bin.part"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(build_dir / "bin", partial, symlinks=True)
        for kept in (root / "bin").glob("*"):  # the binaries built before stay (the same pinned sources)
            if not (partial / kept.name).exists() and not (partial / kept.name).is_symlink():
                shutil.copy2(kept, partial / kept.name, follow_symlinks=False)
        shutil.rmtree(root / "bin", ignore_errors=True)
        partial.replace(root / "bin")
    return root / "bin"


def _env(root: Path) -> dict:
    """The environment a binary runs in: the build's shared libraries (libllama, libggml) first."""
    bin_dir = str(root / "bin")
    return dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [bin_dir, os.environ.get("LD_LIBRARY_PATH")])))


def _run(root: Path, name: str, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(root / "bin" / name), *args], env=_env(root), text=True, **kwargs)


def start(root: Path, name: str, args: list[str], **kwargs) -> subprocess.Popen:
    """Start a binary (e.g. llama-server) in the background; kwargs go to Popen."""
    return subprocess.Popen([str(root / "bin" / name), *args], env=_env(root), **kwargs)


def quantize(root: Path, src: Path, dst: Path, qtype: str, allow_requantize: bool = False) -> Path:
    """llama-quantize src (F16, or any type with allow_requantize) to qtype (e.g. Q8_0, Q4_K_M) at dst."""
    tmp = dst.with_name(dst.name + ".part")  # never a half-written file under the real name
    args = (["--allow-requantize"] if allow_requantize else []) + [str(src), str(tmp), qtype]
    done = _run(root, "llama-quantize", args, capture_output=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {qtype} failed: {done.stderr.strip().splitlines()[-1:]}")
    tmp.replace(dst)
    return dst


def bench(root: Path, gguf: Path, *, threads: int, prompts: list[int], decode: int, depth: int, repetitions: int,
          flash_attn: bool, repack: bool = True, appends=(), cache_type: str = "f16") -> list[dict]:
    """llama-bench on gguf: pp N into an empty cache for each N, pp N after C tokens for each (N, C) of
    appends, tg `decode` after `depth` tokens; the KV cache in cache_type (-ctk and -ctv: f16, q8_0, ...).

    Returns llama-bench's JSON records (avg_ts, samples_ts, n_prompt, n_gen, n_depth, ...), one per test.
    """
    common = ["-m", str(gguf), "-t", str(threads), "-r", str(repetitions), "-fa", "on" if flash_attn else "off",
              "--repack", str(int(repack)), "-ctk", cache_type, "-ctv", cache_type, "-o", "json"]
    runs = []
    if prompts:
        runs.append(["-p", ",".join(map(str, prompts)), "-n", "0", "-d", "0"])
    runs += [["-p", str(n), "-n", "0", "-d", str(held)] for n, held in appends if held or n not in prompts]
    if decode:
        runs.append(["-p", "0", "-n", str(decode), "-d", str(depth)])
    records = []
    for extra in runs:
        done = _run(root, "llama-bench", common + extra, capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-bench exited with status {done.returncode}: "
                               f"{' '.join((done.stderr or done.stdout).strip().splitlines()[-2:])}")
        records += json.loads(done.stdout)
    return records


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(build(native_root(), log=lambda message: print(message, file=sys.stderr)))
