"""How fast plans are written and read: what `einpage plan -o` and `einpage run`/`stats`
spend on the JSON file of a plan, on plans of about 1, 7 and 100 MB.

Run: `python benchmarks/json_bench.py [--quick] [--before REV] [--repeat N] [--json out.json]`.

* Plans: the `mlp` preset compiled by `einpage.compile` at 4 MiB, 1 MiB and 204 KiB (the
  last partitions it into 100,077 tasks and 594,387 nodes: a 100 MB file; planning it
  takes about 40 s). `--quick`: `mlp` at 4 MiB and `llama:tiny` at 30%.
* Each plan is written once by this tree's code; then each tree measured loads that
  file and writes it back, in a fresh Python process of its own (so the planner's
  objects do not weigh on the collector), `--repeat` times, best time kept: "load" is
  `einpage.files.load_plan(path)` (read, parse, validate: what `einpage run` does),
  "save" is `einpage.files.save_plan(mg, path)`, or where a tree has none (before it),
  `path.write_text(mg.to_json())` as its CLI did. "same bytes" says the file written
  back equals the file read, byte for byte. The table gives wall-clock seconds; the JSON
  also the process's CPU seconds (`*_cpu_s`), steadier on a machine shared with others.
* `--before REV` measures the tree of git revision REV too (`git archive`, into a
  temporary folder), side by side on the same files: the old code against the new.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("einpage", "einpage_core", "memgraph", "taskgraph", "runtime")
PLANS = [("mlp", "4MiB"), ("mlp", "1MiB"), ("mlp", "204KiB")]
QUICK_PLANS = [("mlp", "4MiB"), ("llama:tiny", "30%")]


def measure(path: Path, repeat: int) -> dict[str, Any]:
    """Best-of-`repeat` seconds to load the plan at `path` and to save it again, with the
    code on `sys.path` (this tree's or an older revision's)."""
    from einpage import files

    save_plan = getattr(files, "save_plan", None)
    again = path.with_name(f"{path.stem}.again{path.suffix}")
    times: dict[str, list[float]] = {"load_s": [], "load_cpu_s": [], "save_s": [], "save_cpu_s": []}
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        mg = files.load_plan(path)
        times["load_s"].append(time.perf_counter() - start)
        times["load_cpu_s"].append(time.process_time() - cpu)
        start, cpu = time.perf_counter(), time.process_time()
        if save_plan is not None:
            save_plan(mg, again)
        else:  # before save_plan: what `einpage plan -o` did
            again.write_text(mg.to_json(), encoding="utf-8")
        times["save_s"].append(time.perf_counter() - start)
        times["save_cpu_s"].append(time.process_time() - cpu)
        del mg
    same = again.read_bytes() == path.read_bytes()
    again.unlink()
    return {**{key: min(values) for key, values in times.items()}, "same_bytes": same}


def measure_in_process(tree: Path, path: Path, repeat: int) -> dict[str, Any]:
    """`measure` in a fresh interpreter whose project packages come from `tree`."""
    command = [sys.executable, __file__, "--measure", str(path), "--tree", str(tree)]
    command += ["--repeat", str(repeat)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"measuring {path} with {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_revision(revision: str, folder: Path) -> Path:
    """The project's packages at git `revision`, extracted under `folder`."""
    archive = folder / "tree.tar"
    with archive.open("wb") as handle:
        subprocess.run(
            ["git", "archive", "--format=tar", revision, *PACKAGES],
            cwd=ROOT,
            stdout=handle,
            check=True,
        )
    tree = folder / "tree"
    with tarfile.open(archive) as tar:  # git's own archive; the "data" filter where it exists
        tar.extractall(tree, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return tree


def write_plan(preset: str, budget: str, path: Path) -> dict[str, Any]:
    """Compile `preset` under `budget` and write its plan to `path` with this tree."""
    import einpage as ep
    from einpage.files import save_plan
    from einpage.presets import load_program

    start = time.perf_counter()
    mg = ep.compile(load_program(preset), budget).plan
    planned = time.perf_counter() - start
    save_plan(mg, path)
    return {
        "plan": f"{preset} @ {budget}",
        "nodes": len(mg),
        "tasks": len(mg.taskgraph),
        "bytes": path.stat().st_size,
        "compile_s": planned,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="two small plans (seconds)")
    parser.add_argument("--before", metavar="REV", help="also measure git revision REV")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many (3)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.tree))
    if args.measure is not None:  # the child process of measure_in_process
        print(json.dumps(measure(args.measure, args.repeat)))
        return 0

    rows = []
    with tempfile.TemporaryDirectory(prefix="json-bench-") as scratch:
        folder = Path(scratch)
        trees = {"now": ROOT}
        if args.before:
            trees["before"] = export_revision(args.before, folder)
        print("| plan | nodes | file | " + " | ".join(
            f"{name} save s | {name} load s" for name in trees
        ) + " | same bytes |")  # fmt: skip
        print("|---|---|---|" + "---|---|" * len(trees) + "---|")
        for number, (preset, budget) in enumerate(QUICK_PLANS if args.quick else PLANS):
            path = folder / f"plan{number}.json"
            row = write_plan(preset, budget, path)
            for name, tree in trees.items():
                row[name] = measure_in_process(tree, path, args.repeat)
            path.unlink()
            rows.append(row)
            times = " | ".join(
                f"{row[name]['save_s']:.2f} | {row[name]['load_s']:.2f}" for name in trees
            )
            same = all(row[name]["same_bytes"] for name in trees)
            print(
                f"| {row['plan']} | {row['nodes']:,} | {row['bytes'] / 1e6:.1f} MB | {times} | "
                f"{'yes' if same else 'NO'} |"
            )
    if args.json:
        document = {"before": args.before, "repeat": args.repeat, "rows": rows}
        args.json.write_text(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
