"""`omnidraft serve`: an OpenAI-compatible HTTP API over a drafter/target pair.
server starts it; schema checks request bodies, routes is the FastAPI app (keys:
the API keys it takes, and the name each request goes by),
replies turns a job's events into JSON or server-sent events (responses and
messages: the Responses API and Anthropic's Messages API, translated onto the
chat route's request and back), engine decodes
the active requests together a round at a time (admission: who waits, who is
refused), jobs is a request's decode, text cuts stop strings and splits tool calls, tools speaks the target's
tool-call format, logprobs gives the target's log-probabilities (learning from
replies is learn.online's, as chat's is); follow runs it over the ranks of mlx.launch (rank 0
answers, the others decode the same replies).
Nothing imports serve but the CLI.
May import: decode, learn, profile, vocab, anatomy, collectives, errors, failpoints, loading, pair, paths, prompts,
settings, tasks, timing.
"""
