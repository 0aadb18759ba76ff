"""The planted bugs of `make mutants` as data: read from
tools/check/mutants/*.toml, checked (each `find` occurs exactly once in its
file, each named test file exists, some test file runs it), applied to a
file's text, and matched with the test files that must catch them (the
rules are in tools/check/mutants.py's docstring). tools/check/mutant_run.py
runs them; tools/check/mutants.py is the command line."""

import ast
import functools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "tools" / "check" / "mutants"
FIELDS = {"id", "file", "find", "replace", "description", "tests"}


@dataclass
class Mutant:
    id: str
    file: str
    find: str
    replace: str
    description: str
    tests: list = field(default_factory=list)
    source: str = ""  # the TOML file that lists it (from the repository)


@dataclass
class Result:
    mutant: Mutant
    status: str  # caught, missed, invalid, error
    seconds: float = 0.0
    detail: str = ""


def load_mutants(path=MUTANTS):
    """The mutants listed in `path` (a TOML file, or a folder of them read in
    name order), checked for their fields and ids unique across files."""
    paths = sorted(path.glob("*.toml")) if path.is_dir() else [path]
    mutants, seen = [], set()
    for one in paths:
        mutants += load_mutant_file(one, seen)
    return mutants


def load_mutant_file(path, seen):
    """The mutants of one TOML file; `seen` collects the ids so far."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    unknown = set(data) - {"mutant"}
    if unknown:
        raise ValueError(f"{path.name}: unknown top-level keys {unknown}")
    mutants = []
    path = path.resolve()
    source = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for i, entry in enumerate(data.get("mutant", [])):
        missing = {"id", "file", "find", "replace", "description"} - set(entry)
        extra = set(entry) - FIELDS
        if missing or extra:
            raise ValueError(
                f"{path.name}: mutant #{i + 1} ({entry.get('id', '?')}): "
                f"missing {sorted(missing)}, unknown {sorted(extra)}"
            )
        if entry["id"] in seen:
            raise ValueError(f"{path.name}: duplicate id {entry['id']!r}")
        if entry["find"] == entry["replace"]:
            raise ValueError(f"{path.name}: {entry['id']}: replace == find")
        seen.add(entry["id"])
        mutants.append(Mutant(**entry, source=str(source)))
    return mutants


# --- Patching ----------------------------------------------------------------


def code_cells(notebook):
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


@functools.lru_cache(maxsize=4)
def code_sources(text):
    """The source of each code cell of a notebook's text (kept for the next
    mutant of the same notebook: parsing a notebook is the slow part)."""
    return tuple("".join(c["source"]) for c in code_cells(json.loads(text)))


def count_matches(root, mutant):
    """How often `find` occurs in the file (a notebook: in its code cells)."""
    path = root / mutant.file
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".ipynb":
        return text.count(mutant.find)
    return sum(source.count(mutant.find) for source in code_sources(text))


def invalid(mutants, root=ROOT):
    """(mutant, why) for each mutant that cannot be planted or judged as
    listed: its `find` does not occur exactly once in its file, a test file
    it names does not exist, or it names none and the default ones (see
    `tests_for`) are none."""
    found = []
    for m in sorted(mutants, key=lambda m: m.file):  # one parse per notebook
        n = count_matches(root, m)
        exists = (root / m.file).is_file()
        if n != 1:
            where = m.file if exists else f"{m.file} (no such file)"
            found.append((m, f"`find` occurs {n} times in {where}"))
        missing = [t for t in m.tests if not (root / t).is_file()]
        if missing:
            found.append((m, f"no test file {', '.join(missing)}"))
        elif exists and not tests_for(root, m):
            found.append((m, "no test file runs it: name its `tests`"))
    return found


def describe_invalid(found):
    """The lines that name each invalid mutant, its TOML file and why."""
    lines = [f"INVALID {m.id} ({m.source}): {why}" for m, why in found]
    lines.append(
        f"{len(found)} planted bug(s) no longer apply: update their `find` "
        "(or tests) to the code as it is now; "
        "`python tools/check/mutants.py --list` checks them all."
    )
    return lines


def patched_text(text, suffix, mutant):
    """The file's text with the mutant's one edit made."""
    if suffix != ".ipynb":
        return text.replace(mutant.find, mutant.replace, 1)
    notebook = json.loads(text)
    for cell in code_cells(notebook):
        source = "".join(cell["source"])
        if mutant.find in source:
            new = source.replace(mutant.find, mutant.replace, 1)
            cell["source"] = new.splitlines(keepends=True)
    # nbformat's layout: one-space indent, non-ASCII kept, final newline
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


# --- Which tests -------------------------------------------------------------


def imported_modules(path):
    """Top-level names imported by a .py file or a notebook's code cells."""
    if path.suffix == ".ipynb":
        cells = code_cells(json.loads(path.read_text(encoding="utf-8")))
        sources = ["".join(cell["source"]) for cell in cells]
    else:
        sources = [path.read_text(encoding="utf-8")]
    names = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.level == 0:
                    names.add(node.module.split(".")[0])
    return names


def chapter_tests(root, notebook):
    """tests/test_chNN_*.py for book/NN_*.ipynb; for another notebook, the
    test files that name it."""
    match = re.match(r"(\d\d)_", notebook.name)
    if match:
        return sorted(root.glob(f"tests/test_ch{match.group(1)}_*.py"))
    return sorted(
        p
        for p in root.glob("tests/test_*.py")
        if notebook.name in p.read_text(encoding="utf-8")
    )


@functools.cache  # the files it reads are never patched when it reads them
def import_table(root):
    """What each book/ module, test file and notebook under `root` imports,
    read once (`invalid` asks for every mutant's tests)."""
    book = root / "book"
    return (
        {p.stem: imported_modules(p) for p in book.glob("*.py")},
        {p: imported_modules(p) for p in sorted(root.glob("tests/test_*.py"))},
        {p: imported_modules(p) for p in sorted(book.glob("*.ipynb"))},
    )


@functools.cache
def module_tests(root, module):
    """The tests of a shared module book/<module>.py: the test files that
    import it first (they are the quickest to fail), then those of every
    chapter that imports it, directly or through another book/ module."""
    modules, test_files, notebooks = import_table(root)
    users = {module}  # the module and every book/ module that uses it
    while True:
        more = {m for m, imports in modules.items() if imports & users}
        if more <= users:
            break
        users |= more
    direct = [p for p, imports in test_files.items() if imports & users]
    chapters = []
    for notebook, imports in notebooks.items():
        if imports & users:
            chapters += [
                p for p in chapter_tests(root, notebook) if p not in direct
            ]
    return direct + chapters


def tests_for(root, mutant):
    """The test files (relative paths) a mutant runs."""
    if mutant.tests:
        return list(mutant.tests)
    path = root / mutant.file
    if path.suffix == ".ipynb":
        found = chapter_tests(root, path)
    else:
        found = module_tests(root, path.stem)
    return [str(p.relative_to(root)) for p in found]


def select(mutants, only):
    if not only:
        return mutants
    chosen = [
        m
        for m in mutants
        if any(m.id == o or m.id.startswith(o) for o in only)
    ]
    if not chosen:
        raise SystemExit(f"no mutant id equals or starts with {only}")
    return chosen
