"""ucm's scheduler half inside vLLM's real ``Scheduler``: lookups, load and save plans, evictions.

No engine, worker or model runs. Each test builds vLLM's own
:class:`~vllm.v1.core.sched.scheduler.Scheduler` with ``UCMConnector`` (as vLLM's
``tests/v1/kv_connector/unit/utils.py`` does for its connectors) and plays the model
runner itself: after every ``schedule()`` it feeds one sampled token per request that
has finished its prompt to ``update_from_output``. A ``posix`` store is pre-populated
by writing block files under the keys the connector computes, so every hit is one the
test arranged, and every step's metadata is checked against the block tables vLLM
really allocated.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.integration.scheduler_harness import (
    BLOCK,
    Step,
    make_harness,
    posix_tiers,
    prompt,
)
from ucm.integration.vllm.model_info import estimated_block_bytes
from ucm.store.base import BlockKey

# ---- scenarios -------------------------------------------------------------------------


def test_partial_hit_loads_stored_blocks_and_saves_the_rest(
    tiny_model: str, tmp_path: Path
) -> None:
    h = make_harness(tiny_model, posix_tiers(tmp_path / "store"))
    tokens = prompt(10 * BLOCK + 5, seed=1)
    keys = h.chain(tokens)
    h.put(keys[:6])
    h.add("partial", tokens, max_tokens=2)

    step = h.schedule()

    assert step.output.num_scheduled_tokens == {"partial": len(tokens) - 6 * BLOCK}
    (new,) = step.output.scheduled_new_reqs
    table = step.tables["partial"]
    assert list(new.block_ids[0]) == table
    assert new.num_computed_tokens == 6 * BLOCK
    assert len(table) == 11
    loads = [(load.block_id, load.key, load.tier, load.promote_to) for load in step.meta.loads]
    assert loads == [(table[i], keys[i], 0, ()) for i in range(6)]
    saves = [(save.block_id, save.key, save.tiers) for save in step.meta.saves]
    assert saves == [(table[i], keys[i], (0,)) for i in range(6, 10)]
    assert not step.meta.evictions

    h.update(step)
    h.run()
    later = h.steps[1:]
    assert later
    assert all(not s.meta.loads and not s.meta.saves for s in later)  # Block 10 never fills.
    assert len(h.requests["partial"].output_token_ids) == 2
    h.assert_no_leaks()


def test_full_prompt_hit_still_computes_the_last_block(tiny_model: str, tmp_path: Path) -> None:
    h = make_harness(tiny_model, posix_tiers(tmp_path / "store"))
    tokens = prompt(8 * BLOCK, seed=2)
    keys = h.chain(tokens)
    h.put(keys)
    h.add("full", tokens, max_tokens=3)

    step = h.schedule()

    # The last prompt token must be computed to sample from, so its block is not loaded.
    assert step.output.num_scheduled_tokens == {"full": BLOCK}
    table = step.tables["full"]
    assert len(table) == 8
    assert [(load.block_id, load.key) for load in step.meta.loads] == [
        (table[i], keys[i]) for i in range(7)
    ]
    # Block 7 is recomputed; saving it again is allowed, saving a loaded block is not.
    assert all((save.block_id, save.key) == (table[7], keys[7]) for save in step.meta.saves)

    h.update(step)
    h.run()
    assert all(not s.meta.loads for s in h.steps[1:])
    assert len(h.requests["full"].output_token_ids) == 3
    h.assert_no_leaks()


def test_miss_saves_prompt_blocks_then_each_decode_block_as_it_fills(
    tiny_model: str, tmp_path: Path
) -> None:
    h = make_harness(tiny_model, posix_tiers(tmp_path / "store"))
    tokens = prompt(3 * BLOCK + 5, seed=3)
    h.add("miss", tokens, max_tokens=64)  # Ends with 165 tokens: blocks 3 and 4 fill in decode.

    first = h.step()
    assert first.output.num_scheduled_tokens == {"miss": len(tokens)}
    assert not first.meta.loads
    assert first.saved("miss") == [0, 1, 2]
    assert len(first.meta.saves) == 3

    h.run()
    request = h.requests["miss"]
    assert len(request.output_token_ids) == 64
    final_keys = h.chain(request.all_token_ids)
    saved_in: dict[int, int] = {}
    for number, step in enumerate(h.steps):
        assert not step.meta.loads
        for save in step.meta.saves:
            index = final_keys.index(save.key)
            assert index not in saved_in, f"block {index} saved twice"
            assert save.block_id == step.tables["miss"][index]
            saved_in[index] = number
    # Each decode block is saved by the step that computes its last token: the step
    # that starts with (index + 1) * BLOCK - 1 tokens computed.
    assert sorted(saved_in) == [0, 1, 2, 3, 4]
    for index in (3, 4):
        step = h.steps[saved_in[index]]
        assert step.computed["miss"] == (index + 1) * BLOCK - 1
        assert step.output.num_scheduled_tokens["miss"] == 1
    h.assert_no_leaks()


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_resumes_with_loads_into_new_blocks(
    enable_prefix_caching: bool, tiny_model: str, tmp_path: Path
) -> None:
    num_blocks = 24  # 23 usable: 4 requests need 4 x 5 blocks to start, 4 x 7 to finish.
    h = make_harness(
        tiny_model,
        posix_tiers(tmp_path / "store"),
        num_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )
    h.persist_saves = True  # What is saved before a preemption can be loaded after it.
    names = [f"long-{n}" for n in range(4)]
    for seed, name in enumerate(names, start=10):
        tokens = prompt(4 * BLOCK + 10, seed=seed)
        h.put(h.chain(tokens)[:3])
        h.add(name, tokens, max_tokens=60)

    first = h.schedule()
    for name in names:
        assert first.loaded(name) == [0, 1, 2]
    h.update(first)
    h.run()

    assert sum(h.requests[name].num_preemptions for name in names) > 0
    for name in names:
        request = h.requests[name]
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert len(request.output_token_ids) == 60

    resumed_loads = 0
    moved = False
    previous_table: dict[str, list[int]] = {}
    for step in h.steps:
        for req_id in step.output.scheduled_cached_reqs.resumed_req_ids:
            loaded = step.loaded(req_id)
            # check_step already tied every load to this step's (new) block table.
            if not enable_prefix_caching:
                # Nothing is computed locally on resumption: ucm loads every stored
                # block from the first one, up to the one holding the last token.
                assert step.computed[req_id] == len(loaded) * BLOCK
                assert loaded == list(range(len(loaded)))
                limit = (len(h.requests[req_id].all_token_ids) - 1) // BLOCK
                assert len(loaded) >= 3
                assert len(loaded) <= limit
            resumed_loads += len(loaded)
            old = previous_table.get(req_id, [])
            new = step.tables[req_id]
            moved |= any(i < len(old) and old[i] != new[i] for i in loaded)
        previous_table.update(step.tables)
    if not enable_prefix_caching:
        assert resumed_loads > 0
        assert moved  # Some resumed load went to a block other than the one it had before.
    h.assert_no_leaks()


def test_request_aborted_while_its_load_is_planned(tiny_model: str, tmp_path: Path) -> None:
    num_blocks = 64
    h = make_harness(tiny_model, posix_tiers(tmp_path / "store"), num_blocks=num_blocks)
    doomed = prompt(10 * BLOCK + 5, seed=20)
    doomed_keys = h.chain(doomed)
    h.put(doomed_keys[:6])
    h.add("doomed", doomed, max_tokens=4)
    h.add("bystander", prompt(2 * BLOCK + 3, seed=21), max_tokens=40)

    step = h.schedule()
    assert step.loaded("doomed") == list(range(6))
    assert len(step.meta.loads) == 6

    (aborted,) = h.scheduler.finish_requests("doomed", RequestStatus.FINISHED_ABORTED)
    assert aborted.request_id == "doomed"
    h.update(step)  # The step that carried the load still comes back.

    assert "doomed" not in h.scheduler.requests
    assert "doomed" not in h.scheduler.connector.tracked_requests()  # type: ignore[union-attr]
    bystander_blocks = len(h.scheduler.kv_cache_manager.get_block_ids("bystander")[0])
    assert h.free_blocks() == num_blocks - 1 - bystander_blocks
    nxt = h.step()
    assert not nxt.meta.loads  # The aborted request's planned load is not repeated.
    assert set(nxt.output.num_scheduled_tokens) == {"bystander"}
    h.run()
    assert len(h.requests["bystander"].output_token_ids) == 40
    h.assert_no_leaks()

    # A later request with the same prompt loads the stored blocks into its own blocks.
    assert h.scheduler.reset_prefix_cache()  # Else vLLM's own cache holds the prefix.
    h.add("again", doomed, max_tokens=2)
    again = h.schedule()
    assert again.loaded("again") == list(range(6))
    assert again.output.num_scheduled_tokens == {"again": len(doomed) - 6 * BLOCK}
    h.update(again)
    h.run()
    h.assert_no_leaks()


def test_dram_mirror_evicts_least_recently_used_blocks(tiny_model: str, tmp_path: Path) -> None:
    probe = make_harness(tiny_model, posix_tiers(tmp_path / "probe"))
    block_bytes = estimated_block_bytes(probe.vllm_config, probe.kv_cache_config)
    # A wrapper that passes no KV cache layout must estimate the same block size.
    assert estimated_block_bytes(probe.vllm_config, None) == block_bytes
    h = make_harness(tiny_model, [{"backend": "dram", "capacity": 4 * block_bytes}])

    def phase(req_id: str, tokens: list[int]) -> tuple[Step, list[BlockKey]]:
        """Run one single-step request, then empty vLLM's own prefix cache."""
        h.add(req_id, tokens, max_tokens=1)
        step = h.step()
        assert h.requests[req_id].is_finished()
        assert h.scheduler.reset_prefix_cache()
        return step, h.chain(tokens)

    def saved(step: Step) -> list[BlockKey]:
        """Return the keys the step saves."""
        return [save.key for save in step.meta.saves]

    def loaded(step: Step) -> list[BlockKey]:
        """Return the keys the step loads."""
        return [load.key for load in step.meta.loads]

    doc = prompt(3 * BLOCK + 1, seed=30)
    # Each chain used in a step is touched tail to head, so heads outlive tails.
    step, a = phase("a", doc)  # Mirror (LRU first): a2 a1 a0
    assert (loaded(step), saved(step), step.meta.evictions) == ([], a[:3], {})

    step, b = phase("b", doc[:BLOCK] + prompt(BLOCK + 1, seed=31))  # a2 a1 b1 a0
    assert b[0] == a[0]
    assert (loaded(step), saved(step), step.meta.evictions) == ([a[0]], [b[1]], {})

    step, c = phase("c", prompt(2 * BLOCK + 1, seed=32))  # b1 a0 c1 c0: a0 was used in "b".
    assert (loaded(step), saved(step)) == ([], c[:2])
    assert step.meta.evictions == {0: [a[2], a[1]]}

    step, _ = phase("a-again", doc)  # c0 a2 a1 a0
    assert (loaded(step), saved(step)) == ([a[0]], [a[1], a[2]])
    assert step.meta.evictions == {0: [b[1], c[1]]}

    # Six new blocks but room for four: blocks of the current step are never evicted,
    # so the last two (the tail, useless without the head) are left out.
    step, d = phase("d", prompt(6 * BLOCK + 1, seed=33))  # d3 d2 d1 d0
    assert (loaded(step), saved(step)) == ([], d[:4])
    assert step.meta.evictions == {0: [c[0], a[2], a[1], a[0]]}

    step, _ = phase("a-evicted", doc)  # An evicted block is a miss again.
    assert (loaded(step), saved(step)) == ([], a[:3])
    assert step.meta.evictions == {0: [d[3], d[2], d[1]]}  # Tail first: d0 survives.
    h.assert_no_leaks()


def test_dram_tier_smaller_than_one_block_saves_nothing(tiny_model: str) -> None:
    h = make_harness(tiny_model, [{"backend": "dram", "capacity": "1KiB"}])
    h.add("tiny-tier", prompt(2 * BLOCK + 1, seed=40), max_tokens=1)
    step = h.step()
    assert not step.meta.saves
    assert not step.meta.evictions
    h.run()
    h.assert_no_leaks()


def test_promotion_never_evicts_a_block_loaded_in_the_same_step(
    tiny_model: str, tmp_path: Path
) -> None:
    probe = make_harness(tiny_model, posix_tiers(tmp_path / "probe"))
    block_bytes = estimated_block_bytes(probe.vllm_config, probe.kv_cache_config)
    tiers = [
        {"backend": "dram", "capacity": block_bytes},  # Room for one block.
        *posix_tiers(tmp_path / "store"),
    ]
    h = make_harness(tiny_model, tiers)
    dram_only = prompt(BLOCK + 1, seed=50)
    h.add("writer", dram_only, max_tokens=1)
    first = h.step()
    (kept,) = h.chain(dram_only)
    assert [(save.key, save.tiers) for save in first.meta.saves] == [(kept, (0, 1))]
    assert h.scheduler.reset_prefix_cache()
    # No worker ran, so the block is in the dram mirror only (as when posix lost it).
    on_disk = prompt(BLOCK + 1, seed=51)
    (promoted,) = h.chain(on_disk)
    h.put([promoted])

    h.add("from-disk", on_disk, max_tokens=1)  # Looked up first: its load promotes to dram.
    h.add("from-dram", dram_only, max_tokens=1)
    step = h.schedule()  # check_step: no evicted key is loaded in the same step.

    assert step.loaded("from-dram") == [0]
    assert [load.tier for load in step.meta.loads] == [1, 0]
    assert kept not in step.meta.evictions.get(0, [])


def test_background_load_resumes_the_request_when_the_worker_reports_it(
    tiny_model: str, tmp_path: Path
) -> None:
    h = make_harness(tiny_model, posix_tiers(tmp_path / "store"), settings={"async_load": True})
    tokens = prompt(8 * BLOCK + 5, seed=40)
    keys = h.chain(tokens)
    h.put(keys[:6])
    request = h.add("waits", tokens, max_tokens=3)

    first = h.schedule()
    assert not first.output.num_scheduled_tokens  # Nothing to compute while it loads.
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (table,) = h.scheduler.kv_cache_manager.get_block_ids("waits")
    loads = [(load.block_id, load.key) for load in first.meta.async_loads["waits"]]
    assert loads == [(table[i], keys[i]) for i in range(6)]
    assert not first.meta.loads
    h.update(first)

    idle = h.step()  # The worker has not reported the load yet: the request waits.
    assert not idle.output.num_scheduled_tokens and not idle.meta.async_loads
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    h.update(h.schedule(), KVConnectorOutput(finished_recving={"waits"}))
    resumed = h.schedule()
    assert resumed.output.num_scheduled_tokens == {"waits": len(tokens) - 6 * BLOCK}
    assert resumed.computed["waits"] == 6 * BLOCK
    assert not resumed.meta.loads and not resumed.meta.async_loads  # Loaded once only.
    assert [save.key for save in resumed.meta.saves] == keys[6:8]
    h.update(resumed)
    h.run()
    assert len(request.output_token_ids) == 3
    h.assert_no_leaks()


def test_block_that_failed_to_load_is_not_offered_again(tiny_model: str, tmp_path: Path) -> None:
    # A consumer never saves, so nothing but the failure report changes what is offered.
    h = make_harness(
        tiny_model,
        posix_tiers(tmp_path / "store"),
        failure_policy="recompute",
        role="kv_consumer",
    )
    tokens = prompt(8 * BLOCK + 5, seed=41)
    keys = h.chain(tokens)
    h.put(keys[:6])
    h.add("first", tokens, max_tokens=2)
    step = h.schedule()
    assert step.loaded("first") == list(range(6))
    h.update(step, KVConnectorOutput(invalid_block_ids={step.tables["first"][3]}))
    assert h.step().computed["first"] == 3 * BLOCK  # vLLM recomputes from block 3.
    h.run()
    h.assert_no_leaks()

    assert h.scheduler.reset_prefix_cache()
    h.add("second", tokens, max_tokens=2)
    again = h.schedule()
    assert again.loaded("second") == list(range(3))  # Block 3 and beyond: recomputed.
    h.update(again)
    h.run()
    h.assert_no_leaks()


def test_block_that_failed_a_request_is_not_offered_again(tiny_model: str, tmp_path: Path) -> None:
    """With vLLM's default policy the request fails before vLLM reports its bad blocks."""
    h = make_harness(tiny_model, posix_tiers(tmp_path / "store"), role="kv_consumer")
    tokens = prompt(8 * BLOCK + 5, seed=43)
    h.put(h.chain(tokens)[:6])
    h.add("first", tokens, max_tokens=2)
    step = h.schedule()
    assert step.loaded("first") == list(range(6))
    h.update(step, KVConnectorOutput(invalid_block_ids={step.tables["first"][2]}))
    assert "first" not in h.scheduler.requests  # Failed, not recomputed.
    assert h.scheduler.reset_prefix_cache()
    h.add("second", tokens, max_tokens=2)
    again = h.schedule()
    assert again.loaded("second") == list(range(2))
    h.update(again)
    h.run()
    h.assert_no_leaks()


def test_in_memory_index_sees_blocks_stored_by_others(tiny_model: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    h = make_harness(tiny_model, posix_tiers(store, index_refresh_seconds=0.05))
    tokens = prompt(6 * BLOCK + 5, seed=42)
    keys = h.chain(tokens)
    h.put(keys[:4])
    time.sleep(0.5)  # Several refreshes of the connector's view of the store.
    h.add("later", tokens, max_tokens=2)
    step = h.schedule()
    assert step.loaded("later") == list(range(4))
    h.update(step)
    h.run()
    h.assert_no_leaks()


def test_kv_events_name_ucm_blocks_like_vllm_names_its_own(tiny_model: str) -> None:
    """With vLLM's KV events on, ucm reports the blocks it stores (CPU for dram) and the
    ones its DRAM tier evicts, under vLLM's own block hashes."""
    block_bytes = 2 * 2 * BLOCK * 64 * 4  # K+V, 2 layers, 2 KV heads of 64 floats, float32.
    tiers = [{"backend": "dram", "capacity": 4 * block_bytes}]
    h = make_harness(tiny_model, tiers, kv_events=True)
    published: list[Any] = []
    h.scheduler.kv_event_publisher.publish = published.append  # type: ignore[method-assign]
    connector = h.scheduler.connector
    assert connector is not None
    ours: list[Any] = []
    take = connector.take_events

    def take_and_keep() -> list[Any]:
        events = list(take())
        ours.extend(events)
        return events

    connector.take_events = take_and_keep  # type: ignore[method-assign]
    for index in range(2):  # 6 full blocks in all: the DRAM tier holds 4.
        h.add(f"r{index}", prompt(3 * BLOCK + 1, seed=index), max_tokens=1)
        h.run()
    events = [event for batch in published for event in batch.events]
    assert all(event in events for event in ours)  # vLLM published ucm's events.
    stored = [e for e in ours if isinstance(e, BlockStored)]
    assert [e.medium for e in stored] == [MEDIUM_CPU] * 6
    assert all(len(e.token_ids) == BLOCK for e in stored)
    vllm_hashes = [
        block_hash
        for e in events
        if isinstance(e, BlockStored) and not any(e is o for o in ours)
        for block_hash in e.block_hashes
    ]
    assert [e.block_hashes[0] for e in stored] == vllm_hashes
    removed = [h for e in ours if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(removed) == 2
    assert set(removed) <= {e.block_hashes[0] for e in stored[:3]}


def test_async_save_keeps_blocks_until_the_worker_reports_them_written(
    tiny_model: str, tmp_path: Path
) -> None:
    num_blocks = 24  # 23 usable: four requests cannot all finish without a preemption.
    h = make_harness(
        tiny_model,
        posix_tiers(tmp_path / "store"),
        num_blocks=num_blocks,
        settings={"async_save": True},
    )
    held = h.add("held", prompt(3 * BLOCK + 5, seed=50), max_tokens=2)
    first = h.schedule()
    assert first.saved("held") == [0, 1, 2]
    assert first.meta.sending == ["held"]
    h.update(first)
    h.update(h.schedule())  # The second token: the request finishes.
    assert held.is_finished()
    assert "held" in h.scheduler.requests  # vLLM keeps its blocks for the writes.
    assert h.free_blocks() == num_blocks - 1 - 4

    waiting = h.schedule()
    assert waiting.meta.release == ["held"]
    h.update(waiting, KVConnectorOutput())  # The writes are not done yet.
    assert "held" in h.scheduler.requests
    h.update(h.schedule(), KVConnectorOutput(finished_sending={"held"}))
    assert "held" not in h.scheduler.requests
    h.assert_no_leaks()

    names = [f"long-{n}" for n in range(4)]
    for seed, name in enumerate(names, start=60):
        h.add(name, prompt(4 * BLOCK + 10, seed=seed), max_tokens=60)
    h.run()  # The simulated workers report each released request at once.
    assert sum(h.requests[name].num_preemptions for name in names) > 0
    saved: set[str] = set()
    for step in h.steps:
        preempted = step.output.preempted_req_ids or set()
        assert set(step.meta.preempted) == preempted & saved
        saved |= set(step.meta.sending)
    assert any(step.meta.preempted for step in h.steps)
    h.assert_no_leaks()


def test_request_aborted_while_it_loads_in_the_background_keeps_its_blocks(
    tiny_model: str, tmp_path: Path
) -> None:
    num_blocks = 64
    h = make_harness(
        tiny_model,
        posix_tiers(tmp_path / "store"),
        num_blocks=num_blocks,
        settings={"async_load": True},
    )
    tokens = prompt(8 * BLOCK + 5, seed=41)
    h.put(h.chain(tokens)[:6])
    h.add("waits", tokens, max_tokens=3)
    first = h.schedule()
    assert len(first.meta.async_loads["waits"]) == 6
    h.update(first)

    h.scheduler.finish_requests("waits", RequestStatus.FINISHED_ABORTED)
    assert "waits" in h.scheduler.requests  # The worker still reads into its blocks.
    assert h.free_blocks() < num_blocks - 1
    h.update(h.schedule(), KVConnectorOutput(finished_recving={"waits"}))
    h.assert_no_leaks()
