"""The inspection tools on plans with direct sends: the memory map, the stream timeline,
traces of all devices, `MultiPlan` printing, `device_rows`, rendering and the CLI's
`plan`, `stats` and `render` of a plan file for several devices.

Every figure is checked against what the plan itself says (its links, its send and recv
nodes, their regions), counted here, not by the code under test.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import replace

import pytest
from cli_runner import cli

import einpage as ep
from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK, main
from einpage.models import llama
from einpage.pipeline import device_rows
from einpage_core.units import format_bytes
from memgraph import NodeKind
from memgraph.multi import MultiPlan, plan_devices
from memgraph.multi_serialize import read_multi_json
from memgraph.render import memgraph_dot
from memgraph.simulate_multi import simulate_multi
from memgraph.trace import PEER_STREAM, devices_chrome_trace, read_chrome_trace, to_chrome_trace

pytest.importorskip("matplotlib")

TINY = replace(llama.PRESETS["tiny"], num_layers=2)
PLAN_ARGS = [
    "plan",
    "llama:tiny",
    "--seq",
    "16",
    "--devices",
    "2",
    "-b",
    "60%",
    "--strategy",
    "tensor",
]


def chain_program(layers: int = 6) -> ep.Program:
    prog = ep.Program("chain")
    x = prog.input("x", (64, 64))
    for i in range(layers):
        x = ep.tanh(x @ prog.input(f"w{i}", (64, 64), role="weight"))
    prog.output(x, "y")
    return prog


@pytest.fixture(scope="module")
def chain():
    """The 6-layer chain on 3 devices, staged through the host and direct."""
    tg = chain_program().build()
    return plan_devices(tg, 3, 49152), plan_devices(tg, 3, 49152, sends="direct")


@pytest.fixture(scope="module")
def tensor():
    """LLaMA-tiny (2 layers) tensor parallel on 2 devices, staged and direct."""
    prog = llama.prefill_program(TINY, batch=1, seq=8)
    host = ep.compile_devices(prog, "100%", 2, strategy="tensor")
    direct = ep.compile_devices(prog, "100%", 2, strategy="tensor", sends="direct")
    return host.plan, direct.plan


def copies(mp: MultiPlan, device: int, kind: NodeKind) -> list:
    return [n for n in mp.plans[device].mg.nodes if n.kind is kind]


def direct_bytes(mp: MultiPlan, device: int, end: str) -> int:
    return sum(k.nbytes for k in mp.links if k.path == "peer" and getattr(k, end) == device)


def test_the_cases_have_direct_links(chain, tensor):
    for _, direct in (chain, tensor):
        assert direct.links and all(k.path == "peer" for k in direct.links)


# -- the memory map ------------------------------------------------------------------------


def _points(fig, gid: str) -> list[tuple[float, float]]:
    """The (x, y) of the markers of collection `gid`, rounded to 6 places."""
    found = [c for c in fig.axes[0].collections if c.get_gid() == gid]
    return [(round(float(x), 6), round(float(y), 6)) for c in found for x, y in c.get_offsets()]


@pytest.mark.parametrize("case", ["chain", "tensor"])
def test_memory_map_marks_each_receive_and_send_in_its_region(case, request):
    _, mp = request.getfixturevalue(case)
    for plan in mp.plans:
        mg = plan.mg
        fig = mg.memory_map()
        yscale = {"KiB": 1024, "MiB": 2**20}[fig.axes[0].get_ylabel().split("(")[1][:-1]]
        for kind, gid in ((NodeKind.RECV, "transfers:recv"), (NodeKind.SEND, "transfers:send")):
            nodes = copies(mp, plan.device, kind)
            expected = sorted(
                (round(n.id + 0.5, 6), round((n.region.offset + n.region.size / 2) / yscale, 6))
                for n in nodes
            )
            assert sorted(_points(fig, gid)) == expected
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        receives, sends = (len(copies(mp, plan.device, k)) for k in (NodeKind.RECV, NodeKind.SEND))
        if receives:
            assert f"recv (from another device): {receives}" in labels
        if sends:
            assert f"send (to another device): {sends}" in labels
        title = fig.axes[0].get_title()
        assert (
            f"direct to other devices: sent {format_bytes(direct_bytes(mp, plan.device, 'source'))}"
            f" ({sends}) · received {format_bytes(direct_bytes(mp, plan.device, 'target'))}"
            f" ({receives})"
        ) in title


def test_memory_map_of_a_host_staged_plan_has_no_copy_markers(chain):
    host, _ = chain
    for plan in host.plans:
        fig = plan.mg.memory_map()
        assert not _points(fig, "transfers:recv") and not _points(fig, "transfers:send")
        assert "direct to other devices" not in fig.axes[0].get_title()
        reloads = [n for n in plan.mg.nodes if n.kind is NodeKind.RELOAD]
        assert len(_points(fig, "transfers:reload")) == len(reloads)


# -- the numbers: what went direct is no offload or reload ---------------------------------


@pytest.mark.parametrize("case", ["chain", "tensor"])
def test_offloaded_and_reloaded_leave_out_what_goes_direct(case, request):
    host, direct = request.getfixturevalue(case)
    for before, after in zip(host.plans, direct.plans, strict=True):
        d = after.device
        sent, received = direct_bytes(direct, d, "source"), direct_bytes(direct, d, "target")
        assert after.mg.stats.offload_bytes == before.mg.stats.offload_bytes - sent
        assert after.mg.stats.reload_bytes == before.mg.stats.reload_bytes - received
        sends, receives = (len(copies(direct, d, k)) for k in (NodeKind.SEND, NodeKind.RECV))
        header = next(line for line in direct.lines(nodes=False) if line.startswith(f"device {d}:"))
        assert header.endswith(
            f", direct: sent {format_bytes(sent)} ({sends}), "
            f"received {format_bytes(received)} ({receives})"
        )
        assert "direct:" not in next(
            line for line in host.lines(nodes=False) if line.startswith(f"device {d}:")
        )


@pytest.mark.parametrize("case", ["chain", "tensor"])
def test_multiplan_printing_and_device_rows_say_what_went_direct(case, request):
    host, direct = request.getfixturevalue(case)
    total = sum(k.nbytes for k in direct.links)
    assert f" direct={len(direct.links)} ({format_bytes(total)}) " in repr(direct)
    assert " direct=" not in repr(host)
    lines = direct.lines(nodes=False)
    assert f"links ({len(direct.links)}, {len(direct.links)} direct):" in lines
    for index, link in enumerate(direct.links):
        assert f"  link#{index} {link.describe()}" in lines
    rows = device_rows(direct)
    column = rows[0].index("direct out/in")
    for plan, row in zip(direct.plans, rows[1:], strict=True):
        d = plan.device
        assert row[column] == (
            f"{format_bytes(direct_bytes(direct, d, 'source'))} / "
            f"{format_bytes(direct_bytes(direct, d, 'target'))}"
        )
    assert "direct out/in" not in device_rows(host)[0]


# -- timelines and traces ------------------------------------------------------------------


@pytest.mark.parametrize("case", ["chain", "tensor"])
def test_simulated_trace_of_all_devices_has_the_peer_lane_and_an_arrow_per_link(case, request):
    _, mp = request.getfixturevalue(case)
    sim = simulate_multi(mp, timeline=True)
    doc = devices_chrome_trace([r.events for r in sim.per_device], "t")
    records = doc["traceEvents"]
    lanes = {
        (r["pid"], r["tid"]): r["args"]["name"] for r in records if r.get("name") == "thread_name"
    }
    peer = [r for r in records if r["ph"] == "X" and lanes[(r["pid"], r["tid"])] == PEER_STREAM]
    assert len(peer) == 2 * len(mp.links)
    by_link = {}
    for r in peer:
        by_link.setdefault(r["args"]["link"], []).append(r)
        assert f"link#{r['args']['link']}" in r["name"]
    assert sorted(by_link) == list(range(len(mp.links)))
    for index, link in enumerate(mp.links):
        ends = {r["cat"]: r for r in by_link[index]}
        assert ends["send"]["pid"] == link.source + 1 and ends["recv"]["pid"] == link.target + 1
        assert ends["send"]["ts"] == ends["recv"]["ts"]  # one copy, one clock
        assert ends["send"]["dur"] == ends["recv"]["dur"]
        flows = [r for r in records if r.get("cat") == "link" and r["id"] == index]
        assert sorted((f["ph"], f["pid"]) for f in flows) == [
            ("f", link.target + 1),
            ("s", link.source + 1),
        ]
    names = {r["args"]["name"] for r in records if r.get("name") == "process_name"}
    assert names == {f"t device {d}" for d in range(mp.devices)}
    # one device alone: its own trace has the lane, and reads back with it
    for d, result in enumerate(sim.per_device):
        events = read_chrome_trace(to_chrome_trace(result.events))
        on_peer = [e for e in events if e.stream == PEER_STREAM]
        assert len(on_peer) == len(copies(mp, d, NodeKind.SEND)) + len(copies(mp, d, NodeKind.RECV))


def test_stream_timeline_draws_the_peer_lane(chain):
    _, mp = chain
    sim = simulate_multi(mp, timeline=True)
    from memgraph.plots import stream_timeline

    for d, result in enumerate(sim.per_device):
        fig = stream_timeline(result.events)
        ax = fig.axes[0]
        assert "peer (send/recv)" in [t.get_text() for t in ax.get_yticklabels()]
        bars = [c for c in ax.collections if c.get_gid() == f"stream:{PEER_STREAM}"]
        expected = len(copies(mp, d, NodeKind.SEND)) + len(copies(mp, d, NodeKind.RECV))
        assert sum(len(c.get_paths()) for c in bars) == expected
        assert "peer busy" in ax.get_title()


# -- rendering -----------------------------------------------------------------------------


def test_a_folded_layer_names_the_links_it_sends_and_receives(tensor):
    _, mp = tensor
    for plan in mp.plans:
        dot = memgraph_dot(plan.mg)  # layers folded by default
        sent = {int(i) for line in re.findall(r"sends (link#[^<]*)", dot)
                for i in re.findall(r"link#(\d+)", line)}  # fmt: skip
        received = {int(i) for line in re.findall(r"receives (link#[^<]*)", dot)
                    for i in re.findall(r"link#(\d+)", line)}  # fmt: skip
        assert sent == {n.link for n in copies(mp, plan.device, NodeKind.SEND)}
        assert received == {n.link for n in copies(mp, plan.device, NodeKind.RECV)}


# -- the command line ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """`einpage plan ... --sends direct -o two.json --trace sim.json`: its output and files."""
    folder = tmp_path_factory.mktemp("direct")
    path, trace = folder / "two.json", folder / "sim.json"
    out = io.StringIO()  # a module fixture cannot use capsys
    with contextlib.redirect_stdout(out):
        code = main([*PLAN_ARGS, "--sends", "direct", "-o", str(path), "--trace", str(trace)])
    assert code == EXIT_OK
    return path, trace, out.getvalue()


def test_cli_plan_lists_the_direct_links_and_writes_a_trace_of_all_devices(plan_file):
    path, trace, out = plan_file
    mp = read_multi_json(path.read_text(encoding="utf-8")).plan
    assert mp.links and all(k.path == "peer" for k in mp.links)
    assert f"links ({len(mp.links)}, {len(mp.links)} direct)" in out
    for index, link in enumerate(mp.links):
        assert f"link#{index} {link.describe()}" in out
    records = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
    lanes = {
        (r["pid"], r["tid"]): r["args"]["name"] for r in records if r.get("name") == "thread_name"
    }
    peer = [r for r in records if r["ph"] == "X" and lanes[(r["pid"], r["tid"])] == PEER_STREAM]
    assert len(peer) == 2 * len(mp.links)
    assert sum(1 for r in records if r.get("cat") == "link" and r["ph"] == "s") == len(mp.links)
    assert {r["pid"] for r in records} == set(range(1, mp.devices + 1))


def test_cli_stats_names_the_direct_links_and_counts_their_bytes(plan_file, capsys):
    path, _, _ = plan_file
    mp = read_multi_json(path.read_text(encoding="utf-8")).plan
    code, out, err = cli(capsys, "stats", path)
    assert code == EXIT_OK, err
    assert f"direct: {len(mp.links)} of {len(mp.links)} links device to device" in out
    for index, link in enumerate(mp.links):
        assert f"link#{index} {link.describe()}" in out
        assert link.describe().endswith(" direct")
    code, out, err = cli(capsys, "stats", path, "--json")
    assert code == EXIT_OK, err
    document = json.loads(out)
    assert document["direct_links"] == len(mp.links)
    assert document["direct_bytes"] == sum(k.nbytes for k in mp.links)
    assert [(k["source"], k["target"], k["path"]) for k in document["link_list"]] == [
        (k.source, k.target, k.path) for k in mp.links
    ]
    for row in document["per_device"]:
        d = row["device"]
        assert row["direct_sent_bytes"] == direct_bytes(mp, d, "source")
        assert row["direct_received_bytes"] == direct_bytes(mp, d, "target")


def test_cli_render_draws_one_device_of_a_multi_plan_file(plan_file, capsys, tmp_path):
    path, _, _ = plan_file
    mp = read_multi_json(path.read_text(encoding="utf-8")).plan
    for device in range(mp.devices):
        picture = tmp_path / f"d{device}.dot"
        code, out, err = cli(capsys, "render", path, "--device", device, "--unfold", "-o", picture)
        assert code == EXIT_OK, err
        dot = picture.read_text(encoding="utf-8")
        assert "send (to another device)" in dot and "recv (from another device)" in dot
        mine = [i for i, k in enumerate(mp.links) if device in (k.source, k.target)]
        shown = {int(i) for i in re.findall(r"link#(\d+)", dot)}
        assert shown == set(mine)
        for index in mine:
            assert f"link#{index} {mp.links[index].describe()}" in out
    svg = tmp_path / "d0.svg"
    code, _, err = cli(capsys, "render", path, "--device", 0, "-o", svg)
    assert code == EXIT_OK, err
    text = svg.read_text(encoding="utf-8")  # layers folded: their boxes name the links
    mine = {i for i, k in enumerate(mp.links) if 0 in (k.source, k.target)}
    assert {int(i) for i in re.findall(r"link#(\d+)", text)} == mine
    assert "sends link#" in text and "receives link#" in text


def test_cli_render_refusals_say_how(plan_file, capsys, tmp_path):
    path, _, _ = plan_file
    code, _, err = cli(capsys, "render", path, "-o", tmp_path / "x.dot")
    assert code == EXIT_BAD_INPUT and "--device D" in err and "Traceback" not in err
    code, _, err = cli(capsys, "render", path, "--device", 2, "-o", tmp_path / "x.dot")
    assert code == EXIT_BAD_INPUT and "a plan for 2 devices, 0..1" in err
    one = tmp_path / "one.json"
    code, _, err = cli(capsys, "plan", "llama:tiny", "--seq", "16", "-b", "60%", "-o", one)
    assert code == EXIT_OK, err
    code, _, err = cli(capsys, "render", one, "--device", 0, "-o", tmp_path / "x.dot")
    assert code == EXIT_BAD_INPUT and "is a plan for one device" in err
    code, _, err = cli(capsys, *PLAN_ARGS, "--memory-map", tmp_path / "m.png")
    assert code == EXIT_BAD_INPUT and "einpage render PLAN.json --device D" in err
