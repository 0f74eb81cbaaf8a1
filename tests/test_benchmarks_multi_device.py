"""benchmarks/multi_device.py runs end to end in its quick mode (so the script cannot rot),
writes the JSON it returns, and its numbers hang together: tokens/s, speedups and scaling
efficiencies follow from the makespans, every multi-device plan was verified and fits
its budget, each strategy is measured with its links staged through the host and sent
direct, and the auto row of each work, device count and way of sending is its fastest
strategy's."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from memgraph.placement import STRATEGIES

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_device.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("multi_device_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["multi_device_bench"] = module  # dataclasses look it up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["multi_device_bench"]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def test_quick_run_writes_its_json_and_the_numbers_hang_together(bench, tmp_path, capsys):
    out = tmp_path / "multi.json"
    result = bench.main(["--quick", "--json", str(out)])
    assert result["sends"] == "both"
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    printed = capsys.readouterr().out
    assert printed.count("anchor (") == len(bench.ANCHORS)
    assert result["strategies"] == list(STRATEGIES)

    rows = result["rows"]
    setting = result["setting"]
    devices = tuple(setting["devices"])
    works = {(r["work"], r["variant"]) for r in rows}
    assert len(works) == 3 + len(setting["gen_batches"])  # 3 prefills, the generations
    for work, variant in works:
        for n in devices:
            key = (work, variant, n)
            here = [r for r in rows if (r["work"], r["variant"], r["devices"]) == key]
            if n == 1:
                assert [(r["strategy"], r["sends"]) for r in here] == [("one device", "none")]
                continue
            for sends in ("host", "direct"):
                these = [r for r in here if r["sends"] == sends]
                placed = {r["strategy"]: r for r in these if not r["strategy"].startswith("auto")}
                (auto,) = [r for r in these if r["strategy"].startswith("auto: ")]
                assert set(placed) | set(auto["refused"]) == set(STRATEGIES)
                fastest = min(placed.values(), key=lambda r: r["makespan"])
                assert auto["strategy"] == "auto: " + fastest["strategy"]
                assert auto["makespan"] == fastest["makespan"]
            # The same strategies measured both ways, on the same compiled plans: the
            # direct ones are those rewritten, their links the same.
            ways = {(r["strategy"], r["sends"]): r for r in here}
            for (strategy, sends), r in ways.items():
                if sends == "direct" and not strategy.startswith("auto"):
                    staged = ways[(strategy, "host")]
                    assert (r["links"], r["sent_bytes"]) == (staged["links"], staged["sent_bytes"])
    columns = {
        "work", "variant", "devices", "weights", "sends", "links", "direct_links",
        "direct_bytes", "tokens", "makespan", "tokens_per_s", "speedup", "efficiency",
        "efficiency_vs_2", "host_link_bytes", "sent_bytes", "peak_bytes", "budget",
        "planning_seconds", "verified",
    }  # fmt: skip
    for r in rows:
        assert columns <= set(r)
        assert r["verified"] is True
        assert r["weights"] in ("host", "device")
        assert r["budget"] == 80 * 10**9 - bench.RESERVE == result["budget"]
        assert len(r["peak_bytes"]) == r["devices"] and max(r["peak_bytes"]) <= r["budget"]
        assert r["makespan"] > 0 and close(r["tokens_per_s"] * r["makespan"], r["tokens"])
        assert r["makespan"] >= max(r["compute_seconds"])  # no device computes faster
        one = min(x["makespan"] for x in rows if x["work"] == r["work"] and x["devices"] == 1)
        assert close(r["speedup"], one / r["makespan"])
        assert close(r["efficiency"], r["speedup"] / r["devices"])
        family = "auto" if r["strategy"].startswith("auto") else r["strategy"]
        same = {
            x["devices"]: x["makespan"]
            for x in rows
            if (x["work"], x["variant"], x["sends"]) == (r["work"], r["variant"], r["sends"])
            and ("auto" if x["strategy"].startswith("auto") else x["strategy"]) == family
        }
        if r["devices"] == 1:
            assert r["efficiency_vs_2"] is None and r["sent_bytes"] == 0
            assert r["sends"] == "none" and r["links"] == r["direct_links"] == 0
        else:
            assert close(r["efficiency_vs_2"], same[2] / r["makespan"] / (r["devices"] / 2))
            assert r["sent_bytes"] > 0  # devices send activations (or partial sums)
            if r["sends"] == "host":
                assert r["direct_links"] == r["direct_bytes"] == 0
            else:
                assert 0 < r["direct_links"] <= r["links"]
                assert 0 < r["direct_bytes"] <= r["sent_bytes"]
            # what is staged crosses the host links twice (out of one device, into the
            # next); what is sent direct goes over NVLink, not the host links
            assert r["host_link_bytes"] >= 2 * (r["sent_bytes"] - r["direct_bytes"])
    for work in {r["work"] for r in rows}:  # the fastest one-device plan is the reference
        ones = [r for r in rows if r["work"] == work and r["devices"] == 1]
        assert max(r["speedup"] for r in ones) == 1.0
    batch = setting["batch"]
    work = f"prefill {batch}x{setting['prompt']}"
    micro = next(r for r in rows if r["work"] == work and r["variant"] != "one batch")
    whole = next(r for r in rows if r["work"] == work and r["variant"] == "one batch")
    assert micro["variant"] == f"{batch} micro-batches" and micro["tokens"] == whole["tokens"]
    assert micro["tasks"] > (batch - 1) * whole["tasks"]  # each micro-batch's own tasks


def test_weights_can_be_fixed_on_the_host_and_links_staged_through_it(bench, capsys):
    result = bench.main(["--quick", "--weights", "host", "--sends", "host"])
    assert {r["weights"] for r in result["rows"]} == {"host"}
    assert {r["sends"] for r in result["rows"]} == {"host", "none"}
    assert (result["weights"], result["sends"]) == ("host", "host")
    assert all(r["direct_links"] == 0 for r in result["rows"])
    capsys.readouterr()


def test_the_table_prints_one_line_per_row_and_as_markdown(bench):
    rows = bench.run(bench.QUICK, "device", log=lambda line: None, sends="direct")
    assert {r.sends for r in rows} == {"direct", "none"}
    text = bench.format_table(rows).splitlines()
    assert len(text) == 1 + len(rows)
    column = bench.HEADER.index("sends")
    labels = [row[column] for row in bench.table_rows(rows)[1:]]
    for r, label in zip(rows, labels, strict=True):
        assert label == ("-" if r.devices == 1 else f"direct {r.direct_links}/{r.links}")
    markdown = bench.format_table(rows, markdown=True).splitlines()
    assert len(markdown) == 2 + len(rows) and markdown[1].startswith("|---|")
    assert all(line.count("|") == len(bench.HEADER) + 1 for line in markdown)
