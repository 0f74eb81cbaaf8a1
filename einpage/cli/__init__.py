"""The command-line room: `einpage show|plan|stats|run|render|generate|demo|presets`.

* `einpage.cli.commands`: the argument parser, one function per command, exit codes,
  and the CLI's own words for the library's advice (`CLI_SPELLINGS`);
* `einpage.cli.devices`: `einpage plan --devices N`, and `stats` and `run` of a plan
  file for several devices;
* `einpage.cli.generate`: `einpage generate`;
* `einpage.cli.outputs`, `einpage.cli.files`: output paths checked before any work and
  written whole; plan, graph and array files read and validated;
* `einpage.cli.console`: tables, progress bars and the plan summaries;
* `einpage.cli.presets`: the programs a command line names (`mlp`, `llama:7b`, a file);
* `einpage.cli.checks`: outputs held to the reference evaluator (`--check`);
* `einpage.cli.demo`: `make demo`.

The last room: it may import every other; none imports it (`tests/test_imports.py`).
"""

from einpage.cli.commands import CLI_SPELLINGS, main

__all__ = ["main", "CLI_SPELLINGS"]
