"""MkDocs hook: links from the site's pages to files of the repository outside docs/.

A page links BENCHMARKS.md, clusters/README.md or a file mkdocs.yml keeps out of the site
(docs/report/) as GitHub shows the repository, by a path relative to the page
(`../BENCHMARKS.md` from docs/benchmark-results.md), so the link works there as written. MkDocs
knows only the site's own files and would call such a link broken; this hook copies each linked
file into the built site, unrendered, under `repository/`, and points the link at the copy. A link
to a file that does not exist in the repository stops the build.

It also writes the table of every config key into the page that holds its placeholder
(docs/reference/config-keys.md), from the keys' declarations (scripts/config_reference.py).
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
import shutil
from pathlib import Path

from mkdocs.exceptions import PluginError

# A relative link: not an anchor alone, not absolute, no scheme (https:, mailto:).
_LINK = re.compile(r"\]\((?P<target>(?!#|/|[A-Za-z][A-Za-z0-9+.-]*:)[^)#\s]+)(?P<anchor>#[^)\s]*)?\)")
_SCHEME = "repository-file:"
_COPY_UNDER = "repository"
_linked: set[str] = set()


def _repository(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def on_pre_build(config):
    _linked.clear()


def _config_reference():
    """scripts/config_reference.py, beside this hook (MkDocs loads a hook by its path, not as a package)."""
    spec = importlib.util.spec_from_file_location("config_reference", Path(__file__).with_name("config_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown, page, config, files):
    if "<!-- config keys:" in markdown:
        reference = _config_reference()
        if reference.PLACEHOLDER not in markdown:
            raise PluginError(f"{page.file.src_path}: the config keys' placeholder must read {reference.PLACEHOLDER}")
        try:
            table = reference.config_key_table()
        except ValueError as error:  # a key that says nothing of what it does
            raise PluginError(str(error)) from None
        markdown = markdown.replace(reference.PLACEHOLDER, table)
    docs = Path(config["docs_dir"]).resolve()
    repository = _repository(config)
    page_folder = (docs / page.file.src_path).parent

    def rewrite(match: re.Match) -> str:
        target = (page_folder / match["target"]).resolve()
        if target.is_relative_to(docs):
            in_site = files.get_file_from_path(target.relative_to(docs).as_posix())
            if in_site is not None and not in_site.inclusion.is_excluded():
                return match[0]  # a page or file of the site: MkDocs checks it
        if not target.is_relative_to(repository) or not target.is_file():
            raise PluginError(f"{page.file.src_path} links {match['target']}, which is not a file of the repository")
        relative = target.relative_to(repository).as_posix()
        _linked.add(relative)
        return f"]({_SCHEME}{relative}{match['anchor'] or ''})"

    return _LINK.sub(rewrite, markdown)


def on_page_content(html, page, config, files):
    def rewrite(match: re.Match) -> str:
        copy = f"{_COPY_UNDER}/{match['path']}"
        return f'href="{posixpath.relpath(copy, posixpath.dirname(page.file.dest_uri))}'

    return re.sub(rf'href="{re.escape(_SCHEME)}(?P<path>[^"#]+)', rewrite, html)


def on_post_build(config):
    repository, site = _repository(config), Path(config["site_dir"])
    for relative in sorted(_linked):
        (site / _COPY_UNDER / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repository / relative, site / _COPY_UNDER / relative)
