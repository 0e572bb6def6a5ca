"""Prefill through two or more source trees of the engine in one process, on the same weights, alternately.

Two trees measured in separate processes differ by more than the code: each process autotunes its Triton kernels
anew and the GPU's clocks drift between runs. Here the trees' Qwen models are loaded side by side in one process
(each tree's modules imported in turn under the same names, the first set kept alive by its model), from one set
of random weights, and their prefills alternate A B B A round after round, so drift falls on both alike. Run with
TRITON_CACHE_AUTOTUNING=1 so a kernel both trees share picks one configuration.

Prints one JSON line per timed prefill and one summary per length (median seconds of each tree; each later tree's
tok/s over the first's, from the medians and round by round, a round's runs of each tree taken together),
appending them to --out/ab_prefill.jsonl.

    TRITON_CACHE_AUTOTUNING=1 python bench/ab_prefill.py --tree before=/tmp/a --tree after=/tmp/b --out $OUT
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from gpu import TensorsCheckpoint  # bench/gpu.py, on sys.path; its tensorfold imports go with import_tree's purge

PACKAGES = ("tensorfold", "tensorfold_qwen")
QWEN = {False: ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"), True: ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}
TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64}
TINY = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "vocab_size": 1024}
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def emit(out: Path | None, **record: object) -> None:
    """Print one measurement as a JSON line, and append it to out/ab_prefill.jsonl."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with open(out / "ab_prefill.jsonl", "a") as handle:
            handle.write(line + "\n")


def import_tree(root: Path) -> SimpleNamespace:
    """The modules a prefill needs, imported from `root`; the previous tree's modules leave sys.modules (their
    models keep them alive) and come back with `activate`, since the forward imports some modules as it runs."""
    for name in [name for name in sys.modules if name.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    sys.path[:0] = [str(root / "core"), str(root / "tensorfold_qwen")]
    importlib.invalidate_caches()
    return SimpleNamespace(root=root, load=importlib.import_module("tensorfold_qwen.load"),
                           plugin=importlib.import_module("tensorfold_qwen.plugin"),
                           kv=importlib.import_module("tensorfold.kv"),
                           plan=importlib.import_module("tensorfold.plan"), modules={})


def seal_tree(tree: SimpleNamespace) -> None:
    """Remember every module the tree has imported by now (after a warm-up prefill) and take its paths away."""
    tree.modules = {name: module for name, module in sys.modules.items() if name.split(".")[0] in PACKAGES}
    for path in (str(tree.root / "core"), str(tree.root / "tensorfold_qwen")):
        sys.path.remove(path)


def activate(tree: SimpleNamespace) -> None:
    """Make `tree`'s modules the ones imports find, so its forward's call-time imports stay in the tree."""
    if not tree.modules:                                                # still importing: its paths are on
        return
    for name in [name for name in sys.modules if name.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    sys.modules.update(tree.modules)


def random_weights(overrides: dict, moe: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """HF's 9B-shaped Qwen3.5 (or 35B-A3B-shaped, `moe`) with its own random init, as a config dict and a state dict
    (the model freed)."""
    import transformers

    config_class, model_class = QWEN[moe]
    config = getattr(transformers, config_class)(**overrides)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            hf = getattr(transformers, model_class)(config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    tensors = dict(hf.state_dict())
    return config.to_dict(), tensors


def prefill(tree: SimpleNamespace, model, layout, tokens: list[int], chunk: int) -> float:
    """Seconds for one whole prefill of `tokens` from position 0 in `chunk`-row steps, synchronised."""
    page_rows = 256
    pages = -(-(len(tokens) + 1) // page_rows)
    store = tree.kv.PagedStore(layout, 1, pages, page_rows, DEVICE)
    store.bind(0, list(range(pages)))
    activate(tree)
    sync()
    start = time.perf_counter()
    for a in range(0, len(tokens), chunk):
        step = tree.plan.StreamStep(0, a, tokens[a: a + chunk], sample=a + chunk >= len(tokens))
        model.forward(tree.plan.StepPlan((step,)), store)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description="prefill of two engine trees, alternated in one process")
    parser.add_argument("--tree", action="append", required=True, help="name=path, two or more")
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a tiny config on the CPU: checks the script itself")
    parser.add_argument("--moe", action="store_true", help="the 35B-A3B shape (Qwen3.5 MoE) instead of the 9B")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (two 35B-A3B trees fit at 16)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.tiny else "cuda"
    trees = dict(item.split("=", 1) for item in args.tree)
    torch.manual_seed(0)
    overrides = ({**TINY, **(TINY_MOE if args.moe else {})} if args.tiny else {})
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    config, tensors = random_weights(overrides, args.moe)
    models = {}
    inputs = {rows: torch.randint(0, config["vocab_size"], (rows,)).tolist() for rows in args.rows}
    with torch.inference_mode():
        for name, root in trees.items():
            tree = import_tree(Path(root))
            weights = TensorsCheckpoint(config, tensors)
            model = tree.load.load(weights, torch.bfloat16, torch.device(DEVICE), progress=False)
            models[name] = (tree, model, tree.plugin.family_kv_layout(config, torch.bfloat16))
            for tokens in inputs.values():                             # first use: compiles, autotuning, imports
                prefill(*models[name], tokens, args.chunk)
            seal_tree(tree)
            emit(args.out, bench="ab_tree", tree=name, model_source=inspect.getfile(type(model)),
                 modules=len(tree.modules), has_shard="tensorfold.shard" in tree.modules)
        names = list(models)
        for rows, tokens in inputs.items():
            seconds: dict[str, list[float]] = {name: [] for name in names}
            for round_ in range(args.rounds):
                order = names if round_ % 2 == 0 else names[::-1]
                for name in order + order[::-1]:
                    took = prefill(*models[name], tokens, args.chunk)
                    seconds[name].append(took)
                    emit(args.out, bench="ab_prefill", tree=name, rows=rows, round=round_, seconds=round(took, 5))
            first = names[0]
            medians = {name: statistics.median(seconds[name]) for name in names}
            emit(args.out, bench="ab_prefill_summary", rows=rows, rounds=args.rounds, runs_per_tree=2 * args.rounds,
                 median_s={name: round(medians[name], 5) for name in names},
                 tok_s={name: round(rows / medians[name], 1) for name in names},
                 best_tok_s={name: round(rows / min(seconds[name]), 1) for name in names},
                 vs=first, median_ratio={name: round(medians[first] / medians[name], 4) for name in names[1:]},
                 round_ratios={name: [round(sum(seconds[first][2 * r: 2 * r + 2]) / sum(pair), 4)
                                      for r, pair in enumerate(zip(*[iter(seconds[name])] * 2, strict=True))]
                               for name in names[1:]})

if __name__ == "__main__":
    main()
