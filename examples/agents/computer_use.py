"""A computer-use agent that loads skills on demand.

Each step of the task list picks the skill it needs by matching the step against the skill
descriptions the daemon lists, and loads it into the session. The daemon remembers what a session
has loaded, so asking for a skill twice appends nothing; a skill's extra files (such as
spreadsheet/formulas.md) are loaded only when a step mentions them. Every turn prefills only its
own tokens: the skills and the turns before it are reused from the KV cache.

    ellmd start --skills-dir examples/agents/skills --detach
    python examples/agents/computer_use.py
"""

from __future__ import annotations

import re
from pathlib import Path

from ellm import Client

from common import ask, parser, report, say, turn

TASKS = [
    "Open the sales report on the intranet in the browser and download it",
    "Open the downloaded spreadsheet and sum column B",
    "Add a total row with formulas under column B of the spreadsheet",
    "Rename the screenshots in ~/shots by date",
]
STOP = {"the", "and", "for", "with", "from", "into", "under", "its"}


def words(text: str) -> set[str]:
    return {w.rstrip("s") for w in re.findall(r"[a-z]{3,}", text.lower()) if w not in STOP}


def choose(step: str, skills: list[dict]) -> dict:
    """The skill sharing the most words with the step: keyword overlap, as a 135M model cannot pick."""
    return max(skills, key=lambda s: len(words(step) & words(f"{s['name']} {s['description']}")))


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    with Client(args.socket) as client:
        skills = client.skills()
        session = client.open_session(title="computer use", system=(
            "You operate a computer for the user. Follow the instructions of the loaded skills and "
            "answer each step with the short list of actions you would take."))
        steps = []
        for step in TASKS:
            skill = choose(step, skills)
            loads = [session.load_skill(skill["name"])]  # a no-op (0 tokens) once the skill is loaded
            extra = [f for f in skill["files"] if words(Path(f).stem) <= words(step)]
            loads += [session.load_skill(skill["name"], file=f) for f in extra]
            for loaded in loads:
                name = f"{loaded['skill']}/{loaded['file'] or 'SKILL.md'}"
                say(args, f"skill {name}: +{loaded['tokens_appended']} tokens")
            usage = ask(session, step, args)
            steps.append(turn(usage, loads[-1]["tokens"], step=step, skill=skill["name"], loads=[
                {k: loaded[k] for k in ("skill", "file", "tokens_appended")} for loaded in loads]))
        info = session.info()
        say(args, f"session {session.id}: {info['tokens']} tokens, skills loaded: {', '.join(info['skills'])}")
        report(args, {"session_id": session.id, "skills_available": [s["name"] for s in skills],
                      "skills_loaded": info["skills"], "steps": steps, "tokens": info["tokens"]})


if __name__ == "__main__":
    main()
