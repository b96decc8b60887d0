"""mkdocs hooks: the version of the checkout, read from src/datastates/_version.py (no import of
the package, so the site builds without installing it), in the site's name and for
``{{ version }}`` in any page."""

from __future__ import annotations

import os
import re

_VERSION_FILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "datastates", "_version.py"
)


def version() -> str:
    with open(_VERSION_FILE, encoding="utf-8") as f:
        m = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if m is None:
        raise RuntimeError(f"{_VERSION_FILE}: no __version__ line")
    return m.group(1)


def on_config(config):
    config["site_name"] = f"datastates {version()}"
    return config


def on_page_markdown(markdown, page, config, files):
    return markdown.replace("{{ version }}", version())
