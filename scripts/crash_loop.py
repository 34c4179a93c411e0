"""SIGKILL the daemon inside store transactions, again and again; nothing acknowledged may be lost.

    python scripts/crash_loop.py --iterations 200 --seed 1

Each iteration starts the daemon on the same store with ELLMD_TEST_TXN_SLEEP set (each write
transaction sleeps that long before it commits, between two log lines that name it), runs random
opens, appends, forks, rewinds, explicit snapshots, exports with imports, closes and deletes, and
SIGKILLs it. Every other iteration the kill is aimed: after a random warm-up the workload issues
one op of the iteration's target (snapshot, fork, rewind, import, append, open in turn), and the
daemon SIGKILLs itself inside that op's first write transaction, just before it commits
(ELLMD_TEST_TXN_KILL names the file that arms it); the other iterations kill at a random moment. The daemon's log then says which transaction, if any, the kill
landed in (figures "killed_inside", as "op:transaction").

After the restart every session must hold exactly its acknowledged tokens and turns (an op in
flight at the kill may have happened or not, nothing in between), and the KV that came back must
give bit-identical logits to a recompute: the same session's history (the same prefills and
rewinds) replayed into a new session, then one more token appended to both and the top
log-probabilities of the next compared exactly. Prints one JSON line of figures; exits non-zero
on any loss.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "client"))

from ellm import Client  # noqa: E402

VOCAB = 49152
MAX_SESSIONS = 6
TARGETS = ("snapshot", "fork", "rewind", "import", "append", "open")  # the ops aimed kills land in, in turn
TXN_LINE = re.compile(rb"test: (inside|leaving) the (\w+) transaction")  # logged by store.crash_points


@dataclass
class Model:
    """What the client was told: per session, its history of prefills and rewinds."""

    history: list = field(default_factory=list)  # [("append", tokens) | ("rewind", n)]

    def tokens(self) -> list[int]:
        out = []
        for kind, value in self.history:
            out = out + value if kind == "append" else out[:value]
        return out

    def turns(self) -> list[tuple[int, int]]:
        spans, length = [], 0
        for kind, value in self.history:
            if kind == "append":
                spans.append((length, length + len(value)))
                length += len(value)
            else:
                spans, length = [s for s in spans if s[1] <= value], value
        return spans

    def then(self, kind, value) -> "Model":
        return Model(self.history + [(kind, value)])


class Daemon:
    def __init__(self, tmp: Path, txn_sleep: float):
        self.socket, self.store, self.log = tmp / "ellmd.sock", tmp / "store", tmp / "ellmd.log"
        self.kill_file = tmp / "kill-inside-the-next-transaction"
        self.env = {**os.environ, "ELLMD_TEST_TXN_SLEEP": str(txn_sleep), "ELLMD_TEST_TXN_KILL": str(self.kill_file),
                    "XDG_CONFIG_HOME": str(tmp / "config")}
        self.process = None

    def start(self) -> "Daemon":
        args = [sys.executable, "-m", "ellmd.cli", "start", "--socket", str(self.socket), "--store", str(self.store),
                "--batch-size", "2", "--sequence-length", "2048", "--chunk-size", "256", "--threads", "2"]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=log, env=self.env, cwd=ROOT)
        deadline = time.monotonic() + 900  # a start takes seconds, but minutes on a loaded machine
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log.read_text()[-2000:]}")
            try:
                Client(self.socket, timeout=5).close()
                return self
            except Exception:
                time.sleep(0.1)
        self.process.kill()  # leave no daemon behind
        self.process.wait(30)
        raise RuntimeError(f"daemon did not start within 900 s (log: {self.log})")


def exported(client, session_id) -> dict:
    blob = bytearray()
    for event in client.stream("session.export", session_id=session_id):
        blob += event["data"]
    return msgpack.unpackb(bytes(blob), raw=False)


class Workload:
    """Random acknowledged ops; `in_flight` is the op that had no reply yet when the daemon died.

    `force`, once set (by the Killer), makes the next op one of that kind, issued with the
    daemon's kill file in place: its first write transaction is the daemon's last."""

    def __init__(self, rng: random.Random, models: dict[str, Model], kill_file: Path):
        self.rng, self.models, self.kill_file = rng, models, kill_file
        self.in_flight = None  # (kind, session id, model if it happened)
        self.ops: dict[str, int] = {}
        self.force: str | None = None

    def run(self, client) -> None:
        while True:
            self.step(client)

    def choose(self) -> tuple[str, str | None]:
        rng, models = self.rng, self.models
        kinds = ["open"] if not models else ["append", "append", "fork", "rewind", "snapshot", "import",
                                             "close", "delete", "open"]
        kind = self.force if self.force and models else rng.choice(kinds)
        if kind in ("open", "fork", "import") and len(models) >= MAX_SESSIONS:
            kind = "delete"
        filled = sorted(sid for sid in models if models[sid].tokens())
        if kind == "rewind" and not filled:
            kind = "append"
        sid = rng.choice(filled if kind == "rewind" else sorted(models)) if models else None
        return kind, sid

    def step(self, client) -> None:
        rng, models = self.rng, self.models
        kind, sid = self.choose()
        self.ops[kind] = self.ops.get(kind, 0) + 1
        if kind == self.force:  # the reply to the op before has come: its transactions are over
            self.kill_file.touch()
        if kind == "open":
            self.in_flight = (kind, None, None)
            models[client.open_session(title="crash").id] = Model()
        elif kind == "append":
            tokens = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 120))]
            self.in_flight = (kind, sid, models[sid].then("append", tokens))
            client.session(sid).append(tokens=tokens)
            models[sid] = self.in_flight[2]
        elif kind == "rewind":
            keep = rng.randrange(len(models[sid].tokens()))  # always shorter, so before and after can be told apart
            self.in_flight = (kind, sid, models[sid].then("rewind", keep))
            client.session(sid).rewind(tokens=keep)
            models[sid] = self.in_flight[2]
        elif kind == "fork":
            self.in_flight = (kind, sid, None)
            models[client.session(sid).fork().id] = Model(list(models[sid].history))
        elif kind == "import":
            self.in_flight = (kind, sid, None)
            blob = bytearray()
            for event in client.stream("session.export", session_id=sid):
                blob += event["data"]
            models[client.import_session(bytes(blob)).id] = Model(list(models[sid].history))
        elif kind == "delete":
            self.in_flight = (kind, sid, None)
            client.session(sid).delete()
            del models[sid]
        else:  # snapshot, close: nothing acknowledged changes
            self.in_flight = (kind, sid, models[sid])
            getattr(client.session(sid), kind)()
        self.in_flight = None


class Killer(threading.Thread):
    """SIGKILLs the daemon `delay` seconds into the workload; with a `target`, tells the workload to
    issue a `target` op then (the daemon kills itself inside its first write transaction), and
    kills the daemon AIM_DEADLINE_S later should it still live."""

    AIM_DEADLINE_S = 60.0  # an op takes well under a second on a quiet machine, tens of seconds on a loaded one

    def __init__(self, process, workload: Workload, delay: float, target: str | None, log: Path):
        super().__init__(daemon=True)
        self.process, self.workload, self.delay, self.target = process, workload, delay, target
        self.offset = log.stat().st_size  # where this iteration's log lines begin

    def run(self) -> None:
        started = time.monotonic()
        deadline = self.delay + (self.AIM_DEADLINE_S if self.target else 0)
        while self.process.poll() is None:
            elapsed = time.monotonic() - started
            if self.target and elapsed >= self.delay:
                self.workload.force = self.target
            if elapsed >= deadline:
                self.process.send_signal(signal.SIGKILL)
                return
            time.sleep(0.01)


def killed_inside(log: Path, offset: int) -> str | None:
    """The transaction a kill landed in: the last one the log shows begun and not left, if any."""
    with open(log, "rb") as f:
        f.seek(offset)
        found = TXN_LINE.findall(f.read())
    return found[-1][1].decode() if found and found[-1][0] == b"inside" else None


def check(client, models: dict[str, Model], in_flight, rng: random.Random, logit_checks: int) -> dict:
    """Every acknowledged session whole after the restart; returns {sessions, lost, logits_compared}."""
    kind, target, after = in_flight or (None, None, None)
    stored = {s["session_id"] for s in client.list_sessions()}
    lost = []
    for sid in list(models):
        if sid not in stored:
            if kind == "delete" and sid == target:  # the delete in flight happened
                del models[sid]
                continue
            lost.append(f"{sid}: gone")
            continue
        info = client.session(sid).info()
        tokens = msgpack_tokens(exported(client, sid))
        candidates = [models[sid]] + ([after] if sid == target and after is not None else [])
        match = next((m for m in candidates if m.tokens() == tokens), None)
        if match is None:
            lost.append(f"{sid}: {len(tokens)} tokens, acknowledged {len(models[sid].tokens())}")
            continue
        models[sid] = match
        turns = [(t["start"], t["end"]) for t in info["turns"]]
        if turns != match.turns():
            lost.append(f"{sid}: turns {turns} != acknowledged {match.turns()}")
    for sid in stored - set(models):  # made by a fork, import or open in flight: unknown to the model
        client.session(sid).delete()
    compared = 0
    filled = sorted(sid for sid in models if models[sid].tokens())
    for sid in rng.sample(filled, min(logit_checks, len(filled))):
        if resumed_logits(client, sid) != recomputed_logits(client, models[sid]):
            lost.append(f"{sid}: resumed KV does not give the recomputed logits")
        compared += 1
    return {"sessions": len(models), "lost": lost, "logits_compared": compared}


def msgpack_tokens(document: dict) -> list[int]:
    data = document["tokens"]
    return [int.from_bytes(data[i:i + 4], "little", signed=True) for i in range(0, len(data), 4)]


def next_logprobs(session) -> list:
    session.append(tokens=[42])
    return session.generate(max_tokens=1, logprobs=5).logprobs


def resumed_logits(client, sid) -> list:
    fork = client.session(sid).fork()  # the check leaves the session itself as it was
    try:
        return next_logprobs(fork)
    finally:
        fork.delete()


def recomputed_logits(client, model: Model) -> list:
    fresh = client.open_session(title="recompute")
    try:
        for kind, value in model.history:
            fresh.append(tokens=value) if kind == "append" else fresh.rewind(tokens=value)
        return next_logprobs(fresh)
    finally:
        fresh.delete()


def crash_loop(tmp: Path, iterations: int, seed: int, txn_sleep: float = 0.03, logit_checks: int = 2,
               kill_after=(0.3, 2.5), progress=None) -> dict:
    """Run the loop; returns the figures (lost is the list of everything that did not come back)."""
    rng = random.Random(seed)
    models: dict[str, Model] = {}
    figures = {"iterations": 0, "sigkills": 0, "sessions_checked": 0, "lost": [], "logits_compared": 0,
               "in_flight": {}, "aimed": {}, "killed_inside": {}, "ops": {}}
    daemon = Daemon(tmp, txn_sleep)
    in_flight = None
    for iteration in range(iterations):
        daemon.start()
        with Client(daemon.socket, timeout=120) as client:
            result = check(client, models, in_flight, rng, logit_checks)
        figures["sessions_checked"] += result["sessions"]
        figures["lost"] += [f"iteration {iteration}: {x}" for x in result["lost"]]
        figures["logits_compared"] += result["logits_compared"]
        workload = Workload(rng, models, daemon.kill_file)
        target = TARGETS[iteration // 2 % len(TARGETS)] if iteration % 2 == 0 else None
        killer = Killer(daemon.process, workload, rng.uniform(*kill_after), target, daemon.log)
        killer.start()
        try:
            with Client(daemon.socket, timeout=120) as client:
                workload.run(client)
        except Exception:
            pass  # the daemon is gone
        killer.join()
        daemon.process.wait(30)
        daemon.kill_file.unlink(missing_ok=True)
        in_flight = workload.in_flight
        tally(figures, workload, target, killed_inside(daemon.log, killer.offset))
        if progress:
            progress(iteration, figures)
    daemon.start()  # the last check, then a clean stop
    with Client(daemon.socket, timeout=120) as client:
        result = check(client, models, in_flight, rng, logit_checks)
        client.shutdown()
    figures["lost"] += result["lost"]
    figures["logits_compared"] += result["logits_compared"]
    figures["exit_code"] = daemon.process.wait(120)
    return figures


def tally(figures: dict, workload: Workload, target: str | None, transaction: str | None) -> None:
    def count(key: str, name: str) -> None:
        figures[key][name] = figures[key].get(name, 0) + 1

    figures["sigkills"] += 1
    figures["iterations"] += 1
    name = workload.in_flight[0] if workload.in_flight else "none"
    count("in_flight", name)
    if target:
        count("aimed", target)
    if transaction:
        count("killed_inside", f"{name}:{transaction}")
    for kind, n in workload.ops.items():
        figures["ops"][kind] = figures["ops"].get(kind, 0) + n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--txn-sleep", type=float, default=0.03, help="seconds each write transaction sleeps")
    parser.add_argument("--kill-after", type=float, nargs=2, default=(0.3, 2.5), metavar=("MIN", "MAX"),
                        help="the SIGKILL comes this many seconds (uniform) after the workload starts")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ellm-crash-") as tmp:
        figures = crash_loop(Path(tmp), options.iterations, options.seed, options.txn_sleep, kill_after=options.kill_after,
                             progress=lambda i, f: print(f"iteration {i + 1}: sigkills {f['sigkills']}, sessions checked "
                                                         f"{f['sessions_checked']}, logits compared {f['logits_compared']}, "
                                                         f"lost {len(f['lost'])}, killed inside {f['killed_inside']}",
                                                         file=sys.stderr, flush=True))
    print(json.dumps(figures))
    return 1 if figures["lost"] or figures["exit_code"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
