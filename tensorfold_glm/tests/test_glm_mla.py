"""MLA with the DSA pooled-key indexer against HF's Glm5NextTextAttention (one layer, or a full + shared pair).

fp32, weights re-drawn N(0, 1/fan_in) including the indexer's compress gate, ape and k_norm (HF's init leaves the
gate at ones and the pooling flat). Run `pytest -s` to see the measured differences.
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.kv import KvStore, PagedStore, WindowStore
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState, dtype_name
from tensorfold_glm import config as glm_config
from tensorfold_glm import indexer as dsa
from tensorfold_glm import mla

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_n_heads=4, index_head_dim=16,
            index_kpool=4, index_topk=8, rms_norm_eps=1e-5, vocab_size=32, pad_token_id=None)
TOL = 1e-4


# ---------------------------------------------------------------- helpers

def hf_layers(seed: int, indexer_types: list[str], attn: str = "eager", **fields):
    """HF attention modules for layers 0.. of a tiny config, weights re-drawn from `seed`; and the config."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    config = Glm5NextTextConfig(**{**TINY, **fields, "num_hidden_layers": len(indexer_types),
                                   "layer_types": ["indexed_attention"] * len(indexer_types),
                                   "indexer_types": indexer_types})
    config._attn_implementation = attn
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(len(indexer_types)):
        module = Glm5NextTextAttention(config, i).eval()
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(draw(name, p.shape, generator))
        layers.append(module)
    return config, layers


def draw(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Matrices N(0, 1/fan_in); norm weights 1 + 0.1·N; the LayerNorm bias 0.1·N; the pool ape N(0, 1)."""
    noise = torch.randn(tuple(shape), generator=generator)
    if name.endswith("compress_ape"):
        return noise
    if len(shape) >= 2:
        return noise * shape[-1] ** -0.5
    return 0.1 * noise if name.endswith("bias") else 1.0 + 0.1 * noise


def ours(module, config) -> tuple[mla.MlaWeights, mla.MlaDims]:
    """Our weights (the HF names, detached) and dims from an HF attention module."""
    def take(parent, *names: str) -> dict[str, torch.Tensor]:
        found = {n: getattr(parent, n) for n in names}
        return {n: (t if isinstance(t, torch.Tensor) else t.weight).detach() for n, t in found.items()}

    index = None
    if module.indexer is not None:
        ix = module.indexer
        index = dsa.IndexerWeights(**take(ix, "wq_b", "wk", "k_norm", "weights_proj", "index_kpool_compress_ape",
                                          "index_kpool_compress_gate"), k_norm_bias=ix.k_norm.bias.detach())
    w = mla.MlaWeights(**take(module, "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                              "kv_a_layernorm", "kv_b_proj", "o_proj"), indexer=index)
    d = mla.MlaDims(heads=config.num_attention_heads, qk_nope_head_dim=config.qk_nope_head_dim,
                    v_head_dim=config.v_head_dim, rms_norm_eps=config.rms_norm_eps,
                    index=dsa.IndexerDims(n_heads=config.index_n_heads, head_dim=config.index_head_dim,
                                          topk=config.index_topk, kpool=config.index_kpool,
                                          always_select_tail=config.index_kpool_always_select_tail))
    return w, d


def layout(config, dtype: torch.dtype = torch.float32) -> Layout:
    """The shared state names: "latent" per row; a full indexer adds "pooled_key" per pool and "pool_tail"."""
    act, P, DI = dtype_name(dtype), config.index_kpool, config.index_head_dim
    layers = []
    for kind in config.indexer_types:
        rows = [RowState("latent", (config.kv_lora_rank,), act)]
        fixed = []
        if kind == "full":
            rows.append(RowState("pooled_key", (DI,), act, every=P))
            fixed.append(FixedState("pool_tail", (P - 1, 2, DI), act))
        layers.append(LayerLayout(kind="mla", rows=rows, fixed=fixed))
    return Layout(layers)


def run(pairs: list[tuple[mla.MlaWeights, mla.MlaDims]], x: torch.Tensor, cuts: list[int], kv: KvStore, slot: int = 0
        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Layers in sequence (each fed x; a shared layer gets the previous layer's selection), steps from cuts[0] on
    starting at cuts. Returns each layer's outputs [N - cuts[0], E] and selection masks [N, N] (rows before
    cuts[0] False)."""
    N = x.shape[0]
    outs = [[] for _ in pairs]
    masks = [torch.zeros(N, N, dtype=torch.bool) for _ in pairs]
    for start, end in zip(cuts, cuts[1:] + [N], strict=True):
        selection = None
        for layer, (w, d) in enumerate(pairs):
            out, selection = mla.mla_attention(w, d, x[start:end], start, kv, layer, slot, selection)
            outs[layer].append(out)
            masks[layer][start:end, :end] = selection
    return [torch.cat(o) for o in outs], masks


def hf_run(layers, x: torch.Tensor, cuts: list[int] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """HF layers in sequence, no cache (cuts None) or driven with a DynamicCache at the cuts; the first layer's
    top-k indices as a mask [N, N] (all False unless it hands them on)."""
    from transformers.cache_utils import DynamicCache

    N = x.shape[0]
    cache = DynamicCache(config=layers[0].config) if cuts is not None else None
    outs = [[] for _ in layers]
    mask = torch.zeros(N, N, dtype=torch.bool)
    with torch.no_grad():
        for start, end in zip(cuts or [0], (cuts or [0])[1:] + [N], strict=True):
            ones = torch.ones(1, end - start, dtype=torch.bool)
            topk = None
            for i, module in enumerate(layers):
                out, _, handed = module(x[None, start:end], attention_mask=ones, cache=cache, prev_topk_indices=topk)
                outs[i].append(out[0])
                if i == 0 and handed is not None:
                    rows = handed[0].long()                                  # [t, width], -1 = none
                    counts = torch.zeros(end - start, end, dtype=torch.int32)
                    mask[start:end, :end] = counts.scatter_add_(-1, rows.clamp(min=0), (rows >= 0).int()) > 0
                topk = handed
    return [torch.cat(o) for o in outs], mask


def top_k_margin(w: mla.MlaWeights, d: mla.MlaDims, x: torch.Tensor, kv: KvStore, layer: int = 0) -> float:
    """After a one-shot run into kv: the smallest gap between the last kept and the first dropped candidate score,
    over the rows that drop a candidate (inf if none does)."""
    N, P, K = x.shape[0], d.index.kpool, d.index.pools_kept
    q_resid = mla.rms_norm(torch.nn.functional.linear(x, w.q_a_proj), w.q_a_layernorm, d.rms_norm_eps)
    scores = dsa.index_scores(w.indexer, d.index, q_resid, x, kv.rows(layer, "pooled_key", 0, N))
    gaps = [float(s[K - 1] - s[K]) for p in range(N) if (p + 1) // P > K
            for s in [scores[p, : (p + 1) // P].sort(descending=True).values]]
    return min(gaps, default=float("inf"))


def inputs(seed: int, n: int) -> torch.Tensor:
    """The first n of 80 unit-scale input rows drawn from seed, so shorter runs see a prefix of longer ones."""
    return torch.randn(80, TINY["hidden_size"], generator=torch.Generator().manual_seed(seed))[:n]


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


SELECT_SEED = 21    # checked by the tests below to have a clear top-k margin (no ties at the cut)


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kpool", [4, 16])
def test_select_all_matches_hf(attn: str, kpool: int) -> None:
    """index_topk >= context: every row attends causally to everything; one-shot prefill of 70 rows vs HF."""
    config, layers = hf_layers(0, ["full"], attn, index_kpool=kpool, index_topk=128)
    x = inputs(1, 70)
    outs, masks = run([ours(layers[0], config)], x, [0], WindowStore(layout(config), 1, 70))
    (hf,), _ = hf_run(layers, x)
    diff = float((outs[0] - hf).abs().max())
    print(f"\n[mla select-all kpool {kpool} {attn}] max |ours - HF| {diff:.2e} (|out| max {float(hf.abs().max()):.2f})")
    assert torch.equal(masks[0], causal(70))
    assert float(hf.abs().max()) > 0.3 and diff <= TOL


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_real_selection_matches_hf(attn: str) -> None:
    """kpool 4, topk 8 (2 pools) over 60 rows: a margin at every top-k cut, then the same keys and outputs as HF."""
    config, layers = hf_layers(SELECT_SEED, ["full", "shared"], attn)
    pairs = [ours(m, config) for m in layers]
    x = inputs(SELECT_SEED, 60)
    kv = WindowStore(layout(config), 1, 60)
    outs, masks = run(pairs, x, [0], kv)
    margin = top_k_margin(*pairs[0], x, kv)
    hf, hf_mask = hf_run(layers, x)
    diffs = [float((o - h).abs().max()) for o, h in zip(outs, hf, strict=True)]
    print(f"\n[mla topk 8/kpool 4 {attn}] top-k margin {margin:.2e}; max |ours - HF| full {diffs[0]:.2e}, "
          f"shared {diffs[1]:.2e}; keys seen {int(masks[0].sum())} of {int(causal(60).sum())} causal")
    assert margin > 1e-3, "a near-tie at the top-k cut: pick another seed"
    assert torch.equal(masks[0], hf_mask), "selected keys differ from HF's"
    assert masks[0].sum() < 0.6 * causal(60).sum() and not (masks[0] & ~causal(60)).any()
    assert max(diffs) <= TOL


def test_split_and_decode_equal_one_shot() -> None:
    """Prefill split at cuts inside pools (paged store), then token-by-token decode, vs one-shot (window store) and
    vs HF driven with its cache at the same cuts: the same selections, states and outputs within 1e-5. (Not
    bitwise: the CPU GEMM of a 1- or 2-row step rounds differently from the same rows inside a 62-row GEMM; the
    pooling itself is split-invariant bitwise, see the next tests.)"""
    config, layers = hf_layers(SELECT_SEED, ["full", "shared"])
    pairs = [ours(m, config) for m in layers]
    N, prefill = 62, [0, 2, 6, 13, 30, 41]
    cuts = prefill + list(range(42, N))
    x = inputs(SELECT_SEED, N)
    one_kv = WindowStore(layout(config), 1, N)
    one, one_masks = run(pairs, x, [0], one_kv)
    paged = PagedStore(layout(config), 2, pages=12, page_rows=8)
    paged.bind(1, [7, 2, 9, 0, 11, 4, 5, 3])
    split, split_masks = run(pairs, x, cuts, paged, slot=1)
    hf, _ = hf_run(layers, x, cuts)

    states = {name: [kv.rows(layer, name, s, N) for kv, s in ((one_kv, 0), (paged, 1))]
              for layer, name in ((0, "latent"), (1, "latent"), (0, "pooled_key"))}
    assert states["pooled_key"][1].shape == (N // 4, 16)
    state_diff = max(float((a - b).abs().max()) for a, b in states.values())
    tail = paged.fixed(0, "pool_tail", 1)[:2]                    # raw keys and gates of positions 60, 61
    keys, gates = dsa.raw_keys(pairs[0][0].indexer, x[60:])
    assert torch.allclose(tail[:, 0], keys, atol=1e-5) and torch.allclose(tail[:, 1], gates, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(one_masks, split_masks, strict=True))
    vs_one = max(float((a - b).abs().max()) for a, b in zip(one, split, strict=True))
    vs_hf = max(float((a - b).abs().max()) for a, b in zip(split, hf, strict=True))
    print(f"\n[mla split+decode] states vs one-shot {state_diff:.2e}; outputs vs one-shot {vs_one:.2e}, "
          f"vs HF cached {vs_hf:.2e}")
    assert state_diff <= 1e-5 and vs_one <= 1e-5 and vs_hf <= TOL


def test_a_long_prompt_selects_in_row_blocks_with_the_same_bits(monkeypatch) -> None:
    """Past SELECT_BYTES of [rows, NI, N] scores a step selects in blocks of rows: the same masks and outputs, bit for
    bit, as in one block (steps of 29 and 31 rows, blocks of 15 and 7 rows)."""
    config, layers = hf_layers(SELECT_SEED, ["full", "shared"])
    pairs = [ours(m, config) for m in layers]
    x = inputs(SELECT_SEED, 60)
    whole, whole_masks = run(pairs, x, [0, 29], WindowStore(layout(config), 1, 60))
    monkeypatch.setattr(glm_config, "SELECT_BYTES", config.index_n_heads * 15 * 4 * 7)   # 7 rows at 15 pools
    blocks = []
    original = dsa.top_pools
    monkeypatch.setattr(dsa, "top_pools", lambda scores, start, d: blocks.append(scores.shape) or original(
        scores, start, d))
    blocked, blocked_masks = run(pairs, x, [0, 29], WindowStore(layout(config), 1, 60))
    assert blocks == [(15, 7), (14, 7)] + [(7, 15)] * 4 + [(3, 15)]
    assert all(torch.equal(a, b) for a, b in zip(whole_masks, blocked_masks, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(whole, blocked, strict=True))


def test_resumed_step_equals_continued_step_bitwise() -> None:
    """A step depends only on its rows and the KvStore: continuing a stream in a fresh store that holds only the
    copied states (rows past them and the unused tail entries NaN) gives the same bits as continuing in place."""
    config, layers = hf_layers(SELECT_SEED, ["full", "shared"])
    pairs = [ours(m, config) for m in layers]
    x = inputs(SELECT_SEED, 50)
    live = WindowStore(layout(config), 1, 50)
    run(pairs, x[:13], [0, 6], live)
    fresh = WindowStore(layout(config), 1, 50, poison=True)
    fresh.clear(0)
    for layer, name in ((0, "latent"), (1, "latent"), (0, "pooled_key")):
        fresh.write_rows(layer, name, 0, 0, live.rows(layer, name, 0, 13).clone())
    fresh.fixed(0, "pool_tail", 0).fill_(float("nan"))
    fresh.fixed(0, "pool_tail", 0)[:1] = live.fixed(0, "pool_tail", 0)[:1]     # position 12 only
    for start, end in ((13, 14), (14, 31), (31, 32)):
        (a, a_mask), (b, b_mask) = (run(pairs, x[:end], [start], kv) for kv in (live, fresh))
        assert all(torch.equal(u, v) and torch.isfinite(v).all() for u, v in zip(a, b, strict=True))
        assert all(torch.equal(u, v) for u, v in zip(a_mask, b_mask, strict=True))
    for layer, name in ((0, "latent"), (1, "latent"), (0, "pooled_key")):
        assert torch.equal(live.rows(layer, name, 0, 32), fresh.rows(layer, name, 0, 32))
    assert torch.equal(live.fixed(0, "pool_tail", 0)[:3], fresh.fixed(0, "pool_tail", 0)[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pooled_keys_bitwise_across_splits_and_vs_hf(dtype: torch.dtype) -> None:
    """Given the same raw keys and gates, pooling through the tail state at any split (1-row steps included) gives
    the one-shot bits, and those are HF's get_pooled_states bits (fp32 softmax, cast, sum in the key dtype)."""
    config, layers = hf_layers(5, ["full"])
    index = layers[0].indexer.to(dtype)
    w = dsa.IndexerWeights(wq_b=index.wq_b.weight.detach(), wk=index.wk.weight.detach(),
                           k_norm=index.k_norm.weight.detach(), k_norm_bias=index.k_norm.bias.detach(),
                           weights_proj=index.weights_proj.weight.detach(),
                           index_kpool_compress_ape=index.index_kpool_compress_ape.detach(),
                           index_kpool_compress_gate=index.index_kpool_compress_gate.detach())
    x = inputs(6, 45).to(dtype)
    keys, gates = dsa.raw_keys(w, x)
    with torch.no_grad():
        assert torch.equal(keys, index.k_norm(index.wk(x)))
        packed = torch.cat([keys, gates, torch.ones(45, 1, dtype=dtype)], dim=-1)[None]
        hf_pooled = index.get_pooled_states(packed)[0][0]
    one_shot = dsa.extend_pools(w, keys, gates, 0, torch.full((3, 2, 16), float("nan"), dtype=dtype))
    assert torch.equal(one_shot, hf_pooled) and one_shot.dtype == dtype and one_shot.shape == (11, 16)
    tail = torch.full((3, 2, 16), float("nan"), dtype=dtype)     # at start 0 whatever it holds is ignored
    pieces = []
    cuts = [0, 1, 2, 7, 8, 9, 10, 21, 22, 33, 45]
    for start, end in zip(cuts, cuts[1:], strict=False):
        pieces.append(dsa.extend_pools(w, keys[start:end], gates[start:end], start, tail))
    assert torch.equal(torch.cat(pieces), one_shot)
    assert torch.equal(tail[0, 0], keys[44]) and torch.equal(tail[0, 1], gates[44])


def test_tie_break_lower_pool_wins_whatever_the_width() -> None:
    """Equal scores at the cut: the lower pool index is kept, with or without more columns after it."""
    d = dsa.IndexerDims(n_heads=1, head_dim=1, topk=8, kpool=4)              # keeps 2 pools
    row = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, 0.0, 3.0]])
    start = 7 * 4 - 1                                                         # all 7 pools are candidates
    kept = dsa.top_pools(row, start, d)
    assert kept[0].nonzero().flatten().tolist() == [1, 3]
    for extra in (1, 9, 200):
        wide = torch.cat([row, torch.full((1, extra), 3.0)], dim=1)
        assert dsa.top_pools(wide, start, d)[0].nonzero().flatten().tolist() == [1, 3]
    zeros = torch.zeros(1, 40)                                                # a flat row (relu zeros everywhere)
    assert dsa.top_pools(zeros, 159, d)[0].nonzero().flatten().tolist() == [0, 1]
    assert dsa.top_pools(zeros, 5, d)[0].nonzero().flatten().tolist() == [0]  # only pool 0 is complete at p = 5


def test_last_token_of_a_pool_sees_itself_only_if_its_pool_wins() -> None:
    """At p ≡ kpool-1 the tail is empty and pool p // kpool is a candidate; elsewhere the tail holds
    kpool·floor((p+1)/kpool) .. p."""
    d = dsa.IndexerDims(n_heads=1, head_dim=1, topk=4, kpool=4)              # keeps 1 pool
    scores = torch.tensor([[5.0, 1.0], [1.0, 5.0], [0.0, 0.0]])             # 2 complete pools by 10
    start = 7                                                                 # rows at p = 7, 8, 9
    mask = dsa.selection_mask(dsa.top_pools(scores, start, d), start, 10, d)
    assert mask[0].nonzero().flatten().tolist() == [0, 1, 2, 3]              # p 7: pool 0 wins, 7 not seen
    assert mask[1].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]           # p 8: pool 1 wins, tail [8]
    assert mask[2].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 9]        # p 9: tie -> pool 0, tail [8, 9]
    scores[0] = torch.tensor([1.0, 5.0])
    mask = dsa.selection_mask(dsa.top_pools(scores, start, d), start, 10, d)
    assert mask[0].nonzero().flatten().tolist() == [4, 5, 6, 7]              # p 7: own pool wins, sees itself

    config, layers = hf_layers(SELECT_SEED, ["full"])
    x = inputs(SELECT_SEED, 40)
    _, (real,) = run([ours(layers[0], config)], x, [0], WindowStore(layout(config), 1, 40))
    for p in range(40):
        tail = list(range((p + 1) // 4 * 4, p + 1))
        assert real[p, tail].all()
        if p % 4 == 3:
            assert not tail and bool(real[p, p]) == bool(real[p, p - 3 : p + 1].all())
    assert any(not real[p, p] for p in range(3, 40, 4)), "no last-of-pool row dropped itself: weak test"


def test_shared_layer_reuses_the_selection() -> None:
    """A shared layer has no indexer and no indexer state, and attends exactly where the previous layer did."""
    config, layers = hf_layers(SELECT_SEED, ["full", "shared"])
    pairs = [ours(m, config) for m in layers]
    assert pairs[1][0].indexer is None and [s.name for s in layout(config).layers[1].rows] == ["latent"]
    assert not layout(config).layers[1].fixed
    x = inputs(SELECT_SEED, 50)
    kv = WindowStore(layout(config), 1, 50)
    _, selection = mla.mla_attention(*pairs[0], x[:37], 0, kv, 0, 0)
    shared_out, shared_selection = mla.mla_attention(*pairs[1], x[:37], 0, kv, 1, 0, selection)
    assert shared_selection is selection
    with pytest.raises(ValueError, match="shares its DSA selection"):
        mla.mla_attention(*pairs[1], x[37:], 37, kv, 1, 0)
    everything = mla.mla_attention(*pairs[1], x[:37], 0, WindowStore(layout(config), 1, 50), 1, 0, causal(37))[0]
    assert float((everything - shared_out).abs().max()) > 1e-2, "the selection made no difference: weak test"
    (_, hf_shared), _ = hf_run(layers, x[:37])
    diff = float((shared_out - hf_shared).abs().max())
    print(f"\n[mla shared] max |ours - HF| {diff:.2e}")
    assert diff <= TOL


def test_without_tail_rows_that_select_nothing_give_zeros() -> None:
    """index_kpool_always_select_tail False: rows before the first complete pool select nothing; they output zeros
    like HF's SDPA path (HF eager instead averages over every key, future ones included)."""
    config, layers = hf_layers(SELECT_SEED, ["full"], "sdpa", index_kpool_always_select_tail=False)
    x = inputs(SELECT_SEED, 40)
    (out,), (mask,) = run([ours(layers[0], config)], x, [0, 2, 17], WindowStore(layout(config), 1, 40))
    (hf,), _ = hf_run(layers, x)
    assert not mask[:3].any() and torch.equal(out[:3], torch.zeros(3, 64))
    assert not mask[7, 7] or mask[7, 4:8].all()
    assert float((out - hf).abs().max()) <= TOL


@pytest.fixture
def kernel_path(monkeypatch: pytest.MonkeyPatch):
    """mla as on a Triton device (CUDA): use_triton true, masked_attention the Triton kernel (in triton's
    interpreter on the CPU, conftest chooses it)."""
    pytest.importorskip("triton")
    from tensorfold.kernels.masked_attention import triton_prefill
    from tensorfold.testing.triton_interpreter import interpreter_fixes

    monkeypatch.setattr(mla, "use_triton", lambda tensor: True)
    monkeypatch.setattr(mla, "masked_attention", triton_prefill.masked_attention)
    with interpreter_fixes():
        yield


@pytest.mark.triton
def test_the_kernel_path_matches_hf_and_keeps_a_rows_bits(kernel_path) -> None:
    """On a Triton device the prefill attention is the masked_attention kernel: the layers stay within TOL of HF,
    rows that select nothing give zeros, and a chunk's rows (over the keys up to the chunk's end) give the bits the
    one-shot call gives them, which is what resumed == fresh needs."""
    config, layers = hf_layers(SELECT_SEED, ["full", "shared"], "sdpa", index_kpool_always_select_tail=False)
    pairs = [ours(m, config) for m in layers]
    x = inputs(SELECT_SEED, 40)
    outs, masks = run(pairs, x, [0], WindowStore(layout(config), 1, 40))
    hf, _ = hf_run(layers, x)
    assert not masks[0][:3].any() and torch.equal(outs[0][:3], torch.zeros(3, 64))
    assert max(float((a - b).abs().max()) for a, b in zip(outs, hf, strict=True)) <= TOL

    g = torch.Generator().manual_seed(5)
    q = torch.randn(40, 4, 16, generator=g)
    k, v = torch.randn(40, 4, 32, generator=g).split([16, 16], dim=-1)
    whole = mla.attention(q, k, v, masks[0])
    for a, b in ((0, 2), (2, 6), (6, 13), (13, 30), (30, 40)):                # chunks of a prefill
        assert torch.equal(mla.attention(q[a:b], k[:b], v[:b], masks[0][a:b, :b]), whole[a:b]), (a, b)
