"""API keys with attributes (`--api-keys FILE`): who may call the server, and with what.

Owns the key file (YAML, refused unless only its owner can read it), the lookup of a presented
Bearer token (hash-keyed: the token's SHA-256 finds the entry, `hmac.compare_digest` confirms it,
so the time taken says nothing about how much of a key was right), and each key's attributes:
the models it may use, its `max_tokens` cap, its request and token rate limits, its default
scheduling priority and whether its prompts may go to the audit log. `--api-key` is the same
thing with one key that may do everything the server allows.

The audit log records a key's `name`, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from llmctl.server.middleware import RateLimit
from llmctl.server.policy_files import PolicyFileError, read_entries

SHORTCUT_KEY_NAME = "api-key"  # the one key of --api-key / --api-key-file
_KEY_FIELDS = {"name", "key", "key_sha256", "models", "max_tokens", "rate_limit", "token_rate_limit", "priority",
               "audit_prompts"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class KeyFileError(PolicyFileError):
    """The key file cannot be used; the message names the file and what to fix."""


@dataclass(frozen=True)
class ApiKey:
    """One key's attributes (the key itself is kept only as its SHA-256)."""
    name: str
    digest: bytes
    models: Optional[frozenset[str]] = None  # None: every model the server serves
    max_tokens: Optional[int] = None  # None: the server's --max-output-tokens
    rate_limit: Optional[RateLimit] = None  # requests per period
    token_rate_limit: Optional[RateLimit] = None  # prompt + generated tokens per period
    # The scheduling priority of requests that send none, and the earliest one a request may ask for
    # (lower is served earlier; a batch key cannot jump the queue). None: 0, and any a request sends.
    priority: Optional[int] = None
    audit_prompts: bool = True  # False: this key's prompts never reach the audit log

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def digest_of(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class KeyRing:
    """The accepted keys, found by the SHA-256 of the presented token."""

    def __init__(self, keys: Iterable[ApiKey]):
        self._by_digest: dict[bytes, ApiKey] = {}
        for key in keys:
            if key.digest in self._by_digest:
                raise KeyFileError(f"keys {self._by_digest[key.digest].name!r} and {key.name!r} are the same key")
            self._by_digest[key.digest] = key

    @classmethod
    def single(cls, token: str) -> "KeyRing":
        """`--api-key`: one key, no attributes beyond the server's own limits."""
        return cls([ApiKey(SHORTCUT_KEY_NAME, digest_of(token))])

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def keys(self) -> list[ApiKey]:
        return list(self._by_digest.values())

    def check_scheduling_policy(self, policy: str) -> None:
        """A key's default priority needs the priority policy: refused at start-up, not on each request."""
        keyed = next((key for key in self.keys if key.priority), None)
        if keyed is not None and policy != "priority":
            raise KeyFileError(f"--api-keys: the key {keyed.name!r} has priority {keyed.priority}, which needs "
                               f"--scheduling-policy priority (the engine schedules {policy})")

    def find(self, token: str) -> Optional[ApiKey]:
        presented = digest_of(token)
        key = self._by_digest.get(presented)
        # The dict lookup compares digests, not keys; the constant-time check confirms the match.
        if key is not None and hmac.compare_digest(key.digest, presented):
            return key
        return None


# ---- files ------------------------------------------------------------------------------------------
def check_private(path: Path, flag: str) -> None:
    """Refuse a secret file that its group or others may read or write (as ssh refuses such keys)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise KeyFileError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise KeyFileError(f"{flag} {path}: not a regular file")
    if mode & 0o077:
        raise KeyFileError(f"{flag} {path}: permissions {stat.S_IMODE(mode):04o} let other users read or change "
                           f"the keys; run 'chmod 600 {path}'")


def read_key_file(path: Path) -> str:
    """`--api-key-file`: the key on the file's first line."""
    check_private(path, "--api-key-file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"--api-key-file {path}: cannot read it ({exc})") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise KeyFileError(f"--api-key-file {path} is empty")
    return key


def load_key_file(path: Path) -> KeyRing:
    """`--api-keys FILE`: a YAML mapping with a `keys` list (see docs/serve.md)."""
    check_private(path, "--api-keys")
    keys = read_entries(path, "--api-keys", "keys", _parse_key, KeyFileError)
    try:
        return KeyRing(keys)
    except KeyFileError as exc:
        raise KeyFileError(f"--api-keys {path}: {exc}") from None


def _parse_key(entry: Any, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where} must be a mapping")
    unknown = sorted(set(map(str, entry)) - _KEY_FIELDS)
    if unknown:
        raise KeyFileError(f"{where}: unknown field(s) {', '.join(unknown)}; fields are {', '.join(sorted(_KEY_FIELDS))}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise KeyFileError(f"{where}: 'name' must be 1-64 letters, digits or ._:@- (it is what the audit log shows)")
    where = f"{where} ({name})"
    return ApiKey(name=name, digest=_digest(entry, where), models=_models(entry.get("models"), where),
                  max_tokens=_positive(entry.get("max_tokens"), "max_tokens", where),
                  rate_limit=_rate(entry.get("rate_limit"), "rate_limit", where),
                  token_rate_limit=_rate(entry.get("token_rate_limit"), "token_rate_limit", where),
                  priority=_priority(entry.get("priority"), where),
                  audit_prompts=_flag(entry.get("audit_prompts", True), "audit_prompts", where))


def _digest(entry: dict, where: str) -> bytes:
    key, hashed = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (hashed is None):
        raise KeyFileError(f"{where}: give exactly one of 'key' (the secret) or 'key_sha256' (its SHA-256 in hex)")
    if key is not None:
        if not isinstance(key, str) or len(key.strip()) < 8 or key != key.strip():
            raise KeyFileError(f"{where}: 'key' must be a string of at least 8 characters without surrounding spaces")
        return digest_of(key)
    if not isinstance(hashed, str) or not _SHA256.fullmatch(hashed.lower()):
        raise KeyFileError(f"{where}: 'key_sha256' must be 64 hex digits (sha256sum of the key)")
    return bytes.fromhex(hashed)


def _models(value: Any, where: str) -> Optional[frozenset[str]]:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m for m in value):
        raise KeyFileError(f"{where}: 'models' must be a non-empty list of model ids (omit it for every model)")
    return frozenset(value)


def _positive(value: Any, field: str, where: str) -> Optional[int]:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise KeyFileError(f"{where}: {field!r} must be an integer >= 1, got {value!r}")
    return value


def _rate(value: Any, field: str, where: str) -> Optional[RateLimit]:
    if value is None:
        return None
    try:
        return RateLimit.parse(str(value))
    except ValueError as exc:
        raise KeyFileError(f"{where}: {field!r}: {exc}") from None


def _priority(value: Any, where: str) -> Optional[int]:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise KeyFileError(f"{where}: 'priority' must be an integer (lower is served earlier), got {value!r}")
    return value


def _flag(value: Any, field: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise KeyFileError(f"{where}: {field!r} must be true or false, got {value!r}")
    return value
