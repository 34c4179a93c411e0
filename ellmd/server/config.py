"""Daemon settings: defaults, then a TOML file, then command-line flags, then ELLMD_* variables.

config/ellmd.toml documents every key; the names here are the same keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tomllib
from pathlib import Path

from ellmd.errors import EllmError


def default_socket_path() -> Path:
    from ellm.paths import default_socket_path as client_default

    return Path(client_default())


def default_store_path() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(data) / "ellm" / "store"


def default_rag_path() -> Path:
    return default_store_path().parent / "rag"


def default_config_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(config) / "ellm" / "ellmd.toml"


@dataclasses.dataclass
class Settings:
    model_path: str | None = None
    weight_dtype: str | None = None
    kv_dtype: str = "bf16"
    chunk_size: int = 512
    gap_ratio: float = 1.0
    sequence_length: int = 8192
    batch_size: int = 4
    threads: int | None = None
    socket: str | None = None
    store: str | None = None
    store_map_size_gb: float = 1024
    store_backend: str = "lmdb"
    replica: str | None = None
    lease_ttl_s: float = 10.0
    snapshot_every_turn: bool = True
    snapshot_ack: str = "written"
    http: str | None = None
    skills_dir: list[str] = dataclasses.field(default_factory=list)
    context_role: str = "user"
    rag_dir: str | None = None
    rag_retriever: str = "bm25"
    rag_k: int = 4
    log_level: str = "info"
    # limits (ellmd.server.limits)
    max_connections: int = 64
    max_in_flight: int = 64
    max_queue: int = 256
    max_upload_mb: int = 0
    hello_timeout_s: float = 10.0
    frame_timeout_s: float = 30.0
    max_write_buffer_mb: int = 32
    write_timeout_s: float = 60.0
    http_max_connections: int = 64
    http_max_body_mb: int = 16
    http_read_timeout_s: float = 60.0
    http_max_unauthenticated: int = 16
    http_auth_timeout_s: float = 10.0
    max_render_kb: int = 4096
    # HTTP authentication
    api_key: str | None = None
    api_key_file: str | None = None

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else default_socket_path()

    @property
    def store_path(self) -> Path:
        return Path(self.store) if self.store else default_store_path()

    @property
    def rag_path(self) -> Path:
        return Path(self.rag_dir) if self.rag_dir else default_rag_path()

    def api_keys(self) -> list[ApiKey]:
        """The HTTP API keys: api_key (named "default"), and api_key_file's lines (see parse_key_file)."""
        keys = [ApiKey("default", self.api_key)] if self.api_key else []
        if self.api_key_file:
            try:
                text = Path(self.api_key_file).expanduser().read_text()
            except OSError as e:
                raise EllmError(f"api_key_file {self.api_key_file}: {e.strerror or e}") from None
            keys += parse_key_file(text, self.api_key_file)
            if not keys:
                raise EllmError(f"api_key_file {self.api_key_file} holds no key")
        names = [key.name for key in keys]
        if len(set(names)) < len(names):
            twice = next(name for name in names if names.count(name) > 1)
            raise EllmError(f"api_key_file {self.api_key_file}: the key name {twice!r} is given twice")
        return keys


@dataclasses.dataclass(frozen=True)
class ApiKey:
    """An HTTP API key: its name (what logs, grants and metrics call it), the secret, and whether
    it is an admin key (reaches every session, as the Unix socket does, and reads /metrics)."""

    name: str
    secret: str = dataclasses.field(repr=False)
    admin: bool = False

    @property
    def owner(self) -> str:
        """The owner of the sessions this key creates: a fingerprint, never the key itself."""
        return hashlib.sha256(self.secret.encode()).hexdigest()[:32]


KEY_NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"


def parse_key_file(text: str, path: str) -> list[ApiKey]:
    """The keys of an api_key_file: per line `KEY`, `NAME KEY` or `NAME KEY admin`; a line whose
    first non-blank character is # is a comment, blank lines are skipped. A key without a name is
    named after its fingerprint (8 hex digits)."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) == 1:
            key = ApiKey("", words[0])
            keys.append(dataclasses.replace(key, name=key.owner[:8]))
            continue
        if len(words) > 3 or (len(words) == 3 and words[2] != "admin"):
            raise EllmError(f"api_key_file {path} line {number}: expected KEY, NAME KEY or NAME KEY admin")
        if not re.fullmatch(KEY_NAME_PATTERN, words[0]):
            raise EllmError(f"api_key_file {path} line {number}: a key name must match {KEY_NAME_PATTERN}")
        keys.append(ApiKey(words[0], words[1], admin=len(words) == 3))
    return keys


def load_settings(config_file: Path | None, flags: dict) -> Settings:
    """Merge the layers; unknown keys and wrong types are errors that name the key."""
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict = {}
    path = config_file or default_config_path()
    if config_file or path.exists():
        try:
            document = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise EllmError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise EllmError(f"config file {path} is not valid TOML: {e}") from None
        for key, value in document.items():
            key = key.replace("-", "_")
            if key not in fields:
                raise EllmError(f"config file {path}: unknown key {key!r}")
            values[key] = value
    values.update({k: v for k, v in flags.items() if v is not None})
    for key in fields:
        env = os.environ.get("ELLMD_" + key.upper())
        if env is not None:
            values[key] = _parse_env(key, env, fields[key])
    settings = Settings(**values)
    for key, field in fields.items():
        _check_type(key, getattr(settings, key), field)
    return settings


def _parse_env(key, text, field):
    kind = str(field.type)
    try:
        if "int" in kind and "str" not in kind:
            return int(text)
        if "float" in kind:
            return float(text)
        if "bool" in kind:
            return text.lower() in ("1", "true", "yes", "on")
        if "list" in kind:
            return [p for p in text.split(os.pathsep) if p]
    except ValueError:
        raise EllmError(f"ELLMD_{key.upper()}={text!r} is not a valid {kind}") from None
    return text


def _check_type(key, value, field):
    kind = str(field.type)
    expected = (bool if "bool" in kind else int if kind.startswith("int") else (int, float) if "float" in kind
                else list if "list" in kind else str)
    if value is None and "None" in kind:
        return
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        name = "number" if expected == (int, float) else expected.__name__
        raise EllmError(f"setting {key} must be {name}, not {value!r}")
    if key == "replica" and value is not None and not re.fullmatch(REPLICA_PATTERN, value):
        raise EllmError(f"setting replica must match {REPLICA_PATTERN} (a name for this daemon in its fleet), not {value!r}")
    if key in LIMITS and value < (0 if key == "max_upload_mb" else 1e-9):
        raise EllmError(f"setting {key} must be {'at least 0' if key == 'max_upload_mb' else 'positive'}, not {value!r}")


REPLICA_PATTERN = r"[A-Za-z0-9_.:-]{1,64}"
LIMITS = {"gap_ratio", "lease_ttl_s", "max_connections", "max_in_flight", "max_queue", "max_upload_mb", "hello_timeout_s", "frame_timeout_s",
          "max_write_buffer_mb", "write_timeout_s", "http_max_connections", "http_max_body_mb", "http_read_timeout_s",
          "http_max_unauthenticated", "http_auth_timeout_s",
          "max_render_kb"}
