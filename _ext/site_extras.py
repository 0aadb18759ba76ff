"""Small Sphinx extension for the book's site (listed in _config.yml).

1. Offline math. ``_config.yml`` sets ``mathjax_path: mathjax/tex-svg-full.js``
   (relative to ``_static``); this extension copies that one self-contained
   file from the PyPI package ``django-static-mathjax`` into the HTML output
   when the build ends, so that pages render math with no network.
2. No duplicate scripts. Jupyter Book 1.x registers sphinx-thebe's inline
   configuration script twice, and the second copy throws
   "Identifier 'THEBE_JS_URL' has already been declared" in every page's
   console; identical script entries are dropped here.
3. A download that runs. Every chapter page offers, first in its download
   menu, `downloads/<chapter>.zip`: one folder with the notebook (with its
   stored outputs), the book's own modules it imports (`plots.py`,
   `diagrams.py`), the files its code reads (`data/...`),
   `requirements.txt` and a README. `make test` executes every chapter from
   its extracted zip in an empty folder, so a file missing from a zip fails
   the tests. The notebook alone stays in the menu as `.ipynb`.
4. Offline plotly.js for the attention explorer (book/explorer.py). The
   JavaScript bundled in the PyPI package `plotly` is copied to
   `_static/plotly/plotly.min.js` when the build ends, and loaded only by
   the pages that hold an explorer (a raw HTML output with the class
   `attention-explorer`): no CDN.
"""

import ast
import json
import shutil
import zipfile
from pathlib import Path

import mathjax
import plotly
from docutils import nodes

SOURCE = Path(mathjax.__file__).parent / "static/mathjax/es5/tex-svg-full.js"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
PLOTLY_TARGET = "plotly/plotly.min.js"  # under _static
EXPLORER_MARK = 'class="attention-explorer"'


def copy_mathjax(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    target = Path(app.outdir) / "_static" / "mathjax" / SOURCE.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SOURCE, target)


def copy_plotly(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    target = Path(app.outdir) / "_static" / PLOTLY_TARGET
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PLOTLY_JS, target)


def has_explorer(doctree):
    """Whether a page holds an attention explorer (book/explorer.py)."""
    return doctree is not None and any(
        EXPLORER_MARK in node.astext()
        for node in doctree.findall(nodes.raw)
        if "html" in node.get("format", "").split()
    )


def add_plotly_where_needed(app, pagename, templatename, context, doctree):
    """plotly.js for the pages with an explorer, and for no other page."""
    if has_explorer(doctree):
        app.add_js_file(PLOTLY_TARGET)


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


ROOT = Path(__file__).resolve().parents[1]
DOWNLOADS = "downloads"  # folder of the chapter zips in the HTML output

README = """{name}: one chapter of "Attention from Scratch", ready to run.

This folder holds the chapter's notebook (with the outputs the book shows),
the book's helper modules and data files it uses, and the exact package
versions the book is tested with. In a fresh Python 3.11 environment:

    pip install -r requirements.txt jupyterlab
    jupyter lab {name}.ipynb

Run the cells top to bottom; every printed number should be the one stored
in the notebook.
"""


def code_cells(notebook):
    """The source of every code cell of a notebook file."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def chapter_files(notebook):
    """The files under book/ that a chapter needs to run, besides itself.

    The book's own modules the notebook imports (and those they import), and
    every existing file that its code names by a path relative to book/ (for
    example "data/small.csv"). Returns paths relative to book/, sorted.
    """
    book = notebook.parent.resolve()
    needed, queue = set(), list(code_cells(notebook))
    while queue:
        tree = ast.parse(queue.pop())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                module = book / f"{name.split('.')[0]}.py"
                if module.is_file() and module not in needed:
                    needed.add(module)
                    queue.append(module.read_text(encoding="utf-8"))
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value
                if value and "\n" not in value and len(value) < 200:
                    candidate = (book / value).resolve()
                    if candidate.is_file() and book in candidate.parents:
                        needed.add(candidate)
    return sorted(str(p.relative_to(book)) for p in needed)


def write_chapter_zip(notebook, target):
    """Write the zip of one chapter (one folder named after it) to `target`."""
    name = notebook.stem
    members = [(f"{name}.ipynb", notebook)]
    members += [
        (rel, notebook.parent / rel) for rel in chapter_files(notebook)
    ]
    members.append(("requirements.txt", ROOT / "requirements.txt"))
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for arcname, path in members:
            info = zipfile.ZipInfo(f"{name}/{arcname}", (2026, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
        info = zipfile.ZipInfo(f"{name}/README.txt", (2026, 1, 1, 0, 0, 0))
        archive.writestr(info, README.format(name=name))


def chapter_notebooks(app):
    """The chapters of the book: the documents whose source is a notebook."""
    notebooks = []
    for docname in sorted(app.env.found_docs):
        path = Path(app.env.doc2path(docname))
        if path.suffix == ".ipynb":
            notebooks.append((docname, path))
    return notebooks


def write_downloads(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    for _, notebook in chapter_notebooks(app):
        target = Path(app.outdir) / DOWNLOADS / f"{notebook.stem}.zip"
        write_chapter_zip(notebook, target)


def add_zip_download(app, pagename, templatename, context, doctree):
    """Put the chapter's zip first in the page's download menu."""
    if context.get("page_source_suffix") != ".ipynb":
        return
    for group in context.get("header_buttons", []):
        if group.get("label") != "download-buttons":
            continue
        for button in group["buttons"]:
            if button.get("text") == ".ipynb":
                button["tooltip"] = "Download the notebook alone"
        zip_name = f"{Path(pagename).name}.zip"
        group["buttons"].insert(
            0,
            {
                "type": "link",
                "url": context["pathto"](f"{DOWNLOADS}/{zip_name}", 1),
                "text": ".zip",
                "icon": "fas fa-file-zipper",
                "tooltip": "Download the chapter, ready to run: notebook, "
                "helpers, data, requirements.txt",
                "label": "download-zip-button",
            },
        )


def setup(app):
    if not SOURCE.is_file():
        raise RuntimeError(f"MathJax not found at {SOURCE}")
    if not PLOTLY_JS.is_file():
        raise RuntimeError(f"plotly.js not found at {PLOTLY_JS}")
    app.connect("build-finished", copy_plotly)
    app.connect("html-page-context", add_plotly_where_needed)
    app.connect("build-finished", copy_mathjax)
    app.connect("build-finished", write_downloads)
    app.connect("html-page-context", drop_duplicate_scripts)
    # after sphinx-book-theme's header buttons (priority 501)
    app.connect("html-page-context", add_zip_download, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
