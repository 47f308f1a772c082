"""Tiny GGUF files written with gguf.GGUFWriter, for conversion tests.

Weights are random, kept in Hugging Face layout in `hf`, and written the way
llama.cpp's converter writes them (llama q/k rows permuted, Gemma norms +1),
so a correct conversion gives `hf` back.
"""

import gguf
import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 96, 4, 2, 16, 2
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab():
    """A byte-level BPE vocabulary: 256 byte tokens, a few merges, ChatML specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens += ["Ġt", "he", "Ġthe", "in", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]  # 3: control
    return tokens, types, merges


def write_tiny_gguf(path, arch="llama", quant_ffn_down=False, seed=0, unsupported_quant=False):
    """Write a tiny model of `arch`; returns the HF-layout weights (float32)."""
    rng = np.random.default_rng(seed)
    # mlx-lm's gemma3_text needs a full sliding-window pattern (6 layers).
    layers = 6 if arch == "gemma3" else LAYERS
    tokens, types, merges = _vocab()
    vocab = len(tokens)
    head_dim = HEAD_DIM if arch == "gemma3" else HIDDEN // HEADS

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    hf, gg = {}, {}  # HF name -> weight; GGUF name -> weight as written

    def add(hf_name, gguf_name, w, written=None):
        hf[hf_name] = w
        gg[gguf_name] = w if written is None else written

    add("model.embed_tokens.weight", "token_embd.weight", rand(vocab, HIDDEN))
    add("model.norm.weight", "output_norm.weight", 1 + rand(HIDDEN))
    if arch == "qwen2":  # untied output matrix, like both Qwen GGUFs
        add("lm_head.weight", "output.weight", rand(vocab, HIDDEN))
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = rand(HEADS * head_dim, HIDDEN), rand(KV_HEADS * head_dim, HIDDEN)
        if arch == "llama":
            add(p + "self_attn.q_proj.weight", b + "attn_q.weight", q, _permute(q, HEADS))
            add(p + "self_attn.k_proj.weight", b + "attn_k.weight", k, _permute(k, KV_HEADS))
        else:
            add(p + "self_attn.q_proj.weight", b + "attn_q.weight", q)
            add(p + "self_attn.k_proj.weight", b + "attn_k.weight", k)
        add(p + "self_attn.v_proj.weight", b + "attn_v.weight", rand(KV_HEADS * head_dim, HIDDEN))
        add(p + "self_attn.o_proj.weight", b + "attn_output.weight", rand(HIDDEN, HEADS * head_dim))
        add(p + "mlp.gate_proj.weight", b + "ffn_gate.weight", rand(FFN, HIDDEN))
        add(p + "mlp.up_proj.weight", b + "ffn_up.weight", rand(FFN, HIDDEN))
        add(p + "mlp.down_proj.weight", b + "ffn_down.weight", rand(HIDDEN, FFN))
        add(p + "input_layernorm.weight", b + "attn_norm.weight", 1 + rand(HIDDEN))
        if arch == "qwen2":
            add(p + "self_attn.q_proj.bias", b + "attn_q.bias", rand(HEADS * head_dim))
            add(p + "self_attn.k_proj.bias", b + "attn_k.bias", rand(KV_HEADS * head_dim))
            add(p + "self_attn.v_proj.bias", b + "attn_v.bias", rand(KV_HEADS * head_dim))
        if arch == "gemma3":
            norms = {
                "self_attn.q_norm": ("attn_q_norm", head_dim),
                "self_attn.k_norm": ("attn_k_norm", head_dim),
                "post_attention_layernorm": ("post_attention_norm", HIDDEN),
                "pre_feedforward_layernorm": ("ffn_norm", HIDDEN),
                "post_feedforward_layernorm": ("post_ffw_norm", HIDDEN),
            }
            for hf_norm, (gg_norm, n) in norms.items():
                add(p + hf_norm + ".weight", b + gg_norm + ".weight", rand(n))
        else:
            add(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", 1 + rand(HIDDEN))
    if arch == "gemma3":  # llama.cpp stores Gemma's RMSNorm weights as 1 + w
        gg = {k: (w + 1 if k.endswith("norm.weight") else w) for k, w in gg.items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(8)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in gg.items():
        if quant_ffn_down and name.endswith("ffn_down.weight"):
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)
        elif unsupported_quant and name.endswith("ffn_up.weight"):
            qt = gguf.GGMLQuantizationType.IQ4_NL  # 32 values in 18 bytes
            raw = np.zeros((t.shape[0], t.shape[1] // 32 * 18), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf
