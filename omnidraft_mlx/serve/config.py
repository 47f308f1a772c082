"""The server's settings, read by every serve/ module (so none of them imports server.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from omnidraft_mlx.decode.policy import PolicyConfig
from omnidraft_mlx.decode.promptcache import DEFAULT_CACHE_BYTES
from omnidraft_mlx.decode.ranks import SHARDINGS
from omnidraft_mlx.decode.speculative import SpecConfig
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.serve.keys import check_key
from omnidraft_mlx.settings import check_settings, setting


@dataclass(kw_only=True)
class Limits:
    """What one request may hold: past a limit it is refused with a 4xx naming the flag that raises it,
    before any work that grows with it (schema.py)."""

    body_bytes: int = setting(8 << 20, flag="--max-body-bytes", low=1)
    json_depth: int = setting(64, flag="--max-json-depth", low=2)  # nesting of the JSON body
    messages: int = setting(4096, flag="--max-messages", low=1)
    tools: int = setting(512, flag="--max-tools", low=0)
    schema_bytes: int = setting(64 << 10, flag="--max-schema-bytes", low=2)  # one tool's parameters, as JSON
    stops: int = setting(4, flag="--max-stops", low=0)
    stop_chars: int = setting(1024, flag="--max-stop-chars", low=1)  # the text held back grows with it

    def __post_init__(self):
        check_settings(self)


@dataclass(kw_only=True)
class ServeConfig:
    draft: str
    target: str
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # draft length; its k is the draft block
    # Decoding for a request that does not say otherwise: a request's temperature, top_p, seed and
    # max_tokens replace these (SpecConfig.for_reply).
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(max_tokens=512))
    cache_bytes: int = setting(DEFAULT_CACHE_BYTES, flag="--cache-bytes", low=0)
    shard: str = setting("tensor", flag="--shard", choices=SHARDINGS)  # under mlx.launch: how the target is split
    adapt: bool = True  # drafter updates between requests
    adapt_every: int = setting(4, flag="--adapt-every", low=1)  # replies gathered per drafter update
    profile: bool = True  # load and save the pair's profile
    # The keys a request must bring (keys.py): none, --api-key's, and/or a keys file's, one per client.
    api_key: str | None = None
    api_keys_file: str | None = None
    # Whose prompts and replies the history index and the drafter learn from: "all", "none" or key
    # names joined by commas; None: all, or none with a keys file (its clients may not trust each other).
    learn_from: str | None = None
    batch: int = setting(8, flag="--batch", low=1)  # requests decoded together (one target forward verifies all)
    # Admission (admission.py): requests queued beyond --batch, a client's requests under way, and
    # open connections (below macOS's default 256 open files); past one, a 429 (connections: a 503).
    max_queue: int = setting(64, flag="--max-queue", low=1)
    max_per_client: int = setting(16, flag="--max-per-client", low=1)
    max_connections: int = setting(128, flag="--max-connections", low=1)
    limits: Limits = field(default_factory=Limits)
    # Web safety (routes.WebGuard): Host names served besides IP addresses and localhost ("*": any),
    # and the web origins that may call the server (CORS; "*": any).
    allowed_hosts: list[str] = field(default_factory=list)
    cors: list[str] = field(default_factory=list)

    def __post_init__(self):
        check_settings(self)
        if self.api_key is not None:
            check_key(self.api_key, "--api-key (or OMNIDRAFT_API_KEY)")
        if self.learn_from is not None:
            if not re.fullmatch(r"[^,\s]+(,[^,\s]+)*", self.learn_from):
                raise OmniDraftError("--learn-from: all, none, or key names joined by commas (no spaces, none empty)")
            if self.learn_from not in ("all", "none") and not (self.api_key or self.api_keys_file):
                raise OmniDraftError("--learn-from names keys, and the server has none: give --api-keys-file")

    def learns_from(self, key_name: str) -> bool:
        """Whether the history index and the drafter learn from the requests of this key's name."""
        chosen = self.learn_from or ("none" if self.api_keys_file else "all")
        return chosen == "all" or (chosen != "none" and key_name in chosen.split(","))
