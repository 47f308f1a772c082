"""The API keys of `omnidraft serve`: the keys a request may bring, and the name each goes by.

A key's name is what its requests are kept apart by: their prompt-cache namespace, their stored
responses, and whether the pair learns from them (ServeConfig.learns_from). --api-key is named
"default". A keys file (--api-keys-file) holds a key a line, `name:key` or a bare key (named by
a digest of itself, so that it keeps its name when lines move); blank lines and # comments are
skipped. The file is read again when it changes (its mtime looked at, on a request, at most once
a second): a key added works without a restart, a key removed stops working; a file that cannot
be used is logged and the keys read before stay in use.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from pathlib import Path

from omnidraft_mlx.errors import OmniDraftError

log = logging.getLogger("omnidraft.serve")
DEFAULT_NAME = "default"  # --api-key's name
RECHECK_S = 1.0  # the keys file's mtime is looked at this often at most
KEY = re.compile(r"[!-~]+")  # printable ASCII, no spaces: a key travels in an HTTP header
SCOPE_NAME = "omnidraft_key_name"  # where RequireKey puts the key's name in the request's ASGI scope


def check_key(key: str, where: str) -> None:
    """A one-line OmniDraftError unless `key` can be sent as a key."""
    if not key:
        raise OmniDraftError(f"{where}: the key is empty: give one (an empty key would let every request in)")
    if not KEY.fullmatch(key):
        raise OmniDraftError(f"{where}: a key is printable ASCII without spaces")


def read_keys_file(path: str) -> dict[str, str]:
    """{key: name} from a keys file; a one-line OmniDraftError for a file or line it cannot use."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise OmniDraftError(f"--api-keys-file: cannot read {path}: {e}") from e
    keys = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--api-keys-file {path}, line {number}"
        name, colon, key = line.partition(":")
        if not colon:
            name, key = "key-" + hashlib.sha256(line.encode()).hexdigest()[:8], line
        name, key = name.strip(), key.strip()
        if not name:
            raise OmniDraftError(f"{where}: give `name:key` or a bare key (a name before the colon)")
        check_key(key, where)
        if key in keys:
            raise OmniDraftError(f"{where}: this key is already {keys[key]}'s: give each client a key of its own")
        keys[key] = name
    return keys


def digest(key: str) -> bytes:
    """Keys are looked up by digest: a lookup's time says nothing about the keys' text."""
    return hashlib.sha256(key.encode()).digest()


class Keys:
    """The keys a request may bring (--api-key's and the keys file's), by digest, with their names."""

    def __init__(self, api_key: str | None, path: str | None):
        self.api_key, self.path = api_key, path
        self.stamp, self.checked = self._stamp() if path else None, time.monotonic()
        self.names = self._read()
        if not self.names:
            raise OmniDraftError(f"--api-keys-file: no keys in {path}: add a line `name:key` per client")

    def _stamp(self) -> tuple | None:
        """What changes when the keys file is written or replaced (None: it is not there)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read(self) -> dict[bytes, str]:
        keys = read_keys_file(self.path) if self.path else {}
        if self.api_key:
            keys[self.api_key] = DEFAULT_NAME
        return {digest(key): name for key, name in keys.items()}

    def name_of(self, key: str) -> str | None:
        """The name the key goes by; None: it is no key here. The keys file is read again first
        if it changed (looked at once a second at most)."""
        now = time.monotonic()
        if self.path and now - self.checked >= RECHECK_S:
            self.checked = now
            if (stamp := self._stamp()) != self.stamp:
                self.stamp = stamp  # a file that cannot be used is logged once, not every second
                try:
                    self.names = self._read()
                    log.info("API keys read again from %s: %d keys", self.path, len(self.names))
                except OmniDraftError as e:
                    log.error("%s (the keys read before stay in use)", e)
        return self.names.get(digest(key))


def load_keys(api_key: str | None, path: str | None) -> Keys | None:
    """The server's keys; None: it has none, and every request goes in."""
    return Keys(api_key, path) if api_key or path else None


def key_name(request) -> str:
    """The name of the key the request came with ("" where the server has no keys)."""
    return request.scope.get(SCOPE_NAME, "")
