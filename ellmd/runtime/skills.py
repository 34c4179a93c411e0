"""Skills: directories holding a SKILL.md (front matter with name and description, then instructions)."""

from __future__ import annotations

from pathlib import Path

from ellmd.errors import EllmError


class SkillError(EllmError):
    """An unknown skill, or a name that would leave the skill roots."""


class SkillLibrary:
    """Skills found under one or more root directories; a skill is <root>/<name>/SKILL.md."""

    def __init__(self, roots: list[Path]):
        self.roots = [Path(r).resolve() for r in roots]

    def path(self, name: str) -> Path:
        for root in self.roots:
            candidate = (root / name / "SKILL.md").resolve()
            if not candidate.is_relative_to(root):
                raise SkillError(f"skill name {name!r} escapes the skill root {root}")
            if candidate.is_file():
                return candidate
        raise SkillError(f"no skill {name!r} under {', '.join(map(str, self.roots)) or 'any skill root'}")

    def read(self, name: str) -> str:
        """The skill's text as it is appended to a session."""
        return self.path(name).read_text(encoding="utf-8")

    def list(self) -> list[dict]:
        skills = []
        for root in self.roots:
            for path in sorted(root.glob("*/SKILL.md")):
                skills.append({"name": path.parent.name, "description": _front_matter(path).get("description", "")})
        return skills


def _front_matter(path: Path) -> dict:
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    fields = {}
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields
