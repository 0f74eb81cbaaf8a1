"""Partitioning (fine-grained paging): split large tasks into blocks that fit a byte limit.

Offloading whole tensors cannot help when one task's operands and output alone exceed
device memory (attention scores of LLaMA-7B at batch 8, sequence 4096 are 8 GiB each).
`partition(tg, limit)` rewrites a TaskGraph so that the *working set* of every task –
the bytes of its distinct operands plus its output – is at most `limit`, by cutting
large tasks into block tasks over boxes of their iteration space. The result is an
ordinary TaskGraph (built with `GraphBuilder`): the evaluator, the planner and the
runtime use it unchanged, and every task carries a `Block` saying which original task
and which region of it it holds.

Terms
-----
* The *dims* of a task are its output axes, plus, for an einsum, its reduced indices.
  A block is a box over the dims. Splitting a reduced index gives *partial* aggregates
  that a following einsum combines with the same `agg`; this is valid for sum, max,
  min and prod whatever the join, because the join is applied per point and only then
  aggregated.
* Working set (`working_set`): distinct operands (an operand read twice counts once)
  plus the output. A view aliases its operand, so it counts its bytes once. A Slice
  that reads an Input directly is an *input block*: it counts only its output, since a
  planner can load that region straight from host storage (an input that alone
  exceeds the limit must be consumed in such blocks). Input tasks themselves are host
  storage and have no limit.

Algorithm
---------
1. **Feasibility.** `min_block_bytes(tg, t)` is the working set of task t's finest
   block: every dim that may be split cut to one element (reduced dims too, so partials
   need a combine of three). When every task is split so, each region a block reads is
   exactly one producer block, so the finest split needs no assembly and always works.
   If the limit is below the largest, `BlockLimitError` says which task needs how much.
2. **Which tasks split.** Tasks over the limit are *forced*. A task that fits is split
   too (*absorbed*), unless it is a program output, when it reads a split task or when
   every task reading it is split: its blocks then take the producer blocks, or feed
   the consumer blocks, directly. Left whole, it would read the producer's blocks
   concatenated (a copy of all of it), or stay resident while every consumer block
   reads a slice of it (a copy each). Split tasks connected as producer and consumer
   form *components*.
3. **Alignment classes.** Within a component the dims that index the same data are
   unified with a weighted union-find: einsum letters, a concat's other axes, a slice's
   full axes, a gather's id and column axes, a view's unchanged axes, and a view's
   split/merged leading axes with a unit (`[b, s, h*e] -> [b, s, h, e]` links `h` to
   the merged axis in units of `e`). A class has one block size, so blocks flow from
   producer to consumer without reassembly. A link that would put two dims of one task
   into one class is refused – attention's query and key positions both come from the
   sequence axis of the residual stream – so those dims stay independent (and meet
   through assembly if both are split). Links are made core first (forced tasks in
   topological order, then absorbed tasks nearest to the core), so the refusal falls on
   the absorbed side.
4. **Block sizes,** per component. Start unsplit; while the worst task (largest working
   set relative to the limit) does not fit, halve one block size among its dims:

   * the split that shrinks that task's working set most wins; among near ties (within
     10%) the outermost dim (batch before heads before queries: outer blocks are
     contiguous bytes);
   * a class with a refused link counts half (a split there costs assembly), and so does
     a class that other tasks reduce (it gives them partial aggregates, and a softmax
     chain loses its block-by-block flow);
   * when more tasks reduce a class than the worst task has neighbours in it, the dim is
     split for that task alone (a *private* split, also counted half), costing assembly
     only where the task meets its neighbours: the embedding gather, whose table column
     must shrink, splits the hidden axis privately instead of giving every norm and
     projection of the residual stream partials, while attention's head axis, reduced
     only by the output projection, is split for the whole chain.

   Then *relax*: grow each class's block size, then each private one, as far as every
   task still fits – the largest blocks that fit, merging back blocks the greedy made
   needlessly small – and even the blocks out (`ceil(E / count)`). Attention ends up
   split by batch, heads and query blocks; the softmax's key index, reduced by three of
   its einsums, is split last of all.
5. **Materialize** in topological order. Each block reads, per operand, the region its
   box needs: the producer's block itself when aligned; otherwise explicit assembly
   (`Block.kind == "assembly"`): a Slice of one block (or of a whole task, or of an
   input), and Concats of several pieces, one axis at a time. Assembly is cached per
   region, so consumers that read the same region share it. A block of a Slice or
   Concat task that is exactly one producer block is a View of it (an alias, no copy).
   Partials are combined by
   einsums `"X,X,...->X"` whose join is `a + b + ...`, `max(max(a, b), ...)`, `min(...)`
   or the product, each with as many operands as fit the limit (at most 26).
6. **Check.** The working sets of all new tasks are measured. Assembly that does not fit
   (a Slice of a whole producer too large to sit beside the slice, a Concat of more
   pieces than fit) makes the responsible original task split, or split finer (its
   target is halved, and it is split on even where the model of step 4 sees no gain),
   and steps 2-5 run again; a LLaMA-like graph needs no second round.
7. **Order.** Tasks are emitted inputs first. Then, for each original task that reads a
   weight (in topological order), all its blocks run together – the weight is loaded
   once for all of them – each block pulling what it needs depth first; outputs and the
   rest follow likewise. So weight-free chains between weight-reading tasks (attention
   scores, mask, softmax, attention output) run block by block up to their consumer,
   and an 8 GiB intermediate is never live whole, while layers still run one after the
   other (a pure depth-first order from the outputs would run one batch block through
   all layers before the next and reload every weight once per block).

Program outputs keep their names. A split output is rebuilt by Concat tasks of kind
`"output"` (one axis at a time, nested; their leaves are the output's blocks): run on
the device they would need twice the output's bytes, and they are the one exception
to the limit. The planner runs them on the host instead when nothing else reads the
blocks (`taskgraph.assembly`): each block is copied into its box of the output's host
array as soon as it is computed, so the output is never on the device whole.

Views: a view block is a view of the operand region its box maps to. Axes of a view
that keep their size, and the leading axis of a split or merged group, may be split
(the merged axis only at multiples of the inner size); the other axes of such a group,
and every axis of a group that regroups dims (`[6, 4] -> [4, 6]`), stay whole, so that
the region is always a box. When the producer's blocks do not match that region, the
region is assembled.

Modules
-------
* `geometry`: boxes and the records of what partitioning knows of a task (its dims,
  working-set tensors, links);
* `rules`: the partition rule of each op kind – its geometry and how it makes one
  block (`RULES`, an `OpTable`: a new op kind without a rule fails at import);
* `feasibility`: working sets, the model of a block's working set, the finest block
  (step 1);
* `grouping`: which tasks split, components and alignment classes (steps 2 and 3);
* `sizing`: block sizes per component (step 4);
* `materializing`: the new tasks of blocks, partials, combines and assembly (step 5);
* `driver`: the passes – checking, ordering and building (steps 6 and 7),
  `partition` and `partition_for_budget`;
* `tensor`: `tensor_split(tg, parts)`, the tensor-parallel split: the classes of the
  dims that `Shard` facts name cut into `parts` blocks, materialized and built as above.

>>> import einpage as ep
>>> prog = ep.Program("mm")
>>> a = prog.input("a", (4, 4096)); b = prog.input("b", (4096, 4))
>>> prog.output(prog.einsum("ij,jk->ik", a, b), "c")
>>> tg = partition(prog.build(), "40KiB")
>>> sorted({t.block.kind for t in tg if t.kind == "einsum"})
['block', 'partial']
>>> max(working_set(tg, t.id) for t in tg if t.kind != "input") <= 40 * 1024
True
"""

from taskgraph.partition.driver import (
    DEFAULT_BUDGET_FRACTION,
    BudgetPartition,
    TooManyTasksError,
    blocks_of,
    budget_block_limit,
    partition,
    partition_for_budget,
)
from taskgraph.partition.estimate import TaskEstimate, estimate_tasks
from taskgraph.partition.feasibility import (
    BlockLimitError,
    finest_block,
    min_block_bytes,
    smallest_feasible_block_limit,
    working_set,
)
from taskgraph.partition.geometry import Box
from taskgraph.partition.materializing import MAX_COMBINE_FANIN
from taskgraph.partition.tensor import TensorSplitError, tensor_split

__all__ = [
    "partition",
    "partition_for_budget",
    "BudgetPartition",
    "working_set",
    "min_block_bytes",
    "smallest_feasible_block_limit",
    "finest_block",
    "blocks_of",
    "BlockLimitError",
    "TooManyTasksError",
    "estimate_tasks",
    "TaskEstimate",
    "budget_block_limit",
    "DEFAULT_BUDGET_FRACTION",
    "MAX_COMBINE_FANIN",
    "Box",
    "tensor_split",
    "TensorSplitError",
]
