"""Skills: directories holding SKILL.md (YAML front matter with name and description, then the
instructions) and optional files, found under skill roots.

Roots come from the settings (`skills_dir`, `--skills-dir`) and from installed plugins: an entry
point in the group `ellm.skills` names a directory (or a callable returning one). Roots are scanned
on every lookup, so a skill added to a root is found without restarting the daemon.

Nothing outside a root is read: a skill directory or SKILL.md that is a symlink leading out of its
root is listed as broken, a skill's files are the regular files inside its directory (special
files such as FIFOs never block a read), and a file is at most MAX_FILE_BYTES.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import yaml

from ellmd.errors import EllmError
from ellmd.runtime.context.retrieval import MAX_FILE_BYTES, read_regular

log = logging.getLogger("ellmd.skills")


class SkillError(EllmError):
    """An unknown skill or file (code not_found), or a path that would leave a skill root (bad_request)."""

    def __init__(self, message: str, code: str = "not_found"):
        super().__init__(message)
        self.code = code


@dataclass
class Skill:
    name: str
    description: str
    directory: Path
    instructions: str  # SKILL.md without its front matter

    def files(self) -> list[str]:
        """The skill's other files (regular, not hidden, no symlinks), relative to its directory."""
        found = []
        for dirpath, dirnames, filenames in os.walk(self.directory):  # symlinked folders are not followed
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                path = Path(dirpath, name)
                if name.startswith(".") or path == self.directory / "SKILL.md":
                    continue
                try:
                    if stat.S_ISREG(path.lstat().st_mode):
                        found.append(path.relative_to(self.directory).as_posix())
                except OSError:
                    continue
        return sorted(found)

    def info(self) -> dict:
        return {"name": self.name, "description": self.description, "path": str(self.directory), "files": self.files()}

    def message(self, file: str | None = None) -> str:
        """The text appended to a session: the instructions, or one of the skill's files."""
        if file is None:
            listing = "".join(f"\n- {name}" for name in self.files())
            files = f"\n\nFiles of this skill (load one by name when needed):{listing}" if listing else ""
            return f"# Skill: {self.name}\n{self.description}\n\n{self.instructions.strip()}{files}"
        path = (self.directory / file).resolve()
        if not path.is_relative_to(self.directory):
            raise SkillError(f"file {file!r} escapes the directory of skill {self.name!r}", "bad_request")
        try:
            _, data = read_regular(path, MAX_FILE_BYTES)
        except FileNotFoundError:
            raise SkillError(f"skill {self.name!r} has no file {file!r}") from None
        except (OSError, ValueError) as e:  # a folder, a FIFO, a device, too large
            raise SkillError(f"file {file!r} of skill {self.name!r} cannot be loaded: "
                             f"{getattr(e, 'strerror', None) or e}", "bad_request") from None
        try:
            return f"# Skill {self.name}: {file}\n\n{data.decode('utf-8').strip()}"
        except UnicodeDecodeError:
            raise SkillError(f"file {file!r} of skill {self.name!r} is not UTF-8 text") from None


class SkillLibrary:
    """The skills under the configured roots and the roots that plugins install."""

    def __init__(self, roots: list[Path], plugins: bool = True):
        self.roots = [Path(r).expanduser().resolve() for r in roots]
        for root in self.roots:
            if not root.is_dir():
                log.warning("skill root %s is not a directory (yet): no skills from it", root)
        if plugins:
            self.roots += plugin_roots()

    def skills(self) -> dict[str, Skill]:
        """Every skill by name; the first root holding a name wins."""
        return self._scan()[0]

    def _scan(self) -> tuple[dict[str, Skill], list[dict]]:
        found: dict[str, Skill] = {}
        broken = []  # one broken SKILL.md must not hide the others: it is listed with its error
        for root in self.roots:
            for path in sorted(root.glob("*/SKILL.md")):
                try:
                    if not path.resolve().is_relative_to(root):
                        raise SkillError(f"{path} leads out of the skill root {root} (a symlink)", "bad_request")
                    skill = read_skill(path)
                except (SkillError, UnicodeDecodeError, OSError) as e:
                    broken.append({"name": path.parent.name, "description": "", "path": str(path.parent),
                                   "files": [], "error": str(e)})
                    continue
                found.setdefault(skill.name, skill)
        return found, broken

    def get(self, name: str) -> Skill:
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise SkillError(f"skill name {name!r} is not a plain name (it would leave the skill roots)", "bad_request")
        found, broken = self._scan()
        skill = found.get(name)
        for entry in broken if skill is None else ():
            if entry["name"] == name:
                raise SkillError(entry["error"], "bad_request")
        if skill is None:
            where = ", ".join(map(str, self.roots)) or "no skill root is configured (--skills-dir)"
            raise SkillError(f"no skill {name!r} (skill roots: {where})")
        return skill

    def list(self) -> list[dict]:
        """Every skill's info, then the broken ones with an `error` saying what is wrong."""
        found, broken = self._scan()
        return [skill.info() for skill in found.values()] + broken


def read_skill(path: Path) -> Skill:
    """Parse a SKILL.md: the front matter between two `---` lines, then the instructions."""
    try:
        text = read_regular(path.resolve(), MAX_FILE_BYTES)[1].decode("utf-8")
    except ValueError as e:  # not a regular file, too large (UnicodeDecodeError is reported as it is)
        if isinstance(e, UnicodeDecodeError):
            raise
        raise SkillError(f"{path}: {e}", "bad_request") from None
    meta, body = {}, text
    if text.startswith("---"):
        head, sep, rest = text[3:].partition("\n---")
        if not sep:
            raise SkillError(f"{path}: the front matter has no closing '---' line")
        try:
            meta = yaml.safe_load(head) or {}
        except yaml.YAMLError as e:
            raise SkillError(f"{path}: the front matter is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(meta, dict):
            raise SkillError(f"{path}: the front matter must be a mapping with name and description")
        body = rest.partition("\n")[2]
    name = str(meta.get("name") or path.parent.name)
    return Skill(name=name, description=" ".join(str(meta.get("description", "")).split()),
                 directory=path.parent.resolve(), instructions=body)


def plugin_roots() -> list[Path]:
    """Skill roots installed by plugins (entry point group `ellm.skills`)."""
    roots = []
    for entry in importlib.metadata.entry_points(group="ellm.skills"):
        try:
            value = entry.load()
            roots.append(Path(value() if callable(value) else value).resolve())
        except Exception as e:  # a broken plugin is reported, not fatal
            log.warning("skill plugin %s could not be loaded: %s", entry.name, e)
    return roots
