"""What keeping the recurrent state after each draft position costs a hybrid target's verification.

On a hybrid model (recurrent layers beside attention) a verify forward must keep the
state after each of its positions so that rejected draft tokens can be rolled back
(decode/recurrent.py). This times, on random weights at real sizes (Qwen3.5-0.8B,
LFM2-350M, Mamba-2-370M shapes), one forward over 1 and 8 tokens after a cached
context:

- plain: mlx-lm's own caches (ArraysCache), the forward and its cache updates evaluated;
- keeping: this package's caches (StepsCache), the same forward, then a rollback to
  half the tokens (the state kept at the accepted length), all evaluated.

Fastest of several passes each; the bar is keeping / plain <= 1.15 at 8 tokens.

    ./run.sh python -m omnidraft_mlx.bench.recurrent_verify --out bench/results/recurrent-verify
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omnidraft_mlx.decode.kvcache import make_cache, prefill, trim_cache
from omnidraft_mlx.decode.recurrent import layers

WIDTHS = (1, 8)
BAR = 1.15

# Published configurations (text part), weights random: only the shapes matter for timing.
SHAPES = {
    "qwen3.5-0.8b": (
        "qwen3_5",
        dict(
            text_config=dict(
                model_type="qwen3_5_text",
                hidden_size=1024,
                intermediate_size=3584,
                num_hidden_layers=24,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=256,
                linear_num_key_heads=16,
                linear_num_value_heads=16,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_conv_kernel_dim=4,
                full_attention_interval=4,
                vocab_size=248320,
                tie_word_embeddings=True,
                rms_norm_eps=1e-6,
                max_position_embeddings=262144,
            )
        ),
    ),
    "lfm2-350m": (
        "lfm2",
        dict(
            vocab_size=65536,
            hidden_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=128000,
            norm_eps=1e-5,
            conv_bias=False,
            conv_L_cache=3,
            block_dim=1024,
            block_ff_dim=6656,
            block_multiple_of=256,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            full_attn_idxs=[2, 5, 8, 10, 12, 14],
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    "mamba2-370m": (
        "mamba2",
        dict(
            num_heads=32,
            head_dim=64,
            vocab_size=50288,
            hidden_size=1024,
            intermediate_size=2048,
            state_size=128,
            num_hidden_layers=48,
            layer_norm_epsilon=1e-5,
            conv_kernel=4,
            n_groups=1,
            use_bias=False,
            use_conv_bias=True,
            tie_word_embeddings=True,
            time_step_limit=(0.0, float("inf")),
            time_step_rank=64,
        ),
    ),
}


def _tiny(family: str, config: dict) -> dict:
    """The same family at a toy size (--tiny: checks the script runs, times nothing useful)."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=512)
    if family == "qwen3_5":
        text = dict(config["text_config"], **small, head_dim=16, num_attention_heads=4)
        return dict(text_config=dict(text, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2))
    if family == "lfm2":
        return dict(
            config,
            **small,
            block_dim=64,
            block_ff_dim=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            full_attn_idxs=[1, 3],
        )
    return dict(config, **small, num_heads=4, head_dim=32, state_size=16)


def build(family: str, config: dict, dtype):
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    model = mod.Model(mod.ModelArgs.from_dict(dict(config, model_type=family)))
    model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def _arrays(cache: list) -> list:
    """Every array a cache holds after a forward (what must be evaluated for its updates to count)."""
    out = []
    for c in cache:
        for s in layers(c):
            out += [a for a in getattr(s, "cache", []) if a is not None]
            out += [a for a in (getattr(s, "keys", None), getattr(s, "values", None)) if a is not None]
    return out


def _fastest(run, cache: list, passes: int) -> float:
    """Fastest of `passes` runs, each on a fresh copy of the cache (copied outside the timing)."""
    best = float("inf")
    for _ in range(passes + 1):  # the first warms up
        fresh = copy.deepcopy(cache)
        mx.eval(_arrays(fresh))
        start = time.perf_counter()
        run(fresh)
        best = min(best, time.perf_counter() - start)
    return best


def measure(model, cached: int, passes: int) -> dict:
    ids = mx.random.randint(0, 500, (cached + max(WIDTHS),)).tolist()
    plain_cache, keeping_cache = make_prompt_cache(model), make_cache(model)
    prefill(model, plain_cache, ids[:cached])
    prefill(model, keeping_cache, ids[:cached])
    rows = {}
    for width in WIDTHS:
        x = mx.array(ids[cached : cached + width])[None]

        def plain(cache, x=x):
            mx.eval(model(x, cache=cache), _arrays(cache))

        def keeping(cache, x=x, width=width):
            out = model(x, cache=cache)
            trim_cache(cache, width // 2)  # keep the state at the accepted length
            mx.eval(out, _arrays(cache))

        p, k = _fastest(plain, plain_cache, passes), _fastest(keeping, keeping_cache, passes)
        rows[str(width)] = {"plain_ms": 1000 * p, "keeping_ms": 1000 * k, "ratio": k / p}
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cached", type=int, default=256, help="context tokens in the cache before the forward")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--tiny", action="store_true", help="toy sizes: check that the script runs")
    args = ap.parse_args(argv)
    results = {}
    for name in args.shapes.split(","):
        family, config = SHAPES[name]
        model = build(family, _tiny(family, config) if args.tiny else config, getattr(mx, args.dtype))
        results[name] = measure(model, args.cached, args.passes)
        del model
    report = {
        "device": str(mx.default_device()),
        "machine": platform.platform(),
        "dtype": args.dtype,
        "cached_tokens": args.cached,
        "passes": args.passes,
        "tiny": args.tiny,
        "bar": BAR,
        "shapes": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# Verification with recurrent state kept, against a plain forward",
        "",
        f"{report['device']}, {args.dtype}, {args.cached} cached tokens, fastest of {args.passes} passes, "
        f"random weights at each model's real size{' (TINY sizes: a check, not a measurement)' if args.tiny else ''}.",
        f"Bar: keeping / plain <= {BAR} at 8 tokens. Command: `./run.sh python -m omnidraft_mlx.bench.recurrent_verify "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`.",
        "",
        "| shape | tokens | plain ms | keeping ms | keeping / plain |",
        "|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        for width, r in rows.items():
            lines.append(f"| {name} | {width} | {r['plain_ms']:.2f} | {r['keeping_ms']:.2f} | {r['ratio']:.3f} |")
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
