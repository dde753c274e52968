"""Resume an interrupted ``recipe apply`` (``--resume``) from checkpoints of its finished work.

A run keeps ``PARENT/.NAME.resume/`` beside its output ``PARENT/NAME``: ``manifest.json`` (replaced
atomically after each checkpoint, written last: the run's identity, what is finished, the session state and
the sha256 of every file it names), the model's units (an in-memory run's content-addressed
``unit-<sha256>.safetensors``; a streamed run's staged unit files, which *are* the checkpointed units), the
pass's next inputs and the original model's states (``inputs-``/``reference-<sha256>.safetensors``: the
pass state, ``recipe_engine.execution.pass_state``) and quantization records. Checkpoints follow every step
group and every layer of a pass; resume restores the units, extras, records and artifacts, skips the
finished groups and continues a pass after its last finished layer from the stored activations (exact
bits). Data-parallel runs: rank 0 writes, every rank restores and the ranks agree on the manifest. An
exception or a handled signal removes the checkpoints; a hard kill leaves them. docs/scaling.md ("Resume
after a crash") describes the format and each guarantee in full.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import RecipeError
from ..records.report import RunReport
from ..numerics.quantization import Grid, QuantizedLinear
from ..recipe.registry import REGISTRY
from ..system.cleanup import process_alive, process_identity, track, untrack
from .activations import Activations
from .checkpoint_files import CheckpointFiles
from .pass_state import PassState, SavedPass
from .streaming import StagedFile
from .unit_files import file_sha256, fill_module, meta_tensors, parameters_of

MANIFEST = "manifest.json"
KIND, VERSION = "recipe-resume", 5
#: The share of a run's time its resume checkpoints may take (``--checkpoint-budget``): a pass skips a
#: layer's checkpoint while the work since the last checkpoint is shorter than ``(1 − b) / b`` times what
#: that checkpoint cost. A layer's activations are what a pass checkpoint writes (an 8B model at 128 × 2048
#: tokens: 2 GiB, twice with the original model's states), which on a slow disk costs more than the layer.
DEFAULT_CHECKPOINT_BUDGET = 0.1


def resume_directory(output: str) -> Path:
    target = Path(output).expanduser()
    return target.parent / f".{target.name}.resume"


def restore_config(config, saved: dict[str, Any], text: str) -> None:
    """Set the config values the steps changed, compared as the manifest holds them (JSON: setting every value
    would give ``id2label`` string keys, and config.json a block the uninterrupted run's lacks); the config must
    then write ``text``, the checkpointed config's config.json."""
    now = json.loads(json.dumps(config.to_dict(), default=str))
    for key in [key for key, value in saved.items() if key not in now or now[key] != value]:
        setattr(config, key, saved[key])
    if config.to_json_string() != text:
        raise RuntimeError("the restored model config would write another config.json than the checkpointed one")


def has_checkpoint(output: str) -> bool:
    """Whether the output ``output`` has a complete resume checkpoint (a data-parallel rank other than 0 asks:
    rank 0 writes it)."""
    return (resume_directory(output) / MANIFEST).is_file()


class Checkpoints:
    """The resume directory of one run (see the module docstring); ``run_layer_modifiers`` checkpoints inside passes."""

    def __init__(self, directory: Path, identity: dict[str, Any], writer: bool = True):
        #: False on the other ranks of a data-parallel run: they read the checkpoint rank 0 writes
        self.directory, self.identity, self.writer = directory, identity, writer
        #: sha256 of the manifest resumed from (the ranks of a data-parallel run compare it)
        self.manifest_sha: str | None = None
        #: the interrupted pass's state, loaded by ``restore`` (see ``pass_state``)
        self._pass: SavedPass | None = None
        self.manifest: dict[str, Any] | None = None  # the last written or the one resumed from
        self.files = CheckpointFiles(directory)  # the content-addressed files and their sha256
        #: id of a quantization record → (file, key, the record: held so no id is reused)
        self._quantized_files: dict[int, tuple[str, str, Any]] = {}
        self.file: str | None = None
        self._group = 0
        #: Cost of checkpointing in this process: seconds (bytes: ``bytes_written``; ``report.json`` ``checkpoints``).
        self.seconds, self.count = 0.0, 0
        #: ``DEFAULT_CHECKPOINT_BUDGET``; 1 checkpoints after every layer of a pass
        self.budget = DEFAULT_CHECKPOINT_BUDGET
        #: layer checkpoints skipped for the budget; when the last checkpoint ended and what it cost (seconds)
        self.skipped, self._last_end, self._last_cost = 0, None, 0.0

    # -- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, output: str, identity: dict[str, Any], resume: bool, file: str | None,
             writer: bool = True) -> "Checkpoints":
        """Verify and adopt an interrupted run's checkpoints (``resume``), or report and remove them. A reader
        (``writer`` False: rank > 0 of a data-parallel run) only adopts them (rank 0 verifies their files)."""
        directory = resume_directory(output)
        manifest_path = directory / MANIFEST
        text = manifest_path.read_text() if manifest_path.is_file() else None
        found = json.loads(text) if text is not None else None
        checkpoints = cls(directory, identity, writer)
        checkpoints.file = file
        if not writer:
            if resume and found is not None:
                checkpoints._verify(found, file, files=False)
                checkpoints.manifest, checkpoints.manifest_sha = found, hashlib.sha256(text.encode()).hexdigest()
            return checkpoints
        owner = (found or {}).get("owner")
        if owner and owner.get("pid") != os.getpid() and process_alive(owner):
            raise RecipeError(f"another run of {output} is in progress (pid {owner['pid']} on {owner['host']}); "
                              f"its checkpoints in {directory} are left alone", file=file, field="output")
        if directory.exists() and not resume:
            print(f"note: removing the checkpoints of an interrupted run of {output} (continue one with "
                  f"--resume)", file=sys.stderr)
            shutil.rmtree(directory, ignore_errors=True)
        elif resume and found is None:
            print(f"note: no interrupted run of {output} to resume; starting from the beginning", file=sys.stderr)
            shutil.rmtree(directory, ignore_errors=True)
        elif resume:
            checkpoints._verify(found, file)
            checkpoints.manifest, checkpoints.files.digests = found, dict(found["files"])
            checkpoints.manifest_sha = hashlib.sha256(text.encode()).hexdigest()
        directory.mkdir(parents=True, exist_ok=True)
        track(directory)
        return checkpoints

    def _verify(self, found: dict[str, Any], file: str | None, files: bool = True) -> None:
        fail = lambda what: RecipeError(f"cannot resume: {what} since the interrupted run; run without --resume "
                                        f"to start over", file=file, field="output")
        if (found.get("type"), found.get("version")) != (KIND, VERSION):
            raise fail(f"the checkpoint format changed ({found.get('type')} v{found.get('version')})")
        names = {"recipe": "the resolved recipe changed", "model": "the model source changed",
                 "calibration": "the calibration data changed"}
        for key, what in names.items():
            if found["identity"][key] != self.identity[key]:
                raise fail(f"{what} (sha256 {found['identity'][key][:12]} → {self.identity[key][:12]})")
        old, new = found["identity"]["packages"], self.identity["packages"]
        changed = [f"{k} {old.get(k)} → {new.get(k)}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        if changed:
            raise fail(f"package versions changed ({', '.join(changed)})")
        for name, digest in found["files"].items() if files else ():
            path = self.directory / name
            if not path.is_file() or file_sha256(path) != digest:
                raise fail(f"checkpoint file {name} is missing or damaged")

    # -- resuming -------------------------------------------------------------------------------
    @property
    def next_group(self) -> int:
        return self.manifest["reached"]["group"] if self.manifest else 0

    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self.manifest["records"]) if self.manifest else []

    def restore(self, session, report: RunReport) -> None:
        """Bring a freshly loaded session to the checkpointed state (no-op when not resuming)."""
        if self.manifest is None:
            return

        state = self.manifest
        stream = session.stream
        if state["streamed"] != (stream is not None):
            was, now = ("streamed", "is not") if state["streamed"] else ("in memory", "is streamed")
            raise RecipeError(f"cannot resume: the interrupted run was {was} and this one {now} (stream: auto "
                              f"decided otherwise); set stream: {'on' if state['streamed'] else 'off'}",
                              file=self.file, field="stream")
        original = list(session.layers)
        layers, origins = [], []
        for entry in state["layers"]:
            origin = tuple(entry["origin"])
            layer = copy.deepcopy(original[min(origin)])
            if stream is not None:
                self._adopt(stream, layer, entry["home"])
            else:
                fill_module(layer, load_file(str(self.directory / entry["file"])))
            layers.append(layer)
            origins.append(origin)
        session.view.set_layers(layers, origins, [min(o) for o in origins])
        if stream is not None:
            rest = session.residency.stream_units()[len(layers):]
            if len(rest) != len(state["rest"]):
                raise RecipeError(f"cannot resume: the checkpoint has {len(state['rest'])} units besides the "
                                  f"layers, the model {len(rest)}", file=self.file)
            for unit, home in zip(rest, state["rest"]):
                self._adopt(stream, unit, home)
        else:
            fill_module(session.model, load_file(str(self.directory / state["rest"])))
        restore_config(session.model.config, state["config"], state["config_json"])
        extras = load_file(str(self.directory / state["extras"])) if state["extras"] else {}
        for i, entry in enumerate(state["extra_entries"]):
            own = {k[len(f"{i}."):]: v for k, v in extras.items() if k.startswith(f"{i}.")}
            session.outputs.add_extra(entry["modifier"], entry["config"], own)
            REGISTRY.get(entry["modifier"]).restore_extra(session.model, entry["config"], own)
        for name, stored in state["artifacts"].items():
            session.outputs.add_artifact(name, (self.directory / stored).read_bytes())
        if state["quantized"]:
            files = {name: load_file(str(self.directory / name)) for name in {e["file"] for e in state["quantized"]}}
            for entry in state["quantized"]:
                tensors, key = files[entry["file"]], entry["key"]
                bits, group_size, sym, scale_dtype = entry["grid"]
                grid = Grid(bits, group_size, sym, getattr(torch, scale_dtype) if scale_dtype else None)
                record = QuantizedLinear(grid, tensors[f"{key}.scale"], tensors[f"{key}.zero"], entry["format"],
                                         entry["parameter"])
                session.outputs.restore_quantized(session.model.get_submodule(entry["module"]), record)
                self._quantized_files[id(record)] = (entry["file"], key, record)
        self._pass = self._load_pass()
        for section, value in state["report"].items():  # what the interrupted run had made (its evaluation)
            setattr(report, section, value)
        report.resumed = {"group": state["reached"]["group"], "layer": state["reached"]["layer"]}

    def _adopt(self, stream, unit: nn.Module, home: dict[str, Any]) -> None:
        """Give a restored (meta) unit its checkpointed home; a staged one's tensors take the shapes in the
        file's header (read without loading a tensor: a pruned Linear is rebuilt at its stored shape)."""
        path = None if home["file"] is None else self.directory / home["file"]
        if path is not None:
            fill_module(unit, meta_tensors(path))
        stream.adopt(unit, path, home["names"])

    def pass_state(self, captured: Activations, reference: Callable[[], Activations]) -> PassState | None:
        """The interrupted pass now starting (its next layer, inputs, reports, targets and the original
        model's states), or None. Its saved hidden states take the keyword arguments of ``captured`` (this
        pass's capture) and, for the original model's states, of ``reference()`` (the reference's capture)."""
        if self._pass is None or self.manifest["reached"]["group"] != self._group:
            return None
        saved, self._pass = self._pass, None
        return saved.resumed(captured, reference)

    def _load_pass(self) -> SavedPass | None:
        """The interrupted pass's state (``pass_state``), read when restoring: before the run writes its next
        checkpoint (which removes these files), on every rank."""
        saved = self.manifest["pass"]
        if saved is None:
            return None
        inputs = load_file(str(self.directory / saved["inputs"]))
        reference = None
        if saved["reference"] is not None:
            states = load_file(str(self.directory / saved["reference"]["states"]))
            reference = (saved["reference"]["next"], [states[str(k)] for k in range(len(states))])
        return SavedPass(saved["layer"] + 1, [inputs[str(k)] for k in range(len(inputs))], saved["reports"],
                         [set(t) for t in saved["targets"]], reference)

    def agree(self, parallel) -> None:
        """Data-parallel: every rank must have adopted the same checkpoint (the manifest's sha256, or none)."""
        mine = self.manifest_sha or "none"
        digests = parallel.map(lambda _rank: mine, list(range(parallel.world)))
        differ = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        if differ:
            raise RecipeError(f"cannot resume: ranks {differ} see another checkpoint in {self.directory} than "
                              f"rank 0 (the ranks need one shared file system)", file=self.file, field="output")

    # -- writing --------------------------------------------------------------------------------
    def keep_staging(self, stream) -> None:
        """A streamed run stages its changed units here: the staged files are the checkpointed units."""
        stream.staging, stream.keep_staged = self.directory, True

    def group_done(self, session, group_index: int, records: list, report: RunReport) -> None:
        if not self.writer:
            return
        self._save(session, {"group": group_index + 1, "layer": None}, records, report, None)

    def layer_done(self, session, index: int, state: PassState) -> None:
        """Checkpoint after pass layer ``index``: the model, the next layer's inputs and, when the pass
        follows the original model (``state.reference``), the original model's states."""
        if not self.writer:
            return
        start = time.perf_counter()
        if not self.due(start):
            self.skipped += 1
            return
        pass_state = {"layer": index,
                      "inputs": self.files.store({str(k): t for k, t in enumerate(state.inputs)}, "inputs"),
                      "targets": [sorted(t) for t in state.targets],
                      "reports": json.loads(json.dumps(state.reports, default=str)), "reference": None}
        if state.reference is not None:
            states = self.files.store({str(k): t for k, t in enumerate(state.reference.states)}, "reference")
            pass_state["reference"] = {"next": state.reference.next, "states": states}
        self.seconds += time.perf_counter() - start
        self._save(session, {"group": self._group, "layer": index}, self._records, self._report, pass_state)
        self._last_cost = time.perf_counter() - start

    def due(self, now: float) -> bool:
        """Whether a layer checkpoint fits the budget at ``now``: the work since the last checkpoint ended is
        at least ``(1 − budget) / budget`` times that checkpoint's cost (the first one always is)."""
        if self._last_end is None or self.budget >= 1:
            return True
        return now - self._last_end >= (1 - self.budget) / self.budget * self._last_cost

    def begin_group(self, group_index: int, steps: list, records: list, report: RunReport) -> None:
        self._group, self._pass_steps, self._records, self._report = group_index, steps, records, report

    def _home(self, stream, unit: nn.Module) -> dict[str, Any]:
        """A streamed unit's home as the manifest records it: a staged file in this directory (``file``) or
        the source checkpoint (``file`` None), and its tensor names there."""
        stream.settle(unit)
        home = stream.home(unit)
        if not isinstance(home.reader, StagedFile):
            return {"file": None, "names": home.names}
        path = home.reader.path
        if path.parent != self.directory:
            raise RuntimeError(f"staged unit {path} is outside the checkpoint directory {self.directory}")
        if path.name not in self.files.digests:
            self.files.digests[path.name] = file_sha256(path)
        return {"file": path.name, "names": home.names}

    def _model_state(self, session) -> tuple[list[dict[str, Any]], Any]:
        """``(layers, rest)``: each decoder layer's origin and unit, and the rest's (embeddings, final norm,
        ``lm_head``): files of this directory (in memory) or homes (streamed: ``_home``)."""
        stream = session.stream
        if stream is not None:
            units = session.residency.stream_units()
            layers = [{"origin": list(origin), "home": self._home(stream, layer)}
                      for layer, origin in zip(units, session.layer_origin)]
            return layers, [self._home(stream, unit) for unit in units[len(layers):]]
        layer_ids = {id(p) for layer in session.layers for p in layer.parameters()}
        layers = [{"origin": list(origin), "file": self.files.cached(parameters_of(layer), "unit")}
                  for layer, origin in zip(session.layers, session.layer_origin)]
        return layers, self.files.cached(parameters_of(session.model, layer_ids), "unit")

    def _quantized_state(self, session) -> list[dict[str, Any]]:
        """One entry per quantized linear (module name, grid, file and key of its scales and zero points);
        records stored by an earlier checkpoint keep their file, new ones go to one new file (so a pass that
        quantizes layer by layer writes each record once)."""
        names = {id(m): name for name, m in session.model.named_modules()}
        # a record of a linear a step removed since (a packed source's layer ShortGPT dropped) goes with it
        present = {key: record for key, record in session.outputs.quantized.items() if id(key[0]) in names}
        pending = [(module, record) for module, record in present.items() if id(record) not in self._quantized_files]
        if pending:
            tensors = {}
            for k, (_, record) in enumerate(pending):
                tensors.update({f"{k}.scale": record.scale, f"{k}.zero": record.zero})
            name = self.files.store(tensors, "quantized")
            for k, (_, record) in enumerate(pending):
                self._quantized_files[id(record)] = (name, str(k), record)
        entries = []
        for (module, _), record in present.items():
            file, key, _ = self._quantized_files[id(record)]
            grid = record.grid
            dtype = str(grid.scale_dtype).removeprefix("torch.") if grid.scale_dtype else None
            entries.append({"module": names[id(module)], "parameter": record.parameter,
                            "grid": [grid.bits, grid.group_size, grid.sym, dtype],
                            "format": record.format, "file": file, "key": key})
        return entries

    def _save(self, session, reached: dict, records: list, report: RunReport, pass_state: dict | None) -> None:
        start = time.perf_counter()
        layers, rest = self._model_state(session)
        extras_name = None
        if session.outputs.extras:
            extras_name = self.files.cached({f"{i}.{k}": t for i, e in enumerate(session.outputs.extras)
                                        for k, t in e["tensors"].items()}, "extras")
        artifacts = {name: self.files.store_bytes(data, "artifact")  # names may hold one "/" (a subdirectory)
                     for name, data in session.outputs.artifacts.items()}
        quantized = self._quantized_state(session)
        homes = [e["home"] for e in layers] + rest if session.stream is not None else []
        named = [e["file"] for e in layers if "file" in e] + [h["file"] for h in homes if h["file"]] \
            + ([rest] if session.stream is None else []) + ([extras_name] if extras_name else []) \
            + [e["file"] for e in quantized] + list(artifacts.values()) \
            + ([pass_state["inputs"]] if pass_state else []) \
            + ([pass_state["reference"]["states"]] if pass_state and pass_state["reference"] else [])
        files = {name: self.files.digests[name] for name in named}
        manifest = {"type": KIND, "version": VERSION, "owner": process_identity(), "identity": self.identity,
                    "reached": reached, "streamed": session.stream is not None,
                    "layers": layers, "rest": rest, "config": session.model.config.to_dict(),
                    "config_json": session.model.config.to_json_string(),  # config.json's text
                    "extras": extras_name, "extra_entries": [{"modifier": e["modifier"], "config": e["config"]}
                                                             for e in session.outputs.extras],
                    "artifacts": artifacts, "quantized": quantized,
                    "records": json.loads(json.dumps(records, default=str)),
                    "report": {} if report.evaluation is None else {"evaluation": report.evaluation},
                    "pass": pass_state, "files": files}
        tmp = self.directory / f".{MANIFEST}.part"
        tmp.write_text(json.dumps(manifest, default=str))
        os.replace(tmp, self.directory / MANIFEST)
        self.manifest = manifest
        self.files.keep_only(files, also=MANIFEST)
        self._quantized_files = {k: v for k, v in self._quantized_files.items() if v[0] in files}
        self._last_end = time.perf_counter()
        self._last_cost = self._last_end - start  # a layer checkpoint adds its activations' writes
        self.seconds += self._last_cost
        self.count += 1

    @property
    def bytes_written(self) -> int:
        return self.files.bytes_written

    @property
    def resumable(self) -> bool:
        """Whether a run could go on from these checkpoints (one is complete; data-parallel: rank 0's)."""
        return (self.directory / MANIFEST).is_file()

    def discard(self) -> None:
        if not self.writer:
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        untrack(self.directory)
