"""Griffe extension for the docs build: render Sphinx roles in docstrings as Markdown.

The code's docstrings use Sphinx cross-reference roles (``:class:`LeaseLost```), which
Markdown would show literally. This turns each role into an autorefs link when the target
is a public, documented object (``asynclock.<name in __all__>`` or ``asynclock.testing``),
and into a plain code span otherwise, so ``mkdocs build --strict`` never meets a dangling
cross-reference. Loaded by mkdocs.yml (mkdocstrings ``extensions``); not shipped.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([\w.]+)`")
PUBLIC_MODULES = ("asynclock.testing",)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "asynclock":
            return
        exported = {str(name) for name in (pkg.exports or ())}
        # canonical path of a re-exported object -> its public path
        public: dict[str, str] = {}
        for name in exported:
            member = pkg.members.get(name)
            if isinstance(member, griffe.Alias):
                public[member.target_path] = f"asynclock.{name}"

        def exists(path: str) -> bool:
            if path == "asynclock" or path in PUBLIC_MODULES:
                return True
            for mod in PUBLIC_MODULES:
                if path.startswith(mod + "."):
                    rest = path[len(mod) + 1 :]
                    return "." not in rest and rest in _exports(pkg[mod.split(".", 1)[1]])
            if not path.startswith("asynclock."):
                return False
            rest = path[len("asynclock.") :]
            if rest.split(".", 1)[0] not in exported:
                return False
            try:
                obj = pkg[rest]
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                return False
            return not any(part.startswith("_") for part in rest.split(".")) and obj is not None

        def resolve(obj: griffe.Object | griffe.Alias, target: str) -> str | None:
            candidates = [target] if target.startswith("asynclock") else []
            candidates.append(f"asynclock.{target}")
            scope: Any = obj
            while scope is not None:
                if scope.is_class and scope.path in public:
                    candidates.append(f"{public[scope.path]}.{target}")
                scope = scope.parent
            return next((c for c in candidates if exists(c)), None)

        def rewrite(obj: griffe.Object | griffe.Alias) -> None:
            if obj.docstring is not None:

                def sub(m: re.Match[str]) -> str:
                    tilde, target = m.groups()
                    shown = target.rsplit(".", 1)[-1] if tilde else target
                    ident = resolve(obj, target)
                    return f"[`{shown}`][{ident}]" if ident else f"`{shown}`"

                obj.docstring.value = ROLE.sub(sub, obj.docstring.value)
            for member in obj.members.values():
                if not member.is_alias:
                    rewrite(member)

        rewrite(pkg)


def _exports(module: Any) -> set[str]:
    return {str(name) for name in (module.exports or ())}
