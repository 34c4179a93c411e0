"""The web console (/console), its JSON endpoints (/api/...), the `live` and `session.turns` ops and
`ellm top`, against one real daemon with API keys (an admin key and a tenant's).

The browser tests drive the console in Debian's chromium through Selenium and its chromium-driver
(nothing downloaded; .ci/run installs both, and the tests skip, saying so, only where chromium is
absent). Each page's screenshot is written to tests/artifacts/console/ (the path is printed).
"""

from __future__ import annotations

import http.client
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ellm.cli import app as ellm_app

from daemon import ROOT
from test_http import start_daemon

ARTIFACTS = ROOT / "tests" / "artifacts" / "console"
STATIC = ROOT / "ellmd" / "server" / "http" / "console_files"
OPS_KEY, ALICE_KEY = "key-of-the-operator", "key-of-alice"
WAIT_S = 180  # for the browser to see what the daemon does (a loaded 2-core machine)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    keys = tmp / "keys"
    keys.write_text(f"ops {OPS_KEY} admin\nalice {ALICE_KEY}\n")
    d, d.port = start_daemon(tmp, slots=2, extra=["--api-key-file", str(keys)])
    yield d
    assert d.stop() == 0


def call(port: int, path: str, key: str | None = OPS_KEY, body=None, method: str | None = None, headers=None):
    """(status, headers, body bytes) of one request to the daemon."""
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def call_json(port: int, path: str, **kwargs) -> tuple[int, dict]:
    status, _, data = call(port, path, **kwargs)
    return status, json.loads(data)


@pytest.fixture(scope="module")
def made(daemon):
    """Sessions made over the socket (the operator's), over HTTP with the admin key, and with alice's key."""
    with daemon.client() as client:
        session = client.open_session(title="made over the socket", tags=["socket"], system="You are terse.")
        session.chat("Name a color.", max_tokens=8, temperature=0)
    chat = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8, "temperature": 0}
    status, reply = call_json(daemon.port, "/v1/chat/completions", body={**chat, "session_id": "made-over-http"})
    assert status == 200, reply
    status, _ = call_json(daemon.port, "/v1/chat/completions", key=ALICE_KEY, body={**chat, "session_id": "alice-own"})
    assert status == 200
    return {"socket": session.id, "http": "made-over-http", "reply": reply["choices"][0]["message"]["content"],
            "usage": reply["usage"]}


# ---- the endpoints ------------------------------------------------------------------------------


SESSION_FIELDS = {"session_id", "owner", "title", "tags", "tokens", "turn_count", "resident", "busy", "created",
                  "updated", "kv_bytes"}


def test_sessions_lists_both_transports_with_owners_by_key_name(daemon, made):
    status, body = call_json(daemon.port, "/api/sessions")
    assert status == 200
    sessions = {s["session_id"]: s for s in body["sessions"]}
    assert {made["socket"], made["http"]} <= set(sessions)
    per_token = call_json(daemon.port, "/api/status")[1]["kv_bytes_per_token"]
    for info in sessions.values():
        assert SESSION_FIELDS <= set(info)
        assert info["kv_bytes"] == info["tokens"] * per_token
    assert sessions[made["socket"]]["owner"] is None and sessions[made["socket"]]["turn_count"] == 3
    alice = [s for s in sessions.values() if s["session_id"].startswith("alice-own@")]
    assert len(alice) == 1 and alice[0]["owner"] == "alice"  # the key's name, never its fingerprint


def test_a_tenant_key_reaches_its_sessions_alone_and_not_the_live_view(daemon, made):
    status, body = call_json(daemon.port, "/api/sessions", key=ALICE_KEY)
    assert status == 200 and [s["session_id"] for s in body["sessions"]] == ["alice-own"]
    assert body["sessions"][0]["owner"] == "alice"
    assert call_json(daemon.port, "/api/sessions/alice-own", key=ALICE_KEY)[1]["session_id"] == "alice-own"
    status, body = call_json(daemon.port, f"/api/sessions/{made['socket']}", key=ALICE_KEY)
    assert status == 404 and body["error"]["type"] == "not_found_error"
    for path in ("/api/live", "/api/status"):
        status, body = call_json(daemon.port, path, key=ALICE_KEY)
        assert status == 403 and "admin key" in body["error"]["message"]


def test_a_session_gives_its_turns_with_token_counts_text_and_ids_on_demand(daemon, made):
    status, body = call_json(daemon.port, f"/api/sessions/{made['http']}?tokens=1")
    assert status == 200
    turns = body["turns"]
    assert [t["index"] for t in turns] == list(range(len(turns))) and turns[-1]["kind"] == "generation"
    for turn in turns:
        assert turn["tokens"] == turn["end"] - turn["start"] == len(turn["token_ids"])
    assert sum(t["tokens"] for t in turns) == body["tokens"]
    usage = body["usage"]  # the session's own counters: what its one request did
    assert usage["generated"] == made["usage"]["completion_tokens"]
    assert usage["prefilled"] + usage["reused"] == made["usage"]["prompt_tokens"]
    assert usage["reused"] == made["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert made["reply"] in turns[-1]["text"] and "Name a fruit." in turns[-1]["text"]
    assert body["messages"] == [{"role": "user", "content": "Name a fruit."},
                                {"role": "assistant", "content": made["reply"]}]
    status, plain = call_json(daemon.port, f"/api/sessions/{made['http']}")
    assert [{k: v for k, v in t.items() if k != "token_ids"} for t in turns] == plain["turns"]
    with daemon.client() as client:  # the socket's op gives the same turns
        assert client.call("session.turns", session_id=made["http"])["turns"] == turns


def test_fork_rewind_export_and_delete_over_http(daemon, made):
    port, source = daemon.port, made["socket"]
    status, fork = call_json(port, f"/api/sessions/{source}/fork", body={"title": "a fork"}, method="POST")
    assert status == 200 and fork["title"] == "a fork" and fork["session_id"] != source
    assert fork["tokens"] == call_json(port, f"/api/sessions/{source}")[1]["tokens"]
    path = f"/api/sessions/{fork['session_id']}"
    status, body = call_json(port, f"{path}/rewind", body={"turn": 1, "tokens": 3}, method="POST")
    assert status == 400 and "exactly one" in body["error"]["message"]
    status, rewound = call_json(port, f"{path}/rewind", body={"turn": 1}, method="POST")
    assert status == 200 and rewound["tokens"] == fork["turns"][1]["start"] and len(rewound["turns"]) == 1
    status, headers, blob = call(port, f"{path}/export")
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    assert int(headers["X-Session-Tokens"]) == rewound["tokens"]
    status, body = call_json(port, path, method="DELETE")
    assert status == 200 and body == {"session_id": fork["session_id"]}
    assert call_json(port, path)[0] == 404
    with daemon.client() as client:  # the export is a whole session blob
        imported = client.import_session(blob)
        assert client.session(imported.id).info()["tokens"] == rewound["tokens"]
        imported.delete()


def test_live_gives_slots_requests_and_counters(daemon, made):
    status, live = call_json(daemon.port, "/api/live")
    assert status == 200 and len(live["slots"]) == 2
    for slot in live["slots"]:
        assert slot["state"] in ("free", "idle", "prefilling", "generating")
        assert (slot["session_id"] is None) == (slot["state"] == "free")
    assert live["counters"]["generated"] > 0 and 0 < live["kv_bytes_used"] <= live["kv_bytes"]
    assert {"in_flight", "max_queue", "waiting", "queued", "prefilling", "generating", "store",
            "sessions_stored"} <= set(live)


def test_live_and_ellm_top_show_a_session_generating(daemon, made):
    """While a streamed generation runs (its first tokens came, hundreds are left), the live op and
    `ellm top --once` show its slot generating."""
    with daemon.client() as client:
        session = client.open_session(title="long one")
        stream = session.chat("Count from one to a thousand.", stream=True, max_tokens=600, ignore_eos=True,
                              temperature=0)
        pieces = iter(stream)
        next(pieces), next(pieces)
        live = client.call("live")
        top = CliRunner().invoke(ellm_app, ["--socket", str(daemon.socket), "top", "--once"])
        for _ in pieces:  # to its end: the session is then idle
            pass
    slot = next(s for s in live["slots"] if s["session_id"] == session.id)
    assert slot["state"] == "generating" and slot["generated"] >= 1 and live["generating"] == 1
    assert top.exit_code == 0, top.output
    line = next(line for line in top.output.splitlines() if session.id in line)
    assert "generating" in line and "long one" in line


def test_ellm_top_once_prints_a_line_per_slot(daemon, made):
    result = CliRunner().invoke(ellm_app, ["--socket", str(daemon.socket), "top", "--once"])
    assert result.exit_code == 0, result.output
    with daemon.client() as client:
        live = client.call("live")
    lines = result.output.splitlines()
    for slot in live["slots"]:
        row = [line for line in lines if line.startswith(f"│ {slot['slot']} ")]
        assert len(row) == 1 and slot["state"] in row[0] and (slot["session_id"] or "") in row[0]
    assert "KV " in result.output and "requests " in result.output and "tokens since start" in result.output


def test_ellm_top_sorts_its_lines_by_the_key_chosen():
    from rich.console import Console

    from ellm import top

    slots = [{"slot": 0, "state": "idle", "session_id": "a", "title": "", "tokens": 10},
             {"slot": 1, "state": "generating", "session_id": "b", "title": "", "tokens": 30, "generated": 5, "tok_s": 9.5},
             {"slot": 2, "state": "prefilling", "session_id": "c", "title": "", "tokens": 20, "done": 256, "total": 1024},
             {"slot": 3, "state": "free", "session_id": None}]
    counters = dict.fromkeys(("prefilled", "reused", "shared", "generated", "drafted", "accepted"), 0)
    stats = {"model": "/m/model.gguf", "kv_bytes": 2**30, "kv_bytes_used": 2**20, "sessions_resident": 3,
             "sessions_stored": 7, "store": {"bytes_used": 2**20, "map_size": 2**40}, "counters": counters}
    now = {"live": {"slots": slots, "generating": 1, "prefilling": 1, "waiting": 2, "queued": 0}, "stats": stats, "at": 1.0}
    before = {**now, "stats": {**stats, "counters": {**counters, "generated": -20}}, "at": 0.5}

    def order(sort: str) -> list[str]:
        console = Console(width=120, record=True)
        console.print(top.frame(now, before, sort))
        text = console.export_text()
        assert "generated 40.0 tok/s" in text and "256 / 1,024 tokens (25%)" in text and "9.5 tok/s" in text
        return [line.split("│")[2].strip() for line in text.splitlines() if line.startswith("│")]

    assert order("slot") == ["idle", "generating", "prefilling", "free"]
    assert order("state") == ["generating", "prefilling", "idle", "free"]
    assert order("tokens") == ["generating", "prefilling", "idle", "free"]
    assert order("tok/s")[0] == "generating"
    assert list(top.SORTS) == ["slot", "state", "tokens", "tok/s"]  # the order `s` cycles through


def read_until(fd: int, text: str, seen: bytearray) -> None:
    """Read a terminal's output until `text` shows (or WAIT_S pass: a failure)."""
    deadline = time.monotonic() + WAIT_S
    while text.encode() not in seen:
        assert time.monotonic() < deadline, f"{text!r} never showed: {seen[-2000:]!r}"
        if select.select([fd], [], [], 1.0)[0]:
            seen += os.read(fd, 65536)


def test_ellm_top_in_a_terminal_sorts_on_s_and_quits_on_q(daemon, made):
    master, terminal = pty.openpty()
    top = subprocess.Popen([sys.executable, "-m", "ellm", "--socket", str(daemon.socket), "top", "--interval", "0.5"],
                           stdin=terminal, stdout=terminal, stderr=terminal, env={**os.environ, "COLUMNS": "120"})
    os.close(terminal)
    seen = bytearray()
    try:
        read_until(master, "sorted by slot", seen)
        os.write(master, b"s")
        read_until(master, "sorted by state", seen)
        os.write(master, b"q")
        assert top.wait(timeout=WAIT_S) == 0
    finally:
        top.kill()
        os.close(master)


def test_ellm_session_show_has_the_turn_table_with_text(daemon, made):
    result = CliRunner().invoke(ellm_app, ["--socket", str(daemon.socket), "session", "show", made["socket"]],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "message/" in line or "generation/" in line]
    assert len(rows) == 3
    assert "message/system" in rows[0] and "You are terse." in rows[0] and "[0, " in rows[0]
    assert "message/user" in rows[1] and "Name a color." in rows[1]


def test_the_page_is_served_without_a_key_with_a_strict_policy(daemon):
    status, headers, page = call(daemon.port, "/console", key=None)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "unsafe" not in policy
    for name in ("app.js", "app.css"):
        status, headers, _ = call(daemon.port, f"/console/{name}", key=None)
        assert status == 200 and headers["X-Content-Type-Options"] == "nosniff"
    assert call(daemon.port, "/console/secret.txt", key=None)[0] == 401  # the three files alone are public
    assert call(daemon.port, "/console/secret.txt")[0] == 404
    for file in STATIC.iterdir():  # nothing from another origin
        assert "://" not in file.read_text(), file
    connection = http.client.HTTPConnection("127.0.0.1", daemon.port)
    connection.request("GET", "/")
    reply = connection.getresponse()
    assert reply.status == 302 and reply.getheader("Location") == "/console"
    assert call(daemon.port, "/api/sessions", key=None)[0] == 401
    assert call(daemon.port, "/api/sessions", key="not-a-key")[0] == 401


def test_host_and_origin_are_checked_on_the_console_too(daemon, made):
    port = daemon.port
    assert call(port, "/console", key=None, headers={"Host": "evil.example"})[0] == 403
    assert call(port, "/api/sessions", headers={"Host": f"evil.example:{port}"})[0] == 403
    path = f"/api/sessions/{made['socket']}/fork"
    status, _, body = call(port, path, body={}, method="POST", headers={"Origin": "http://evil.example"})
    assert status == 403 and b"refused" in body
    status, _, _ = call(port, "/api/sessions/no-such-session/fork", body={}, method="POST",
                        headers={"Origin": f"http://127.0.0.1:{port}"})
    assert status == 404


# ---- in the browser -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(pytestconfig):
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("the browser tests need Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver; .ci/run installs them)")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    chrome = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield chrome
    chrome.quit()
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"console screenshots: {ARTIFACTS}")


def screenshot(browser, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    assert browser.save_screenshot(str(path)), path
    print(f"screenshot: {path}")
    return path


def wait(browser, condition, message: str):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # a page that refreshes replaces its elements: look again
    return WebDriverWait(browser, WAIT_S, ignored_exceptions=[StaleElementReferenceException]).until(condition, message)


def find(browser, selector: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, selector)


def shown(browser, selector: str):
    """The first visible element matching `selector`, once there is one."""
    return wait(browser, lambda d: next((e for e in find(d, selector) if e.is_displayed()), None), selector)


def log_in(browser, port: int, key: str) -> None:
    """Open the console in a fresh tab state and give it `key`."""
    browser.get(f"http://127.0.0.1:{port}/console")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"http://127.0.0.1:{port}/console")
    shown(browser, "#key").send_keys(key)
    shown(browser, "#connect").click()


def session_rows(browser) -> dict:
    return {row.get_attribute("data-id"): row for row in find(browser, "#sessions tbody tr")}


def click_in_row(browser, session_id: str, selector: str) -> None:
    wait(browser, lambda d: session_rows(d)[session_id].find_element("css selector", selector).click() or True,
         f"{selector} of {session_id}")


def test_browser_a_wrong_key_is_refused(daemon, browser):
    log_in(browser, daemon.port, "not-the-key")
    error = wait(browser, lambda d: find(d, "#login-error")[0].text, "an error under the key")
    assert "refused" in error and "API key" in error
    assert not find(browser, "#sessions") and find(browser, "#login")[0].is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('ellm-api-key')") is None
    screenshot(browser, "login-refused")


def test_browser_lists_sessions_made_over_the_socket_and_http(daemon, made, browser):
    log_in(browser, daemon.port, OPS_KEY)
    rows = wait(browser, lambda d: session_rows(d) if {made["socket"], made["http"]} <= set(session_rows(d)) else None,
                "both sessions listed")
    listed = {s["session_id"]: s for s in call_json(daemon.port, "/api/sessions")[1]["sessions"]}
    for session_id in (made["socket"], made["http"]):
        info, text = listed[session_id], rows[session_id].text
        assert info["title"] in text and f"{info['tokens']} {info['turn_count']}" in text
        assert ("resident" if info["resident"] else "stored") in text
    screenshot(browser, "sessions")
    shown(browser, "#filter").send_keys("socket")
    wait(browser, lambda d: set(session_rows(d)) == {made["socket"]}, "the filter keeps the socket's session")
    shown(browser, "#filter").clear()


def test_browser_a_session_shows_the_turns_of_ellm_session_show(daemon, made, browser):
    log_in(browser, daemon.port, OPS_KEY)
    wait(browser, lambda d: made["socket"] in session_rows(d), "the socket's session listed")
    click_in_row(browser, made["socket"], "a.open")
    rows = wait(browser, lambda d: find(d, "#turns tbody tr") or None, "the turn table")
    result = CliRunner().invoke(ellm_app, ["--socket", str(daemon.socket), "session", "show", made["socket"], "--json"])
    turns = json.loads(result.output)["turns"]
    counts = [int(row.find_element("css selector", "td.tokens").text) for row in rows]
    assert counts == [t["end"] - t["start"] for t in turns]
    kinds = [row.find_element("css selector", "td.kind").text for row in rows]
    assert kinds == [t["kind"] for t in turns]
    assert "Name a color." in rows[1].text
    rows[0].find_element("css selector", "button.show-tokens").click()
    ids = wait(browser, lambda d: find(d, "#turns tbody tr td.ids")[0].text, "the first turn's token ids")
    assert len(ids.split()) == counts[0]
    screenshot(browser, "session")


def test_browser_chat_streams_and_the_turn_list_grows(daemon, made, browser):
    log_in(browser, daemon.port, OPS_KEY)
    browser.get(f"http://127.0.0.1:{daemon.port}/console#/chat/{made['http']}")
    before = len(wait(browser, lambda d: find(d, "#chat-turns tr[data-index]") or None, "the turn list"))
    # every text the streaming reply shows, recorded as it changes
    browser.execute_script("""
        window.seen = [];
        new MutationObserver(() => {
          const reply = document.querySelector('.msg.streaming .content');
          if (reply && reply.textContent) window.seen.push(reply.textContent);
        }).observe(document.querySelector('#chat-log'), {subtree: true, childList: true, characterData: true});""")
    limit = shown(browser, "#chat-max-tokens")
    limit.clear()
    limit.send_keys("24")
    shown(browser, "#chat-input").send_keys("Name a vegetable.")
    shown(browser, "#chat-send").click()
    wait(browser, lambda d: find(d, ".msg.assistant.done .content") or None, "the reply done")
    reply = browser.execute_script("return [...document.querySelectorAll('.msg.assistant.done .content')].pop().textContent")
    seen = browser.execute_script("return window.seen")
    assert len(set(seen)) >= 2 and seen[-1] == reply, seen  # it grew in pieces, each the start of the next
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:])), seen
    wait(browser, lambda d: len(find(d, "#chat-turns tr[data-index]")) > before, "the turn list grown")
    status, body = call_json(daemon.port, f"/api/sessions/{made['http']}")
    assert body["messages"][-2:] == [{"role": "user", "content": "Name a vegetable."},
                                     {"role": "assistant", "content": body["messages"][-1]["content"]}]
    assert body["messages"][-1]["content"] == reply
    screenshot(browser, "chat")


def test_browser_chat_with_a_new_session(daemon, made, browser):
    log_in(browser, daemon.port, OPS_KEY)
    browser.get(f"http://127.0.0.1:{daemon.port}/console#/chat/")
    session_id = shown(browser, "#chat-session").text
    assert session_id.startswith("chat-")
    limit = shown(browser, "#chat-max-tokens")
    limit.clear()
    limit.send_keys("8")
    shown(browser, "#chat-input").send_keys("Hello there.")
    shown(browser, "#chat-send").click()
    wait(browser, lambda d: find(d, ".msg.assistant.done") or None, "the reply done")
    rows = wait(browser, lambda d: find(d, "#chat-turns tr[data-index]") or None, "the new session's turns")
    assert [row.find_element("css selector", "td.kind").text for row in rows] == ["generation"]
    assert browser.current_url.endswith(f"#/chat/{session_id}")
    status, body = call_json(daemon.port, f"/api/sessions/{session_id}")
    assert status == 200 and body["messages"][0] == {"role": "user", "content": "Hello there."}


def test_browser_forks_and_deletes_with_a_confirmation(daemon, made, browser):
    log_in(browser, daemon.port, OPS_KEY)
    wait(browser, lambda d: made["socket"] in session_rows(d), "the socket's session listed")
    before = set(session_rows(browser))
    click_in_row(browser, made["socket"], "button.fork")
    shown(browser, "#confirm-no").click()  # cancelled: nothing happens
    click_in_row(browser, made["socket"], "button.fork")
    shown(browser, "#confirm-text")
    screenshot(browser, "confirm-fork")
    shown(browser, "#confirm-yes").click()
    ids = wait(browser, lambda d: set(session_rows(d)) if len(session_rows(d)) == len(before) + 1 else None, "the fork")
    (fork,) = ids - before
    wait(browser, lambda d: "fork of made over the socket" in session_rows(d)[fork].text, "the fork's title")
    screenshot(browser, "sessions-forked")
    with daemon.client() as client:
        assert client.session(fork).info()["title"] == "fork of made over the socket"
    click_in_row(browser, fork, "button.delete")
    shown(browser, "#confirm-yes").click()
    wait(browser, lambda d: fork not in session_rows(d) and len(session_rows(d)) == len(before), "the fork deleted")
    with daemon.client() as client:
        assert fork not in {s["session_id"] for s in client.call("session.list")["sessions"]}


def generating(daemon, started: threading.Event, stop: threading.Event) -> None:
    """A session generating (streamed) until `stop`; disconnecting then cancels the rest."""
    with daemon.client() as client:
        session = client.open_session(title="generating for the live page")
        for _ in client.session(session.id).chat("Count to a thousand.", stream=True, max_tokens=1800,
                                                 ignore_eos=True, temperature=0):
            started.set()
            if stop.is_set():
                break


def test_browser_live_page_shows_slots_memory_and_charts(daemon, made, browser):
    log_in(browser, daemon.port, OPS_KEY)
    browser.get(f"http://127.0.0.1:{daemon.port}/console#/live")
    wait(browser, lambda d: len(find(d, "#slots tr[data-slot]")) == 2, "a line per slot")
    started, stop = threading.Event(), threading.Event()
    writer = threading.Thread(target=generating, args=(daemon, started, stop))
    writer.start()
    try:
        assert started.wait(WAIT_S)
        row = wait(browser, lambda d: next((r for r in find(d, "#slots tr[data-slot]")
                                             if "generating" in r.text and "tok/s" in r.text), None), "a slot generating")
        assert "generating for the live page" in row.text
        wait(browser, lambda d: "1 generating" in d.find_element("css selector", "#requests").text, "the request")
        screenshot(browser, "live-generating")
    finally:
        stop.set()
        writer.join()
    wait(browser, lambda d: d.execute_script("return state.live.length") >= 3, "three samples for the charts")
    assert "in flight" in shown(browser, "#requests").text
    assert " of " in shown(browser, "#kv-meter").text and "%" in shown(browser, "#kv-meter").text
    assert len(find(browser, ".chart canvas")) == 6
    with daemon.client() as client:
        resident = {s["session_id"] for s in client.call("live")["slots"] if s["session_id"]}
    assert all(any(sid in row.text for row in find(browser, "#slots tr[data-slot]")) for sid in resident)
    screenshot(browser, "live")
