"""Result rows as markdown tables (the report's and ``--compile-only``'s): a row's status, a number
column, the table."""

from __future__ import annotations


def row_status(row) -> str:
    label = "**FAILED**" if row["status"] == "failed" else row["status"]
    return f"{label}: {row['reason']}" if row.get("reason") else label


def number(key, spec):
    return lambda row: format(row[key], spec) if row.get(key) is not None else ""


def table(rows, columns) -> str:
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(value(row)) for _, value in columns) + " |" for row in rows]
    return "\n".join(lines)
