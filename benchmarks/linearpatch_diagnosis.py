"""Why LinearPatch breaks dropped Gemma 3 models: the patch against simpler maps at the same interfaces.

The model is ShortGPT's (the held-out protocol: 32 × 512 Wikipedia-sample tokens, seed 0), then
LinearPatch as shipped; each of its interface matrices ``P = H diag(d) Hᵀ`` is then replaced by:

- ``none``: no patch (ShortGPT alone);
- ``LinearPatch``: ``P`` as fitted;
- ``LinearPatch, top channels untouched``: ``P`` with the rows and columns of the residual stream's ``--top``
  largest channels (by mean |x| of the dense model's hidden states at the interface) set to the identity's;
- ``scalar``: ``mean(d) · I`` (the same overall rescaling, no mixing between channels);
- ``per-channel``: ``diag(mean|X_end| / mean|X_start|)`` in the model's own channels (no rotation).

Perplexity: WikiText-2 test, the C4 sample and the code sample, ``--windows`` × 1024 tokens each.

A second table looks at each interface on the dense model's own hidden states (8 × 512 Wikipedia-sample
tokens, first position left out): the share of the squared norm the top channels carry, the next layer's
input-norm gains, and the median per-token relative error to the hidden state the next layer expects, of the
raw hidden state and of what that layer reads (after its input RMSNorm with its gains), for no map, the fitted
``P`` and the per-channel ratio.

Run: python -m benchmarks.linearpatch_diagnosis [--model gemma3-270m] [--threads 1] [--windows 8]
It prints a table and upserts it into the model's committed result file (a free-form table).
"""
from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import rowstore
from benchmarks.compare_methods import EVALS, ROW_FILES, RESULTS
from benchmarks.diagnosis.common import heldout_run, load_dense, parser
from recipe_engine.architectures.adapters import ADAPTERS  # noqa: E402
from recipe_engine.evaluation.perplexity import perplexity  # noqa: E402
from recipe_engine.sources.text import load_text  # noqa: E402
from recipe_engine.modifiers.linear_patch import Patch  # noqa: E402
from recipe_engine.numerics.hadamard import rotation  # noqa: E402

TITLE = "Why LinearPatch breaks dropped Gemma 3 models"
INTERFACE_TITLE = "LinearPatch's interfaces: the hidden state and what the next layer reads"


def patches(model) -> list[tuple[int, Patch]]:
    """(layer position, hook) of every LinearPatch hook in the model (the final norm's as the layer count)."""
    adapter = ADAPTERS[model.config.model_type]
    modules = list(adapter.layers(model)) + [adapter.final_norm(model)]
    return [(i, hook) for i, module in enumerate(modules) for hook in module._forward_pre_hooks.values()
            if isinstance(hook, Patch)]


@torch.no_grad()
def layer_inputs(dense, tokenizer, windows: int = 8) -> list[torch.Tensor]:
    """The dense model's input of every layer (and the last layer's output) on Wikipedia-sample windows."""
    text = load_text("wikipedia-sample", "train").text
    ids = tokenizer(text[: 400_000], return_tensors="pt").input_ids[0]
    batch = torch.stack([ids[i * 512:(i + 1) * 512] for i in range(windows)])
    captured: list[torch.Tensor] = []
    adapter = ADAPTERS[dense.config.model_type]
    hooks = [layer.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach().float()))
             for layer in adapter.layers(dense)]
    hooks.append(adapter.final_norm(dense).register_forward_pre_hook(
        lambda _m, args: captured.append(args[0].detach().float())))
    try:
        dense(input_ids=batch, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def main() -> None:
    parse = parser(__doc__.split("\n")[0], ["ShortGPT+LinearPatch"])
    parse.set_defaults(model="gemma3-270m")
    parse.add_argument("--windows", type=int, default=8)
    parse.add_argument("--top", type=int, default=4)
    parse.add_argument("--conditions")
    parse.add_argument("--skip-ppl", action="store_true", help="only the interface table")
    args = parse.parse_args()
    dense, tokenizer, n = load_dense(args)
    model, report = heldout_run(args.model, dense, tokenizer, args.methods[0], n)
    found = patches(model)
    hidden = layer_inputs(dense, tokenizer)
    h = rotation(dense.config.hidden_size, 0)[0].float()
    ends = [(i["position"], i["start"], i["end"]) for i in report.steps[-1].result["interfaces"]]
    fitted = {position: hook.matrix.clone() for position, hook in found}
    top = set()
    shares = []
    for _position, start, end in ends:
        magnitude = hidden[end].abs().mean((0, 1))
        channels = magnitude.argsort(descending=True)[: args.top]
        top |= set(channels.tolist())
        x = hidden[end].reshape(-1, magnitude.numel())
        shares.append(f"{start}→{end}: {float((x[:, channels] ** 2).sum() / (x ** 2).sum()):.2f}")
    top_index = torch.tensor(sorted(top))

    def untouched(p: torch.Tensor) -> torch.Tensor:
        q = p.clone()
        q[top_index, :] = 0
        q[:, top_index] = 0
        q[top_index, top_index] = 1
        return q

    variants = {
        "none": {pos: torch.eye(h.shape[0]) for pos in fitted},
        "LinearPatch": fitted,
        "LinearPatch, top channels untouched": {pos: untouched(p) for pos, p in fitted.items()},
        "scalar mean(d)": {pos: torch.diagonal(h.T @ p @ h).mean() * torch.eye(h.shape[0])
                           for pos, p in fitted.items()},
        "per-channel ratio, no rotation": {pos: torch.diag(hidden[end].abs().mean((0, 1))
                                                           / hidden[start].abs().mean((0, 1)))
                                           for pos, start, end in ends},
    }
    file_name, section, order = ROW_FILES[args.model]
    run = rowstore.run_record(conditions=args.conditions)
    print(f"top {args.top} channels {sorted(top)}; their share of the squared norm: {', '.join(shares)}")
    interface_table(dense, fitted, ends, hidden, top_index, run, RESULTS / file_name, section, order)
    if args.skip_ppl:
        return
    texts = {e: load_text(name, split).text for e, (name, split) in EVALS.items()}
    columns = [{"key": "variant", "label": "map at each interface"}, {"key": "wikitext2", "label": "WikiText-2 PPL"},
               {"key": "c4", "label": "C4 PPL"}, {"key": "code", "label": "code PPL"}]
    for name, matrices in variants.items():
        for position, hook in found:
            hook.matrix = matrices[position].float()
        row = {"variant": name}
        for source, text in texts.items():
            row[source] = f"{perplexity(model, tokenizer, text, seq_len=1024, limit=args.windows)['ppl']:,.2f}"
        print(row, flush=True)
        rowstore.upsert_table_row(RESULTS / file_name, TITLE, row, run, "variant", section=section, order=order,
                                  columns=columns)


@torch.no_grad()
def interface_table(dense, fitted: dict, ends: list, hidden: list, top_index: torch.Tensor, run: dict,
                    path: Path, section: str, order: float) -> None:
    """Per interface: the top channels' share of the squared norm, the next layer's input-norm gains, and the
    median per-token relative error of the raw hidden state and of the normalized input, per map."""
    adapter = ADAPTERS[dense.config.model_type]
    layers = adapter.layers(dense)
    maps = ("none", "LinearPatch", "per-channel ratio")
    columns = [{"key": "interface", "label": "interface (original layers)"},
               {"key": "share", "label": "top channels' share of the squared norm"},
               {"key": "gains", "label": "next layer's input-norm gains: top channels; all (min / median / max)"}]
    columns += [{"key": f"raw {m}", "label": f"error of the hidden state: {m}"} for m in maps]
    columns += [{"key": f"read {m}", "label": f"error of what the layer reads: {m}"} for m in maps]
    for position, start, end in ends:
        if end >= len(layers):
            continue  # before the final norm: no next layer
        x, target = (hidden[i][:, 1:].reshape(-1, hidden[i].shape[-1]) for i in (start, end))
        norm = adapter.norm(layers[end], "attention_norm")
        gains = adapter.norm_gain(norm)
        mapped = {"none": x, "LinearPatch": x @ fitted[position].float(),
                  "per-channel ratio": x * (target.abs().mean(0) / x.abs().mean(0))}
        row = {"interface": f"{start} → {end}",
               "share": f"{float((target[:, top_index] ** 2).sum() / (target ** 2).sum()):.2f}",
               "gains": f"{gains[top_index].min():.2f}–{gains[top_index].max():.2f}; "
                        f"{gains.min():.2f} / {gains.median():.2f} / {gains.max():.1f}"}
        expected = norm(target)
        for m, value in mapped.items():
            row[f"raw {m}"] = f"{float(((value - target).norm(dim=-1) / target.norm(dim=-1)).median()):.3f}"
            row[f"read {m}"] = f"{float(((norm(value) - expected).norm(dim=-1) / expected.norm(dim=-1)).median()):.3f}"
        print(row, flush=True)
        rowstore.upsert_table_row(path, INTERFACE_TITLE, row, run, "interface", section=section, order=order,
                                  columns=columns)


if __name__ == "__main__":
    main()
