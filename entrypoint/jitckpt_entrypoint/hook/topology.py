"""Where this process sits in the job: rank, node, and how many of each (from torchrun's env)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    """torchrun's GROUP_RANK: which node (pod) of the job this is."""
    nodes: int = 1

    @property
    def is_leader(self) -> bool:
        """Local rank 0 writes this node's manifests and status files."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Topology:
        def num(name: str, default: int) -> int:
            try:
                return int(env[name])
            except (KeyError, ValueError):
                return default

        world = num("WORLD_SIZE", 1)
        local_world = num("LOCAL_WORLD_SIZE", world)
        return cls(
            rank=num("RANK", 0),
            world_size=world,
            local_rank=num("LOCAL_RANK", 0),
            local_world_size=local_world,
            node=num("GROUP_RANK", 0),
            nodes=num("GROUP_WORLD_SIZE", max(1, world // max(1, local_world))),
        )
