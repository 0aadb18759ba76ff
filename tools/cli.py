"""The command line of the scripts that take no options of their own (or
only notebooks): `--help` prints the script's docstring, up to its Usage
section, and exits 0 before any work is done."""

import argparse


def parser(doc):
    """An ArgumentParser described by the docstring `doc`."""
    return argparse.ArgumentParser(
        description=doc.split("\n\nUsage")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def help_only(doc, argv=None):
    """Parse a command line that has no options: only --help."""
    return parser(doc).parse_args(argv)


def notebooks(doc, argv=None):
    """The notebooks named on the command line (none: every chapter)."""
    command = parser(doc)
    command.add_argument(
        "notebooks", nargs="*", help="the notebooks (default: every chapter)"
    )
    return command.parse_args(argv).notebooks
