"""`omnidraft serve`: an OpenAI-compatible server that speculates, caches prompts and learns.

The server is omnidraft_mlx/serve/server.py; this parses the flags and prints where it listens.
Under `mlx.launch` the target is split over the ranks (--shard), rank 0 answers HTTP and the
others follow (omnidraft_mlx/serve/follow.py).
"""

from __future__ import annotations

import os

import typer

from omnidraft_mlx.cli import options
from omnidraft_mlx.decode.promptcache import DEFAULT_CACHE_BYTES
from omnidraft_mlx.serve.config import Limits

LIMITS = Limits()  # the defaults of the --max-* flags


def serve(
    draft: str = options.DRAFT,
    target: str = options.TARGET,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="OMNIDRAFT_API_KEY", help="Require 'Authorization: Bearer KEY' (the key 'default')."
    ),
    api_keys_file: str | None = typer.Option(
        None,
        "--api-keys-file",
        help="Keys, one per client: a line each, 'name:key' or a key; # comments. Read again when it changes. "
        "Each key has its own prompt cache and stored responses.",
    ),
    learn_from: str | None = typer.Option(
        None,
        "--learn-from",
        help="Whose requests the history index and the drafter learn from: all, none, or key names joined by "
        "commas. Default: all; none with --api-keys-file.",
    ),
    cache_bytes: int = typer.Option(
        DEFAULT_CACHE_BYTES,
        "--cache-bytes",
        help="Memory for KV caches (both models'), in bytes: the requests being "
        "decoded first, cached prompts in what they leave.",
    ),
    k: int = options.K,
    policy: str = options.POLICY,
    gamma: str = options.GAMMA,
    max_k: int | None = options.MAX_K,
    max_tokens: int = typer.Option(512, "--max-tokens", help="Reply length when a request does not say."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature when a request does not say; 0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold when a request does not say."),
    seed: int = typer.Option(
        0, "--seed", help="Random seed of a greedy request; a sampled one without a seed: random."
    ),
    translation: str = options.TRANSLATION,
    sampling: str = options.SAMPLING,
    lookup_len: int = options.LOOKUP_LEN,
    adapt: bool = typer.Option(
        True, "--adapt/--no-adapt", help="Update the drafter from the replies, between requests."
    ),
    adapt_every: int = typer.Option(4, "--adapt-every", help="Replies gathered per drafter update."),
    source: str = options.SOURCE,
    no_guard: bool = options.NO_GUARD,
    tree: bool = options.TREE,
    batch: int = typer.Option(
        8,
        "--batch",
        help="Requests decoded together (their drafts verified in one "
        "target forward); more wait in a queue. 1: one at a time.",
    ),
    max_queue: int = typer.Option(
        64, "--max-queue", help="Requests waiting beyond --batch; past that a request gets 429 (Retry-After)."
    ),
    max_per_client: int = typer.Option(
        16,
        "--max-per-client",
        help="Requests one client (its API key, else its address) may have under way; past that, 429.",
    ),
    max_connections: int = typer.Option(
        128, "--max-connections", help="Open HTTP connections; past that a request gets 503 (keep below ulimit -n)."
    ),
    no_profile: bool = options.NO_PROFILE,
    shard: str = options.SHARD,
    allowed_hosts: str = typer.Option(
        "",
        "--allowed-hosts",
        help="Host names the server answers to besides IP addresses, localhost and --host, joined by commas; "
        "'*': any. Others get 403 (a page on another site can reach this machine through its own name).",
    ),
    cors: str = typer.Option(
        "",
        "--cors",
        help="Web origins (https://app.example) whose pages may call the server, joined by commas; '*': any. "
        "Requests from other pages get 403, and no CORS headers are sent.",
    ),
    max_body_bytes: int = typer.Option(LIMITS.body_bytes, "--max-body-bytes", help="Largest request body (413)."),
    max_json_depth: int = typer.Option(LIMITS.json_depth, "--max-json-depth", help="Deepest nesting of a body."),
    max_messages: int = typer.Option(LIMITS.messages, "--max-messages", help="Most messages in a request."),
    max_tools: int = typer.Option(LIMITS.tools, "--max-tools", help="Most tools in a request."),
    max_schema_bytes: int = typer.Option(
        LIMITS.schema_bytes, "--max-schema-bytes", help="Largest JSON schema of a tool's parameters."
    ),
    max_stops: int = typer.Option(LIMITS.stops, "--max-stops", help="Most stop strings in a request."),
    max_stop_chars: int = typer.Option(LIMITS.stop_chars, "--max-stop-chars", help="Longest stop string."),
) -> None:
    """Serve TARGET (the model name clients ask for), DRAFT speculating, over the OpenAI HTTP API
    (/v1/chat/completions, /v1/completions)."""
    flags = dict(locals())  # the flags as given, before the body adds names
    from omnidraft_mlx.blas import warn_if_slow_blas
    from omnidraft_mlx.cli.main import console, err_console
    from omnidraft_mlx.collectives import world
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER
    from omnidraft_mlx.serve.config import ServeConfig
    from omnidraft_mlx.serve.follow import on_ranks
    from omnidraft_mlx.serve.server import serve as run_server
    from omnidraft_mlx.settings import check_range

    # The settings check themselves (one-line errors), before any model loads.
    check_range("--port", port, 1, 65535)
    if api_key is None and os.environ.get("OMNIDRAFT_API_KEY") == "":  # click takes it for unset
        api_key = ""  # an error (ServeConfig), not a server without a key
    spec = options.decoding(flags)
    cfg = ServeConfig(
        draft=draft,
        target=target,
        policy=options.draft_length(policy, gamma, k, max_k),
        spec=spec,
        cache_bytes=cache_bytes,
        shard=shard,
        adapt=adapt,
        adapt_every=adapt_every,
        profile=not no_profile,
        api_key=api_key,
        api_keys_file=api_keys_file,
        learn_from=learn_from,
        batch=batch,
        max_queue=max_queue,
        max_per_client=max_per_client,
        max_connections=max_connections,
        limits=Limits(
            body_bytes=max_body_bytes,
            json_depth=max_json_depth,
            messages=max_messages,
            tools=max_tools,
            schema_bytes=max_schema_bytes,
            stops=max_stops,
            stop_chars=max_stop_chars,
        ),
        allowed_hosts=[host, *names(allowed_hosts)],
        cors=names(cors),
    )
    group = world()
    lead = group.rank() == 0  # the rank that answers HTTP and prints
    if group.size() > 1:
        cfg, said = on_ranks(cfg, group.size())
        if lead:
            console.print(f"[dim]{said}[/]")
    if lead:
        warn_if_slow_blas(err_console)

    def ready(engine) -> None:
        console.print(
            f"[bold]{draft}[/] drafting for [bold]{target}[/] | vocabulary intersection "
            f"{engine.pair.vmap.size} | n-gram cache {len(engine.pair.ngrams)}"
            f" | drafter updates {engine.profile.updates if engine.profile else 0}"
        )
        console.print(
            f"serving '{target}' at http://{host}:{port}/v1"
            + (" (API key required)" if api_key or api_keys_file else "")
            + " | Ctrl-C stops"
        )

    if lead:
        console.print(f"[dim]loading {draft} and {target}[/]")
    run_server(cfg, host, port, ready, resolver=CATALOG_RESOLVER)


def names(joined: str) -> list[str]:
    """A flag's comma-joined list."""
    return [n.strip() for n in joined.split(",") if n.strip()]
