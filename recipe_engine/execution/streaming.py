"""Streaming weights: a model skeleton on the meta device whose parts are materialized from disk on use.

A model too large for host memory is built with accelerate's ``init_empty_weights`` (parameters on the
meta device, buffers such as rotary frequencies real). Its *units* — each decoder layer, the embeddings,
the final norm and ``lm_head`` — are materialized on CPU when a pass needs them and released after
(``accelerate.utils.set_module_tensor_to_device``). Each unit has a *home* on disk:

* the source checkpoint (``safetensors`` read lazily with ``safe_open``: the tensors are memory-mapped, so
  an untouched tensor costs page cache, not resident memory), under the unit's original name;
* or, once a step changed it, a file in the staging directory (``unit-<token>-NNNNN.safetensors``, the
  token fresh per process, so a resumed run never reuses an interrupted one's names).

Releasing a unit compares every tensor's identity and version counter with what was loaded: a unit that a
step changed (in place, or by replacing a submodule) is written to staging first; an unchanged one simply
returns to meta. A unit built by a step (e.g. a merged layer) has no home until it is released. Nothing is
ever silently dropped: a released unit's tensors are held until its file is written (by a thread, behind the
compute: reading the unit waits for it, and ``run_steps`` drains the write before it returns).

Reading ahead: a layer-sequential pass using layer i asks for layer i + 1 (``read_ahead``); its tensors are read
from its home by a thread while layer i computes, and materializing it takes them (when its home is still the
one read; else they are dropped and it is read again). One unit is read ahead at a time, so host memory holds at
most one unit more.

A run that keeps resume checkpoints (``recipe_engine.execution.resume``) makes its checkpoint directory the staging
directory and sets ``keep_staged``: a superseded staging file is then left for the checkpoint store, which
deletes it once no checkpoint names it (the staged files *are* the checkpointed units).
"""
from __future__ import annotations

import contextlib
import itertools
import secrets
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.reader import CheckpointReader, is_materialized
from ..system.host_memory import PAGE_BYTES, release_freed_memory_eagerly, trim_heap


@dataclass(frozen=True)
class Home:
    """Where a released unit's weights are: ``names`` maps the unit's own tensor names to names in
    ``reader`` (the source checkpoint, or a staging file)."""

    reader: CheckpointReader | "StagedFile"
    names: dict[str, str]


class StagedFile:
    """One staged unit: a safetensors file written by :meth:`WeightStream.stage`, maybe still being written
    behind the compute (``pending``)."""

    def __init__(self, path: Path, pending: Future | None = None):
        self._path, self._pending = path, pending

    @property
    def path(self) -> Path:
        """The file, once written: a write still in flight is waited for (its error is raised here)."""
        if self._pending is not None:  # kept (result() of a done write returns at once): safe from two threads
            self._pending.result()
        return self._path

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(self.path), "pt") as handle:
            return {name: handle.get_tensor(name) for name in names}


def _read_paged_in(reader, names: list[str], pinned: bool = False) -> dict[str, torch.Tensor]:
    """``reader.read(names)`` with every page of the tensors read in: a checkpoint's tensors are memory-mapped
    views whose pages the disk delivers only when first touched, so one value per page is summed here (on the
    read-ahead thread) and the materializing copy later runs at memory speed. Adds no memory of its own: the
    pages are the file's, in the page cache. ``pinned`` (a unit bound for a GPU): the tensors are copied into
    page-locked host memory instead (torch's caching host allocator: the next unit reuses the blocks), so the
    copy to the device runs at the bus's speed, not through the driver's pageable staging (1.2 GB: ~0.25 s →
    ~0.05 s on an H200); the host then holds the unit once more than the page cache does."""
    values = reader.read(names)
    if pinned:
        return {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for name, t in values.items()}
    for tensor in values.values():
        if tensor.numel() and tensor.is_contiguous():
            tensor.view(-1)[:: max(1, PAGE_BYTES // tensor.element_size())].sum()
    return values


def _host_copies_behind(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
    """Host copies of a released unit's tensors, and what to wait for before they hold the values (None: they
    already do). A GPU tensor is copied into pinned host memory on a side CUDA stream, ordered after the
    compute that made it, so the compute stream goes on while the copy runs; the source is recorded on that
    stream, so the caching allocator does not reuse its memory before the copy is done (the same pattern as
    the activations' ``CopyStream``). The writer thread waits for the copy's event, then writes the file."""
    on_gpu = [t for t in tensors.values() if t.is_cuda]
    if not on_gpu:
        return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, None
    device = on_gpu[0].device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    copies = {}
    with torch.cuda.stream(side):
        for name, tensor in tensors.items():
            source = tensor.detach()
            if not source.is_cuda:
                copies[name] = source.contiguous()
                continue
            copies[name] = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            copies[name].copy_(source, non_blocking=True)
            source.record_stream(side)
        copied = torch.cuda.Event()
        copied.record(side)
    return copies, copied


def _save_when_copied(copied, tensors: dict[str, torch.Tensor], path: Path) -> None:
    if copied is not None:
        copied.synchronize()
    save_file(tensors, str(path))


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by qualified name (``state_dict`` keys, tied ones once)."""
    return dict(module.state_dict(keep_vars=True))


class WeightStream:
    """The homes of a meta-device model's units, and the materialize / release cycle over them.

    ``units`` are the modules that are loaded and released whole; every parameter of the model belongs to
    exactly one. ``staging`` is the directory for changed units (created on first use).
    """

    def __init__(self, model: nn.Module, units: list[nn.Module], source: CheckpointReader,
                 staging: Path | None, retie: Callable[[], None] = lambda: None):
        self.staging, self._retie, self.source = staging, retie, source
        #: Leave superseded staging files on disk (the resume checkpoint store deletes them; see above).
        self.keep_staged = False
        self._token = secrets.token_hex(4)
        self._homes: "weakref.WeakKeyDictionary[nn.Module, Home]" = weakref.WeakKeyDictionary()
        self._loaded: "weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[int, int]]]" = weakref.WeakKeyDictionary()
        self._pins: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
        self._staged = itertools.count()
        #: The one staging write behind the compute (``release``), and the thread that writes it.
        self._in_flight: StagedFile | None = None
        self._writer: ThreadPoolExecutor | None = None
        #: The one unit read ahead (``read_ahead``): the unit (weakly), the home it was read from, the read.
        self._ahead: tuple[weakref.ref, Home, Future] | None = None
        self._reader: ThreadPoolExecutor | None = None
        self.bytes_read = self.bytes_staged = 0
        names = {id(m): name for name, m in model.named_modules()}
        covered: set[int] = set()
        for unit in units:
            prefix = names[id(unit)] + "."
            self._homes[unit] = Home(source, {n: prefix + n for n in _tensors(unit)})
            covered.update(id(p) for p in unit.parameters())
        stray = [n for n, p in model.named_parameters() if id(p) not in covered]
        if stray:
            raise RuntimeError(f"parameters outside every streamed unit: {stray[:3]}")

    # -- one unit ------------------------------------------------------------------------------
    def materialize(self, unit: nn.Module, device: torch.device = torch.device("cpu")) -> None:
        """Load ``unit``'s weights from its home onto ``device`` (no-op when it is already materialized)."""
        # deferred: accelerate (~0.2 s) is needed only when weights stream
        from accelerate.utils import set_module_tensor_to_device

        if unit in self._loaded or is_materialized(unit):
            self._loaded.setdefault(unit, self._versions(unit))
            return
        home = self._homes.get(unit)
        if home is None:
            raise RuntimeError("a released unit has no home on disk (it was never staged)")
        values = self._taken_ahead(unit, home) or home.reader.read(home.names.values())
        for name, stored in home.names.items():
            value = values[stored]
            set_module_tensor_to_device(unit, name, device, value=value)
            self.bytes_read += value.numel() * value.element_size()
        self._retie()
        self._loaded[unit] = self._versions(unit)

    def read_ahead(self, unit: nn.Module, device: torch.device = torch.device("cpu")) -> None:
        """Start reading a released ``unit``'s tensors from its home on a thread (the next layer of a pass,
        while this one computes); ``materialize`` takes them. Replaces an earlier read-ahead not yet taken.
        ``device``: where they go next (a GPU: read into pinned host memory, ``_read_paged_in``)."""
        if unit in self._loaded or is_materialized(unit) or unit not in self._homes:
            return
        if self._ahead is not None and self._ahead[0]() is unit:
            return
        home = self._homes[unit]
        self._reader = self._reader or ThreadPoolExecutor(1, thread_name_prefix="recipe-read-ahead")
        read = self._reader.submit(_read_paged_in, home.reader, list(home.names.values()), device.type == "cuda")
        self._ahead = (weakref.ref(unit), home, read)

    def drop_read_ahead(self) -> None:
        """Forget a read-ahead not taken (its tensors are freed once its read is done)."""
        self._ahead = None

    def _taken_ahead(self, unit: nn.Module, home: Home) -> dict[str, torch.Tensor] | None:
        """The tensors read ahead for ``unit`` from ``home`` (None: none were, or from another home); a
        read-ahead of another unit is dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0]() is not unit or ahead[1] is not home:
            return None
        return ahead[2].result()

    def release(self, unit: nn.Module) -> None:
        """Return ``unit`` to the meta device; first stage it when it changed since it was loaded or has
        no home. A pinned unit (inside a ``loaded`` block) stays."""
        if self._pins.get(unit, 0) > 0 or not is_materialized(unit):
            return
        loaded = self._loaded.pop(unit, None)
        if loaded is None or loaded != self._versions(unit) or unit not in self._homes:
            self.stage(unit, behind=True)
        # deferred: accelerate (~0.2 s) is needed only when weights stream
        from accelerate.utils import set_module_tensor_to_device

        for name in _tensors(unit):
            set_module_tensor_to_device(unit, name, "meta")
        self._retie()

    def stage(self, unit: nn.Module, behind: bool = False) -> None:
        """Write ``unit``'s current tensors to a new staging file and make it the unit's home. ``behind``
        (a unit being released: nothing can change its tensors any more): the file is written by a
        thread while the compute goes on, one write in flight at a time; reading the unit, or
        :meth:`drain`, waits for it."""
        if self.staging is None:
            raise RuntimeError("this weight stream is read-only (no staging directory)")
        self.staging.mkdir(parents=True, exist_ok=True)
        path = self.staging / f"unit-{self._token}-{next(self._staged):05d}.safetensors"
        if behind:
            self.drain()
            tensors, copied = _host_copies_behind(_tensors(unit))
            self._writer = self._writer or ThreadPoolExecutor(1, thread_name_prefix="recipe-staging")
            staged = self._in_flight = StagedFile(path, self._writer.submit(_save_when_copied, copied, tensors, path))
        else:
            tensors = {name: t.detach().to("cpu").contiguous() for name, t in _tensors(unit).items()}
            save_file(tensors, str(path))
            staged = StagedFile(path)
        self.bytes_staged += sum(t.numel() * t.element_size() for t in tensors.values())
        self.discard_staged(unit)  # its earlier staged state is obsolete: staging holds one file per unit
        self._homes[unit] = Home(staged, {name: name for name in tensors})

    def drain(self, quietly: bool = False) -> None:
        """Wait for the staging write in flight, if any; its error is raised (``quietly``: only waited for,
        when another error is already ending the run and its files are about to be removed)."""
        staged, self._in_flight = self._in_flight, None
        if staged is not None:
            try:
                staged.path
            except Exception:
                if not quietly:
                    raise

    def discard_staged(self, unit: nn.Module) -> None:
        """Delete the staging file that is ``unit``'s home, if it has one (the writer calls this once a
        unit is in the output, so staging and output together never hold a unit twice)."""
        home = self._homes.get(unit)
        if home is not None and isinstance(home.reader, StagedFile):
            if not self.keep_staged:
                home.reader.path.unlink(missing_ok=True)
            del self._homes[unit]

    def home(self, unit: nn.Module) -> Home | None:
        """Where ``unit``'s current weights are on disk: after :meth:`settle`, always its current state."""
        return self._homes.get(unit)

    def settle(self, unit: nn.Module) -> None:
        """Make ``unit``'s home hold its current weights: a materialized unit that changed since it was
        loaded (or was built by a step) is staged now and stays materialized (it is not staged again on
        release unless it changes again)."""
        if not is_materialized(unit):
            return
        loaded = self._loaded.get(unit)
        if loaded is None or loaded != self._versions(unit) or unit not in self._homes:
            self.stage(unit)
            self._loaded[unit] = self._versions(unit)

    def adopt(self, unit: nn.Module, staged: Path | None, names: dict[str, str]) -> None:
        """Make a released (meta) unit's home the staged file ``staged``, or the source checkpoint when None;
        ``names`` maps the unit's tensor names to names there (``recipe_engine.execution.resume`` restoring a unit)."""
        self._homes[unit] = Home(self.source if staged is None else StagedFile(staged), dict(names))

    def read_unit(self, unit: nn.Module) -> dict[str, torch.Tensor]:
        """The unit's current tensors (from memory when materialized, else from its home, or as read ahead), CPU,
        in the model's dtypes: a source checkpoint stored in another dtype than the run's (a bf16 checkpoint
        run in fp32) is cast as ``materialize`` casts it (accelerate casts to the parameter's dtype)."""
        if is_materialized(unit):
            return {name: t.detach() for name, t in _tensors(unit).items()}
        home = self._homes[unit]
        values = self._taken_ahead(unit, home) or home.reader.read(home.names.values())
        current = _tensors(unit)
        return {name: values[stored].to(current[name].dtype) for name, stored in home.names.items()}

    @staticmethod
    def _versions(unit: nn.Module) -> dict[str, tuple[int, int]]:
        return {name: (id(t), t._version) for name, t in _tensors(unit).items()}

    # -- blocks ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def loaded(self, units: list[nn.Module], device: torch.device = torch.device("cpu")) -> Iterator[None]:
        """Materialize ``units`` for the block, then release them (staging what changed). On an exception
        nothing is staged: the run is ending and its staging directory goes with it."""
        for unit in units:
            self._pins[unit] = self._pins.get(unit, 0) + 1
        try:
            for unit in units:
                self.materialize(unit, device)
            yield
        finally:
            for unit in units:
                self._pins[unit] -= 1
        for unit in units:
            self.release(unit)
        trim_heap()


def stream_units(model: nn.Module, adapter) -> list[nn.Module]:
    """What a streamed model loads and releases whole: decoder layers, embeddings, final norm and an
    untied ``lm_head`` (a tied one is the embedding matrix)."""
    units = [*adapter.layers(model), adapter.embeddings(model), adapter.final_norm(model)]
    head = adapter.lm_head(model)
    if head.weight is not adapter.embeddings(model).weight:
        units.append(head)
    return units


def open_stream(model: nn.Module, adapter, location: str, staging: Path | None, *,
                bound_heap: bool = True) -> WeightStream:
    """The weight stream of a (meta-device) model from the checkpoint at ``location``, for a session to
    run on (``Session(stream=...)``); changed units go to ``staging`` (``None``: read-only, for the
    original model). ``bound_heap``: bound the process's heap (``release_freed_memory_eagerly``), as a
    streamed model needs; the original model streamed beside a model held in memory passes False: the
    setting sends every activation-sized buffer through ``mmap``, page-faulted afresh at each allocation
    (SmolLM2's layer passes 1.47× slower on CPU, measured), for a memory bound that run does not seek."""
    if bound_heap:
        release_freed_memory_eagerly()

    def retie() -> None:  # a tied lm_head is the embedding matrix, whatever state that is in
        if getattr(model.config, "tie_word_embeddings", False):
            adapter.lm_head(model).weight = adapter.embeddings(model).weight

    retie()
    return WeightStream(model, stream_units(model, adapter), CheckpointReader(location, model), staging, retie)


@contextlib.contextmanager
def forward_streamed(session, device: torch.device) -> Iterator[None]:
    """Whole-model forwards (lm-eval's zero-shot tasks) on a streamed model with one unit resident at a
    time: an accelerate ``ModelHook`` on every unit (and on a tied ``lm_head``, which is the embedding
    matrix) materializes it on ``device`` when its forward starts and releases it when the forward ends —
    accelerate's offload-hook mechanism (``add_hook_to_module``) with the stream as the weights' home — and
    reads the unit whose forward comes next ahead (``read_ahead``)."""
    # deferred: accelerate (~0.2 s) is needed only when weights stream
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
    from accelerate.utils import send_to_device

    open_blocks: list[contextlib.AbstractContextManager] = []

    class UnitOnDevice(ModelHook):
        def __init__(self, units: list[nn.Module], following: nn.Module):
            super().__init__()
            self.units, self.following = units, following

        def pre_forward(self, module, *args, **kwargs):
            block = session.stream.loaded(self.units, device)
            block.__enter__()
            open_blocks.append(block)
            session.stream.read_ahead(self.following, device)  # the unit whose forward comes next
            return send_to_device(args, device), send_to_device(kwargs, device)

        def post_forward(self, module, output):
            open_blocks.pop().__exit__(None, None, None)
            return output

    model, adapter = session.model, session.context.adapter
    head = adapter.lm_head(model)
    units = session.residency.stream_units()
    modules = units + ([head] if head not in units else [])
    # forward order; after the head comes the next forward's embeddings
    order = [adapter.embeddings(model), *adapter.layers(model), adapter.final_norm(model), head]
    units_of = session.residency.units_of
    following = {id(module): units_of([order[(i + 1) % len(order)]])[0] for i, module in enumerate(order)}
    for module in modules:
        add_hook_to_module(module, UnitOnDevice(units_of([module]), following[id(module)]))
    try:
        yield
    finally:
        while open_blocks:  # a forward that raised: release what it had loaded
            open_blocks.pop().__exit__(None, None, None)
        session.stream.drop_read_ahead()  # the next forward's embeddings, read after the last head
        for module in modules:
            remove_hook_from_module(module)


