"""Reports as plain data (`Table`s), rendered as text, Markdown or HTML, so every
format shows the same thing."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class Table:
    """A titled table; rows may carry a group label (printed as a sub-header)."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    groups: list[str] | None = None
    right: tuple[int, ...] = ()  # right-aligned column indices
    notes: list[str] = field(default_factory=list)


def render(header: Sequence[str], tables: Iterable[Table], fmt: str) -> str:
    tables = list(tables)
    if fmt == "table":
        return _render_text(header, tables)
    if fmt == "markdown":
        return _render_markdown(header, tables)
    if fmt == "html":
        return _render_html(header, tables)
    raise ValueError(f"unknown format {fmt!r}")


def _render_text(header: Sequence[str], tables: list[Table]) -> str:
    out = list(header)
    for t in tables:
        out += ["", f"== {t.title} " + "=" * max(0, 74 - len(t.title))]
        if t.rows:
            widths = [max(len(c), *(len(r[i]) for r in t.rows)) for i, c in enumerate(t.columns)]

            def line(cells, widths=widths, t=t):
                return (
                    "  "
                    + "  ".join(
                        c.rjust(w) if i in t.right else c.ljust(w)
                        for i, (c, w) in enumerate(zip(cells, widths))
                    ).rstrip()
                )

            out.append(line(t.columns))
            out.append("  " + "  ".join("-" * w for w in widths))
            group = None
            for i, r in enumerate(t.rows):
                if t.groups is not None and t.groups[i] != group:
                    group = t.groups[i]
                    out.append(f"  [{group}]")
                out.append(line(r))
        else:
            out.append("  (none)")
        out += [f"  {n}" for n in t.notes]
    return "\n".join(out)


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def _render_markdown(header: Sequence[str], tables: list[Table]) -> str:
    out = []
    if header:
        out += [f"# {header[0]}", ""] + [f"    {h}" for h in header[1:]]
    for t in tables:
        out += ["", f"## {t.title}", ""]
        cols = (["group"] if t.groups is not None else []) + t.columns
        right = {i + (t.groups is not None) for i in t.right}
        if t.rows:
            out.append("| " + " | ".join(_md(c) for c in cols) + " |")
            out.append(
                "|" + "|".join("---:" if i in right else "---" for i in range(len(cols))) + "|"
            )
            for i, r in enumerate(t.rows):
                cells = ([t.groups[i]] if t.groups is not None else []) + r
                out.append("| " + " | ".join(_md(c) for c in cells) + " |")
        else:
            out.append("(none)")
        if t.notes:
            out.append("")
            out += [f"{n}  " for n in t.notes]
    return "\n".join(out) + "\n"


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em}"
    "table{border-collapse:collapse;margin-bottom:1em}"
    "td,th{border:1px solid #ccc;padding:2px 6px;font-family:monospace;white-space:pre}"
    "th{background:#eee}tr.group th{background:#dde8f5;text-align:left}td.r{text-align:right}"
)


def _render_html(header: Sequence[str], tables: list[Table]) -> str:
    e = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"><title>autopar plan</title>',
        f"<style>{_CSS}</style></head><body>",
    ]
    if header:
        out.append(f"<h1>{e(header[0])}</h1>")
        out += [f"<pre>{e(h)}</pre>" for h in header[1:]]
    for t in tables:
        out.append(f"<h2>{e(t.title)}</h2>")
        if not t.rows:
            out.append("<p>(none)</p>")
        else:
            out.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in t.columns) + "</tr>")
            group = None
            for i, r in enumerate(t.rows):
                if t.groups is not None and t.groups[i] != group:
                    group = t.groups[i]
                    out.append(
                        f'<tr class="group"><th colspan="{len(t.columns)}">{e(group)}</th></tr>'
                    )
                out.append(
                    "<tr>"
                    + "".join(
                        f'<td class="r">{e(c)}</td>' if j in t.right else f"<td>{e(c)}</td>"
                        for j, c in enumerate(r)
                    )
                    + "</tr>"
                )
            out.append("</table>")
        out += [f"<p>{e(n)}</p>" for n in t.notes]
    out.append("</body></html>")
    return "\n".join(out) + "\n"
