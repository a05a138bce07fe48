"""A bounded stress run: thousands of requests through ucm under capacity pressure and
injected corruption, every output compared with a run without ucm.

``python -m ucm.testing.soak DIR --requests 2000`` builds the tiny model, computes the
reference outputs of a pool of prompts (documents asked several questions) without a
connector, then serves ``--requests`` requests drawn from the pool on one engine with
a ``dram`` and a ``posix`` tier each far smaller than the pool's KV, emptying vLLM's
own prefix cache every few batches so that ucm serves the hits. Meanwhile it flips a
byte in a random stored block now and then. It prints and writes ``soak.json``:
requests, wrong outputs, prompt tokens served by ucm, corruptions injected, load
failures vLLM recovered from, resident memory over the run, open file descriptors
before and after, and whether vLLM's and ucm's schedulers ended empty.
``--eviction s3fifo`` selects the tiers' eviction policy, ``--async-save`` writes
``posix`` from the KV pages (blocks held until written); ``--without-ucm`` runs the
same requests with no connector, to compare memory figures against.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ucm.eviction import DEFAULT_POLICY, POLICIES
from ucm.testing.engine import ENGINE_ENV, EngineSpec, Phase, reset_prefix_cache, run_engine
from ucm.testing.model import TINY, build_model, make_prompt_token_ids

DOCUMENTS, QUESTIONS, DOCUMENT_TOKENS, QUESTION_TOKENS = 12, 6, 300, 40
BATCH = 8
RESET_EVERY = 4
"""Batches between two resets of vLLM's own prefix cache."""
CORRUPT_EVERY = 5
"""Batches between two corrupted stored blocks."""


def prompt_pool() -> list[list[int]]:
    """Return every document followed by each of its questions."""
    vocab = TINY.vocab_size
    pool = []
    for doc in range(DOCUMENTS):
        document = make_prompt_token_ids(DOCUMENT_TOKENS, seed=7000 + doc, vocab_size=vocab)
        for question in range(QUESTIONS):
            seed = 8000 + doc * QUESTIONS + question
            pool.append(document + make_prompt_token_ids(QUESTION_TOKENS, seed, vocab))
    return pool


def transfer_config(store: Path, eviction: str, async_save: bool = False) -> dict[str, Any]:
    """ucm with both tiers far smaller than the pool's KV (about 9 MiB on the tiny model)."""
    tiers = [
        {"backend": "dram", "capacity": "2MiB", "eviction": eviction},
        {"backend": "posix", "path": str(store), "capacity": "4MiB", "eviction": eviction},
    ]
    return {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": tiers, "async_save": async_save},
        "kv_load_failure_policy": "recompute",
    }


def serve(workdir: Path, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak in this process (a fresh one: see :func:`main`)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    pool = prompt_pool()
    reference = json.loads((workdir / "reference.json").read_text())
    store = workdir / "store"
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=1024,
        block_size=32,
        kv_cache_memory_bytes=16 << 20,
        kv_transfer_config=(
            None
            if args.without_ucm
            else KVTransferConfig(**transfer_config(store, args.eviction, args.async_save))
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rng = random.Random(args.seed)
    requests = args.requests
    corrupt_every = 0 if args.without_ucm else args.corrupt_every
    fds_before = len(os.listdir("/proc/self/fd"))
    rss: list[int] = []
    wrong = cached = corrupted = done = 0
    batches = 0
    started = time.perf_counter()
    while done < requests:
        if batches % RESET_EVERY == 0:
            reset_prefix_cache(llm, in_process=True)
        if corrupt_every and batches % corrupt_every == 0:
            corrupted += _corrupt_one(store, rng)
        chosen = [rng.randrange(len(pool)) for _ in range(min(BATCH, requests - done))]
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=pool[i]) for i in chosen], params, use_tqdm=False
        )
        for index, output in zip(chosen, outputs, strict=True):
            wrong += list(output.outputs[0].token_ids) != reference[index]
            cached += int(output.num_cached_tokens or 0)
        done += len(chosen)
        batches += 1
        if batches % 10 == 1:
            rss.append(_rss_bytes())
    reset_prefix_cache(llm, in_process=True)  # Also lets every held request go.
    elapsed = time.perf_counter() - started
    engine = llm.llm_engine
    return {
        "requests": done,
        "distinct_prompts": len(pool),
        "wrong_outputs": wrong,
        "prompt_tokens_cached": cached,
        "corruptions_injected": corrupted,
        "seconds": round(elapsed, 1),
        "rss_mib_max_per_quarter": [_mib(max(part)) for part in _quarters(rss)],
        "fds_before": fds_before,
        "fds_after": len(os.listdir("/proc/self/fd")),
        "vllm_unfinished_requests": engine.get_num_unfinished_requests(),
        "vllm_requests_held": len(_scheduler(engine).requests),
        "ucm_tracked_requests": _ucm_tracked(engine),
    }


def _corrupt_one(store: Path, rng: random.Random) -> int:
    """Flip one payload byte of a random stored block; return 1 if one was found."""
    blocks = sorted(store.rglob("*.blk"))
    if not blocks:
        return 0
    path = rng.choice(blocks)
    try:
        with path.open("r+b") as handle:
            handle.seek(rng.randrange(max(path.stat().st_size - 64, 1)))
            byte = handle.read(1)
            handle.seek(-1, 1)
            handle.write(bytes([byte[0] ^ 0x40]))
    except (OSError, IndexError):  # Evicted meanwhile.
        return 0
    return 1


def _scheduler(engine: Any) -> Any:
    """Return vLLM's scheduler of an in-process engine."""
    return engine.engine_core.engine_core.scheduler


def _ucm_tracked(engine: Any) -> int | None:
    """Return how many requests ucm's scheduler half still tracks, where it runs."""
    tracked = getattr(_scheduler(engine).connector, "tracked_requests", None)
    return len(tracked()) if tracked is not None else None


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _quarters(samples: list[int]) -> list[list[int]]:
    """Split the samples into four consecutive parts (fewer if there are fewer samples)."""
    bounds = [len(samples) * i // 4 for i in range(5)]
    return [samples[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _mib(nbytes: int) -> float:
    return round(nbytes / 2**20, 1)


def main(argv: list[str] | None = None) -> int:
    """Run the soak (``DIR``), or its engine half (``--serve``, internal)."""
    parser = argparse.ArgumentParser(prog="python -m ucm.testing.soak", description=__doc__)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--corrupt-every", type=int, default=CORRUPT_EVERY, help="batches per fault (0: none)"
    )
    parser.add_argument("--eviction", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    parser.add_argument(
        "--async-save", action="store_true", help="write posix straight from the KV pages"
    )
    parser.add_argument(
        "--without-ucm", action="store_true", help="the same run with no connector (a control)"
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    workdir = args.workdir.absolute()
    if args.serve:
        result = serve(workdir, args.serve, args)
        (workdir / "soak.json").write_text(json.dumps(result, indent=2))
        return 0
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(build_model(TINY, workdir / "models"))
    spec = EngineSpec(model, [Phase(prompt_pool(), batch=True)], 32, max_model_len=1024)
    reference = run_engine(spec, workdir / "reference")[0].outputs
    (workdir / "reference.json").write_text(json.dumps(reference))
    env = {**os.environ, **ENGINE_ENV}
    command = [sys.executable, "-m", "ucm.testing.soak", str(workdir), "--serve", model]
    command += ["--requests", str(args.requests), "--seed", str(args.seed)]
    command += ["--corrupt-every", str(args.corrupt_every), "--eviction", args.eviction]
    command += ["--without-ucm"] if args.without_ucm else []
    command += ["--async-save"] if args.async_save else []
    with (workdir / "soak.log").open("w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        print((workdir / "soak.log").read_text()[-4000:])
        return code
    result = json.loads((workdir / "soak.json").read_text())
    text = (workdir / "soak.log").read_text()
    result["load_failures_recovered"] = text.count("Recovered from KV load failure")
    (workdir / "soak.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
