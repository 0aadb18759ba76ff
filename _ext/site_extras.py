"""Small Sphinx extension for the book's site (listed in _config.yml).

1. Offline math. ``_config.yml`` sets ``mathjax_path: mathjax/tex-svg-full.js``
   (relative to ``_static``); this extension copies that one self-contained
   file from the PyPI package ``django-static-mathjax`` into the HTML output
   when the build ends, so that pages render math with no network.
2. No duplicate scripts. Jupyter Book 1.x registers sphinx-thebe's inline
   configuration script twice, and the second copy throws
   "Identifier 'THEBE_JS_URL' has already been declared" in every page's
   console; identical script entries are dropped here.
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


def drop_duplicate_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        attributes = getattr(script, "attributes", {})
        key = attributes.get("body") or str(
            getattr(script, "filename", script)
        )
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique


def setup(app):
    if not SOURCE.is_file():
        raise RuntimeError(f"MathJax not found at {SOURCE}")
    app.connect("build-finished", copy_mathjax)
    app.connect("html-page-context", drop_duplicate_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
