"""`miles tito verify --family NAME [--model DIR]`: prints the family's verification table and
its known limits; exits 1 if a conversation kind the family promises to render append-only does
not (against itself, or against the chat template the model directory ships)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from miles_core.tito import build_family
from miles_core.tito.verify import model_template, verify


def run_verify(
    name: str, conversations: int, turns: int, seed: int, model_dir: str | None = None
) -> int:
    console = Console()
    if not console.is_terminal:  # piped or captured: wide enough that rows stay on one line
        console = Console(width=120)
    try:
        family = build_family(name)
    except ValueError as e:
        console.print(f"miles: error: {e}", style="red", highlight=False, markup=False)
        return 2
    template = None
    if model_dir is not None:
        try:
            template = model_template(model_dir)
        except OSError as e:
            console.print(f"miles: error: --model {model_dir}: {e}", style="red", markup=False)
            return 2
        if template is None:
            console.print(f"{model_dir} ships no chat template: compared with the family only")
    reports = verify(family, conversations, turns, seed, template)
    table = Table(title=f"TITO verify: {name} ({conversations} conversations × {turns} turns each)")
    columns = ["kind", "append-only expected", "turns", "incremental == full", "parsed back"]
    if template is not None:
        columns.append("== model template")
    for col in (*columns, "result"):
        table.add_column(col)
    for r in reports:
        result = "ok" if r.ok else "FAIL"
        template_differs = r.template_matched is not None and r.template_matched < r.turns
        if r.ok and not r.expected and (r.matched < r.turns or template_differs):
            result = "differs (known limit)"
        row = [
            r.variant,
            "yes" if r.expected else "no",
            str(r.turns),
            f"{r.matched}/{r.turns}",
            f"{r.parsed}/{r.turns}",
        ]
        if template is not None:
            row.append(f"{r.template_matched}/{r.turns}")
        table.add_row(*row, result)
    console.print(table)
    for r in reports:  # the first place per kind where the session's ids and a re-render part
        for line in r.first_mismatches[:1]:
            console.print(f"{r.variant}, {line}", highlight=False, markup=False)
        for line in r.template_mismatches[:1]:
            console.print(f"{r.variant}, model template, {line}", highlight=False, markup=False)
    if family.limits:
        console.print("Known limits of this family's template:")
        for limit in family.limits:
            console.print(f"  - {limit}", highlight=False, markup=False)
    failed = [r.variant for r in reports if not r.ok]
    if failed:
        against = " and match the model's chat template" if template is not None else ""
        console.print(f"FAILED: {', '.join(failed)} should be append-only{against}", style="red")
        return 1
    against = ", equal to the model's chat template" if template is not None else ""
    console.print(f"{name}: every append-only kind matched at every turn{against}", style="green")
    return 0
