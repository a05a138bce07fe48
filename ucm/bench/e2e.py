"""End-to-end benchmark: serving systems side by side on the same workloads, one run.

Systems: recompute (no cache at all), vLLM's own prefix cache, vLLM's built-in
``ExampleConnector``, and ucm with ``dram``, ``posix`` and ``dram+posix`` tiers. Each
runs in a fresh engine process on a locally built model with its own empty store.

Workloads:
- long-document QA: every document is asked a first question (cold), then new
  questions (a hit on the document's blocks), then the first question again (an exact
  repeat). Except for "vLLM prefix cache", vLLM's own cache is emptied before every
  request, as if it had lost the document; "vLLM prefix cache" is the reference a
  cache hit should approach. ``ucm dram`` has room for every document; in
  ``ucm dram+posix`` the ``dram`` tier holds only half of them, so hits also come
  from disk (through the page cache, which cannot be dropped here).
- multi-round chat: users share a system prompt; each round appends a new user
  message to the conversation so far (earlier prompts and answers), so a round hits
  the blocks its previous round saved, decode blocks included.
- no reuse: distinct prompts submitted as one batch, for the throughput cost of saving.

Reported per system: TTFT p50/p90 per request kind, hit rate, tokens and bytes loaded,
bytes stored, no-reuse throughput; JSON, a Markdown table, and a PNG plot of TTFT
against prompt length (when matplotlib is installed).
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ucm.testing.engine import EngineSpec, Phase, run_engine
from ucm.testing.model import ModelSpec, build_model, make_prompt_token_ids

TransferFactory = Callable[[Path, int], dict[str, Any] | None]


@dataclass(frozen=True)
class Workload:
    """Sizes of the benchmark's workloads."""

    documents: int = 4
    """Documents in the QA workload."""
    document_tokens: int = 2048
    """Tokens per document."""
    questions: int = 3
    """Questions per document (the first is asked again at the end)."""
    question_tokens: int = 64
    """Tokens per question."""
    output_tokens: int = 16
    """Tokens generated per request."""
    no_reuse_prompts: int = 8
    """Distinct prompts in each no-reuse batch."""
    no_reuse_batches: int = 3
    """No-reuse batches (new prompts each); the best throughput is reported."""
    chat_users: int = 4
    """Conversations in the multi-round chat workload."""
    chat_rounds: int = 3
    """Rounds per conversation."""
    system_prompt_tokens: int = 1024
    """Tokens of the system prompt every conversation starts with."""
    message_tokens: int = 128
    """Tokens per user message."""


@dataclass(frozen=True)
class System:
    """One way of serving the workloads."""

    name: str
    """Label in the report."""
    transfer: TransferFactory
    """Builds vLLM's ``kv_transfer_config`` from a store directory and a DRAM size."""
    prefix_caching: bool = True
    """Whether vLLM's own prefix cache is on."""
    keeps_vllm_cache: bool = False
    """Whether vLLM's own cache keeps documents between requests (never emptied)."""
    dram_documents: float = 0.5
    """How many of the workload's documents a ``dram`` tier holds, as a fraction."""


def _ucm(kinds: str, async_save: bool = False, direct_io: bool = False) -> TransferFactory:
    def transfer(store: Path, dram_bytes: int) -> dict[str, Any]:
        posix = {"backend": "posix", "path": str(store), "capacity": "64GiB"}
        tiers = {
            "dram": {"backend": "dram", "capacity": dram_bytes},
            "posix": {**posix, "direct_io": True} if direct_io else posix,
        }
        return {
            "kv_connector": "UCMConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "tiers": [tiers[kind] for kind in kinds.split("+")],
                "async_save": async_save,
            },
        }

    return transfer


def _example(store: Path, dram_bytes: int) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }


SYSTEMS = (
    System("recompute", lambda store, dram: None, prefix_caching=False),
    System("vLLM prefix cache", lambda store, dram: None, keeps_vllm_cache=True),
    System("ExampleConnector", _example),
    System("ucm dram", _ucm("dram"), dram_documents=1.5),
    System("ucm posix", _ucm("posix")),
    System("ucm dram+posix", _ucm("dram+posix")),
    System("ucm posix async-save", _ucm("posix", async_save=True)),
    System("ucm dram+posix async-save", _ucm("dram+posix", async_save=True)),
    System("ucm posix direct-io", _ucm("posix", direct_io=True)),
    System(
        "ucm dram+posix direct-io async-save",
        _ucm("dram+posix", async_save=True, direct_io=True),
    ),
)
"""Every system the benchmark compares."""
UCM_SYSTEMS = tuple(system.name for system in SYSTEMS if system.name.startswith("ucm"))
"""The names of the systems that run ucm."""


@dataclass
class SystemResult:
    """What one system measured."""

    system: str
    ttft_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per request kind (cold, new question, exact repeat): p50 and p90 TTFT."""
    cached_tokens: dict[str, int] = field(default_factory=dict)
    """Per request kind: prompt tokens served from a cache."""
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    """Per request kind: prompt tokens asked."""
    no_reuse_tokens_per_s: float = 0.0
    """Prompt plus generated tokens per second of the best no-reuse batch."""
    store_bytes: int = 0
    """Bytes the system left in its store directory."""
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    """Generated tokens per request kind, to check every system answers alike."""
    requests: list[tuple[str, int, float, int]] = field(default_factory=list)
    """Every timed request: kind, prompt tokens, TTFT in ms, prompt tokens from a cache."""
    store_traffic: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per ucm tier (``<index>:<backend>``): bytes saved and loaded over the whole run,
    and the seconds those transfers took, as ucm's stats in vLLM report them."""


def _prompts(workload: Workload, vocab: int) -> dict[str, list[list[int]]]:
    def tokens(count: int, seed: int) -> list[int]:
        return make_prompt_token_ids(count, seed=seed, vocab_size=vocab)

    docs = [tokens(workload.document_tokens, seed) for seed in range(workload.documents)]

    def ask(question: int) -> list[list[int]]:
        return [
            doc + tokens(workload.question_tokens, 10_000 + 100 * question + index)
            for index, doc in enumerate(docs)
        ]

    new_questions = [prompt for q in range(1, workload.questions) for prompt in ask(q)]
    prompts = {"cold": ask(0), "new question": new_questions, "exact repeat": ask(0)}
    system_prompt = tokens(workload.system_prompt_tokens, 70_000)
    for turn in range(workload.chat_rounds):
        messages = [
            tokens(workload.message_tokens, 80_000 + 100 * turn + user)
            for user in range(workload.chat_users)
        ]
        prompts[f"chat round {turn}"] = [
            system_prompt + message if turn == 0 else message for message in messages
        ]
    for batch in range(workload.no_reuse_batches):
        prompts[f"no reuse {batch}"] = [
            tokens(workload.document_tokens, 50_000 + 1000 * batch + index)
            for index in range(workload.no_reuse_prompts)
        ]
    return prompts


FOLLOW_UP = "chat follow-up"
"""The request kind that sums up chat rounds after the first."""
REPORTED_KINDS = ("cold", "new question", "exact repeat", FOLLOW_UP)
"""Request kinds in the report's table; all but the first are cache hits for a cache."""


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered) * 1000, "p90": p90 * 1000}


def run_system(
    system: System,
    model: Path,
    workload: Workload,
    vocab: int,
    workdir: Path,
    kv_bytes_per_token: int,
) -> SystemResult:
    """Run every workload on one system in a fresh engine process."""
    prompts = _prompts(workload, vocab)
    store = workdir / "store"
    shutil.rmtree(workdir, ignore_errors=True)  # Every system starts with an empty store.
    document_bytes = workload.document_tokens * kv_bytes_per_token
    dram_bytes = max(int(system.dram_documents * workload.documents * document_bytes), 1)
    reset = not system.keeps_vllm_cache
    chat = tuple(f"chat round {turn}" for turn in range(workload.chat_rounds))
    kinds = ("cold", "new question", "exact repeat", *chat)
    phases = [
        Phase(
            prompts[kind],
            workload.output_tokens,
            reset_before_each=reset,
            follow_up=kind in chat[1:],
        )
        for kind in kinds
    ]
    batches = [f"no reuse {batch}" for batch in range(workload.no_reuse_batches)]
    phases += [Phase(prompts[name], workload.output_tokens, batch=True) for name in batches]
    conversation = workload.system_prompt_tokens + workload.chat_rounds * (
        workload.message_tokens + workload.output_tokens
    )
    longest = max(
        workload.document_tokens + workload.question_tokens + workload.output_tokens,
        conversation,
    )
    spec = EngineSpec(
        model=str(model),
        phases=phases,
        block_size=32,
        kv_transfer_config=system.transfer(store, dram_bytes),
        max_model_len=longest + 64,
        kv_cache_bytes=max(4 * longest * kv_bytes_per_token, 256 << 20),
        enable_prefix_caching=system.prefix_caching,
    )
    results = run_engine(spec, workdir / "engine", timeout=3600)
    measured = SystemResult(system.name)
    for kind, result in zip(kinds, results, strict=False):
        measured.ttft_ms[kind] = _percentiles(result.ttft_s)
        measured.cached_tokens[kind] = sum(result.cached_tokens)
        measured.prompt_tokens[kind] = sum(result.prompt_tokens)
        measured.outputs[kind] = result.outputs
        measured.requests += [
            (kind, length, ttft * 1000, cached)
            for length, ttft, cached in zip(
                result.prompt_tokens, result.ttft_s, result.cached_tokens, strict=True
            )
        ]
    follow_ups = [r for r in measured.requests if r[0] in chat[1:]]
    if follow_ups:
        measured.ttft_ms[FOLLOW_UP] = _percentiles([r[2] / 1000 for r in follow_ups])
        measured.cached_tokens[FOLLOW_UP] = sum(r[3] for r in follow_ups)
        measured.prompt_tokens[FOLLOW_UP] = sum(r[1] for r in follow_ups)
    for name, result in zip(batches, results[len(kinds) :], strict=True):
        total = sum(len(p) for p in prompts[name]) + sum(len(o) for o in result.outputs)
        measured.no_reuse_tokens_per_s = max(measured.no_reuse_tokens_per_s, total / result.wall_s)
    measured.store_bytes = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    measured.store_traffic = store_traffic(results[-1].ucm_totals if results else {})
    return measured


_TRAFFIC = {
    "tier_save_bytes_total": "saved_bytes",
    "save_seconds_sum": "save_seconds",
    "tier_load_bytes_total": "loaded_bytes",
    "load_seconds_sum": "load_seconds",
}


def store_traffic(totals: dict[str, float]) -> dict[str, dict[str, float]]:
    """Sort ucm's totals (:func:`ucm.testing.engine.ucm_totals`) into per-tier traffic."""
    traffic: dict[str, dict[str, float]] = {}
    for name, value in totals.items():
        base, _, tier = name.partition("|")
        if tier and base in _TRAFFIC:
            traffic.setdefault(tier, dict.fromkeys(_TRAFFIC.values(), 0.0))[_TRAFFIC[base]] = value
    return traffic


def run(
    spec: ModelSpec, workload: Workload, workdir: Path, systems: tuple[System, ...] = SYSTEMS
) -> dict[str, Any]:
    """Run every system and return the results plus the targets' ratios."""
    model = build_model(spec, workdir / "models")
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * head_dim * 4
    measured: list[SystemResult] = []
    progress = tqdm(systems, desc="systems", unit="system")
    for index, system in enumerate(progress, start=1):
        progress.set_postfix_str(system.name)
        measured.append(
            run_system(
                system, model, workload, spec.vocab_size, workdir / f"s{index}", kv_bytes_per_token
            )
        )
    return {
        "model": asdict(spec),
        "model_name": spec.name,
        "kv_bytes_per_token": kv_bytes_per_token,
        "workload": asdict(workload),
        "systems": [asdict(result) for result in measured],
        "targets": targets(measured),
    }


def targets(measured: list[SystemResult]) -> dict[str, float | bool]:
    """Compute the issue's target ratios from the measurements (reported, not asserted).

    A ratio is left out when one of its two systems did not run.
    """
    by_name = {result.system: result for result in measured}
    ucm_systems = [name for name in UCM_SYSTEMS if name in by_name]

    def p50(system: str, kind: str) -> float:
        return by_name[system].ttft_ms[kind]["p50"]

    reference = measured[0].outputs
    report: dict[str, float | bool] = {
        "outputs identical across systems": all(r.outputs == reference for r in measured),
    }
    if "vLLM prefix cache" in by_name:
        for kind in ("new question", FOLLOW_UP):
            for system in ucm_systems:
                report[f"{system} {kind} TTFT / vLLM prefix cache"] = p50(system, kind) / p50(
                    "vLLM prefix cache", kind
                )
    if "ExampleConnector" in by_name and "ucm dram+posix" in by_name:
        for kind in ("new question", "exact repeat"):
            report[f"ExampleConnector / ucm dram+posix TTFT, {kind}"] = p50(
                "ExampleConnector", kind
            ) / p50("ucm dram+posix", kind)
    if "vLLM prefix cache" in by_name:
        base = by_name["vLLM prefix cache"].no_reuse_tokens_per_s
        for system in ucm_systems:
            report[f"{system} no-reuse throughput / no connector"] = (
                by_name[system].no_reuse_tokens_per_s / base
            )
    return report


def markdown(results: dict[str, Any]) -> str:
    """Render :func:`run`'s results as a Markdown report."""
    kinds = [k for k in REPORTED_KINDS if k in results["systems"][0]["ttft_ms"]]
    header = "| system | " + " | ".join(f"TTFT p50/p90 ms, {k}" for k in kinds)
    lines = [header + " | hit rate | KV from cache MiB | no-reuse tok/s | store MiB |"]
    lines.append("| --- |" + " ---: |" * (len(kinds) + 4))
    for result in results["systems"]:
        ttft = " | ".join(
            f"{result['ttft_ms'][k]['p50']:.0f} / {result['ttft_ms'][k]['p90']:.0f}" for k in kinds
        )
        cached = sum(result["cached_tokens"][k] for k in kinds[1:])
        asked = sum(result["prompt_tokens"][k] for k in kinds[1:])
        loaded = sum(r[3] for r in result["requests"]) * results["kv_bytes_per_token"]
        lines.append(
            f"| {result['system']} | {ttft} | {cached / asked:.0%} | {loaded / 2**20:.1f} | "
            f"{result['no_reuse_tokens_per_s']:.0f} | {result['store_bytes'] / 2**20:.1f} |"
        )
    lines += _traffic_table(results["systems"])
    lines += ["", "| target | value |", "| --- | ---: |"]
    for name, value in results["targets"].items():
        shown = value if isinstance(value, bool) else f"{value:.2f}"
        lines.append(f"| {name} | {shown} |")
    return "\n".join(lines) + "\n"


def _traffic_table(systems: list[dict[str, Any]]) -> list[str]:
    """Markdown lines for every ucm tier's bytes and rates (none without ucm systems).

    A rate is bytes over the summed seconds of the tier's transfers: the rate of one
    transfer; transfers that run at once (reader and writer threads) add up to more.
    """

    def rate(nbytes: float, seconds: float) -> str:
        return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "–"

    rows = [
        f"| {result['system']} | {tier} | {t['saved_bytes'] / 2**20:.1f} | "
        f"{rate(t['saved_bytes'], t['save_seconds'])} | {t['loaded_bytes'] / 2**20:.1f} | "
        f"{rate(t['loaded_bytes'], t['load_seconds'])} |"
        for result in systems
        for tier, t in sorted(result.get("store_traffic", {}).items())
    ]
    if not rows:
        return []
    header = (
        "| system | tier | saved MiB | save GB/s per transfer | loaded MiB "
        "| load GB/s per transfer |"
    )
    return ["", header, "| --- | --- |" + " ---: |" * 4, *rows]


def plot(results: dict[str, Any], path: Path) -> bool:
    """Draw TTFT against prompt length, per system, into a PNG file.

    Returns:
        False (and draws nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return False
    figure, axes = pyplot.subplots(figsize=(9, 5.5))
    for result in results["systems"]:
        lengths = [request[1] for request in result["requests"]]
        ttfts = [request[2] for request in result["requests"]]
        axes.scatter(lengths, ttfts, label=result["system"], s=18, alpha=0.75)
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("TTFT (ms)")
    axes.set_yscale("log")
    axes.set_title(f"TTFT vs prompt length, {results['model_name']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return True
