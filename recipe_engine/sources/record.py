"""What a run's report records of its model source (``report.ModelRecord``): where it was read, its license, the
hub id it comes from, how its weights are packed, and the file a source format converted them from."""
from __future__ import annotations

from pathlib import Path

from ..formats import source_formats
from ..records.report import ModelRecord, ReportError, is_recipe_output, load_report
from .hub import hub_unreachable
from .models import ModelSource, builtin_format, builtin_names, packed_description, resolve_model, source_format

#: A model's card in its directory (a local source's, and an output's).
CARD_FILE = "README.md"


def model_record(spec: str, source: ModelSource) -> ModelRecord:
    """The report's record of the model source ``spec`` resolved as ``source``: each source format records the
    file the weights were converted from under its own name (a field of ``ModelRecord``)."""
    origins = {name: fmt.origin(source) for name, fmt in source_formats().items()}
    return ModelRecord(spec=spec, kind=source.kind, location=source.location, license=source_license(source),
                       base_model=hub_origin(source.spec, source.kind, source.location),
                       packed=packed_description(source.location), **origins)


def hub_origin(spec: str, kind: str, location: str | None, seen: tuple = ()) -> str | None:
    """The hub id a source comes from: a hub source's own, a builtin alias's (its source format's ``builtins``),
    or for a local directory that is a recipe output, its own source's; None otherwise (a local directory or
    model file of unknown origin, a model passed in memory)."""
    if kind == "hub":
        return spec
    if kind == "builtin":
        return builtin_format(spec).builtins.get(spec) if spec in builtin_names() else None
    directory = Path(location) if kind == "local" and location else None
    if directory is None or directory in seen or not directory.is_dir() or not is_recipe_output(directory):
        return None
    try:
        model = load_report(directory).model
    except ReportError:  # an output this engine cannot read: no known origin
        return None
    return model.base_model or hub_origin(model.spec, model.kind, model.location, (*seen, directory))


def source_license(source) -> str | None:
    """The license of a source model (``models.ModelSource``): its card's ``license`` (a local directory; a hub
    model's card from the local HF cache, else downloaded when the hub answers), or the one a model file states
    (its source format's ``license``). None when it has none or it cannot be read."""
    # deferred: the hub client is only needed when an output is written
    import huggingface_hub

    try:
        if source_format(source) is not None:
            return source_format(source).license(Path(resolve_model(source.spec, convert=False).location))
        if source.kind == "local":
            card = Path(source.location) / CARD_FILE
        else:
            card = huggingface_hub.try_to_load_from_cache(source.spec, CARD_FILE)
            if not isinstance(card, str):
                card = None if hub_unreachable() else huggingface_hub.hf_hub_download(source.spec, CARD_FILE)
        if card is None or not Path(card).is_file():
            return None
        value = huggingface_hub.ModelCard.load(card).data.license
        return value if isinstance(value, str) else None
    except Exception:  # noqa: BLE001 - a missing or malformed card of someone else's model: no license to carry
        return None
