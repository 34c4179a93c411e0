"""The fleet on Ray Serve: `ellmd fleet start` with 2 replicas of the built-in model at 1 thread each,
driven over HTTP like any OpenAI client.

One fleet serves the whole module (it takes a while to start): sessions keep to their replica, each
turn prefills only its new tokens, an anonymous conversation meets its own prefix, a SIGKILLed
replica loses no acknowledged turn and its sessions go on bit-identical to a lone daemon's, and
SIGTERM stops the fleet with every session in the store.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from daemon import ROOT, Daemon
from ellmd.fleet.app import READY_LINE
from ellmd.fleet.metrics import merge
from ellmd.fleet.replica import replica_processes
from ellmd.fleet.routing import PREFIX_KEY, routing_key

SESSIONS = 8
TURNS = 3
MAX_TOKENS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, headers: dict | None = None):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.headers, json.loads(response.read())  # headers: case-insensitive


def question(session: int, turn: int) -> str:
    return f"Agent {session}, step {turn}: name one prime number above {10 * session + turn}."


def chat_body(history: list[dict]) -> dict:
    return {"messages": history, "max_tokens": MAX_TOKENS, "temperature": 0}


class Fleet:
    def __init__(self, tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "fleet.log"
        self.store = tmp / "store"
        # Ray's sockets live under its temp dir, and a socket's path must stay under 108 bytes
        self.ray_tmp = tempfile.mkdtemp(prefix="ellm-ray-", dir="/tmp")
        env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "config"), "RAY_TMPDIR": self.ray_tmp}
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ellmd.cli", "fleet", "start", "--replicas", "2", "--threads", "1",
                 "--batch-size", "4", "--sequence-length", "2048", "--store", str(self.store),
                 "--http", f"127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            self.wait_ready()
        except BaseException:  # pytest-timeout's too: a fleet that never served must not outlive the test
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM, which stops Ray's processes with the fleet (a SIGKILL left them running, busy);
        SIGKILL past a minute."""
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def wait_ready(self, timeout: float = 900) -> None:
        """Until the fleet says it serves: every replica is up (its /health answers from the first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            if READY_LINE in self.log.read_text(errors="replace"):
                return
            time.sleep(1)
        raise AssertionError(f"the fleet did not start: {self.log.read_text()[-3000:]}")

    def chat(self, history: list[dict], session_id: str | None = None) -> tuple[str, dict, str]:
        """(reply text, usage, serving replica) of one turn."""
        headers = {"X-Session-Id": session_id} if session_id else {}
        head, body = post(self.url + "/v1/chat/completions", chat_body(history), headers)
        return body["choices"][0]["message"]["content"], body["usage"], head["X-Ellm-Replica"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    yield fleet
    if fleet.process.poll() is None:
        fleet.stop()
        fleet.process.wait()
    shutil.rmtree(fleet.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same conversations on a lone daemon at 1 thread, never interrupted: the texts to match."""
    port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp("lone"), slots=SESSIONS, extra=["--http", f"127.0.0.1:{port}"])
    daemon.args[daemon.args.index("--threads") + 1] = "1"  # as the fleet's replicas
    daemon.start()
    url = f"http://127.0.0.1:{port}"
    texts = {}
    try:
        for s in range(SESSIONS):
            history = []
            for turn in range(TURNS + 1):
                history.append({"role": "user", "content": question(s, turn)})
                _, body = post(url + "/v1/chat/completions", chat_body(history), {"X-Session-Id": f"ref-{s}"})
                history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            texts[s] = [m["content"] for m in history[1::2]]
    finally:
        daemon.stop()
    return texts


def test_routing_key_names_the_session_else_the_conversation_start():
    headers = {"x-session-id": "h1"}
    assert routing_key(headers, {"messages": []}) == "h1"
    assert routing_key({}, {"session_id": "b1", "messages": []}) == "b1"
    assert routing_key({}, {"previous_response_id": "resp_0123456789abcdef_s42", "input": "go on"}) == "s42"
    assert routing_key({}, None, "/v1/responses/resp_0123456789abcdef_s43") == "s43"  # GET, DELETE
    assert routing_key({}, None, "/v1/responses/resp_nothing") is None
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert routing_key({}, {"messages": first}).startswith(PREFIX_KEY)
    assert routing_key({}, {"messages": first}) == routing_key({}, {"messages": later})
    other = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]
    assert routing_key({}, {"messages": other}) != routing_key({}, {"messages": first})
    assert routing_key({}, {"prompt": "abc"}) == routing_key({}, {"prompt": "abc"}) != routing_key({}, {"prompt": "abd"})
    assert routing_key({}, None) is None and routing_key({}, {"model": "x"}) is None


def test_metrics_of_replicas_merge_under_a_replica_label():
    text = ("# HELP ellm_generated_tokens_total Tokens generated.\n# TYPE ellm_generated_tokens_total counter\n"
            "ellm_generated_tokens_total {n}\n# HELP ellm_sessions_resident Sessions.\n"
            "# TYPE ellm_sessions_resident gauge\nellm_sessions_resident{{kind=\"x\"}} 2.0\n")
    merged = merge({"r1": text.format(n=5), "r2": text.format(n=7)}).decode()
    assert 'ellm_generated_tokens_total{replica="r1"} 5.0' in merged
    assert 'ellm_generated_tokens_total{replica="r2"} 7.0' in merged
    assert 'ellm_sessions_resident{kind="x",replica="r2"} 2.0' in merged
    assert merged.count("# TYPE ellm_generated_tokens_total counter") == 1


def test_sessions_keep_to_their_replica_and_survive_a_killed_one(fleet, reference):
    histories = {s: [] for s in range(SESSIONS)}
    served: dict[int, list[str]] = {s: [] for s in range(SESSIONS)}

    def turn(s: int, t: int) -> dict:
        histories[s].append({"role": "user", "content": question(s, t)})
        text, usage, replica = fleet.chat(histories[s], f"agent-{s}")
        histories[s].append({"role": "assistant", "content": text})
        served[s].append(replica)
        return usage

    # The sessions start together, as agents do: a burst of new ids must still spread over both.
    with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
        prompts = {s: usage["prompt_tokens"] for s, usage in enumerate(pool.map(lambda s: turn(s, 0), range(SESSIONS)))}
    for t in range(1, TURNS):
        for s in range(SESSIONS):
            usage = turn(s, t)
            # the turns before are in the session's KV: only the new message is prefilled
            assert usage["prompt_tokens_details"]["cached_tokens"] >= prompts[s]
            prompts[s] = usage["prompt_tokens"]
    for s in range(SESSIONS):
        assert len(set(served[s])) == 1, f"agent-{s} moved between replicas: {served[s]}"
    placed = collections.Counter(served[s][0] for s in range(SESSIONS))
    assert sorted(placed.values()) == [SESSIONS // 2] * 2, f"new sessions not spread evenly: {served}"
    replicas = set(placed)
    time.sleep(6)  # a metrics period
    with urllib.request.urlopen(fleet.url + "/metrics", timeout=30) as response:
        metrics = response.read().decode()
    for replica in replicas:
        assert f'ellm_generated_tokens_total{{replica="{replica}"}}' in metrics

    victim = served[0][0]
    pids = replica_processes(victim)
    assert pids, f"no process of replica {victim}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for s in range(SESSIONS):
        usage = turn(s, TURNS)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= prompts[s], \
            f"agent-{s} lost acknowledged turns: {usage}"
        assert served[s][-1] != victim
    for s in range(SESSIONS):
        texts = [m["content"] for m in histories[s][1::2]]
        assert texts == reference[s], f"agent-{s} differs from a lone daemon's never-interrupted session"


def test_an_anonymous_conversation_meets_its_prefix(fleet):
    history = [{"role": "system", "content": "You answer in one short sentence."},
               {"role": "user", "content": "What is the capital of France?"}]
    text, first, replica = fleet.chat(history)
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "And of Italy?"}]
    _, second, again = fleet.chat(history)
    assert again == replica
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"]


def test_sigterm_stops_the_fleet_with_every_session_stored(fleet, tmp_path):
    fleet.process.send_signal(signal.SIGTERM)
    assert fleet.process.wait(timeout=300) == 0, fleet.log.read_text()[-3000:]
    daemon = Daemon(tmp_path, slots=2)
    daemon.args[daemon.args.index("--store") + 1] = str(fleet.store)
    daemon.start()
    try:
        stored = {s["session_id"]: s for s in daemon.client().list_sessions()}
    finally:
        daemon.stop()
    for s in range(SESSIONS):
        assert stored[f"agent-{s}"]["tokens"] > 0
