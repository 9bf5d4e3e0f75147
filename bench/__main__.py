"""``python -m bench [name ...] [--repeat N] [--json PATH]``: run the bench modules in this folder
(or the named ones), print one table, then the results as JSON (also written to PATH when given).
Exit status 1 when a target is missed or a module fails. Convention: bench/README.md."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import numbers
import pkgutil
import shutil
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import Context, Result

HERE = Path(__file__).resolve().parent


def discover() -> list[str]:
    """Modules of bench/ that are benches: not private (``_x``), and exposing ``async def run(ctx)``
    or ``def main()``. Anything else (e.g. a helper process's module) is not run."""
    names = []
    for info in pkgutil.iter_modules([str(HERE)]):
        if info.name.startswith("_") or info.ispkg:
            continue
        if _entry(importlib.import_module(f"bench.{info.name}")) is not None:
            names.append(info.name)
    return sorted(names)


def _entry(module: ModuleType) -> str | None:
    if inspect.iscoroutinefunction(getattr(module, "run", None)):
        return "run"
    if callable(getattr(module, "main", None)) and not inspect.signature(module.main).parameters:
        return "main"
    return None


def _flatten(prefix: str, value: Any) -> list[Result]:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, dict)):
        return []
    if isinstance(value, dict):
        return [r for k, v in value.items() for r in _flatten(f"{prefix}.{k}" if prefix else str(k), v)]
    return [Result(prefix, float(value), "s" if prefix.endswith("_s") else "")]


async def run_module(name: str, ctx: Context) -> list[Result]:
    module = importlib.import_module(f"bench.{name}")
    if _entry(module) == "run":
        results = list(await module.run(ctx))
    else:  # the simple form: main() -> dict of numbers, run in a thread
        results = _flatten("", await asyncio.to_thread(module.main))
    for result in results:
        result.bench = name
    return results


def table(results: list[Result]) -> str:
    rows = [("bench", "metric", "value", "unit", "target", "ok", "note")]
    for r in results:
        ok = "" if r.ok is None else ("yes" if r.ok else "NO")
        rows.append((r.bench, r.metric, f"{r.value:.4g}", r.unit, r.target, ok, r.note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(line.rstrip() for line in lines)


async def main_async(args: argparse.Namespace) -> int:
    available = discover()
    unknown = sorted(set(args.names) - set(available))
    if unknown:
        print(f"unknown bench module(s): {', '.join(unknown)}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    ctx = Context(repeat=args.repeat)
    results: list[Result] = []
    failures: dict[str, str] = {}
    try:
        for name in args.names or available:
            started = time.monotonic()
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            try:
                results += await run_module(name, ctx)
            except Exception:  # one broken module does not hide the others' numbers
                failures[name] = traceback.format_exc()
                print(failures[name], file=sys.stderr)
            print(f"[bench] {name} done in {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)
    finally:
        await ctx.close()
        if args.keep:
            print(f"[bench] scratch directory kept: {ctx.root}", file=sys.stderr)
        else:
            shutil.rmtree(ctx.root, ignore_errors=True)
    print(table(results))
    text = json.dumps({"results": [r.as_dict() for r in results], "failed_modules": failures}, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if failures or any(r.ok is False for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="Run gpudra's benchmarks.")
    parser.add_argument("names", nargs="*", help="bench modules to run (default: all of them)")
    parser.add_argument("--repeat", type=int, default=10, help="repetitions per measurement (default: %(default)s)")
    parser.add_argument("--json", help="also write the JSON results to this file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (agent logs etc.)")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
