"""Micro-batches: several TaskGraphs side by side in one, sharing their weights.

`stack(graphs)` makes one TaskGraph that computes every graph of `graphs` (the
micro-batches: typically one program built for several slices of a batch) and reads
each weight once. Placed on a pipeline of devices (`memgraph.placement`), whose
executors are dependency-driven, device 0 works on micro-batch 1 while device 1 works
on micro-batch 0: the pipe fills.

* **Shared inputs**: an `Input` with role "weight" (a typed field: names are never
  parsed) whose name appears in every graph, with the same op (shape, dtype, role,
  location, domain) in each, is one task of the stacked graph, keeping its name. The
  same name with another shape, dtype or op is a `GraphError` naming the input and the
  two. A weight's name that some graph lacks is not shared: each graph's is its own.
* **Renamed**: every other input and every output of graph k is named `{name}@{k}` (or,
  if that is taken, `{name}@{k}#1`, `#2`, ...). The suffix is a label for people:
  `Stacked.inputs` and `Stacked.outputs` map (graph k, original name) to the new name,
  so no caller parses it.
* **Order**: graph 0's tasks, then graph 1's (less the shared weights, which graph 0
  already has), ...; each graph's tasks keep their order, so the stacked graph's order is
  topological. Every task keeps its scope, label, workspace and facts (renumbered with
  its graph's ids: `Fact.renumbered`; a fact about a shared weight names the one shared
  task). A block's `of` (a task of the graph before partitioning) is shifted per graph
  so that blocks of two graphs never name one original task.
* **Refused**: an `Update` fact about a shared weight (two micro-batches of a training
  step each making the weight's next value: accumulating their gradients is not built).
  Facts without a task reference (a `KVPage`, `ChosenIds`) are kept as stated, once per
  graph: stacking is for programs run once (prefill, an unrolled generation), not for the
  step plans of a generation loop, which looks its pages up by those facts.

>>> import einpage as ep
>>> prog = ep.Program("mlp")
>>> x = prog.input("x", (1, 4))
>>> prog.output(ep.tanh(x @ prog.input("w", (4, 4), role="weight")), "y")
>>> tg = prog.build()
>>> both = stack([tg, tg])
>>> list(both.tg.inputs), list(both.tg.outputs)
(['x@0', 'w', 'x@1'], ['y@0', 'y@1'])
>>> both.inputs[1, "x"], both.inputs[1, "w"], both.outputs[0, "y"]
('x@1', 'w', 'y@0')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from einpage_core.errors import GraphError
from taskgraph.builder import GraphBuilder, fresh_name
from taskgraph.facts import Update
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, with_blocks

__all__ = ["Stacked", "stack", "shared_weights"]


@dataclass(frozen=True, eq=False)
class Stacked:
    """What `stack` made: the stacked TaskGraph `tg`; `inputs` and `outputs`, (graph k,
    original name) -> the name in `tg` (a shared weight keeps its name); `task_ids[k][i]`,
    the id in `tg` of graph k's task i."""

    tg: TaskGraph
    inputs: Mapping[tuple[int, str], str]
    outputs: Mapping[tuple[int, str], str]
    task_ids: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))
        object.__setattr__(self, "outputs", MappingProxyType(dict(self.outputs)))

    @property
    def graphs(self) -> int:
        """How many graphs were stacked."""
        return len(self.task_ids)

    def stacked_inputs(self, arrays: Sequence[Mapping[str, object]]) -> dict[str, object]:
        """The stacked graph's inputs from each graph's own (`arrays[k]`: original name ->
        array): a shared weight is taken from graph 0's. `GraphError` naming a missing
        input."""
        if len(arrays) != self.graphs:
            raise GraphError(f"{len(arrays)} input sets given for {self.graphs} stacked graphs")
        result: dict[str, object] = {}
        for (k, name), new in self.inputs.items():
            if new in result:
                continue
            if name not in arrays[k]:
                raise GraphError(f"input {name!r} of stacked graph {k} is not given")
            result[new] = arrays[k][name]
        return result

    def split_outputs(self, values: Mapping[str, object]) -> list[dict[str, object]]:
        """The stacked graph's outputs `values` (name in `tg` -> value) as one dict per
        graph, by original names."""
        per_graph: list[dict[str, object]] = [{} for _ in range(self.graphs)]
        for (k, name), new in self.outputs.items():
            per_graph[k][name] = values[new]
        return per_graph

    def __repr__(self) -> str:
        shared = sum(1 for (k, name), new in self.inputs.items() if k == 0 and name == new)
        return f"<Stacked graphs={self.graphs} shared={shared} {self.tg!r}>"


def shared_weights(graphs: Sequence[TaskGraph]) -> list[str]:
    """The names of the inputs `stack` shares: role "weight" in graph 0, and an input of
    that name in every graph, which must be the same op (shape and dtype too); in graph
    0's order. `GraphError` naming the input, the graphs and both ops on a mismatch."""
    first = graphs[0]
    names = []
    for name, task_id in first.inputs.items():
        task = first[task_id]
        if task.op.role != "weight" or not all(name in g.inputs for g in graphs[1:]):
            continue
        for k, graph in enumerate(graphs[1:], start=1):
            other = graph[graph.inputs[name]]
            if (other.op, other.shape, other.dtype) != (task.op, task.shape, task.dtype):
                raise GraphError(
                    f"weight {name!r} differs between stacked graphs 0 and {k}: "
                    f"{task.dtype}{list(task.shape)} {task.op.describe()} in graph 0, "
                    f"{other.dtype}{list(other.shape)} {other.op.describe()} in graph {k}; "
                    f"a weight shared by micro-batches must be the same input in each"
                )
        names.append(name)
    return names


def stack(graphs: Sequence[TaskGraph], name: str | None = None) -> Stacked:
    """`graphs` side by side in one TaskGraph, sharing their weights (see the module
    docstring); `name` names it (default: the first graph's name and `xN`).

    Raises `GraphError` for no graphs, something that is not a TaskGraph, a weight that
    differs between graphs, or an `Update` of a shared weight.
    """
    graphs = list(graphs)
    if not graphs:
        raise GraphError("stack needs at least one TaskGraph")
    for k, graph in enumerate(graphs):
        if not isinstance(graph, TaskGraph):
            raise GraphError(f"stack: graph {k} is a {type(graph).__name__}, not a TaskGraph")
    shared = shared_weights(graphs)
    taken = set(shared)
    builder = GraphBuilder(name or f"{graphs[0].name}x{len(graphs)}")
    blocks = []
    shared_id: dict[str, int] = {}
    inputs: dict[tuple[int, str], str] = {}
    outputs: dict[tuple[int, str], str] = {}
    task_ids = []
    block_offset = 0
    for k, graph in enumerate(graphs):
        new_id: dict[int, int] = {}
        for task in graph:
            op = task.op
            if isinstance(op, Input):
                if op.name in shared_id:
                    new_id[task.id] = shared_id[op.name]
                    inputs[k, op.name] = op.name
                    continue
                new_name = op.name if op.name in shared else fresh_name(f"{op.name}@{k}", taken)
                inputs[k, op.name] = new_name
                op = replace(op, name=new_name)
            facts = []
            for fact in task.facts:
                renumbered = fact.renumbered(new_id)
                if renumbered is None:
                    continue
                if isinstance(fact, Update) and graph[fact.of].op.name in shared_id and k > 0:
                    raise GraphError(
                        f"graph {k}'s %{task.id} is the update of weight "
                        f"{graph[fact.of].op.name!r}, which the stacked graphs share; "
                        f"micro-batches of a training step would each make its next value "
                        f"(accumulating their gradients is not built)"
                    )
                facts.append(renumbered)
            new_id[task.id] = builder.add(
                op,
                [new_id[i] for i in task.inputs],
                task.shape,
                task.dtype,
                task.scope,
                task.label,
                facts,
                task.workspace,
            )
            if isinstance(op, Input) and op.name in shared:
                shared_id[op.name] = new_id[task.id]
            block = task.block
            blocks.append(None if block is None else replace(block, of=block.of + block_offset))
        block_offset += 1 + max((t.block.of for t in graph if t.block is not None), default=-1)
        for out_name, task_id in graph.outputs.items():
            new_name = fresh_name(f"{out_name}@{k}", taken)
            outputs[k, out_name] = new_name
            builder.output(new_id[task_id], new_name)
        task_ids.append(tuple(new_id[t.id] for t in graph))
    built = builder.build()
    if any(block is not None for block in blocks):
        built = TaskGraph(with_blocks(built.tasks, blocks), built.outputs, built.name)
    return Stacked(built, inputs, outputs, tuple(task_ids))

