"""The two-column tables the command lines print: a title, then one indented ``label  value`` row each."""

from __future__ import annotations


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    print(title)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
