"""`miles tito verify --family NAME`: prints the family's verification table and its known
limits; exits 1 if a conversation kind the family promises to render append-only does not."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from miles_core.tito import get_family
from miles_core.tito.verify import verify


def run_verify(name: str, conversations: int, turns: int, seed: int) -> int:
    console = Console()
    if not console.is_terminal:  # piped or captured: wide enough that rows stay on one line
        console = Console(width=120)
    try:
        family = get_family(name)
    except ValueError as e:
        console.print(f"miles: error: {e}", style="red")
        return 2
    reports = verify(family, conversations, turns, seed)
    table = Table(title=f"TITO verify: {name} ({conversations} conversations × {turns} turns each)")
    for col in (
        "kind",
        "append-only expected",
        "turns",
        "incremental == full",
        "parsed back",
        "result",
    ):
        table.add_column(col)
    for r in reports:
        result = "ok" if r.ok else "FAIL"
        if r.ok and not r.expected and r.matched < r.turns:
            result = "differs (known limit)"
        table.add_row(
            r.variant,
            "yes" if r.expected else "no",
            str(r.turns),
            f"{r.matched}/{r.turns}",
            f"{r.parsed}/{r.turns}",
            result,
        )
    console.print(table)
    for r in reports:  # the first place per kind where the session's ids and a re-render part
        for line in r.first_mismatches[:1]:
            console.print(f"{r.variant}, {line}", highlight=False, markup=False)
    if family.limits:
        console.print("Known limits of this family's template:")
        for limit in family.limits:
            console.print(f"  - {limit}", highlight=False)
    failed = [r.variant for r in reports if not r.ok]
    if failed:
        console.print(f"FAILED: {', '.join(failed)} should be append-only", style="red")
        return 1
    console.print(f"{name}: every append-only kind matched at every turn", style="green")
    return 0
