"""Serve MathJax from the built site, so that math renders with no network.

``_config.yml`` sets ``mathjax_path: mathjax/tex-svg-full.js`` (relative to
``_static``); this extension copies that one self-contained file from the PyPI
package ``django-static-mathjax`` into the HTML output when the build ends.
"""

import shutil
from pathlib import Path

import mathjax

SOURCE = Path(mathjax.__file__).parent / "static/mathjax/es5/tex-svg-full.js"


def copy_mathjax(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    target = Path(app.outdir) / "_static" / "mathjax" / SOURCE.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SOURCE, target)


def setup(app):
    if not SOURCE.is_file():
        raise RuntimeError(f"MathJax not found at {SOURCE}")
    app.connect("build-finished", copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
