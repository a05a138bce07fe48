"""Block keys: chained, deterministic across processes, sensitive to everything that matters."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from ucm.keys import KeyChain, KeySpace, chain_keys, request_root, shard_key

SPACE = KeySpace(
    model_id="m",
    revision="",
    architecture="LlamaForCausalLM",
    dtype="torch.float32",
    kv_cache_dtype="auto",
    block_size=4,
    num_layers=2,
    num_kv_heads=2,
    head_size=64,
    use_mla=False,
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    device="cpu",
    attention_backend="",
    quantization="",
    speculative="",
    model_config_digest="0123",
)

tokens = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=0, max_size=64)


@given(tokens)
def test_incremental_chain_equals_batch(ids: list[int]) -> None:
    chain = KeyChain(SPACE.root(), 4)
    for end in range(0, len(ids) + 1, 3):
        chain.extend(ids[:end])
    assert chain.extend(ids) == chain_keys(SPACE.root(), ids, 4, len(ids) // 4)


@given(tokens, st.integers(min_value=0, max_value=63))
def test_a_block_key_covers_every_earlier_token(ids: list[int], position: int) -> None:
    if position >= len(ids) // 4 * 4:
        return
    changed = list(ids)
    changed[position] += 1
    before = chain_keys(SPACE.root(), ids, 4, len(ids) // 4)
    after = chain_keys(SPACE.root(), changed, 4, len(ids) // 4)
    first_changed = position // 4
    assert before[:first_changed] == after[:first_changed]
    assert all(a != b for a, b in zip(before[first_changed:], after[first_changed:], strict=True))


def test_every_key_space_field_changes_the_root() -> None:
    for field in dataclasses.fields(KeySpace):
        value = getattr(SPACE, field.name)
        other = (
            not value
            if isinstance(value, bool)
            else value + 1
            if isinstance(value, int)
            else value + "x"
        )
        assert dataclasses.replace(SPACE, **{field.name: other}).root() != SPACE.root(), field.name


def test_request_identity_and_shards_change_keys() -> None:
    root = SPACE.root()
    assert request_root(root) == root
    assert request_root(root, ["lora:a"]) != request_root(root, ["lora:b"])
    key = chain_keys(root, [1, 2, 3, 4], 4, 1)[0]
    assert shard_key(key, 0, 1) == key
    shards = {shard_key(key, shard, 2) for shard in range(2)}
    assert len(shards) == 2 and key not in shards


def test_keys_do_not_depend_on_pythonhashseed() -> None:
    script = (
        "import json, dataclasses; from tests.unit.test_keys import SPACE; "
        "from ucm.keys import chain_keys; "
        "print(json.dumps([k.hex() for k in chain_keys(SPACE.root(), list(range(16)), 4, 4)]))"
    )
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    assert len(json.loads(outputs.pop())) == 4
