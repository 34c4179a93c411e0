"""A deep-research loop that snapshots its session, exits, and resumes in a later run.

Each step injects a field note and asks a sub-question. At the end of a run the session is
snapshotted to the daemon's store and its id written to a state file. The next run (even after
the daemon restarted) resumes the session from its stored KV, with no forward pass over the
history: its first turn reuses every token of it and prefills only its own.

    python examples/agents/deep_research.py              # run 1: two steps, snapshot, exit
    python examples/agents/deep_research.py --steps 1    # run 2: resume, recap, one more step
"""

from __future__ import annotations

import json
from pathlib import Path

from ellm import Client

from common import ask, parser, report, say, turn

# (field note, sub-question): the research material, one pair per step.
NOTES = [
    ("Survey 1998: the Lake Varn perch catch was 410 tonnes; 14 boats fished the north shore.",
     "What was the catch in 1998?"),
    ("Survey 2008: the perch catch fell to 160 tonnes. A paper mill upstream had doubled its output in 2003.",
     "What changed between 1998 and 2008?"),
    ("Water report 2009: oxygen near the river mouth fell below 4 mg/l each August, too low for perch eggs.",
     "Which cause does the water report point to?"),
    ("Survey 2019: after the mill's new filters (2012) the catch rose back to 300 tonnes.",
     "Did the fishery recover, and why?"),
]


def research(session, step: int, args) -> dict:
    """One step: inject the step's note, ask its sub-question."""
    note, question = NOTES[step % len(NOTES)]
    injected = session.inject(documents=[{"text": note, "source": f"note-{step + 1}"}])
    usage = ask(session, question, args)
    return turn(usage, injected["tokens"], step=step + 1, question=question,
                tokens_appended=injected["tokens_appended"])


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--state", type=Path, default=Path("deep_research.json"),
                   help="the file keeping the session id between runs (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="research steps in this run (default: %(default)s)")
    args = p.parse_args()
    state = json.loads(args.state.read_text()) if args.state.exists() else {"run": 0, "step": 0}
    with Client(args.socket) as client:
        resumed, recap = None, None
        if "session_id" in state:
            session = client.session(state["session_id"])
            resumed = session.resume()  # stored KV back into a slot: no tokens recomputed
            say(args, f"resumed session {session.id}: {resumed['tokens']} tokens in {resumed['ms']:.0f} ms\n")
            usage = ask(session, "Recap the findings so far in one sentence.", args)
            recap = turn(usage, resumed["tokens"])
        else:
            session = client.open_session(title="deep research: Lake Varn perch", system=(
                "You research why the Lake Varn perch fishery declined. Answer each question "
                "briefly from the field notes."))
        steps = [research(session, state["step"] + i, args) for i in range(args.steps)]
        snapshot = session.snapshot()
        tokens = session.info()["tokens"]
        state = {"session_id": session.id, "run": state["run"] + 1, "step": state["step"] + args.steps}
        args.state.write_text(json.dumps(state))
        say(args, f"run {state['run']}: session {session.id} ({tokens} tokens) is in the store; run again to resume")
        report(args, {"run": state["run"], "session_id": session.id, "resumed": resumed, "recap": recap,
                      "steps": steps, "tokens": tokens, "snapshot": snapshot})


if __name__ == "__main__":
    main()
