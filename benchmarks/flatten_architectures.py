"""Can FlattenGPT's parallel merge be one stock layer on Gemma 3 (sandwich norms) and Qwen3-style per-head
q/k norms? Measured on adjacent layer pairs of Gemma-3-270M (which has both).

For each pair (i, i+1), on the inputs ``x`` of layer i (calibration: Wikipedia sample train, ``--samples`` ×
``--seq-len`` tokens, seed 0), with ``u_j`` a block's raw output (attention after ``o_proj``, MLP after
``down_proj``) and ``N_j(u) = g_j ⊙ u / rms(u)`` its own post-norm:

* **flatten**: ``‖parallel − serial‖ / ‖serial − x‖``, the error FlattenGPT accepts on every architecture
  (parallel = ``x + Σ_j N_j(u_j)``, then the same for the MLPs on that sum, each layer with its own norms);
* **one-norm attention / MLP**: a stock merged layer has ONE post-norm over the summed branch. Its best
  form here: ``γ ⊙ N(Σ_j (g_j / r̄_j) ⊙ u_j)`` (``g_j / r̄_j`` folded into the o_proj / down_proj rows, ``r̄_j``
  the mean RMS of ``u_j``, ``γ`` the least-squares per-channel gain); relative error of the branch sum
  ``‖Σ_j N_j(u_j) − γ ⊙ N(…)‖ / ‖Σ_j N_j(u_j)‖``;
* **head norms**: the spread of the two layers' q/k norm gains (``head_norm_spread``) and the relative
  error of the summed attention output when both layers use the mean gains (what ``merge_layers`` does for
  Qwen3): ``‖Σ_j u_j(mean gains) − Σ_j u_j‖ / ‖Σ_j u_j‖``.

Run: nice -n 10 python -m benchmarks.flatten_architectures [--samples 4 --seq-len 256]
(prints a table; writes benchmarks/results/raw/flatten_architectures.json)
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from recipe_engine.modifiers.flatten_adjacent import head_norm_spread
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.sources.text import load_text
from recipe_engine.sources.windows import sample_windows, tokenize
from recipe_engine.sources.models import load_model
from recipe_engine.recipe.schema import CalibrationConfig
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session

RESULTS = Path(__file__).parent / "results" / "raw"   # raw output (ignored by git)


def unit(u: torch.Tensor) -> torch.Tensor:
    return u / u.pow(2).mean(-1, keepdim=True).sqrt()


def one_norm_error(raw: list[torch.Tensor], gains: list[torch.Tensor], exact: torch.Tensor) -> float:
    """Relative error of the best one-post-norm form of ``exact = Σ_j g_j ⊙ unit(u_j)`` (module docstring)."""
    mixed = sum(g * u / u.pow(2).mean(-1).sqrt().mean() for g, u in zip(gains, raw))
    approx = unit(mixed).reshape(-1, exact.shape[-1]).double()
    target = exact.reshape(-1, exact.shape[-1]).double()
    gamma = (target * approx).sum(0) / approx.pow(2).sum(0)
    return float((target - gamma * approx).norm() / target.norm())


@torch.no_grad()
def measure_pair(adapter, layers, x, kwargs) -> dict:
    attention = [adapter.attention(layer) for layer in layers]
    own = [adapter.layer_kwargs(layer, kwargs) for layer in layers]
    raw_attn = [a(hidden_states=adapter.norm(layer, "attention_norm")(x), **k)[0]
                for a, layer, k in zip(attention, layers, own)]
    post_attn = [adapter.norm(layer, "attention_output_norm")(u) for layer, u in zip(layers, raw_attn)]
    h = x + sum(post_attn)
    raw_mlp = [adapter.mlp(layer)(adapter.norm(layer, "mlp_norm")(h)) for layer in layers]
    post_mlp = [adapter.norm(layer, "mlp_output_norm")(u) for layer, u in zip(layers, raw_mlp)]
    parallel = h + sum(post_mlp)
    serial = x
    for layer, k in zip(layers, own):
        serial = layer(serial, **k)
        serial = serial[0] if isinstance(serial, tuple) else serial
    gains = lambda role: [adapter.norm_gain(adapter.norm(layer, role)) for layer in layers]
    # Qwen3-style: every layer's attention with the pair's mean q/k norm gains
    averaged = [copy.deepcopy(a) for a in attention]
    for norm in adapter.head_norms:
        mean = torch.stack([adapter.norm_gain(adapter.norm(layer, norm)) for layer in layers]).mean(0)
        for a in averaged:
            adapter.set_norm_gain(getattr(a, norm.split("_")[0] + "_norm"), mean)
    raw_mean = [a(hidden_states=adapter.norm(layer, "attention_norm")(x), **k)[0]
                for a, layer, k in zip(averaged, layers, own)]
    return {
        "types": [adapter.layer_type(layer) for layer in layers],
        "flatten_error": float((parallel - serial).double().norm() / (serial - x).double().norm()),
        "one_norm_attention_error": one_norm_error(raw_attn, gains("attention_output_norm"), sum(post_attn)),
        "one_norm_mlp_error": one_norm_error(raw_mlp, gains("mlp_output_norm"), sum(post_mlp)),
        "head_norm_spread": head_norm_spread(layers, adapter),
        "mean_head_norm_error": float((sum(raw_mean) - sum(raw_attn)).double().norm()
                                      / sum(raw_attn).double().norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(args.model, "float32")
    config = CalibrationConfig(dataset="wikipedia-sample", split="train", samples=args.samples,
                               seq_len=args.seq_len, batch_size=args.samples, seed=0)
    ids = tokenize(tokenizer, load_text("wikipedia-sample", "train").text)
    windows = sample_windows(ids, args.samples, args.seq_len, 0, "wikipedia-sample")
    session = Session(RunContext(tokenizer, adapter_for(model.config), config, torch.device("cpu")), model, windows)
    inputs: dict[int, torch.Tensor] = {}
    session.pipeline.layer_pass(lambda index, x, _out: inputs.__setitem__(index, x[0]), "layer inputs")
    kwargs = session.pipeline.capture_inputs()[1][0]
    adapter, layers = session.context.adapter, session.layers
    rows = []
    for i in range(len(layers) - 1):
        row = {"pair": [i, i + 1], **measure_pair(adapter, [layers[i], layers[i + 1]], inputs[i], kwargs)}
        rows.append(row)
        print(row, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "flatten_architectures.json").write_text(json.dumps(
        {"model": args.model, "samples": args.samples, "seq_len": args.seq_len, "rows": rows}, indent=2))
    print("\n| pair | types | flatten | one-norm attention | one-norm MLP | q/k gain spread | mean-gain attention |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kinds = "/".join("S" if t == "sliding_attention" else "G" for t in r["types"])
        print(f"| {r['pair'][0]}–{r['pair'][1]} | {kinds} | {r['flatten_error']:.3f} | "
              f"{r['one_norm_attention_error']:.3f} | {r['one_norm_mlp_error']:.3f} | {r['head_norm_spread']:.3f} | "
              f"{r['mean_head_norm_error']:.3f} |")
    for key in ("flatten_error", "one_norm_attention_error", "one_norm_mlp_error", "head_norm_spread",
                "mean_head_norm_error"):
        values = [r[key] for r in rows]
        print(f"{key}: median {sorted(values)[len(values) // 2]:.3f}, min {min(values):.3f}, max {max(values):.3f}")


if __name__ == "__main__":
    main()
