"""Time to first token per turn of a chat, with and without the prompt cache.

Without it every turn prefills the whole conversation in both models again,
so the wait grows with the history; with it a turn prefills only the last
reply and the new message. The same 6-turn conversation runs both ways in one
process (the replies are the same: greedy), alternating turn by turn.

    python -m omnidraft_mlx.bench.chat_ttft --out bench/results/chat-ttft
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omnidraft_mlx.bench.run import environment_base
from omnidraft_mlx.profile.atomic import atomic_write_text

TURNS = (
    "Write a Python function that parses a line of a CSV file with quoted fields.",
    "Now make it handle escaped quotes inside a quoted field.",
    "Add type hints and a docstring.",
    "Write three pytest tests for it.",
    "How would you make it faster for very long lines?",
    "Summarize what the function does in two sentences.",
)


def run(draft: str, target: str, max_tokens: int) -> dict:
    from omnidraft_mlx.chat import ChatConfig, ChatSession
    from omnidraft_mlx.decode.promptcache import PromptCache
    from omnidraft_mlx.decode.speculative import SpecConfig
    from omnidraft_mlx.loading import load_model
    from omnidraft_mlx.models.pull import CATALOG_RESOLVER
    from omnidraft_mlx.pair import make_pair

    (dm, dt), (tm, tt) = load_model(draft, CATALOG_RESOLVER), load_model(target, CATALOG_RESOLVER)
    pair = make_pair(dm, dt, tm, tt)
    cfg = ChatConfig(spec=SpecConfig(max_tokens=max_tokens), adapt=False)
    sessions = {"cached": ChatSession(pair, cfg), "no cache": ChatSession(pair, cfg, prompt_cache=PromptCache(0))}
    turns = []
    for i, text in enumerate(TURNS, 1):
        row = {"turn": i}
        for name, session in sessions.items():
            reply = session.start(text)
            for _ in session.stream(reply):
                pass
            session.finish(reply)
            row[name] = {
                "ttft_s": reply.ttft_s,
                "prompt_tokens": len(reply.target_ids),
                "cached_tokens": reply.stats.cached_tokens,
                "reply": reply.text,
            }
        same = row["cached"].pop("reply") == row["no cache"].pop("reply")
        turns.append({**row, "same_reply": same})
        print(
            f"turn {i}: TTFT cached {row['cached']['ttft_s']:.2f}s, no cache {row['no cache']['ttft_s']:.2f}s "
            f"({row['cached']['prompt_tokens']} prompt tokens, {row['cached']['cached_tokens']} cached)",
            flush=True,
        )
    first, last = turns[0]["cached"]["ttft_s"], turns[-1]["cached"]["ttft_s"]
    return {
        "draft": draft,
        "target": target,
        "max_tokens": max_tokens,
        "turns": turns,
        "turn6_over_turn1_cached": last / first,
        "turn6_over_turn1_no_cache": turns[-1]["no cache"]["ttft_s"] / turns[0]["no cache"]["ttft_s"],
        "environment": environment_base(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/chat-ttft"))
    args = parser.parse_args()
    result = run(args.draft, args.target, args.max_tokens)
    atomic_write_text(args.out / "chat_ttft.json", json.dumps(result, indent=1))
    print(
        f"turn 6 / turn 1 TTFT: cached {result['turn6_over_turn1_cached']:.2f}x, "
        f"no cache {result['turn6_over_turn1_no_cache']:.2f}x; wrote {args.out / 'chat_ttft.json'}"
    )


if __name__ == "__main__":
    main()
