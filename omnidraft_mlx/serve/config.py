"""The server's settings, read by every serve/ module (so none of them imports server.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnidraft_mlx.decode.policy import PolicyConfig
from omnidraft_mlx.decode.promptcache import DEFAULT_CACHE_BYTES
from omnidraft_mlx.decode.speculative import SpecConfig
from omnidraft_mlx.settings import check_settings, setting


@dataclass(kw_only=True)
class ServeConfig:
    draft: str
    target: str
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # draft length; its k is the draft block
    # Decoding for a request that does not say otherwise: a request's temperature, top_p, seed and
    # max_tokens replace these (SpecConfig.for_reply).
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(max_tokens=512))
    cache_bytes: int = setting(DEFAULT_CACHE_BYTES, flag="--cache-bytes", low=0)
    adapt: bool = True  # drafter updates between requests
    adapt_every: int = setting(4, flag="--adapt-every", low=1)  # replies gathered per drafter update
    profile: bool = True  # load and save the pair's profile
    api_key: str | None = None
    batch: int = setting(8, flag="--batch", low=1)  # requests decoded together (one target forward verifies all)

    def __post_init__(self):
        check_settings(self)
