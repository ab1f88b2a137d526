"""Build the JSON-extraction workload of `forerun bench structured` from public package metadata
that ships on PyPI: the `*.dist-info/METADATA` headers of pinned wheels of well-known packages.

Each row asks the model to turn one package's core-metadata headers (real text, as its
maintainers published it; the long description dropped, a multi-line License field cut to its
first line, only the `License ::` classifiers kept) into one JSON object under a fixed schema,
and carries the object the headers imply (`expected`), so the bench can score extractions as
well as time them. Pinned versions make the output reproducible: the same wheel bytes wherever
they are downloaded (the sha256 of each is written to SOURCE.md's table).

    python experiments/build_pypi_extraction.py            # downloads ~15 MB of wheels
    python experiments/build_pypi_extraction.py --wheels /tmp/wheels   # reuse a download

Writes forerun/bench/workloads/pypi_metadata/extract.jsonl and wheels.md (the provenance table).
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "forerun" / "bench" / "workloads" / "pypi_metadata"
# well-known, mostly pure-Python packages (small wheels), each pinned to a release of 2024
PINS = (
    "requests==2.32.3", "urllib3==2.2.3", "idna==3.10", "certifi==2024.8.30",
    "charset-normalizer==3.3.2", "click==8.1.7", "flask==3.0.3", "jinja2==3.1.4",
    "werkzeug==3.0.4", "itsdangerous==2.2.0", "markupsafe==2.1.5", "attrs==24.2.0",
    "packaging==24.1", "six==1.16.0", "python-dateutil==2.9.0.post0", "pytz==2024.2",
    "rich==13.9.2", "pygments==2.18.0", "tqdm==4.66.5", "typer==0.12.5", "fastapi==0.115.0",
    "pydantic==2.9.2", "starlette==0.38.6", "httpx==0.27.2", "httpcore==1.0.6", "anyio==4.6.0",
    "sniffio==1.3.1", "h11==0.14.0", "uvicorn==0.31.0", "toml==0.10.2", "tomli==2.0.2",
    "filelock==3.16.1", "platformdirs==4.3.6", "virtualenv==20.26.6", "pluggy==1.5.0",
    "pytest==8.3.3", "iniconfig==2.0.0", "wheel==0.44.0", "isort==5.13.2",
    "typing-extensions==4.12.2", "decorator==5.1.1", "more-itertools==10.5.0",
    "jsonschema==4.23.0", "referencing==0.35.1", "tabulate==0.9.0", "colorama==0.4.6",
    "docutils==0.21.2", "markdown==3.7", "beautifulsoup4==4.12.3", "soupsieve==2.6",
    "networkx==3.3", "mpmath==1.3.0", "fsspec==2024.9.0", "huggingface-hub==0.25.1",
    "openai==1.51.0", "cachetools==5.5.0",
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "summary": {"type": ["string", "null"]},
        "license": {"type": ["string", "null"]},
        "requires_python": {"type": ["string", "null"]},
        "dependencies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "version", "summary", "license", "requires_python", "dependencies"],
    "additionalProperties": False,
}
INSTRUCTION = (
    "Extract this Python package's metadata as one JSON object with the keys name, version, "
    "summary, license, requires_python and dependencies. dependencies lists the names of the "
    "packages in the Requires-Dist lines that have no `extra ==` marker (the required ones), "
    "in their order; use null for a field the headers do not give. Reply with the JSON object "
    "only.\n\n```\n{headers}\n```")
DROPPED = {"Description", "Description-Content-Type", "Dynamic"}
LONG_LICENSE = 80  # a License field longer than this (or multi-line) is a licence text: cut
DEP_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def download(pins: tuple[str, ...], dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                    ":all:", "--dest", str(dest), *pins], check=True)


def metadata_text(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode("utf-8")


def headers_and_expected(text: str) -> tuple[str, dict]:
    """The prompt's header block and the object it implies."""
    msg = email.parser.Parser().parsestr(text, headersonly=True)
    lines, license_field = [], None
    for key, value in msg.items():
        value = str(value)
        if key in DROPPED:
            continue
        if key == "Classifier" and not value.startswith("License ::"):
            continue
        if key == "License":
            first = value.strip().splitlines()[0].strip() if value.strip() else ""
            if "\n" in value.strip() or len(first) > LONG_LICENSE:
                value = first[:LONG_LICENSE] + " [...]"
            else:
                license_field = first or None
        lines.append(f"{key}: {' '.join(value.split()) if key != 'License' else value}")
    return "\n".join(lines), {
        "name": msg["Name"], "version": msg["Version"], "summary": msg.get("Summary"),
        "license": msg.get("License-Expression") or license_field or _classifier_license(msg),
        "requires_python": msg.get("Requires-Python"),
        "dependencies": [DEP_NAME.match(d).group(1) for d in msg.get_all("Requires-Dist") or []
                         if "extra ==" not in d.replace("extra==", "extra ==")],
    }


def _classifier_license(msg) -> str | None:
    found = [c.split("::")[-1].strip() for c in msg.get_all("Classifier") or []
             if c.startswith("License ::")]
    return found[0] if found else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=None,
                    help="a folder of the pinned wheels (downloaded there if missing)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheels or Path(tmp)
        wheels.mkdir(parents=True, exist_ok=True)
        download(PINS, wheels)
        rows, table = [], []
        for pin in PINS:
            name, version = pin.split("==")
            stem = re.sub(r"[-_.]+", "_", name).lower()
            wheel = next(w for w in sorted(wheels.glob("*.whl"))
                         if w.name.lower().startswith(f"{stem}-{version}-"))
            headers, expected = headers_and_expected(metadata_text(wheel))
            rows.append({"id": f"{name}-{version}", "category": "json_extraction",
                         "prompt": INSTRUCTION.format(headers=headers), "schema": SCHEMA,
                         "expected": expected})
            table.append(f"| {pin} | `{wheel.name}` | "
                         f"`{hashlib.sha256(wheel.read_bytes()).hexdigest()}` |")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "extract.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (OUT_DIR / "wheels.md").write_text(
        "# The wheels the extraction prompts were read from\n\n| pin | wheel | sha256 |\n"
        "|---|---|---|\n" + "\n".join(table) + "\n")
    print(f"wrote {len(rows)} rows to {OUT_DIR / 'extract.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
