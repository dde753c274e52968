"""FlattenAdjacent: merge adjacent decoder layers with similar inputs into wide parallel layers
(FlattenGPT §3.1, Algorithm 1)."""
from __future__ import annotations

import copy
import io
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from recipe_engine.api import (ADAPTERS, Activations, SCORE_FRACTION, LayerBudget, LayerShape, ModelShape, Modifier,
                               ModifierSession, budget_field, calibration_nll_bytes, heldout_split, install_linear,
                               register)

from ._depth import check_search_window
from .head_prune import HeadPrune
from .nystrom_mlp import NystromMLP


def select_blocks(similarity: torch.Tensor, merges: int) -> tuple[list[list[int]], list[float]]:
    """Greedy adjacent merging with the paper's row/column deletion (Algorithm 1, lines 3 and 10).

    Blocks start as single layers; a block ``a..b`` and its right neighbour ``c..d`` are scored by
    ``S[a][d]`` (input of the block's first layer vs input of the neighbour's last layer). The best-scoring
    adjacent pair is merged, ``merges`` times; ties go to the lowest index. Returns the blocks (lists of
    layer indices) and the score of each merge in the order done.
    """
    blocks = [[i] for i in range(similarity.shape[0])]
    scores: list[float] = []
    for _ in range(merges):
        pair_scores = [float(similarity[blocks[j][0], blocks[j + 1][-1]]) for j in range(len(blocks) - 1)]
        best = max(range(len(pair_scores)), key=lambda j: (pair_scores[j], -j))
        blocks[best: best + 2] = [blocks[best] + blocks[best + 1]]
        scores.append(pair_scores[best])
    return blocks, scores


#: ``selection: nll`` scores the first this many calibration windows × tokens by default (SLEB's budget).
SEARCH_SAMPLES, SEARCH_LENGTH = 8, 128


def scoring_prune() -> tuple:
    """The steps ``prune_to_config`` applies (imported late: sibling modifier modules)."""
    return HeadPrune(), NystromMLP(criterion="energy", target="merged")


@torch.no_grad()
def prune_to_config(probe: ModifierSession, layer: torch.nn.Module, states: Activations) -> torch.nn.Module:
    """A wide (merged) layer pruned back to the config's widths in place, close to what the flagship recipe
    does: ``HeadPrune`` at its defaults, then ``NystromMLP<criterion: energy, target: merged>`` (channels by
    output energy, Theorem 3.1 refit; not ridge leverage, whose fp64 inverse of the merged Gram was 71 % of
    the search's time on Qwen2.5-0.5B), each on statistics of this layer run over ``states`` (the MLP's after
    the attention is pruned). The layer is put alone in ``probe``'s layer list while the two steps act on
    it (their ``compress_layer`` reads ``session.layers``)."""
    layers = probe.adapter.layers(probe.model)
    probe.adapter.set_layer_list(probe.model, torch.nn.ModuleList([layer]))
    try:
        with probe.placed(layer):
            for step in scoring_prune():
                hooks = step.statistics(probe, 0)
                probe.run_layer(layer, states, hooks=hooks)
                step.compress_layer(probe, 0, {hook.key: hook for hook in hooks})
    finally:
        probe.adapter.set_layer_list(probe.model, layers)
    return layer


@torch.no_grad()
def select_blocks_by_nll(probe: ModifierSession, merges: int, rounds: list[dict[str, Any]] | None = None,
                         pruned: bool = True, drops: bool = False, fit: ModifierSession | None = None
                         ) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Greedy adjacent merging decided by the model's loss rather than by a similarity proxy.

    Blocks start as single layers of ``probe``'s model (a session over the calibration windows to score).
    Each round scores every adjacent pair of blocks by the calibration NLL of the model with that pair
    run as one parallel layer (``merge_layers``) and merges the argmin (ties: lowest index): SLEB's
    round-by-round search (Song et al. 2024, §3) with "merge the two blocks" in place of "skip the block".
    ``pruned``: every merged layer — candidate or merged in an earlier round — is pruned back to the
    config's widths (``prune_to_config``) before it is scored, so a candidate is judged as it will end up;
    else merged layers run unpruned (measured: a poor predictor, docs/methods/flattengpt.md). A round walks the
    prefix once, keeping each block's input (earlier rounds' blocks are pruned there, on those inputs, and
    reused as they are in every candidate's suffix), and runs every candidate from its own block on.
    ``drops``: a round also scores skipping each unmerged layer but the first and last (SLEB's own move,
    candidate ``-j``) and takes whichever move, merge or drop, gives the lowest NLL (a fallback to
    dropping a layer when flattening loses, decided by the model's loss); a dropped layer leaves the blocks.
    ``fit``: a session over other windows (same model) that merged blocks are pruned on (``score: heldout``):
    a round then walks the prefix over both sets of windows, prunes every merged block on its fit-window
    inputs and scores every candidate on ``probe``'s windows only, so a fitted merge and an unfitted drop are
    judged on windows neither was fitted on; None: pruned on the scored windows themselves (in-sample).
    Returns the blocks and, per round, the merged block (or the dropped one), its NLL and every
    candidate's. ``rounds`` (extended in place) are earlier rounds to start from: a greedy search for fewer
    merges is a prefix of one for more (a sweep over ``n`` shares them).
    """
    layers = list(probe.layers)
    # in memory, a block built on an unchanged prefix is reused in later rounds (same inputs: same layer)
    built: dict[tuple, torch.nn.Module] | None = {} if not probe.streamed else None

    fitter = probe if fit is None else fit

    def build(prefix: list[list[int]], block: list[int], states: Activations) -> torch.nn.Module:
        """The merged ``block`` on ``prefix``, pruned on ``states`` (``fitter``'s windows)."""
        key = (tuple(map(tuple, prefix)), tuple(block))
        if built is not None and key in built:
            return built[key]
        with probe.placed(*block, on_device=False):
            merged = merge_layers([layers[i] for i in block], probe.adapter)
        module = prune_to_config(fitter, merged, states) if pruned else merged
        if built is not None:
            built[key] = module
        return module

    def run(block: list[int], module: torch.nn.Module | None, states: Activations) -> Activations:
        if module is None:
            with probe.placed(block[0]):
                return probe.run_layer(layers[block[0]], states)
        with probe.placed(module):
            return probe.run_layer(module, states)

    blocks = [[i] for i in range(len(layers))]
    rounds = [] if rounds is None else rounds
    for done in rounds[:merges]:
        if "dropped" in done:
            blocks.remove(done["dropped"])
            continue
        j = next(j for j in range(len(blocks) - 1) if blocks[j] + blocks[j + 1] == done["merged"])
        blocks[j: j + 2] = [done["merged"]]
    for _ in range(len(rounds), merges):
        if built is not None:  # forget blocks built on a prefix that has changed
            built = {key: m for key, m in built.items() if [list(b) for b in key[0]] == blocks[: len(key[0])]}
        states = probe.capture_inputs()
        # the fitting windows' states (the scored ones themselves when in-sample)
        fit_states = fit.capture_inputs() if fit is not None else states
        block_inputs, fit_inputs, modules = [], [], []
        for j, block in enumerate(blocks):
            block_inputs.append(states)
            fit_inputs.append(fit_states)
            modules.append(build(blocks[:j], block, fit_states) if len(block) > 1 else None)
            if j < len(blocks) - 1:
                states = run(block, modules[-1], states)
                fit_states = states if fit is None else run(block, modules[-1], fit_states)
        scores: dict[tuple[int, str], float] = {}  # (block index, "merge" | "drop") → NLL
        for j in range(len(blocks) - 1):
            candidate = blocks[j] + blocks[j + 1]
            merged = build(blocks[:j], candidate, fit_inputs[j])
            states = run(candidate, merged, block_inputs[j])
            for block, module in zip(blocks[j + 2:], modules[j + 2:]):
                states = run(block, module, states)
            scores[j, "merge"] = probe.calibration_nll(finals=states)
        for j in range(1, len(blocks) - 1) if drops else ():
            if len(blocks[j]) > 1:
                continue
            states = block_inputs[j]
            for block, module in zip(blocks[j + 1:], modules[j + 1:]):
                states = run(block, module, states)
            scores[j, "drop"] = probe.calibration_nll(finals=states)
        (best, move) = min(scores, key=lambda key: (scores[key], key[0], key[1] == "drop"))
        name = lambda j, kind: "+".join(map(str, blocks[j] + blocks[j + 1])) if kind == "merge" else f"-{blocks[j][0]}"
        record = {"merged": blocks[best] + blocks[best + 1]} if move == "merge" else {"dropped": blocks[best]}
        rounds.append({**record, "nll": scores[best, move],
                       "candidates": {name(j, kind): v for (j, kind), v in scores.items()}})
        if move == "merge":
            blocks[best: best + 2] = [blocks[best] + blocks[best + 1]]
        else:
            del blocks[best]
    return blocks, rounds


def symbolic_blocks(num_layers: int, merges: int) -> list[list[int]]:
    """Stand-in grouping for config-only validation (the real one needs calibration data): repeatedly
    merge the smallest adjacent pair, scanning from the last layer. Layer count and widths are exact in
    kind (merged layers are oversized by whole layers), not in position."""
    blocks = [[i] for i in range(num_layers)]
    for _ in range(merges):
        best = min(range(len(blocks) - 2, -1, -1), key=lambda j: len(blocks[j]) + len(blocks[j + 1]))
        blocks[best: best + 2] = [blocks[best] + blocks[best + 1]]
    return blocks


@torch.no_grad()
def merge_layers(layers: list[torch.nn.Module], adapter) -> torch.nn.Module:
    """One wide layer computing ``h = x + Σ_j Attn_j(x̂)``, then ``h + Σ_j MLP_j(ĥ)`` (Eqs. 7–11).

    Each layer's norm gain (``adapter.norm_gain``) is folded into its own q/k/v and gate/up (``fold_norm_into``'s
    arithmetic: fp32 product cast back; the merged norms' gains are 1, so ``x̂`` is the shared ``x / rms(x)``);
    q/k/v (and their biases), gate/up are concatenated along the output axis, o/down along the input axis,
    a fused linear (Phi-3 qkv, gate_up) member by member. Heads keep their order: layer 0's heads, then
    layer 1's, ... Per-head q/k norms (Qwen3) are shared by all heads of a layer, so the merged layer takes
    the mean gain of its sources: exact when they agree, else an approximation (``head_norm_spread``; see
    docs/methods/flattengpt.md). The source layers are left unchanged.
    """
    # the copy's linears are replaced below: their weights are not copied (placeholders in deepcopy's memo)
    linears = [adapter.linear(layers[0], role) for role in adapter.linears]
    merged = copy.deepcopy(layers[0], {id(t): torch.nn.Parameter(torch.empty(0, dtype=t.dtype), requires_grad=False)
                                       for linear in linears for t in (linear.weight, linear.bias) if t is not None})
    head_dim = adapter.attention(layers[0]).head_dim
    reads = {role: norm for norm, roles in adapter.norm_reads for role in roles}
    for role, path in adapter.linears.items():
        axis = 1 if role in ("o_proj", "down_proj") else 0
        members: dict[str, list] = {}
        for layer in layers:
            gain = adapter.norm_gain(adapter.norm(layer, reads[role])) if role in reads else None
            for member, (weight, bias) in adapter.member_parts(layer, role, head_dim).items():
                members.setdefault(member, []).append((weight, bias, gain))
        parts = [part for member in members.values() for part in member]
        if axis == 0:
            rows, columns = sum(w.shape[0] for w, _, _ in parts), parts[0][0].shape[1]
        else:
            rows = sum(member[0][0].shape[0] for member in members.values())
            columns = sum(w.shape[1] for w, _, _ in next(iter(members.values())))
        bias = None
        if layers[0].get_submodule(path).bias is not None:
            bias = torch.cat([torch.cat([b for _, b, _ in member]) if axis == 0
                              else torch.stack([b for _, b, _ in member]).sum(0) for member in members.values()])
        linear = install_linear(merged, path, columns, rows, bias is not None, parts[0][0].dtype, parts[0][0].device)
        _fill_concatenated(linear.weight, members, axis)
        if bias is not None:
            linear.bias.copy_(bias)
    for norm in {norm for norm, _ in adapter.norm_reads}:
        adapter.set_norm_gain(adapter.norm(merged, norm), 1.0)
    for norm in adapter.head_norms:
        adapter.set_norm_gain(adapter.norm(merged, norm),
                              torch.stack([adapter.norm_gain(adapter.norm(layer, norm)) for layer in layers]).mean(0))
    adapter.sync_widths(merged, head_dim)
    return merged


@torch.no_grad()
def _fill_concatenated(target: torch.Tensor, members: dict[str, list], axis: int) -> None:
    """``target ← cat_members(cat_axis(w · gain))``: each member's weights side by side along ``axis``, members
    stacked by rows, each source's norm gain (or None) multiplied in fp32 and rounded once to the weight dtype
    as it is written (no fp32 copy, no concatenation buffer)."""
    row = 0
    for member in members.values():
        column = 0
        for weight, _, gain in member:
            block = (target[row:row + weight.shape[0]] if axis == 0
                     else target[row:row + weight.shape[0], column:column + weight.shape[1]])
            if gain is None:
                block.copy_(weight)
            else:
                torch.mul(weight, gain.float()[None, :], out=block)
            if axis == 0:
                row += weight.shape[0]
            else:
                column += weight.shape[1]
        if axis == 1:
            row += member[0][0].shape[0]


@torch.no_grad()
def head_norm_spread(layers: list[torch.nn.Module], adapter) -> float:
    """Largest relative spread ``max_j ‖g_j − ḡ‖ / ‖ḡ‖`` of the per-head q/k norm gains ``g_j`` of the merged
    source layers around their mean ``ḡ`` (0: the merge is exact; no head norms: 0)."""
    spread = 0.0
    for norm in adapter.head_norms:
        gains = torch.stack([adapter.norm_gain(adapter.norm(layer, norm)) for layer in layers]).double()
        mean = gains.mean(0)
        spread = max(spread, float((gains - mean).norm(dim=1).max() / mean.norm()))
    return spread


def similarity_heatmap(similarity: torch.Tensor, blocks: list[list[int]]) -> bytes:
    """PNG of the input cosine-similarity matrix with each merged block outlined."""
    # deferred: matplotlib is needed only to draw a plot
    import matplotlib

    matplotlib.use("Agg")
    # deferred: as above
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(similarity.numpy(), cmap="viridis", vmin=float(similarity.min()), vmax=1.0)
    for block in (b for b in blocks if len(b) > 1):
        ax.add_patch(Rectangle((block[0] - 0.5, block[0] - 0.5), len(block), len(block),
                               fill=False, edgecolor="red", linewidth=2))
    ax.set_xlabel("layer j")
    ax.set_ylabel("layer i")
    ax.set_title("input cosine similarity S[i][j]; merged blocks in red")
    fig.colorbar(image, ax=ax)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


class UnitVectorStore:
    """``layers × tokens × hidden`` fp32 vectors, in memory or in an unlinked scratch file (``directory``),
    written one layer at a time; :meth:`cosine_gram` returns ``Σ_t U[:, t] U[:, t]ᵀ`` (fp64 sums of fp32
    chunk products over ``chunk`` token positions), identical for both backings."""

    def __init__(self, layers: int, tokens: int, hidden: int, directory: Path | None, chunk: int = 256):
        self.shape, self.chunk = (layers, tokens, hidden), chunk
        self.memory = torch.empty(self.shape) if directory is None else None
        self.file = None if directory is None else tempfile.TemporaryFile(dir=directory)

    def __enter__(self) -> "UnitVectorStore":
        return self

    def __exit__(self, *_exc) -> None:
        if self.file is not None:
            self.file.close()

    def write(self, layer: int, vectors: torch.Tensor) -> None:
        if self.file is None:
            self.memory[layer] = vectors
            return
        self.file.seek(layer * vectors.numel() * 4)
        self.file.write(vectors.contiguous().numpy().tobytes())

    def _chunk(self, start: int, stop: int) -> torch.Tensor:
        layers, tokens, hidden = self.shape
        if self.file is None:
            return self.memory[:, start:stop]
        out = torch.empty(layers, stop - start, hidden)
        for layer in range(layers):
            self.file.seek(((layer * tokens) + start) * hidden * 4)
            self.file.readinto(out[layer].numpy())
        return out

    def cosine_gram(self) -> torch.Tensor:
        layers, tokens, _ = self.shape
        total = torch.zeros(layers, layers, dtype=torch.float64)
        for start in range(0, tokens, self.chunk):
            flat = self._chunk(start, min(start + self.chunk, tokens)).reshape(layers, -1)
            total += (flat @ flat.T).double()
        return total.float()


@register
class FlattenAdjacent(Modifier):
    """Merge adjacent layers with the most similar inputs into wide parallel layers (FlattenGPT §3.1).

    ``S[i][j]`` is the mean over calibration tokens of the fp32 cosine similarity (hidden axis) between the
    inputs of layers ``i`` and ``j``, from one whole-model pass. To bound memory on large models only a
    seeded subsample of ``similarity_tokens`` token positions (the same positions in every layer) is kept,
    as fp32 unit vectors: ``layers × tokens × hidden × 4`` bytes (Llama-3-8B, 4096 tokens: 2.1 GiB).
    Exactly ``n`` merges are done (``select_blocks``); each removes one layer. Give exactly one of ``n``,
    ``sparsity`` (``n = round(sparsity × layers)``) or ``target_layers`` (``n = layers − target_layers``).
    The merged layers are wider than the config until HeadPrune and NystromMLP prune them back.

    ``selection: nll`` (not in the paper) picks the blocks by the model's calibration loss instead of by
    ``S`` (``select_blocks_by_nll``: each round merges the adjacent pair whose merge, pruned back to the
    config (``candidates: pruned``: ``prune_to_config``) or left unpruned, gives
    the lowest NLL on the first ``search_samples`` × ``search_length`` calibration tokens); with ``drops``
    a round may instead drop an unmerged layer (SLEB's move) when that gives the lower NLL, so fewer
    (or no) layers end up merged and the report lists ``dropped``. ``score: heldout`` (default) prunes the
    candidates on fit windows and scores them on held-out score windows (``recipe_engine.recipe.split``; one more
    prefix walk per round), ``insample`` on the same first windows (docs/methods/bestof.md). About
    ``n × layers² / 2`` layer runs of those tokens, ``n × layers`` ``lm_head`` passes and, pruned, as many
    prunes (each an ``o_proj`` and a ``down_proj`` Gram solve of the merged width).
    """

    n: LayerBudget | None = budget_field(None, "number of merges (layers removed)")
    sparsity: float | None = Field(None, gt=0, lt=1, description="fraction of layers to remove")
    target_layers: LayerBudget | None = budget_field(None, "number of layers to keep")
    similarity_tokens: int = Field(4096, ge=1, description="token positions sampled for S (memory bound)")
    seed: int = Field(0, description="seed of the token subsample")
    selection: Literal["similarity", "nll"] = Field(
        "similarity", description="which blocks to merge: by input cosine similarity (the paper) or by "
                                  "calibration NLL of the merged model, round by round (SLEB-style)")
    candidates: Literal["pruned", "merged"] = Field(
        "pruned", description="selection nll: score each candidate pruned back to the config (HeadPrune, "
                              "NystromMLP<criterion: energy, target: merged>) or merged and unpruned")
    search_samples: int | None = Field(None, ge=1, description="selection nll: calibration windows scored, "
                                                               f"the first ones (None: min({SEARCH_SAMPLES}, samples))")
    drops: bool = Field(False, description="selection nll: also score dropping each unmerged layer but the "
                                           "first and last (SLEB's move) and take the better move each round")
    search_length: int | None = Field(None, ge=2, description="selection nll: tokens scored per window, its "
                                                              f"start (None: min({SEARCH_LENGTH}, seq_len))")
    score: Literal["heldout", "insample"] = Field(
        "heldout", description="selection nll: prune candidates on fit windows and score them on held-out score "
                               "windows (recipe_engine.recipe.split), or prune and score on the same first windows")
    score_fraction: float = Field(SCORE_FRACTION, gt=0, lt=1, description="selection nll, score heldout: share "
                                                                          "of the calibration windows held out")

    calibration_passes = 1
    streams = True
    keeps_original_states = True  # the similarity pass runs as received
    shared_ignores = ("n", "sparsity", "target_layers")  # S / the NLL rounds do not depend on the count
    example = ("FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP")  # merged layers must be pruned back
    needs = ("input cosine similarity of every layer pair",)

    def passes(self, shape: ModelShape) -> int:
        """Similarity: one pass. NLL: one per round (the prefix), candidates resume from kept inputs; with
        ``score: heldout`` and pruned candidates, a second per round (the prefix over the fit windows)."""
        if self.selection != "nll":
            return 1
        return self.merges_for(shape.num_layers) * (2 if self.fits_on_other_windows else 1)

    @property
    def fits_on_other_windows(self) -> bool:
        """Whether candidates are pruned on fit windows that are not the scored ones."""
        return self.score == "heldout" and self.candidates == "pruned"

    def check_calibration(self, calibration) -> None:
        if self.selection != "nll":
            if self.drops:
                raise self.fail("drops: true needs selection: nll (the moves are compared by calibration NLL)",
                                field="drops")
            return
        if self.score == "heldout" and calibration.samples < 2:
            raise self.fail("score: heldout needs at least 2 calibration windows (fit and score); "
                            "use score: insample", field="score")
        check_search_window(self, calibration)

    def search_window(self, samples: int, seq_len: int) -> tuple[int, int]:
        """Windows and tokens per window that ``selection: nll`` scores (defaults: at most
        ``SEARCH_SAMPLES × SEARCH_LENGTH``)."""
        return (self.search_samples or min(SEARCH_SAMPLES, samples), self.search_length or min(SEARCH_LENGTH, seq_len))

    def search_windows(self, samples: int, seed: int, count: int) -> tuple[list[int], list[int]]:
        """``selection: nll``: indices of the windows candidates are scored on and fitted on, at most
        ``count`` each. ``heldout``: the first ``count`` score and fit windows of
        ``heldout_split(samples, seed, score_fraction)``; ``insample``: the first ``count`` windows, both."""
        if self.score == "insample":
            return list(range(count)), list(range(count))
        split = heldout_split(samples, seed, self.score_fraction)
        return list(split.score[:count]), list(split.fit[:count])

    def merges_for(self, num_layers: int) -> int:
        """Resolve ``n`` / ``sparsity`` / ``target_layers`` against the current layer count."""
        given = [k for k in ("n", "sparsity", "target_layers") if getattr(self, k) is not None]
        if len(given) != 1:
            raise self.fail(f"give exactly one of n, sparsity, target_layers (got {given or 'none'})",
                            field="n")
        if self.n is not None:
            merges = self.n
        elif self.sparsity is not None:
            merges = round(self.sparsity * num_layers)
        else:
            merges = num_layers - self.target_layers
        if not 1 <= merges < num_layers:
            raise self.fail(f"{given[0]} resolves to {merges} merges of a {num_layers}-layer model; "
                            f"need 1 ≤ merges < {num_layers}", field=given[0])
        return merges

    def check(self, shape: ModelShape) -> None:
        adapter = ADAPTERS.get(shape.model_type)
        if adapter is not None and adapter.output_norms:
            raise self.fail(f"{shape.model_type} normalizes each layer's attention and MLP output on its own "
                            f"(post-attention/post-feedforward norms): a parallel sum of such layers is not one "
                            f"stock layer (best one-norm form: see docs/methods/flattengpt.md)")
        if refusal := shape.moe_refusal(unpaired="their parallel sum is not one stock MoE layer"):
            raise self.fail(refusal)
        blocks = symbolic_blocks(shape.num_layers, self.merges_for(shape.num_layers))
        shape.layers = [LayerShape(sum(shape.layers[i].num_heads for i in block),
                                   sum(shape.layers[i].num_kv_heads for i in block),
                                   sum(shape.layers[i].intermediate_size for i in block),
                                   tuple(o for i in block for o in shape.layers[i].origin))
                        for block in blocks]

    def working_memory(self, shape: ModelShape, tokens: int) -> int:
        """The fp32 unit vectors of the sampled tokens (``input_similarity``): of every layer in memory;
        streamed, one layer's plus one chunk of every layer's (the rest is in a scratch file). With
        ``selection: nll``: the search's kept block inputs and its largest merged block."""
        if self.selection == "nll":  # every block's input and one merged block (at most merges + 1 layers), fp32
            probe_tokens = min(tokens, (self.search_samples or SEARCH_SAMPLES) * (self.search_length or SEARCH_LENGTH))
            widest = max(shape.layer_parameters(layer) for layer in shape.layers)
            merges = self.merges_for(shape.num_layers)
            # pruned: the kept pruned blocks, and NystromMLP's fp64 Gram of a merged pair (wider blocks: more)
            pruning = (merges * widest * 4 + 8 * (2 * shape.intermediate_size) ** 2
                       if self.candidates == "pruned" else 0)
            kept = 2 if self.fits_on_other_windows else 1  # heldout: block inputs over fit and score windows
            nll = calibration_nll_bytes(shape, self.search_samples or SEARCH_SAMPLES,
                                        self.search_length or min(SEARCH_LENGTH, shape.calibration_seq_len))
            return (4 * (kept * shape.num_layers * probe_tokens * shape.hidden_size + (merges + 1) * widest)
                    + pruning + nll)
        sampled = min(self.similarity_tokens, tokens)
        if shape.streamed:
            return (sampled + shape.num_layers * min(256, sampled)) * shape.hidden_size * 4
        return shape.num_layers * sampled * shape.hidden_size * 4

    @torch.no_grad()
    def input_similarity(self, session: ModifierSession) -> torch.Tensor:
        """``S[i][j] = mean_t cos(x_i,t, x_j,t)`` over a seeded token subsample: each layer's fp32 unit
        vectors go into a ``layers × tokens × hidden`` store filled batch by batch (no copy of the layer's
        activations), and ``S = Σ_c U_c U_cᵀ / tokens`` over chunks of token positions, accumulated in fp64.
        A streamed run keeps the store in a scratch file beside its staging data (read back one chunk at a
        time), so host memory holds one layer's vectors, not every layer's (32 × 4096 tokens × 4096 fp32:
        2.1 GiB); an in-memory run keeps it in memory."""
        tokens = session.calibration.numel()
        generator = torch.Generator().manual_seed(self.seed)
        picked = torch.randperm(tokens, generator=generator)[: self.similarity_tokens].sort().values
        store = UnitVectorStore(len(session.layers), len(picked), session.model.config.hidden_size,
                                session.scratch_directory)

        def keep_units(index: int, inputs: Activations, _outputs) -> None:
            offset, rows = 0, []
            for x in inputs:  # select batch by batch: no full copy of the layer's activations
                flat = x.reshape(-1, x.shape[-1])
                local = picked[(picked >= offset) & (picked < offset + flat.shape[0])] - offset
                rows.append(torch.nn.functional.normalize(flat[local.to(flat.device)].float().cpu(), dim=-1))
                offset += flat.shape[0]
            store.write(index, torch.cat(rows))

        with store:
            session.layer_pass(keep_units, "FlattenAdjacent similarity", as_received=True)
            return store.cosine_gram() / len(picked)

    def apply(self, session: ModifierSession) -> dict[str, Any]:
        merges = self.merges_for(len(session.layers))
        rounds = None
        if self.selection == "nll":
            samples, length = self.search_window(*session.calibration.shape)
            scored, fitted = self.search_windows(session.calibration.shape[0], session.config.seed, samples)
            probe = session.branch(session.calibration[list(scored)][:, :length], copy=False)
            fit = (session.branch(session.calibration[list(fitted)][:, :length], copy=False)
                   if self.fits_on_other_windows else None)
            rounds = session.shared(self, "FlattenAdjacent NLL rounds", list)
            blocks, rounds = select_blocks_by_nll(probe, merges, rounds, pruned=self.candidates == "pruned",
                                                  drops=self.drops, fit=fit)
            rounds = rounds[:merges]
            similarity, scores = None, [r["nll"] for r in rounds]
        else:
            similarity = session.shared(self, "FlattenAdjacent similarity", lambda: self.input_similarity(session))
            blocks, scores = select_blocks(similarity, merges)
        old_layers, old_origin = list(session.layers), session.layer_origin
        new_layers, spreads = [], {}
        for block in blocks:
            if len(block) == 1:
                new_layers.append(old_layers[block[0]])
                continue
            with session.placed(*block, on_device=False):
                new_layers.append(merge_layers([old_layers[i] for i in block], session.adapter))
                spreads[len(new_layers) - 1] = head_norm_spread([old_layers[i] for i in block], session.adapter)
            session.release(new_layers[-1])  # streamed: staged now, not held until every block is merged
        session.set_layers(new_layers, [tuple(o for i in b for o in old_origin[i]) for b in blocks],
                           [b[0] for b in blocks])
        if similarity is not None:
            session.outputs.add_artifact("similarity.png", lambda: similarity_heatmap(similarity, blocks))
        groups = [{"layer": index, "merged": block, "origin": list(session.layer_origin[index]),
                   **({"similarity": float(similarity[block[0], block[-1]])} if similarity is not None else {}),
                   **({"head_norm_spread": spreads[index]} if session.adapter.head_norms else {})}
                  for index, block in enumerate(blocks) if len(block) > 1]
        kept = {i for block in blocks for i in block}
        report = {"merges": merges, "merge_scores": scores, "groups": groups, "layers_after": len(new_layers)}
        if len(kept) < len(old_layers):  # drops: true chose to skip these layers
            report["dropped"] = [list(old_origin[i]) for i in range(len(old_layers)) if i not in kept]
        if similarity is not None:
            report["similarity"] = similarity.tolist()
        if rounds is not None:
            report["rounds"] = rounds
            report["search"] = {"score": self.score, "score_windows": scored, "tokens_per_window": length,
                                "fit_windows": fitted if self.fits_on_other_windows else scored}
        return report
