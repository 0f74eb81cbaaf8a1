"""The pipeline room: `einpage.compile(program, budget)` and what it needs.

* `einpage.pipeline.compiler`: the pass itself – `compile` (partition when needed, plan,
  verify) and `Compiled`, the plan with how it was made;
* `einpage.pipeline.devices`: `compile_devices` (place on several devices, plan each,
  verify the whole) and `CompiledDevices`;
* `einpage.pipeline.search`: what compiles – the automatic partitions tried, the search
  for the smallest budget that compiles, the caps on tasks;
* `einpage.pipeline.refusals`: why a budget is refused, in words (the errors);
* `einpage.pipeline.weight_files`: weights read where a safetensors checkpoint holds
  them (a plan with a host tier), and `checkpoint_files`: which files a checkpoint has.

It builds on the program room and the lower packages (taskgraph, memgraph); the rooms
after it (models, workloads, cli) may import it (`tests/test_imports.py`).
"""

from einpage.pipeline.compiler import (
    COMPILE_KEYWORDS,
    PARTITION_MODES,
    STAGE_SHARES,
    Compiled,
    Partitioning,
    compile,
    partition_mode,
)
from einpage.pipeline.devices import (
    AUTO,
    RUNNERS,
    CompiledDevices,
    NoStrategyError,
    StrategyChoice,
    compile_devices,
    device_rows,
)
from einpage.pipeline.refusals import PartitionInfeasibleError, TooManyBlocksError
from einpage.pipeline.search import (
    MAX_AUTO_BLOCKS,
    PLANNER_BYTES_PER_TASK,
    check_block_count,
    estimated_blocks,
    explicit_partition,
    task_cap,
)

__all__ = [
    "compile",
    "Compiled",
    "Partitioning",
    "compile_devices",
    "CompiledDevices",
    "StrategyChoice",
    "NoStrategyError",
    "AUTO",
    "RUNNERS",
    "device_rows",
    "PARTITION_MODES",
    "COMPILE_KEYWORDS",
    "STAGE_SHARES",
    "MAX_AUTO_BLOCKS",
    "PLANNER_BYTES_PER_TASK",
    "PartitionInfeasibleError",
    "TooManyBlocksError",
    "partition_mode",
    "estimated_blocks",
    "check_block_count",
    "explicit_partition",
    "task_cap",
]
