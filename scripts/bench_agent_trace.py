"""An agent trace over the OpenAI streaming API: ellm's daemon beside native llama-server.

N agents (each with its own system prompt: a few hundred words of tool documentation) take T
turns each: a tool output of ~700 characters of seeded random text comes in as a user message,
then one streamed chat completion (max_tokens 16, temperature 0), whose reply joins that agent's
history, so every request resends a longer conversation, as agents do. The turns arrive one at
a time, round-robin over the agents or in a seeded random order (`--shuffle SEED`).

  ellm          `ellmd start --http` with `--batch-size SLOTS`, a temporary store and socket; each
                agent names its session (`session_id`), so a turn prefills only its new tokens, an
                evicted session comes back from the store, and after a restart too
  llama-server  native llama.cpp (scripts/llama_native.py), `-np SLOTS --kv-unified` with its RAM
                prompt cache (`--cache-ram`), `cache_prompt: true`; it applies the GGUF's template

Both load the same GGUF with the same thread count, one after the other. `--restart-at 0.5`
stops each server halfway through the trace and starts it again (the downtime is not counted in
the trace time): ellm's sessions resume from its store, llama-server's RAM cache is gone.

Per turn: time to the first content token and to the end of the stream, prompt and cached
tokens as the server reports them (`usage`). The table gives the trace time, each server's CPU
time, the mean TTFT in each quarter of the turns and after the restart, and the share of prompt
tokens reused; `--json PATH` writes every turn. The servers run with ELLMD_* variables and user
config files out of the way (`--ellm-args`, `--llama-args` add flags).

The measurement (docs/benchmarks.md, "Agent work"; the ratio is llama-server's trace time over
ellm's), on a quiet machine, with llama-server from $LLAMA_NATIVE or ~/.cache/ellm/llama-native
(built by scripts/llama_native.py): 12 agents over 4 slots, shuffled, a restart halfway, 120 turns
per server: about 11 minutes in all on a 2-thread Zen 3 (154 s of trace for ellm, 451 s for
llama-server, and the servers' starts). A run of 2 agents x 2 turns only proves the setup works
(about 6 minutes on a busy machine):

    .venv/bin/python scripts/bench_agent_trace.py --agents 12 --slots 4 --turns 10 --shuffle 0 --restart-at 0.5
    .venv/bin/python scripts/bench_agent_trace.py --agents 4 --turns 30    # every agent resident
    .venv/bin/python scripts/bench_agent_trace.py --agents 2 --turns 2 --restart-at 0.5    # a smoke run
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_native  # noqa: E402
from bench_turns import WORDS, filler  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("ellm", "llama-server")
TOOL_WORDS = WORDS + ("ok", "failed", "pending", "row", "cell", "path", "line", "status", "user", "id")
CLK_TCK = os.sysconf("SC_CLK_TCK")


class TraceError(Exception):
    """A server that would not start, or a request it answered with an error."""


# ---- the trace ------------------------------------------------------------------------------


def system_prompt(agent: int, words: int) -> str:
    return (f"You are agent {agent}. You operate a computer through tools and answer in one short line.\n"
            f"Tools: {filler(words, agent)}")


def tool_output(agent: int, turn: int, chars: int, seed: int) -> str:
    """~chars characters of seeded random tool output, the same for every server."""
    rng = random.Random(f"{seed}:{agent}:{turn}")
    words = [f"Tool output {turn} (agent {agent}):"]
    while sum(len(w) + 1 for w in words) < chars:
        words.append(str(rng.randrange(10_000)) if rng.random() < 0.15 else rng.choice(TOOL_WORDS))
    return " ".join(words)


def trace_order(agents: int, turns: int, shuffle: int | None) -> list[int]:
    """The agent of each turn, in arrival order; each agent's own turns stay in order."""
    order = [agent for _ in range(turns) for agent in range(agents)]
    if shuffle is not None:
        random.Random(shuffle).shuffle(order)
    return order


def context_per_agent(args) -> int:
    """KV tokens one conversation needs by its last reply (rendered with the GGUF's template,
    replies counted at twice max_tokens words), rounded up to 256."""
    from ellmd.model.weights import GGUFCheckpoint
    from ellmd.text import ChatTemplate, Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(args.model).fields)
    template = ChatTemplate.from_tokenizer(tokenizer)
    need = 0
    for agent in range(args.agents):
        messages = [{"role": "system", "content": system_prompt(agent, args.system_words)}]
        for turn in range(args.turns):
            messages += [{"role": "user", "content": tool_output(agent, turn, args.tool_chars, args.seed)},
                         {"role": "assistant", "content": filler(2 * args.max_tokens, turn)}]
        need = max(need, len(tokenizer.encode(template.render(messages))))
    return -(-(need + 64) // 256) * 256


# ---- the servers ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class Server:
    """A server process on 127.0.0.1:port, started and stopped as the trace needs; log in a file."""

    name: str
    launch: Callable  # (log file) -> Popen
    port: int
    log_path: Path
    stop_timeout_s: float
    process: subprocess.Popen | None = None
    cpu_s: float = 0.0  # of the processes stopped so far
    _cpu_at_mark: float = field(default=0.0, repr=False)

    def start(self, timeout_s: float) -> float:
        """Start it and wait for /health to answer 200; returns the seconds that took."""
        began = time.perf_counter()
        with self.log_path.open("ab") as log:
            self.process = self.launch(log)
        while True:
            if self.process.poll() is not None:
                raise TraceError(f"{self.name} exited with status {self.process.returncode} while starting\n"
                                 f"{self.log_tail()}")
            if self.healthy():
                self._cpu_at_mark = cpu_seconds(self.process.pid)
                return time.perf_counter() - began
            if time.perf_counter() - began > timeout_s:
                raise TraceError(f"{self.name} was not ready within {timeout_s:g} s\n{self.log_tail()}")
            time.sleep(0.25)

    def healthy(self) -> bool:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            connection.request("GET", "/health")
            ok = connection.getresponse().status == 200
            connection.close()
            return ok
        except OSError:
            return False

    def stop(self) -> float:
        """SIGTERM (a graceful stop: ellm snapshots its sessions), then SIGKILL past the timeout;
        returns the seconds it took."""
        if self.process is None:
            return 0.0
        began = time.perf_counter()
        process, self.process = self.process, None
        if process.poll() is None:
            try:
                self.cpu_s += cpu_seconds(process.pid) - self._cpu_at_mark
            except OSError:
                pass
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return time.perf_counter() - began

    def log_tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return f"--- last lines of {self.log_path} ---\n" + "\n".join(text[-lines:])


def clean_env() -> dict:
    """The environment without ELLMD_* settings, so that only the flags configure the daemon."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ELLMD_")}


def ellm_server(args, tmp: Path, context: int) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "ellmd.cli", "start", "--model-path", str(args.model),
               "--socket", str(tmp / "ellmd.sock"), "--store", str(tmp / "store"), "--rag-dir", str(tmp / "rag"),
               "--http", f"127.0.0.1:{port}", "--batch-size", str(args.slots), "--sequence-length", str(context),
               "--threads", str(args.threads), *shlex.split(args.ellm_args)]
    env = dict(clean_env(), XDG_CONFIG_HOME=str(tmp / "config"))  # no user ellmd.toml

    def launch(log):
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # Ctrl-C is ours to handle
    return Server("ellm", launch, port, args.log_dir / "ellmd.log", stop_timeout_s=300)


def llama_server(args, context: int) -> Server:
    binary = args.llama_native / "bin" / "llama-server"
    if not binary.is_file():
        raise TraceError(f"no {binary}: build it with scripts/llama_native.py, or point --llama-native "
                         "(or $LLAMA_NATIVE) at a build")
    port = free_port()
    flags = ["-m", str(args.model), "-np", str(args.slots), "--kv-unified", "-c", str(context * args.slots),
             "--cache-ram", str(args.cache_ram), "-t", str(args.threads), "-tb", str(args.threads),
             "--host", "127.0.0.1", "--port", str(port), "--no-webui", *shlex.split(args.llama_args)]

    def launch(log):
        return llama_native.start(args.llama_native, "llama-server", flags, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    return Server("llama-server", launch, port, args.log_dir / "llama-server.log", stop_timeout_s=60)


# ---- one streamed turn ----------------------------------------------------------------------


def stream_chat(server: Server, body: dict, timeout_s: float) -> dict:
    """One streamed chat completion, on a connection of its own (llama-server closes a connection
    after a streamed reply): seconds to the first content token and to the end, the reply, and the
    prompt and cached tokens of the final usage chunk."""
    began = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise TraceError(f"{server.name}: HTTP {response.status} to a chat completion: {response.read()[:2000]!r}")
        first, pieces, usage = None, [], None
        for line in response:  # server-sent events, one "data: {json}" line each
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise TraceError(f"{server.name}: an error event in the stream: {event['error']}")
            for choice in event.get("choices") or ():
                if text := (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    pieces.append(text)
            usage = event.get("usage") or usage
    except (OSError, http.client.HTTPException) as e:
        raise TraceError(f"{server.name}: the chat completion failed: {e!r}\n{server.log_tail()}") from None
    finally:
        connection.close()
    end = time.perf_counter()
    if usage is None:
        raise TraceError(f"{server.name}: the stream ended without a usage chunk")
    return {"ttft_s": (first or end) - began, "turn_s": end - began, "reply": "".join(pieces),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def run_trace(server: Server, args, order: list[int]) -> dict:
    """Replay the trace on one server (started here, always stopped); the per-turn figures."""
    histories = {agent: [{"role": "system", "content": system_prompt(agent, args.system_words)}]
                 for agent in set(order)}
    taken = dict.fromkeys(histories, 0)
    restart_index = round(args.restart_at * len(order)) if args.restart_at is not None else None
    result = {"turns": [], "trace_s": 0.0, "restart_s": None}
    try:
        result["start_s"] = server.start(args.start_timeout)
        for index, agent in enumerate(order):
            if index == restart_index:
                result["restart_s"] = server.stop() + server.start(args.start_timeout)
            turn, history = taken[agent], histories[agent]
            history.append({"role": "user", "content": tool_output(agent, turn, args.tool_chars, args.seed)})
            body = {"model": args.model.stem, "messages": history, "max_tokens": args.max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            if server.name == "ellm":
                body["session_id"] = f"agent-{agent}"  # its resident session, or the stored one
            else:
                body["cache_prompt"] = True
            measured = stream_chat(server, body, args.request_timeout)
            history.append({"role": "assistant", "content": measured["reply"]})
            taken[agent] += 1
            result["trace_s"] += measured["turn_s"]
            result["turns"].append({"index": index, "agent": agent, "turn": turn,
                                    "after_restart": restart_index is not None and index >= restart_index,
                                    **measured})
            if args.verbose:
                print(f"{server.name} turn {index} agent {agent}: ttft {measured['ttft_s'] * 1000:.0f} ms, "
                      f"prompt {measured['prompt_tokens']}, cached {measured['cached_tokens']}", file=sys.stderr)
    finally:
        server.stop()
    result["cpu_s"] = server.cpu_s
    return result


# ---- the report -----------------------------------------------------------------------------


def quarters(values: list[float]) -> list[list[float]]:
    n = len(values)
    return [values[n * q // 4:n * (q + 1) // 4] for q in range(4)]


def ms(values: list[float]) -> str:
    return f"{statistics.mean(values) * 1000:.0f}" if values else "-"


def report(console: Console, results: dict, args, context: int) -> None:
    restart = f", restart at {args.restart_at:g}" if args.restart_at is not None else ""
    order = f"shuffled (seed {args.shuffle})" if args.shuffle is not None else "round-robin"
    table = Table("system", "trace (s)", "server CPU (s)", "TTFT Q1 (ms)", "Q2", "Q3", "Q4",
                  "TTFT after restart (ms)", "restart (s)", "prompt tokens", "reused",
                  title=f"{args.model.name}: {args.agents} agents x {args.turns} turns {order}, {args.slots} slots"
                        f"{restart}, {args.threads} threads, {context} tokens per agent")
    for name, r in results.items():
        ttfts = [t["ttft_s"] for t in r["turns"]]
        prompt = sum(t["prompt_tokens"] for t in r["turns"])
        cached = sum(t["cached_tokens"] for t in r["turns"])
        table.add_row(name, f"{r['trace_s']:.1f}", f"{r['cpu_s']:.1f}", *(ms(q) for q in quarters(ttfts)),
                      ms([t["ttft_s"] for t in r["turns"] if t["after_restart"]]),
                      f"{r['restart_s']:.1f}" if r["restart_s"] is not None else "-",
                      str(prompt), f"{100 * cached / max(prompt, 1):.1f}%")
    console.print(table)
    if len(results) == len(SYSTEMS):
        ellm, llama = results["ellm"], results["llama-server"]
        console.print(f"llama-server / ellm: trace time {llama['trace_s'] / ellm['trace_s']:.2f}x, "
                      f"server CPU time {llama['cpu_s'] / max(ellm['cpu_s'], 1e-9):.2f}x")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=30, help="turns of each agent")
    parser.add_argument("--slots", type=int,
                        help="server slots (ellm --batch-size, llama-server -np) [default: agents]")
    parser.add_argument("--shuffle", type=int, metavar="SEED", help="a seeded random order instead of round-robin")
    parser.add_argument("--restart-at", type=float, metavar="FRACTION",
                        help="stop and restart each server at this fraction of the trace (e.g. 0.5)")
    parser.add_argument("--system-words", type=int, default=300, help="words of each agent's system prompt")
    parser.add_argument("--tool-chars", type=int, default=700, help="characters of each tool output")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of each reply at most")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tool outputs' text")
    parser.add_argument("--model", type=Path, help="a GGUF file both servers load [default: the built-in SmolLM2]")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-ram", type=int, default=8192, help="llama-server --cache-ram, MiB")
    parser.add_argument("--llama-native", type=Path, default=llama_native.native_root(),
                        help="native llama.cpp build holding bin/llama-server [default: $LLAMA_NATIVE or "
                             "~/.cache/ellm/llama-native]")
    parser.add_argument("--skip", choices=SYSTEMS, action="append", default=[], help="leave a system out")
    parser.add_argument("--ellm-args", default="", help="more `ellmd start` flags, one string")
    parser.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to be ready")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds a turn may take")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here [default: a temporary folder]")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every turn's figures to PATH")
    parser.add_argument("--verbose", action="store_true", help="a line per turn on stderr")
    args = parser.parse_args()
    args.slots = args.slots or args.agents
    if args.restart_at is not None and not 0 < args.restart_at < 1:
        parser.error("--restart-at takes a fraction between 0 and 1")
    if args.model is None:
        from ellmd.engine.engine import builtin_model_path

        args.model = builtin_model_path()
    if args.model.suffix != ".gguf" or not args.model.is_file():
        parser.error(f"--model must be a GGUF file (llama-server loads it too): {args.model}")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally blocks that stop the servers
    console = Console() if sys.stdout.isatty() else Console(width=160)  # the table in a log file too
    context = context_per_agent(args)
    order = trace_order(args.agents, args.turns, args.shuffle)
    results = {}
    with tempfile.TemporaryDirectory(prefix="ellm-agent-trace-") as tmp:
        tmp = Path(tmp)
        args.log_dir = args.log_dir or tmp
        args.log_dir.mkdir(parents=True, exist_ok=True)
        servers = {"ellm": lambda: ellm_server(args, tmp, context), "llama-server": lambda: llama_server(args, context)}
        try:
            for name in SYSTEMS:
                if name in args.skip:
                    continue
                console.print(f"{name}: {len(order)} turns", highlight=False)
                results[name] = run_trace(servers[name](), args, order)
        except TraceError as e:
            console.print(f"error: {e}", highlight=False, markup=False)
            sys.exit(1)
        except KeyboardInterrupt:
            console.print("interrupted: the servers were stopped")
            sys.exit(130)
    report(console, results, args, context)
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "context_per_agent": context, "order": order,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
