"""The API reference is completed from the source tree (docs/_griffe/reference_hook.py): a
public module nobody added to docs/reference.md still gets its section (issue 39 item 4:
the page said everything public lived in two modules and left several out)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "reference_hook", ROOT / "docs" / "_griffe" / "reference_hook.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_module_of_the_tree_is_in_the_reference() -> None:
    hook = _hook()
    found = hook.public_modules()
    for name in (
        "asynclock",
        "asynclock.testing",
        "asynclock.fence.sql",
        "asynclock.fence.redis",
        "asynclock.from_thread",
        "asynclock_celery",
        "asynclock_fastapi",
        "asynclock_apscheduler",
    ):
        assert name in found, name
    assert not [m for m in found if any(part.startswith("_") for part in m.split("."))]
    page = (ROOT / "docs" / "reference.md").read_text()
    built = page + hook.missing_sections(page)
    for name in found:
        assert built.count(f"\n::: {name}\n") == 1, name


def test_a_new_public_module_gets_a_section_without_editing_the_page(tmp_path: Path) -> None:
    hook = _hook()
    for package in ("asynclock", "asynclock/fence", "integrations/asynclock_new"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "asynclock" / "shiny.py").write_text("")
    (tmp_path / "asynclock" / "_private.py").write_text("")
    (tmp_path / "integrations" / "asynclock_new" / "helpers.py").write_text("")
    page = "# API reference\n\n::: asynclock\n"
    added = hook.missing_sections(page, tmp_path)
    assert "::: asynclock.shiny\n" in added
    assert "::: asynclock_new\n" in added and "::: asynclock_new.helpers\n" in added
    assert "_private" not in added and "\n::: asynclock\n" not in added
