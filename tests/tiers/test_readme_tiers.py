"""The README's "Three tiers" example runs as written (a script in a scratch folder): it
plans a host tier that streams weights from the checkpoint and spills, and the ids it
generates equal the reference evaluator's."""

from __future__ import annotations

import re

from readme_blocks import run_section


def test_the_three_tiers_example_runs_and_equals_the_reference(tmp_path):
    result = run_section("## Three tiers", tmp_path)
    assert result.returncode == 0, result.stderr
    tier, host, last = result.stdout.strip().splitlines()
    assert tier.startswith("host tier ") and "checkpoint" in tier and "spill" in tier
    streamed = int(re.search(r"(\d+) weights streamed", host).group(1))
    spilled = int(re.search(r"(\d+) tensors spilled", host).group(1))
    assert streamed > 0 and spilled > 0
    assert last.endswith(" True")  # the ids equal the reference's
