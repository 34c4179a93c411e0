"""`ellm top`: the daemon's live view in the terminal, refreshed in place.

One line per KV slot (a resident session, and what it is doing: idle, prefilling with its
progress, generating with its tok/s), above a summary of KV memory, the store, the requests and
the token rates since the last frame. From the `live` op (PROTOCOL.md, "Live state").
Keys, when stdin is a terminal: s cycles the sort, q quits; otherwise it refreshes until Ctrl-C.
"""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from contextlib import contextmanager

from rich.console import Group
from rich.live import Live
from rich.table import Column, Table
from rich.text import Text

STATE_ORDER = {"generating": 0, "prefilling": 1, "idle": 2, "free": 3}
SORTS = {  # name -> key of a slot line (ascending)
    "slot": lambda s: s["slot"],
    "state": lambda s: (STATE_ORDER.get(s["state"], 9), s["slot"]),
    "tokens": lambda s: -(s.get("tokens") or 0),
    "tok/s": lambda s: -(s.get("tok_s") or 0),
}
RATES = {"generated": "generated", "prefilled": "prefilled", "reused": "reused"}  # counters shown per second


def sample(client) -> dict:
    """One reading of the daemon: the live op's slots and requests, and its stats (memory, counters)."""
    live = client.call("live")
    return {"live": live, "stats": live.pop("stats"), "at": time.monotonic()}


def size(n: float) -> str:
    """Bytes in the largest binary unit under 1024 of it."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:,.1f} TiB"


def progress(slot: dict) -> str:
    if slot["state"] == "prefilling":
        return f"{slot['done']:,} / {slot['total']:,} tokens ({100 * slot['done'] // max(slot['total'], 1)}%)"
    if slot["state"] == "generating":
        rate = f"{slot['tok_s']:.1f} tok/s" if slot.get("tok_s") is not None else "..."
        return f"{slot['generated']:,} tokens, {rate}"
    return ""


def rates(now: dict, before: dict | None) -> str:
    if before is None:  # the first frame: totals since the daemon started
        counters = now["stats"]["counters"]
        return ", ".join(f"{name} {counters[key]:,}" for name, key in RATES.items()) + " tokens since start"
    seconds = max(now["at"] - before["at"], 1e-9)
    counters, previous = now["stats"]["counters"], before["stats"]["counters"]
    return ", ".join(f"{name} {(counters[key] - previous[key]) / seconds:,.1f} tok/s" for name, key in RATES.items())


def frame(now: dict, before: dict | None, sort: str) -> Group:
    """What one refresh shows: the summary lines and the slot table, sorted by `sort`."""
    live, stats = now["live"], now["stats"]
    store = stats.get("store") or {}
    summary = Text.assemble(
        ("ellm top", "bold"), f"  {os.path.basename(stats.get('model', ''))}\n",
        f"KV {size(stats['kv_bytes_used'])} of {size(stats['kv_bytes'])}   store {size(store.get('bytes_used', 0))}"
        + (f" of {size(store['map_size'])}" if store.get("map_size") else "")
        + f"   sessions {stats['sessions_resident']} resident, {stats['sessions_stored']} stored\n",
        f"requests {live['generating']} generating, {live['prefilling']} prefilling, {live['waiting']} waiting, "
        f"{live['queued']} queued   {rates(now, before)}")
    ids = [slot.get("session_id") or "" for slot in live["slots"]]
    table = Table(Column("slot", no_wrap=True), Column("state", no_wrap=True, min_width=10),
                  Column("session", no_wrap=True, min_width=max(map(len, ids), default=7)),
                  Column("title", overflow="ellipsis", no_wrap=True), Column("tokens", no_wrap=True), "progress",
                  title=f"sorted by {sort} (s: sort, q: quit)", title_justify="left")  # ids whole, titles cut
    for slot in sorted(live["slots"], key=SORTS[sort]):
        table.add_row(str(slot["slot"]), slot["state"], Text(slot.get("session_id") or ""), Text(slot.get("title") or ""),
                      f"{slot['tokens']:,}" if slot.get("tokens") is not None else "", progress(slot))
    return Group(summary, table)


@contextmanager
def keys():
    """A function giving the key pressed since the last call (or None), stdin in cbreak mode meanwhile;
    one that gives None always when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield lambda timeout: time.sleep(timeout)
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def key(timeout: float):
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace") if ready else None

    try:
        yield key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(client, console, interval: float) -> None:
    """Refresh in place until q (or Ctrl-C)."""
    order = list(SORTS)
    sort, before = order[0], None
    now = sample(client)
    with keys() as key, Live(frame(now, before, sort), console=console, auto_refresh=False) as live:
        while True:
            pressed = key(interval)
            if pressed in ("q", "Q"):
                return
            if pressed in ("s", "S"):
                sort = order[(order.index(sort) + 1) % len(order)]
            else:
                before, now = now, sample(client)
            live.update(frame(now, before, sort), refresh=True)
