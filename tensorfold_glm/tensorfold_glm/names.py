"""The GLM-5.3-Flash checkpoint's tensor names and shapes, as HF's `save_pretrained` writes them.

HF writes the original on-disk format (conversion_mapping.py turns it into its in-memory modules at load): the
KDA convs as three tensors `self_attn.{q,k,v}_conv1d.weight`, the forget gate's `f_a_proj`, `f_b_proj`, `A_log`,
`dt_bias` directly under `self_attn.`, the mHC weights as `hc_{attn,ffn}_{fn,base,scale}`, and the routed experts
one by one, `mlp.experts.{e}.{gate,up,down}_proj.weight`. The text model lives under `model.language_model.`,
the head is `lm_head.weight`.

Spellings accepted (`canonical` maps them to the one above, so a checkpoint may use any one of them):

    model.language_model.{embed_tokens,layers,norm}.*     Glm5NextForConditionalGeneration (what HF writes)
    model.{embed_tokens,layers,norm}.*                    a text-only conversion (HF itself never writes it)
    {embed_tokens,layers,norm}.*                          Glm5NextTextModel.save_pretrained (model_type
                                                          glm5_next_text; it has no lm_head: serve it tied)

Ignored (`is_ignored`): the vision tower `model.visual.*`; multi-token-prediction layers, `layers.{N}.*` for
N >= num_hidden_layers (HF drops `layers.45.*`, the published MTP layer), and any `layers.{i}.shared_head.*`;
`lm_head.weight` when the embeddings are tied.
"""

from __future__ import annotations

import re

from tensorfold_glm.config import LINEAR, SPARSE, GlmConfig

TEXT = "model.language_model."
TEXT_ROOTS = ("embed_tokens.", "layers.", "norm.")
VISION = "model.visual."
LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")
SHARED_HEAD = re.compile(r"\.layers\.\d+\.shared_head\.")
Shapes = dict[str, tuple[int, ...]]


def hc_shapes(c: GlmConfig) -> Shapes:
    """A layer's two mHC blocks (attention, then the feed-forward), under `layers.{i}.`."""
    shapes: Shapes = {}
    for block in ("attn", "ffn"):
        shapes.update({f"hc_{block}_fn": (c.hc_mixes, c.hc_mult * c.hidden_size),     # float32 in HF
                       f"hc_{block}_base": (c.hc_mixes,),                              # float32
                       f"hc_{block}_scale": (3,)})                                     # float32: pre, post, comb
    return shapes


def kda_shapes(c: GlmConfig) -> Shapes:
    """A KDA layer's tensors, under `layers.{i}.self_attn.`."""
    E, H, D, K = c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    shapes: Shapes = {}
    for part in ("q", "k", "v"):
        shapes[f"{part}_proj.weight"] = (H * D, E)
        shapes[f"{part}_conv1d.weight"] = (H * D, 1, K)           # float32 in HF
    shapes.update({
        "f_a_proj.weight": (D, E), "f_b_proj.weight": (H * D, D),
        "A_log": (H,), "dt_bias": (H * D,),                       # float32
        "b_proj.weight": (H, E),
        "g_a_proj.weight": (D, E), "g_b_proj.weight": (H * D, D),
        "o_norm.weight": (D,), "o_proj.weight": (E, H * D),
    })
    return shapes


def mla_shapes(c: GlmConfig, full_indexer: bool) -> Shapes:
    """An MLA layer's tensors, and its DSA indexer's when it runs its own, under `layers.{i}.self_attn.`."""
    E, H, Q, R = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    shapes: Shapes = {
        "q_a_proj.weight": (Q, E), "q_a_layernorm.weight": (Q,),
        "q_b_proj.weight": (H * c.qk_head_dim, Q),
        "kv_a_proj_with_mqa.weight": (R + c.qk_rope_head_dim, E), "kv_a_layernorm.weight": (R,),
        "kv_b_proj.weight": (H * (c.qk_nope_head_dim + c.v_head_dim), R),
        "o_proj.weight": (E, H * c.v_head_dim),
    }
    if full_indexer:
        NI, DI = c.index_n_heads, c.index_head_dim
        shapes.update({f"indexer.{name}": shape for name, shape in {
            "wq_b.weight": (NI * DI, Q), "wk.weight": (DI, E),
            "k_norm.weight": (DI,), "k_norm.bias": (DI,),
            "weights_proj.weight": (NI, E),
            "index_kpool_compress_ape": (c.index_kpool, DI), "index_kpool_compress_gate": (DI, E),
        }.items()})
    return shapes


def swiglu_shapes(c: GlmConfig, prefix: str, inner: int) -> Shapes:
    """A SwiGLU MLP's tensors under `prefix`."""
    E = c.hidden_size
    return {f"{prefix}gate_proj.weight": (inner, E), f"{prefix}up_proj.weight": (inner, E),
            f"{prefix}down_proj.weight": (E, inner)}


def ffn_shapes(c: GlmConfig, sparse: bool) -> Shapes:
    """A layer's feed-forward, under `layers.{i}.mlp.`: dense, or router + experts + shared experts."""
    if not sparse:
        return swiglu_shapes(c, "", c.intermediate_size)
    N = c.n_routed_experts
    shapes: Shapes = {"gate.weight": (N, c.hidden_size), "gate.e_score_correction_bias": (N,)}   # float32
    for e in range(N):
        shapes.update(swiglu_shapes(c, f"experts.{e}.", c.moe_intermediate_size))
    shapes.update(swiglu_shapes(c, "shared_experts.", c.shared_intermediate_size))
    return shapes


def layer_shapes(c: GlmConfig, i: int) -> Shapes:
    """Every tensor of layer i, under `layers.{i}.`."""
    E = c.hidden_size
    shapes: Shapes = {"input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,)}
    shapes.update(hc_shapes(c))
    mixer = kda_shapes(c) if c.layer_types[i] == LINEAR else mla_shapes(c, c.indexer(i) == "full")
    shapes.update({f"self_attn.{name}": shape for name, shape in mixer.items()})
    shapes.update({f"mlp.{name}": shape for name, shape in ffn_shapes(c, c.mlp_layer_types[i] == SPARSE).items()})
    return shapes


def expected_shapes(c: GlmConfig) -> Shapes:
    """Every tensor the checkpoint must hold (HF's `model.language_model.` spelling) and its shape."""
    E = c.hidden_size
    shapes: Shapes = {f"{TEXT}embed_tokens.weight": (c.vocab_size, E), f"{TEXT}norm.weight": (E,)}
    for i in range(c.layers):
        shapes.update({f"{TEXT}layers.{i}.{name}": shape for name, shape in layer_shapes(c, i).items()})
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, E)
    return shapes


def canonical(name: str) -> str:
    """A checkpoint name in HF's spelling: `model.layers.x` and `layers.x` (and embed_tokens, norm) become
    `model.language_model.…`; every other name is returned as it is."""
    if name.startswith(TEXT) or name.startswith(VISION):
        return name
    for prefix in ("model.", ""):
        if name.startswith(prefix) and name[len(prefix):].startswith(TEXT_ROOTS):
            return TEXT + name[len(prefix):]
    return name


def is_ignored(name: str, c: GlmConfig) -> bool:
    """Tensors a checkpoint may hold that the text model does not use: the vision tower, MTP layers (index >=
    num_hidden_layers), `shared_head` tensors, a tied lm_head. `name` in any accepted spelling."""
    name = canonical(name)
    if name.startswith(VISION) or SHARED_HEAD.search("." + name):
        return True
    layer = LAYER.match(name)
    if layer and int(layer.group(1)) >= c.layers:
        return True
    return name == "lm_head.weight" and c.tie_word_embeddings
