"""Several agents interleaved: ellm's daemon beside llama.cpp, on one multi-turn trace.

Each agent has its own long system prompt (tool documentation) and takes turns: a tool result
comes in, the agent answers with a fixed number of greedy tokens. The agents' turns interleave
(turn 1 of every agent, then turn 2, ...), as when several agents share one inference server.

  ellm                    the daemon (`ellmd start --batch-size AGENTS`), through the client: each
                          session stays resident, each turn prefills only its new tokens
  llama.cpp, 1 context    llama-cpp-python on one context, reusing the longest prefix of what it
                          evaluated last (what its generate() does): with interleaved agents, that
                          is another agent's conversation, so every turn is prefilled whole
  llama.cpp, N contexts   one context per agent (like llama-server's slots with prompt caching):
                          incremental too, at N times the memory of the weights

All read the same weights (an F16 GGUF of the built-in model; ellm keeps them in bf16) and the same prompt tokens
(rendered by the model's chat template); time to first token is measured by the caller.

    .venv/bin/python scripts/bench_agents.py --agents 4 --turns 4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compare import LlamaCppRunner, prepare_model, require_llama_cpp  # noqa: E402
from bench_turns import filler  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
def trace(args) -> list[tuple[int, str]]:
    """(agent, tool result) in the order the turns arrive."""
    return [(a, f"Tool result {t} for agent {a}: " + filler(args.turn_words, 100 * a + t))
            for t in range(args.turns) for a in range(args.agents)]


def system_prompt(agent: int, args) -> str:
    return f"You are agent {agent}. Tools: " + filler(args.system_words, agent)


def run_ellm(args, tmp: Path, gguf: Path) -> dict:
    from ellm import Client

    socket = tmp / "ellmd.sock"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "ellmd.cli", "start", "--model-path", str(gguf), "--weight-dtype", "bf16",
         "--socket", str(socket), "--store", str(tmp / "store"),
         "--batch-size", str(args.agents), "--sequence-length", str(args.context), "--threads", str(args.threads)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not socket.exists():
            if daemon.poll() is not None:
                raise SystemExit("ellmd did not start")
            time.sleep(0.2)
        time.sleep(0.5)
        with Client(socket) as client:
            sessions = {}
            ttfts, prefilled = [], 0
            start = time.perf_counter()
            for agent, message in trace(args):
                began = time.perf_counter()
                if agent not in sessions:  # its first turn also prefills the system prompt, as for llama.cpp
                    sessions[agent] = client.open_session(system=system_prompt(agent, args))
                    prefilled += sessions[agent].info()["tokens"]
                stream = sessions[agent].chat(message, stream=True, max_tokens=args.reply_tokens, ignore_eos=True)
                first = None
                for _ in stream:
                    first = first or time.perf_counter()
                ttfts.append(first - began)
                prefilled += stream.result.usage["prefilled_tokens"]
            return {"seconds": time.perf_counter() - start, "ttfts": ttfts, "prefilled": prefilled}
    finally:
        daemon.terminate()
        daemon.wait(120)


class Conversation:
    """One agent's chat, rendered to token ids by the model's template, for llama.cpp."""

    def __init__(self, agent: int, args, template, tokenizer):
        self.messages = [{"role": "system", "content": system_prompt(agent, args)}]
        self.template, self.tokenizer = template, tokenizer

    def prompt(self, message: str) -> list[int]:
        self.messages.append({"role": "user", "content": message})
        return self.tokenizer.encode(self.template.render(self.messages, add_generation_prompt=True))

    def reply(self, token_ids: list[int]) -> None:
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(token_ids, skip_special_tokens=True)})


def run_llama_cpp(args, gguf: Path, contexts: int, template, tokenizer) -> dict:
    runners = [LlamaCppRunner(gguf, args.context, args.threads, flash_attn=False) for _ in range(contexts)]
    evaluated = [[] for _ in runners]  # the tokens each context's KV holds
    conversations = [Conversation(a, args, template, tokenizer) for a in range(args.agents)]
    ttfts, prefilled = [], 0
    start = time.perf_counter()
    for agent, message in trace(args):
        began = time.perf_counter()
        prompt = conversations[agent].prompt(message)
        index = agent % contexts
        runner, held = runners[index], evaluated[index]
        keep = 0
        while keep < min(len(held), len(prompt) - 1) and held[keep] == prompt[keep]:
            keep += 1
        runner.llm.n_tokens = keep  # the next eval drops the KV past the shared prefix
        token = runner.prefill(prompt[keep:])
        ttfts.append(time.perf_counter() - began)
        prefilled += len(prompt) - keep
        reply = [token]
        for _ in range(args.reply_tokens - 1):
            reply.append(runner.decode_step(reply[-1]))
        evaluated[index] = prompt + reply[:-1]
        conversations[agent].reply(reply)
    seconds = time.perf_counter() - start
    for runner in runners:
        runner.close()
    return {"seconds": seconds, "ttfts": ttfts, "prefilled": prefilled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=800, help="words of each agent's system prompt")
    parser.add_argument("--turn-words", type=int, default=100, help="words of each tool result")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096, help="KV capacity per session / context")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--install-llama-cpp", action="store_true", help="pip install llama-cpp-python if missing")
    args = parser.parse_args()
    require_llama_cpp(args.install_llama_cpp)

    from ellmd.engine import builtin_model_path
    from ellmd.model.weights import GGUFCheckpoint
    from ellmd.text import ChatTemplate, Tokenizer

    console = Console()
    with tempfile.TemporaryDirectory(prefix="ellm-bench-agents-") as tmp:
        tmp = Path(tmp)
        args.layers, args.seed = None, 0
        case = prepare_model("builtin", args, tmp)
        tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(builtin_model_path()).fields)
        template = ChatTemplate.from_tokenizer(tokenizer)
        results = {}
        console.print(f"{args.agents} agents x {args.turns} turns, {args.threads} threads: ellm daemon")
        results["ellm (daemon)"] = run_ellm(args, tmp, case.gguf)
        console.print("llama.cpp, 1 context")
        results["llama.cpp, 1 context"] = run_llama_cpp(args, case.gguf, 1, template, tokenizer)
        console.print(f"llama.cpp, {args.agents} contexts")
        results[f"llama.cpp, {args.agents} contexts"] = run_llama_cpp(args, case.gguf, args.agents, template, tokenizer)

    later = slice(args.agents, None)  # turns after each agent's first (which prefills its system prompt)
    table = Table("system", "trace (s)", "tokens prefilled", "TTFT turn 1 (ms)", "TTFT later turns (ms)",
                  title=f"SmolLM2-135M: {args.agents} interleaved agents x {args.turns} turns "
                        f"({args.reply_tokens} tokens per reply)")
    for name, r in results.items():
        table.add_row(name, f"{r['seconds']:.1f}", str(r["prefilled"]),
                      f"{statistics.mean(r['ttfts'][:args.agents]) * 1000:.0f}",
                      f"{statistics.mean(r['ttfts'][later]) * 1000:.0f}")
    console.print(table)
    ellm = results["ellm (daemon)"]["seconds"]
    console.print("trace time / ellm's: " + ", ".join(f"{n} {r['seconds'] / ellm:.2f}x" for n, r in results.items()))


if __name__ == "__main__":
    main()
