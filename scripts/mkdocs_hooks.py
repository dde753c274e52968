"""mkdocs hook: the repository's top-level pages become site pages, read fresh at every build.

README.md is the site's home page (``index.md``), BENCHMARKS.md its results page (``benchmarks.md``) and
CHANGELOG.md its changelog (``changelog.md``). They are not copied into ``docs/`` (a copy would go stale):
``on_files`` adds them as generated pages, with their repository-relative links rewritten for the site:

* ``docs/X`` → ``X`` (a page or image of the site);
* ``README.md`` / ``BENCHMARKS.md`` / ``CHANGELOG.md`` → the generated page;
* an image elsewhere in the repository (e.g. a benchmark's PNG) → the same file, added to the site under
  ``repository/``;
* any other repository file (a script, a recipe) → its path as inline code, since the site does not serve it.

So ``mkdocs build --strict`` checks every link of these pages too. Web links and anchors are left alone.

Pages under ``docs/`` link the top-level files as the repository has them (``../BENCHMARKS.md`` from
``docs/``, ``../../BENCHMARKS.md`` from ``docs/guides/``), so the links also work when the files are read on a
forge; ``on_page_markdown`` points such links at the generated pages, and renders a link to any other file
outside ``docs/`` as its path in inline code.
"""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
TOP_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md", "CHANGELOG.md": "changelog.md"}
IMAGES = (".png", ".svg", ".jpg", ".jpeg", ".gif")
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def _site_target(target: str, extra: dict[str, Path]) -> str | None:
    """The link target on the site, or None when the site cannot link it (rendered as code instead)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target
    path, _, anchor = target.partition("#")
    suffix = f"#{anchor}" if anchor else ""
    if path in TOP_PAGES:
        return TOP_PAGES[path] + suffix
    if path.startswith("docs/"):
        return path[len("docs/"):] + suffix
    if path.lower().endswith(IMAGES) and (ROOT / path).is_file():
        extra[f"repository/{path}"] = ROOT / path
        return f"repository/{path}"
    return None


def rewrite(text: str, extra: dict[str, Path]) -> str:
    """The page's markdown with its links rewritten for the site (see the module docstring)."""
    def replace(match: re.Match) -> str:
        target = _site_target(match.group(2), extra)
        if target is not None:
            return f"{match.group(1)}{target}{match.group(3)}"
        label = match.group(1)[match.group(1).index("[") + 1:-2]
        return f"{label} (`{match.group(2)}`)" if label and label != match.group(2) else f"`{match.group(2)}`"

    return LINK.sub(replace, text)


def on_files(files, config):
    extra: dict[str, Path] = {}
    for source, page in TOP_PAGES.items():
        path = ROOT / source
        if path.is_file():
            content = rewrite(path.read_text(encoding="utf-8"), extra)
            files.append(File.generated(config, page, content=content))
    for uri, path in extra.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri in TOP_PAGES.values():
        return markdown  # rewritten when generated
    docs = Path(config["docs_dir"]).resolve()
    here = PurePosixPath(page.file.src_uri).parent

    def replace(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = (docs / here / path).resolve()
        if resolved.is_relative_to(docs):
            return match.group(0)
        relative = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else path
        if relative in TOP_PAGES:
            site = os.path.relpath(TOP_PAGES[relative], here.as_posix() or ".")
            return f"{match.group(1)}{site}{'#' + anchor if anchor else ''}{match.group(3)}"
        label = match.group(1)[match.group(1).index("[") + 1:-2]
        return f"{label} (`{relative}`)" if label and label != relative else f"`{relative}`"

    return LINK.sub(replace, markdown)
