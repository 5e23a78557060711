"""hook/dcp_reads with real DCP saves: FSDP2 on 4 CPU ranks (gloo) under the entrypoint.

Each rank loads the model and optimizer back from a copy of the checkpoint that holds only its
node's files (2 ranks per node): its own shards, the one small file of replicated values, and
`.metadata`; the state must come back exactly. A load in another layout (the full model: every
shard file) first asks the node's sidecar for what the node does not hold.
"""

from __future__ import annotations

import json
import re

import pytest

from harness.training import CHILDREN, entrypoint, torchrun

pytestmark = pytest.mark.integration


def test_each_node_loads_an_fsdp_checkpoint_from_its_own_shards_and_the_shared_files(
    spawn, base_env
):
    proc = spawn(entrypoint(torchrun(CHILDREN / "dcp_node_reads.py", nproc=4)), env=base_env)
    assert proc.wait(timeout=300) == 0, proc.output()
    out = "\n".join(proc.stdout)  # the ranks' lines may interleave
    assert set(re.findall(r"rank (\d) ok", out)) == {"0", "1", "2", "3"}, proc.output()
    # In another layout (full tensors) each node asked its sidecar for the rest, then loaded.
    assert set(re.findall(r"rank (\d) resharded ok", out)) == {"0", "1", "2", "3"}, proc.output()
    asked = [line for line in proc.stderr if "needs" in line and "asking the sidecar" in line]
    assert asked, proc.output()
    views = json.loads(re.search(r"^views (.*)$", out, re.MULTILINE).group(1))
    node1 = set(views["nodes"]["1"])
    assert {"optimizer_0/__0_1.distcp", "optimizer_0/.metadata"} <= node1
    assert not node1 & {"optimizer_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"}
    # Node 1 fetches its half of the shards and the one file of replicated values.
    assert len(node1) == len(views["union"]) - 4
