"""How ranks split blocks into shards: one per TP x PP rank, or one per stage with MLA."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ucm.integration.vllm.model_info import num_shards, rank_shard


def config(tp: int, pp: int, mla: bool) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 2), (1, 3)])
def test_every_rank_writes_its_own_shard_without_mla(tp: int, pp: int) -> None:
    vllm_config = config(tp, pp, mla=False)
    shards = [rank_shard(vllm_config, t, p) for p in range(pp) for t in range(tp)]
    assert sorted(shard for shard, _ in shards) == list(range(num_shards(vllm_config)))
    assert all(writes for _, writes in shards)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (4, 2)])
def test_with_mla_the_ranks_of_a_stage_share_one_shard_written_once(tp: int, pp: int) -> None:
    vllm_config = config(tp, pp, mla=True)
    assert num_shards(vllm_config) == pp
    for stage in range(pp):
        shards = [rank_shard(vllm_config, t, stage) for t in range(tp)]
        assert {shard for shard, _ in shards} == {stage}
        assert [writes for _, writes in shards] == [True] + [False] * (tp - 1)
