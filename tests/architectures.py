"""Tiny random-weight causal LMs of every mlx-lm family that builds on a CPU.

Each family's ModelArgs gets a shared tiny base (hidden 64, 2 layers, 4 heads,
a 256-token vocabulary) and what its own settings need on top. A family's
settings that only name what it lacks (no vision tower, no Metal kernel) list
it in UNBUILDABLE with the reason, so the matrix says why it is not run.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math

import mlx.core as mx
import pytest

VOCAB = 320  # the tiny tokenizers (tests/tiny_models.py) fit
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    rms_norm_eps=1e-5,
    layer_norm_eps=1e-5,
    layer_norm_epsilon=1e-5,
    norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    # other families' names for the same sizes
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=512,
    n_inner=128,
    n_ctx=512,
    d_model=64,
    n_heads=4,
    n_layers=2,
    num_layers=2,
    model_dim=64,
    num_heads=4,
    num_kv_heads=2,
    # mixtures of experts
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    num_local_experts=4,
    shared_expert_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=0,
    routed_scaling_factor=1.0,
    # latent attention
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    # state spaces
    state_size=8,
    conv_kernel=4,
    expand=2,
    time_step_rank=8,
    ssm_state_size=8,
    n_groups=1,
    rotary_dim=8,
    partial_rotary_factor=0.5,
    rotary_pct=0.5,
    sliding_window=8,
)
LINEAR_ATTENTION = dict(
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    partial_rotary_factor=0.25,
)
GEMMA3 = dict(query_pre_attn_scalar=16, sliding_window_pattern=2, rope_local_base_freq=10000.0)
GEMMA4 = dict(
    global_head_dim=16,
    num_kv_shared_layers=0,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=16,
    sliding_window_pattern=2,
    num_global_key_value_heads=2,
)
LFM2 = dict(
    conv_bias=False,
    conv_L_cache=3,
    block_dim=64,
    block_ff_dim=128,
    block_multiple_of=16,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=False,
    full_attn_idxs=[1],
)
LONGCAT = dict(
    ffn_hidden_size=128,
    moe_topk=2,
    expert_ffn_hidden_size=32,
    zero_expert_num=1,
    mla_scale_q_lora=True,
    mla_scale_kv_lora=True,
)
GRANITE = dict(logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=2.0, residual_multiplier=0.5)
MAMBA = dict(
    mamba_n_heads=4,
    mamba_d_head=32,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_n_groups=1,
    mamba_proj_bias=False,
    mamba_conv_bias=True,
    mamba_chunk_size=16,
    time_step_limit=(0.001, 100.0),
)

FAMILIES: dict[str, dict] = {
    "apertus": {},
    "cohere": {},
    "cohere2": dict(sliding_window_pattern=2),
    "dbrx": dict(
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
    ),
    "deepseek": {},
    "deepseek_v3": {},
    "ernie4_5": {},
    "exaone": {},
    "exaone4": {},
    "falcon_h1": dict(MAMBA, mamba_d_head=16, mamba_d_ssm=64, mamba_expand=1, mlp_expansion_factor=2),
    "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3_text": GEMMA3,
    "gemma3": dict(text_config=dict(GEMMA3, model_type="gemma3_text")),
    "glm": {},
    "glm4": {},
    "glm4_moe": {},
    "gpt2": {},
    "gpt_bigcode": {},
    "gpt_neox": dict(rotary_emb_base=10000.0, rotary_pct=0.25),
    "gpt_oss": {},
    "gptj": {},
    "granite": GRANITE,
    "granitemoe": GRANITE,
    "granitemoehybrid": dict(GRANITE, **MAMBA, layer_types=["mamba", "attention"], shared_intermediate_size=64),
    "helium": {},
    "hunyuan_v1_dense": {},
    "internlm2": {},
    "internlm3": {},
    "lfm2": LFM2,
    "llama": {},
    "mamba": dict(use_bias=False, use_conv_bias=True, tie_word_embeddings=True),
    "mamba2": dict(
        head_dim=32,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=(0.001, 100.0),
    ),
    "mimo": {},
    "minicpm": dict(dim_model_base=32, scale_depth=1.4, scale_emb=2.0),
    "minimax": {},
    "ministral3": dict(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.0,
            "original_max_position_embeddings": 512,
        }
    ),
    "mistral3": dict(text_config=dict(model_type="llama")),
    "mixtral": {},
    "nanochat": {},
    "nemotron": {},
    "nemotron_h": dict(
        MAMBA,
        mamba_num_heads=4,
        mamba_head_dim=32,
        hybrid_override_pattern="M*-",
        num_hidden_layers=3,
        use_bias=False,
        use_conv_bias=True,
    ),
    "olmo2": {},
    "olmo3": dict(layer_types=["sliding_attention", "full_attention"]),
    "olmoe": {},
    "phi": {},
    "phi3": {},
    "phimoe": dict(  # Phi-3.5-MoE's su-scaled rotary embedding (older mlx-lm requires it)
        original_max_position_embeddings=256,
        rope_scaling=dict(short_factor=[1.0] * 8, long_factor=[1.5] * 8, short_mscale=1.0, long_mscale=1.1),
    ),
    "qwen2": {},
    "qwen2_moe": {},
    "qwen3": {},
    "qwen3_moe": {},
    "qwen3_5": dict(text_config=dict(LINEAR_ATTENTION, num_experts=0)),
    "qwen3_next": dict(LINEAR_ATTENTION),
    "recurrent_gemma": dict(
        conv1d_width=4,
        logits_soft_cap=30.0,
        attention_window_size=8,
        block_types=["recurrent", "attention"],
    ),
    "rwkv7": dict(a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, decay_low_rank_dim=8),
    "seed_oss": {},
    "smollm3": {},
    "stablelm": {},
    "starcoder2": {},
    "deepseek_v32": {},
    "deepseek_v41": {},
    "gear": {},
    "glm4_moe_lite": {},
    "iquestloopcoder": {},
    "kimi_k25": {},
    "kimi_vl": {},
    "laguna": {},
    "minimax_m3_vl": {},
    "muse_glimmer": {},
    "nanbeige": {},
    "phixtral": {},
    "pixtral": {},
    "plamo2": {},
    "plamo3": {},
    "qwen2_vl": {},
    "qwen3_vl": {},
    "talkie": {},
    "telechat3": {},
    "youtu_llm": {},
    "Klear": {},
    "dots1": {},
    "solar_open": {},
    "qwen3_vl_moe": {},
    "bailing_moe_v3": {},
    "lfm2_moe": dict(use_expert_bias=False, num_dense_layers=1, conv_bias=False, conv_L_cache=3, full_attn_idxs=[1]),
    "qwen3_5_moe": dict(text_config=dict(LINEAR_ATTENTION)),
    "jamba": dict(
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=2,
        mamba_d_conv=4,
        mamba_d_state=8,
        mamba_expand=2,
        mamba_dt_rank=8,
    ),
    "olmo_hybrid": dict(
        LINEAR_ATTENTION,
        linear_allow_neg_eigval=False,
        layer_types=["linear_attention", "full_attention"],
    ),
    "minicpm3": dict(
        dim_model_base=32,
        scale_depth=1.4,
        scale_emb=2.0,
        rope_scaling={
            "type": "longrope",
            "long_factor": [1.0] * 4,
            "short_factor": [1.0] * 4,
            "original_max_position_embeddings": 512,
        },
    ),
    "openelm": dict(
        num_transformer_layers=2,
        ffn_dim_divisor=16,
        num_query_heads=[4, 4],
        num_kv_heads=[2, 2],
        ffn_multipliers=[2.0, 2.0],
    ),
    "qwen": dict(kv_channels=16, intermediate_size=256),
    "ernie4_5_moe": dict(use_bias=False, moe_num_experts=4, moe_k=2),
    "plamo": dict(n_shared_head=2),
    "llama4_text": dict(intermediate_size_mlp=128, no_rope_layers=[1, 0], use_qk_norm=True),
    "gemma4_text": GEMMA4,
    "hunyuan": dict(
        moe_topk=2,
        num_shared_expert=1,
        use_mixed_mlp_moe=True,
        use_qk_norm=True,
        use_cla=False,
        cla_share_factor=1,
        rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    ),
    "mistral4": dict(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.0,
            "original_max_position_embeddings": 512,
        }
    ),
    "exaone_moe": dict(
        num_shared_experts=1,
        layer_types=["sliding_attention", "full_attention"],
        is_moe_layer=[False, True],
    ),
    "bailing_moe": dict(num_shared_experts=1),
    "step3p5": dict(
        num_attention_groups=2,
        moe_num_experts=4,
        moe_top_k=2,
        share_expert_dim=32,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "afm7": dict(hidden_dim=64, num_kv_reuse_layers=1),
    "gemma4": dict(text_config=dict(GEMMA4, model_type="gemma4_text")),
    "gemma3n": dict(
        text_config=dict(
            GEMMA3,
            model_type="gemma3n_text",
            num_kv_shared_layers=0,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=16,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"],
            activation_sparsity_pattern=[0.95, 0.0],
            altup_num_inputs=2,
            altup_coef_clip=120.0,
            altup_correct_scale=True,
            altup_active_idx=0,
            laurel_rank=8,
        )
    ),
    "llama4": dict(
        text_config=dict(
            model_type="llama4_text",
            num_hidden_layers=4,  # every 4th layer attends globally (its mask is made from cache[3])
            attention_chunk_size=16,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=128,
            use_qk_norm=True,
            num_experts_per_tok=1,  # its MoE routes each token to one expert
            rope_scaling=None,
        )
    ),
    "kimi_linear": dict(
        linear_attn_config={"kda_layers": [1], "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4},
        model_max_length=512,
        num_experts_per_token=2,
        num_shared_experts=1,
    ),
    "deepseek_v2": dict(rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512}),
    "kimi_k3": dict(
        text_config=dict(
            model_type="kimi_linear",
            linear_attn_config={"kda_layers": [1], "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4},
            num_experts_per_token=2,
            num_shared_experts=1,
        )
    ),
    "lfm2-vl": dict(text_config=dict(LFM2, model_type="lfm2")),
    "nemotron-nas": dict(
        block_configs=[
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        ]
    ),
    "afmoe": dict(layer_types=["sliding_attention", "full_attention"], num_dense_layers=1, num_shared_experts=1),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1, num_shared_experts=1),
    "bailing_hybrid": dict(
        layer_group_size=2, group_norm_size=1, num_shared_experts=1, moe_shared_expert_intermediate_size=32
    ),
    "glm_moe_dsa": dict(
        index_head_dim=16,
        index_n_heads=2,
        index_topk=8,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
        rope_parameters={"rope_theta": 10000.0},
    ),
    "lille-130m": dict(block_size=512, n_kv_heads=2),
    "longcat_flash": dict(
        LONGCAT,
        attention_method="MLA",
        zero_expert_type="identity",
    ),
    "longcat_flash_ngram": dict(LONGCAT, ngram_vocab_size_ratio=2, emb_neighbor_num=3, emb_split_num=2),
    "mellum": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 10000.0}},
    ),
    "mimo_v2_flash": dict(
        hybrid_layer_pattern=[1, 0],
        moe_layer_freq=[0, 1],
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        sliding_window_size=8,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        layernorm_epsilon=1e-5,
        swa_rope_theta=10000.0,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        swa_v_head_dim=16,
    ),
    "spark2_5": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 10000.0}},
    ),
    "baichuan_m1": dict(sliding_window_layers=[0], conv_window=2),
}

# Recurrent families are in FAMILIES like the rest: decode/recurrent.py keeps the state per draft position
# for gated delta (qwen3_5, qwen3_next, olmo_hybrid, kimi_linear, ...), Mamba-2 (mamba2, nemotron_h,
# granitemoehybrid, falcon_h1, plamo2), Mamba-1 (mamba, jamba), RG-LRU (recurrent_gemma), RWKV-7 (rwkv7),
# gated linear attention (bailing_moe_linear, bailing_hybrid), short-convolution (lfm2) layers and token
# windows (longcat_flash_ngram).


# Families refused in one line (an OmniDraftError naming what to do), with why.
REFUSED = {
    "deepseek_v41": "its LayerCache layers cannot roll back rejected draft tokens",
    "baichuan_m1": "its key-convolution state and window caches (inside a CacheList) do not roll back",
}


def installed(names) -> list:
    """The families as test parameters, those the installed mlx-lm lacks (an older version, e.g. the
    lowest pyproject.toml allows) skipped with that reason."""
    missing = pytest.mark.skip(reason="not in the installed mlx-lm (older than the family)")
    return [n if importlib.util.find_spec(f"mlx_lm.models.{n}") else pytest.param(n, marks=missing) for n in names]


def config(family: str) -> dict:
    """The family's tiny settings as a config.json would hold them."""
    extra = FAMILIES[family]
    cfg = dict(BASE, model_type=family, **{k: v for k, v in extra.items() if k != "text_config"})
    if "text_config" in extra:
        cfg["text_config"] = dict(BASE, **{"model_type": family, **extra["text_config"]})
    return cfg


def build(family: str, seed: int = 0, noise: float = 0.0, **settings):
    """A tiny random-weight model of the family (seeded), `settings` over its tiny ones; noise > 0
    perturbs every weight by that fraction of its scale (a drafter that agrees with the target
    often, not always)."""
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    cfg = dict(config(family), **settings)
    known = {f.name for f in dataclasses.fields(mod.ModelArgs)}
    missing = [f.name for f in dataclasses.fields(mod.ModelArgs) if _required(f) and f.name not in cfg]
    cfg.update(dict.fromkeys(missing))  # settings this family does not use at this size
    if "text_config" in known and not cfg.get("text_config"):
        cfg["text_config"] = dict(BASE, model_type=family)  # a wrapper's text model: the same tiny sizes
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict({k: v for k, v in cfg.items() if k in known}))
    # Sharper logits than the default init (a trained model's are peaked): greedy ties are rare.
    model.update(_sharpen(model.parameters()))
    if noise:
        mx.random.seed(seed + 1)
        model.update(_perturb(model.parameters(), noise))
    mx.eval(model.parameters())
    return model


def _required(f) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    return fn(tree)


def _sharpen(params):
    return _map(params, lambda a: a * 2.0 if a.ndim >= 2 and a.dtype == mx.float32 else a)


def _perturb(params, noise: float):
    def fn(a):
        if a.dtype != mx.float32:
            return a
        scale = math.sqrt(float(mx.mean(a * a).item())) or 1.0
        return a + noise * scale * mx.random.normal(a.shape)

    return _map(params, fn)
