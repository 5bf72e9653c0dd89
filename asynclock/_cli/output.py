"""Output for every ``asynclock`` command: rich when installed, aligned plain text otherwise.

Commands speak in *parts*, ``(text, style)`` pairs, and call :class:`Output`'s methods
(``line``, ``paragraph``, ``header``, ``step``, ``table``, ``verdict``); which renderer they
get is decided once, by :func:`make_output`. Styles are names from :data:`STYLES`.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from typing import Any

Parts = list[tuple[str, str]]
#: Table columns, (heading, "<" or ">"), and rows of cells.
Columns = list[tuple[str, str]]
Rows = list[list[str]]

#: The styles commands may name, as rich styles; w1/w2 tell two workers apart.
STYLES = dict(
    w1="bold cyan", w2="bold magenta", tok="bold", good="bold green", bad="bold red",
    dim="dim", h="bold",
)  # fmt: skip
#: SGR codes of the words in STYLES, for plain output on a terminal.
_SGR = {"bold": "1", "dim": "2", "red": "31", "green": "32", "magenta": "35", "cyan": "36"}


def safe(text: str) -> str:
    """``text`` with every character a terminal would act on or hide made visible, as
    ``ls`` and ``git`` do: C0 and C1 controls and DEL (so no ESC starts a CSI or OSC
    sequence: no cleared screen, no window title), newlines (no forged output line),
    Unicode format characters (bidi overrides) and line separators, as ``\\xNN`` /
    ``\\uNNNN``. Lock names and holder ids are chosen by whoever takes a lock; every human
    output of the CLI passes through here (``--json`` is escaped by JSON itself)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def ansi(style: str) -> str:
    """The ANSI escape that starts ``style`` ("bold cyan": ``ESC[1;36m``)."""
    return "\x1b[" + ";".join(_SGR[word] for word in STYLES[style].split()) + "m"


class Output:
    """Plain-text renderer: aligned columns, ANSI styles only when ``color``."""

    def __init__(self, color: bool) -> None:
        self.color = color
        self.width = max(60, min(100, shutil.get_terminal_size((88, 24)).columns))

    def _style(self, text: str, style: str) -> str:
        if not self.color or not style or not text:
            return text
        return f"{ansi(style)}{text}\x1b[0m"

    def _wrap(self, parts: Parts, first: str, indent: str) -> list[Parts]:
        """Lines of at most ``width`` columns; words may span parts ("token " "7" ".")."""
        words: list[Parts] = [[]]
        for text, style in parts:
            for piece in re.findall(r"\s+|\S+", text):
                if piece.isspace():
                    words.append([])
                else:
                    words[-1].append((piece, style))
        lines: list[Parts] = [[(first, "")]]
        used = len(first)
        for word in filter(None, words):
            size = sum(len(t) for t, _ in word)
            if used > len(indent) and used + 1 + size > self.width:
                lines.append([(indent, "")])
                used = len(indent)
            elif len(lines[-1]) > 1:
                # Inside a styled phrase ("worker 1") the space takes the phrase's style.
                joint = word[0][1] if word[0][1] == lines[-1][-1][1] else ""
                lines[-1].append((" ", joint))
                used += 1
            lines[-1].extend(word)
            used += size
        return lines

    def line(self, parts: Parts) -> None:
        merged: Parts = []
        for text, style in ((safe(t), s) for t, s in parts):
            if merged and merged[-1][1] == style:
                merged[-1] = (merged[-1][0] + text, style)
            else:
                merged.append((text, style))
        print("".join(self._style(text, style) for text, style in merged), flush=True)

    def paragraph(self, parts: Parts, first: str = "", indent: str = "") -> None:
        parts = [(safe(text), style) for text, style in parts]  # before "\n" is a space
        for line in self._wrap(parts, first, indent):
            self.line(line)

    def header(self, title: str, rows: list[tuple[str, str]]) -> None:
        self.line([(title, "h")])
        for key, value in rows:
            self.paragraph([(value, "")], f"  {key:<9} ", " " * 12)
        self.line([])

    def step(self, n: int, parts: Parts) -> None:
        self.paragraph(parts, f"{n:>2}. ", "    ")

    def table(
        self,
        title: str,
        columns: Columns,
        rows: Rows,
        styles: Mapping[str, str] | None = None,
    ) -> None:
        """``columns``: (heading, "<" or ">"); a cell found in ``styles`` gets that style."""
        rows = [[safe(cell) for cell in row] for row in rows]
        styles = {safe(cell): style for cell, style in (styles or {}).items()}
        self._table(safe(title), columns, rows, styles)

    def _table(self, title: str, columns: Columns, rows: Rows, styles: Mapping[str, str]) -> None:
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, (h, _) in enumerate(columns)]

        def fmt(cells: list[str], styled: bool) -> str:
            out = []
            for cell, (_, align), width in zip(cells, columns, widths, strict=True):
                style = styles.get(cell, "") if styled else ""
                out.append(self._style(f"{cell:{align}{width}}", style))
            return ("  " + "  ".join(out)).rstrip()

        print()
        self.line([(title, "h")])
        print(fmt([h for h, _ in columns], False))
        print("  " + "  ".join("-" * w for w in widths))
        for row in rows:
            print(fmt(row, True))

    def verdict(self, ok: bool, title: str, lines: list[str], label: str = "") -> None:
        label = label or ("OK" if ok else "DEVIATION")
        print()
        self.line([(f"{label}: ", "good" if ok else "bad"), (title, "h")])
        for text in lines:
            self.paragraph([(text, "")], "  - ", "    ")


class RichOutput(Output):
    """The same output through rich: styled text, tables, a panel for the verdict."""

    def __init__(self, color: bool) -> None:
        super().__init__(color)
        from rich.console import Console

        self.console = Console(highlight=False, color_system="auto" if color else None)
        self.width = min(self.width, self.console.width)

    def _text(self, parts: Parts) -> Any:
        from rich.text import Text

        return Text.assemble(*((safe(t), STYLES[s] if s else "") for t, s in parts))

    def line(self, parts: Parts) -> None:
        self.console.print(self._text(parts), soft_wrap=True)

    def _table(self, title: str, columns: Columns, rows: Rows, styles: Mapping[str, str]) -> None:
        from rich import box
        from rich.table import Table

        table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD)
        for heading, align in columns:
            # One line per row: a cell wrapped at its spaces reads as rows of its own
            # (a name can hold "... free, nobody holds it"); a long one ends in "…".
            table.add_column(heading, justify="right" if align == ">" else "left", no_wrap=True)
        for row in rows:
            table.add_row(*(self._text([(c, styles.get(c, ""))]) for c in row))
        self.console.print()
        self.console.print(table)

    def verdict(self, ok: bool, title: str, lines: list[str], label: str = "") -> None:
        from rich.panel import Panel

        label = label or ("OK" if ok else "DEVIATION")
        color = "green" if ok else "red"
        body = self._text([(title, "h")])
        for text in lines:
            body.append("\n• ")
            body.append(safe(text))
        self.console.print()
        self.console.print(
            Panel(body, title=f"[bold {color}]{label}[/]", title_align="left", border_style=color)
        )


def make_output(color: bool) -> Output:
    """The rich renderer when rich is installed (``asynclock[cli]``), else plain text."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return Output(color)
    return RichOutput(color)


def wants_color(no_color: bool) -> bool:
    """Colors only on a terminal, unless ``--no-color`` or ``NO_COLOR`` says otherwise."""
    return not no_color and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
