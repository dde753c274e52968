"""Which part of FlattenGPT loses on held-out text? A cheap per-part ablation at model level.

The merged pairs (default: the ones FlattenAdjacent picks on Qwen2.5-0.5B at n = 5) are built from the
dense model's own inputs (every pair calibrated on dense activations, independently: no propagation), and
the variants below replace *every* pair at once; perplexity is measured on a few windows of each source
(the layers before the first pair are cached, so a variant costs one pass through the rest of the model):

* ``drop first`` / ``drop second``: keep one original layer of each pair (layer dropping);
* ``merged``: the merged, unpruned wide layer (more parameters: shows what merging alone costs);
* ``+heads``: merged + HeadPrune (reconstruction criterion, ridge o_proj refit, λ = 0.01 × mean eig);
* ``+heads nocomp``: the same groups, o_proj sliced without refit;
* ``+heads eq12``: the groups chosen by Eq. 12 instead (with the refit);
* ``+mlp``: merged + NystromMLP (leverage λ = 10 × mean eig, Theorem 3.1 refit), attention wide;
  ``+mlp nocomp``: no refit; ``+mlp energy``: channels by output energy ``G_ii ‖W_:,i‖²`` (± refit);
  ``+mlp weights``: by the data-free weight norms ``‖W_gate[i]‖ ‖W_up[i]‖ ‖W_down[:, i]‖``;
* ``+heads+mlp``: both (NystromMLP ``target: merged``);
* ``+heads+mlp+target λ``: then the down_proj refit towards the dense output of the pair (``target:
  original``/``serial`` coincide here) with λ_t = λ × mean eig.

Run: nice -n 10 python -m benchmarks.diagnosis.flatten [--model qwen2.5-0.5b] [--pairs 10,11 13,14 ...]
     [--samples 8] [--windows 2 2 4 2]
(prints a table, writes benchmarks/results/raw/flatten_diagnosis_<model>_s<samples>.json)
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from recipe_engine.modifiers.flatten_adjacent import merge_layers
from recipe_engine.modifiers.head_prune import best_groups_by_error, eq12_group_scores, group_channels
from recipe_engine.sources.text import load_text
from recipe_engine.sources.windows import sample_windows, tokenize
from recipe_engine.evaluation.perplexity import make_windows
from recipe_engine.numerics.linalg import mean_eigenvalue, ridge_compensation, ridge_leverage_scores, set_linear_weight

RESULTS = Path(__file__).resolve().parents[1] / "results" / "raw"   # raw output (ignored by git)
SOURCES = {"wikitext2": ("wikitext2", "test"), "c4": ("c4-sample", "all"), "code": ("code-sample", "all"),
           "wiki-heldout": ("wikipedia-sample", "test")}


class Capture:
    """Inputs (and kwargs) of one layer, and outputs of another, over the batches of one forward pass."""

    def __init__(self, first, last):
        self.inputs, self.kwargs, self.outputs = [], [], []
        self.handles = [first.register_forward_pre_hook(self.pre, with_kwargs=True),
                        last.register_forward_hook(self.post)]

    def pre(self, _module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.inputs.append(hidden.detach().clone())
        self.kwargs.append({k: v for k, v in kwargs.items() if k != "hidden_states"})

    def post(self, _module, _args, output):
        self.outputs.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    def remove(self):
        for handle in self.handles:
            handle.remove()


def run_layer(layer, inputs, kwargs_list):
    return [layer(x, **kw) for x, kw in zip(inputs, kwargs_list)]


def out(y):
    return y[0] if isinstance(y, tuple) else y


class Gram:
    def __init__(self, module):
        self.gram, self.last = None, None
        self.handle = module.register_forward_pre_hook(self.hook)

    def hook(self, _module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        self.last = x
        g = (x.T @ x).double()
        self.gram = g if self.gram is None else self.gram + g


@torch.no_grad()
def prune_heads(layer, inputs, kwargs, config, compensate=True, scale=0.01, criterion="reconstruction"):
    attn = layer.self_attn
    hook = Gram(attn.o_proj)
    run_layer(layer, inputs, kwargs)
    hook.handle.remove()
    head_dim = attn.head_dim
    per_group = config.num_attention_heads // config.num_key_value_heads
    groups = attn.k_proj.out_features // head_dim
    ridge = scale * mean_eigenvalue(hook.gram)
    if criterion == "eq12":
        count = sum(x.numel() // x.shape[-1] for x in inputs)
        scores = eq12_group_scores(attn.o_proj.weight, hook.gram, count, groups, per_group, head_dim)
        kept = sorted(scores.topk(config.num_key_value_heads).indices.tolist())
    else:
        kept = best_groups_by_error(attn.o_proj.weight, hook.gram, groups, config.num_key_value_heads,
                                    per_group, head_dim, ridge, 1024)
    query, kv = group_channels(kept, per_group, head_dim)
    new_o = ridge_compensation(attn.o_proj.weight, hook.gram, query, ridge) if compensate \
        else attn.o_proj.weight[:, query]
    for linear, rows in ((attn.q_proj, query), (attn.k_proj, kv), (attn.v_proj, kv)):
        set_linear_weight(linear, linear.weight[rows], linear.bias[rows] if linear.bias is not None else None)
    set_linear_weight(attn.o_proj, new_o, attn.o_proj.bias)
    return kept


@torch.no_grad()
def prune_mlp(layer, inputs, kwargs, config, scale=10.0, criterion="leverage", compensate=True):
    mlp = layer.mlp
    hook = Gram(mlp.down_proj)
    run_layer(layer, inputs, kwargs)
    hook.handle.remove()
    gram = hook.gram
    mean = mean_eigenvalue(gram)
    if criterion == "leverage":
        score = ridge_leverage_scores(gram, scale * mean)
    elif criterion == "energy":  # output energy of each channel: E[σ_i²] ‖W_down[:, i]‖²
        score = torch.diagonal(gram) * mlp.down_proj.weight.double().pow(2).sum(0)
    else:  # data-free: ‖W_gate[i]‖ ‖W_up[i]‖ ‖W_down[:, i]‖ (no calibration text in the choice)
        score = (mlp.gate_proj.weight.double().norm(dim=1) * mlp.up_proj.weight.double().norm(dim=1)
                 * mlp.down_proj.weight.double().norm(dim=0))
    keep = score.topk(config.intermediate_size).indices.sort().values
    down = ridge_compensation(mlp.down_proj.weight, gram, keep, scale * mean) if compensate \
        else mlp.down_proj.weight[:, keep]
    for linear in (mlp.gate_proj, mlp.up_proj):
        set_linear_weight(linear, linear.weight[keep], linear.bias[keep] if linear.bias is not None else None)
    set_linear_weight(mlp.down_proj, down, mlp.down_proj.bias)


@torch.no_grad()
def refit_target(layer, inputs, kwargs, targets, scale):
    down = layer.mlp.down_proj
    sigma = []
    handle = down.register_forward_pre_hook(lambda m, a: sigma.append(a[0].reshape(-1, a[0].shape[-1]).float()))
    outputs = [out(y) for y in run_layer(layer, inputs, kwargs)]
    handle.remove()
    gram = sum((s.T @ s).double() for s in sigma)
    cross = sum(s.double().T @ (t - y).reshape(-1, t.shape[-1]).double()
                for s, t, y in zip(sigma, targets, outputs))
    eye = torch.eye(gram.shape[0], dtype=torch.float64)
    delta = torch.linalg.solve(gram + scale * mean_eigenvalue(gram) * eye, cross).T
    set_linear_weight(down, down.weight.double() + delta, down.bias)


def build(variant, dense_layers, pair, data, config):
    """The layer(s) standing for ``pair`` in ``variant``."""
    a, b = pair
    if variant == "drop first":
        return [dense_layers[b]]
    if variant == "drop second":  # keep the block's first layer
        return [dense_layers[a]]
    merged = merge_layers(dense_layers[a: b + 1], None)  # a block a..b (a pair when b = a + 1)
    inputs, kwargs, targets = data
    if variant == "merged":
        return [merged]
    if "heads" in variant:
        prune_heads(merged, inputs, kwargs, config, compensate="heads nocomp" not in variant,
                    criterion="eq12" if "eq12" in variant else "reconstruction")
    if "mlp" in variant:
        criterion = next((c for c in ("energy", "weights") if c in variant), "leverage")
        prune_mlp(merged, inputs, kwargs, config, criterion=criterion,
                  compensate="nocomp" not in variant.replace("heads nocomp", ""))
    if "target" in variant:
        refit_target(merged, inputs, kwargs, targets, float(variant.rsplit(" ", 1)[1]))
    return [merged]


@torch.no_grad()
def tail_nll(model, layers, start_inputs, start_kwargs, windows):
    """Token-mean NLL of ``windows`` with ``layers`` run from the cached inputs of layer ``start``."""
    total, count = 0.0, 0
    for h, kw, ids in zip(start_inputs, start_kwargs, windows):
        for layer in layers:
            h = out(layer(h, **kw))
        logits = model.lm_head(model.model.norm(h)).float()
        total += float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[1:], reduction="sum"))
        count += ids.numel() - 1
    return total / count


def layer_error(layers, inputs, kwargs, targets):
    """Relative squared error of the block output vs the dense output over captured batches."""
    err, norm = 0.0, 0.0
    for x, kw, t in zip(inputs, kwargs, targets):
        h = x
        for layer in layers:
            h = out(layer(h, **kw))
        err += float((h - t).double().pow(2).sum())
        norm += float((t - x).double().pow(2).sum())
    return err / norm


@torch.no_grad()
def main() -> None:
    from recipe_engine.sources.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--pairs", nargs="*", default=["10,11", "13,14", "15,16", "18,19", "22,23"])
    parser.add_argument("--samples", type=int, default=8, help="calibration windows × 512 (wikipedia train)")
    parser.add_argument("--calibration", nargs="*", default=["wikipedia-sample:train"],
                        help="calibration sources NAME:SPLIT; the windows are shared evenly among them")
    parser.add_argument("--windows", nargs=4, type=int, default=[2, 2, 4, 2],
                        help="eval windows × 512 of wikitext2, c4, code, wiki-heldout")
    parser.add_argument("--variants", nargs="*", default=[
        "dense", "drop first", "drop second", "merged", "+heads", "+heads nocomp", "+mlp", "+heads+mlp",
        "+heads+mlp+target 0.1", "+heads+mlp+target 1"])
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--no-nll", action="store_true", help="layer errors only (no model-level perplexity)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    pairs = [tuple(int(i) for i in p.split(",")) for p in args.pairs]
    model, tokenizer, _ = load_model(args.model, "float32")
    config = model.config
    dense_layers = list(model.model.layers)
    sources = [c.split(":") for c in args.calibration]
    cal = torch.cat([sample_windows(tokenize(tokenizer, load_text(name, split).text), args.samples // len(sources),
                                    512, 0, name) for name, split in sources])
    calibrated = {name for name, _ in sources}  # a calibrated source is evaluated on its test split only
    evals = {name: make_windows(tokenize(tokenizer, load_text(
        source, "test" if source in calibrated else split).text), 512, count, name)
        for (name, (source, split)), count in zip(SOURCES.items(), args.windows)}
    start = pairs[0][0]

    def captured(windows, batch):
        caps = {p: Capture(dense_layers[p[0]], dense_layers[p[1]]) for p in pairs}
        first = Capture(dense_layers[start], dense_layers[start])
        for i in range(0, len(windows), batch):
            model(input_ids=windows[i: i + batch], use_cache=False)
        for c in (*caps.values(), first):
            c.remove()
        return caps, first

    t0 = time.time()
    cal_caps, _ = captured(cal, 2)
    eval_caps = {name: captured(w, 1) for name, w in evals.items()}
    print(f"captured in {time.time() - t0:.0f} s", flush=True)
    rows = []
    for variant in args.variants:
        t0 = time.time()
        new_layers, errors = [], {}
        i = 0
        replaced = {}
        for p in pairs:
            c = cal_caps[p]
            replaced[p] = dense_layers[p[0]: p[1] + 1] if variant == "dense" else \
                build(variant, dense_layers, p, (c.inputs, c.kwargs, c.outputs), config)
        while i < len(dense_layers):
            p = next((p for p in pairs if p[0] == i), None)
            if p is None:
                new_layers.append(dense_layers[i])
                i += 1
            else:
                new_layers.extend(replaced[p])
                i = p[1] + 1
        for p in pairs:
            errors[f"{p[0]},{p[1]}"] = {
                "calibration": layer_error(replaced[p], cal_caps[p].inputs, cal_caps[p].kwargs, cal_caps[p].outputs),
                **{name: layer_error(replaced[p], caps[p].inputs, caps[p].kwargs, caps[p].outputs)
                   for name, (caps, _) in eval_caps.items()}}
        tail = new_layers[start:] if variant != "dense" else dense_layers[start:]
        # the layers before the first pair are unchanged: start from the cached inputs of layer `start`
        nll = {} if args.no_nll else {name: tail_nll(model, tail, first.inputs, first.kwargs, evals[name])
                                      for name, (_, first) in eval_caps.items()}
        row = {"variant": variant, "ppl": {k: math.exp(v) for k, v in nll.items()}, "layer_error": errors,
               "seconds": time.time() - t0}
        rows.append(row)
        print(f"{variant:<26} " + " ".join(f"{k} {v:8.2f}" for k, v in row["ppl"].items())
              + "  rel.err cal/wt2/code " + " ".join(f"{e['calibration']:.3f}/{e['wikitext2']:.3f}/{e['code']:.3f}"
                                                for e in errors.values())
              + f"  {row['seconds']:.0f}s", flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"flatten_diagnosis_{args.model}_s{args.samples}{args.tag}.json").write_text(json.dumps(
            {"pairs": args.pairs, "samples": args.samples, "calibration": args.calibration, "windows": args.windows,
             "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
