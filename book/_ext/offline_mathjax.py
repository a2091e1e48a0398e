"""Serve MathJax from the book itself when a local copy is installed (the book then renders math offline).

``npm install --prefix .mathjax mathjax@3.2.2`` (the README's book command and CI do this) puts MathJax 3 in
``.mathjax/``; the build then copies its combined TeX component and fonts into ``_static/mathjax`` and points
Sphinx's ``mathjax_path`` there. Without the copy, pages load MathJax from Sphinx's default CDN.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util import logging

COMPONENT = "tex-mml-chtml.js"
FONTS = Path("output") / "chtml" / "fonts" / "woff-v2"
logger = logging.getLogger(__name__)


def local_copy(srcdir: Path) -> Path | None:
    """The es5 folder of an npm-installed MathJax 3 under ``.mathjax/``, or None."""
    es5 = srcdir / ".mathjax" / "node_modules" / "mathjax" / "es5"
    return es5 if (es5 / COMPONENT).is_file() and (es5 / FONTS).is_dir() else None


def use_local_mathjax(app: Sphinx) -> None:
    es5 = local_copy(Path(app.srcdir))
    if es5 is None:
        logger.info("offline_mathjax: no .mathjax/ copy; pages load MathJax from the CDN")
        return
    target = Path(app.outdir) / "_static" / "mathjax"
    (target / FONTS).mkdir(parents=True, exist_ok=True)
    shutil.copy2(es5 / COMPONENT, target / COMPONENT)
    shutil.copytree(es5 / FONTS, target / FONTS, dirs_exist_ok=True)
    app.config.mathjax_path = f"mathjax/{COMPONENT}"


def setup(app: Sphinx) -> dict[str, object]:
    app.connect("builder-inited", use_local_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
