"""mkdocs hook: the API reference covers every public module, found in the source tree.

``docs/reference.md`` carries the prose for the modules it introduces; every public module
it does not mention (``::: module``) is appended with a section of its own at build time, so
a new public module is in the reference without anyone remembering to add it. Public: each
non-underscore module or package directly under ``asynclock/`` (``asynclock.backends`` as
the package only: the drivers are reached through ``asynclock.connect``), the modules of
``asynclock.fence``, and each package under ``integrations/`` with its non-underscore
modules. ``tests/test_docs_reference.py`` checks the list against the tree.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_DOCUMENTED = re.compile(r"^::: ([\w.]+)", re.MULTILINE)
_OPTIONS = """    options:
      show_root_heading: false
      show_root_toc_entry: false
      heading_level: 3"""


def _modules(package: Path, dotted: str, *, deep: bool) -> list[str]:
    found = [dotted]
    for child in sorted(package.iterdir()):
        name = child.stem if child.suffix == ".py" else child.name
        if name.startswith("_") or not (child.suffix == ".py" or (child / "__init__.py").exists()):
            continue
        if child.is_dir() and not deep:
            found.append(f"{dotted}.{name}")
        elif child.is_dir():
            found += _modules(child, f"{dotted}.{name}", deep=True)
        else:
            found.append(f"{dotted}.{name}")
    return found


def public_modules(root: Path = ROOT) -> list[str]:
    """Every public module, as the reference must cover them."""
    found = _modules(root / "asynclock", "asynclock", deep=False)
    found += _modules(root / "asynclock" / "fence", "asynclock.fence", deep=False)[1:]
    for package in sorted((root / "integrations").iterdir()):
        if (package / "__init__.py").exists() and not package.name.startswith("_"):
            found += _modules(package, package.name, deep=True)
    return sorted(set(found))


def missing_sections(markdown: str, root: Path = ROOT) -> str:
    """Sections for the public modules ``markdown`` does not document yet."""
    documented = set(_DOCUMENTED.findall(markdown))
    missing = [m for m in public_modules(root) if m not in documented]
    return "".join(f"\n## {m}\n\n::: {m}\n{_OPTIONS}\n" for m in missing)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "reference.md":
        return markdown
    return markdown + missing_sections(markdown)
