"""The CLI's one table renderer (`llmgw get`, `llmgw status`, `llmgw usage`, `llmgw keys list`).

Columns are left-aligned, three spaces apart, with no frame, so a script can still read a row
with ``line.split()``; an absent value (None or "") reads "-" so that it still fills a column.
Rich lays the columns out (it measures wide characters as the terminal draws them), sized to
the table itself rather than to the terminal, so a row is never wrapped onto a second line.

Every value comes from the admin API, and so, in part, from whoever named a node, a model or
a key: a name holding ESC could set the terminal's title or rewrite the screen (OSC and CSI
sequences), and one holding a newline could print a row of its own. Every cell is therefore
escaped (`visible`) before it is laid out: what reaches the terminal is printable text only.
"""

from __future__ import annotations

import io
import unicodedata
from collections.abc import Sequence

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["render_table", "visible"]

_GAP = 3

# Not control characters (category Cc) but still able to change what a line shows: line and
# paragraph separators, and the bidirectional overrides and isolates that reorder text
# ("Trojan Source").
_ALSO_ESCAPED = frozenset("\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def visible(value: object) -> str:
    """`value` as text with every C0 and C1 control character (ESC, newline, tab, DEL
    included) and every line-breaking or reordering format character written as its escape
    (``\\x1b``, ``\\n``, ``\\u202e``): the value still shows, but only as text."""
    text = str(value)
    if text.isprintable():  # the common case: nothing to escape
        return text
    return "".join(
        ch.encode("unicode_escape").decode("ascii")
        if unicodedata.category(ch) == "Cc" or ch in _ALSO_ESCAPED
        else ch
        for ch in text
    )


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else visible(value)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The table as lines of text: a header line, then one line per row; no trailing spaces."""
    head = [_cell(h) for h in headers]
    body = [[_cell(v) for v in row] for row in rows]
    for row in body:
        if len(row) != len(head):
            raise ValueError(f"a row has {len(row)} cells for {len(head)} columns")
    table = Table(
        box=None,
        show_edge=False,
        pad_edge=False,
        padding=(0, _GAP, 0, 0),
        header_style=None,
    )
    for h in head:
        # Markup is never parsed: a cell is a Text, so "[bold]" in a name prints as itself.
        table.add_column(Text(h), no_wrap=True, overflow="ignore")
    for row in body:
        table.add_row(*(Text(c) for c in row))
    widths = [max(cell_len(r[c]) for r in [head, *body]) for c in range(len(head))]
    out = io.StringIO()
    console = Console(
        file=out,
        # The table's own width: the terminal's would wrap or cut a long row.
        width=sum(widths) + _GAP * (len(widths) - 1) + 1,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
    )
    console.print(table)
    # split("\n"), not splitlines(): the lines are the ones Rich wrote, nothing else.
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").split("\n"))
