"""Run a real vLLM engine in a fresh process from a JSON spec, for tests and the demo.

Every run is its own process (``python -m ucm.testing.engine SPEC OUT``): vLLM keeps
process-wide state, and "a fresh process reads what another saved" is exactly what
ucm must get right. A spec lists phases; each phase generates its prompts greedily,
one request at a time, and records the output tokens, how many prompt tokens were
served from a cache (``num_cached_tokens``) and the time to first token.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment every engine process runs with (offline, loopback, one process)."""


@dataclass
class Phase:
    """One batch of work for the engine."""

    prompts: list[list[int]]
    """Prompt token ids; each is generated as its own request, in order."""
    max_tokens: int = 8
    """Tokens to generate per prompt (greedy, EOS ignored)."""
    reset_before_each: bool = False
    """Empty vLLM's own prefix cache before each prompt, so every cache hit is ucm's."""
    wait_for: str | None = None
    """A file to wait for before starting (another process's signal)."""
    settle_seconds: float = 0.0
    """Seconds to wait once ``wait_for`` exists (for another process's blocks to show
    in this engine's view of a shared store)."""
    signal: str | None = None
    """A file to create once the phase is done."""
    batch: bool = False
    """Submit all prompts in one ``generate`` call (throughput) instead of one by one."""
    follow_up: bool = False
    """Continue the previous phase's conversations: prompt ``i`` is appended to the
    previous phase's prompt ``i`` and its output (multi-round chat)."""


@dataclass
class EngineSpec:
    """How to start the engine and what to run on it."""

    model: str
    """Path of a local model directory."""
    phases: list[Phase]
    """The work, in order."""
    block_size: int = 32
    """vLLM's KV block size."""
    kv_transfer_config: dict[str, Any] | None = None
    """vLLM's ``kv_transfer_config``; None runs without a connector."""
    max_model_len: int = 2048
    """Longest sequence the engine accepts."""
    multiprocessing: bool = False
    """Run vLLM's scheduler and worker in separate processes (production layout)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the engine process."""
    kv_cache_bytes: int = 64 << 20
    """Memory for vLLM's own paged KV cache."""
    enable_prefix_caching: bool = True
    """Whether vLLM's own prefix cache is on."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks. Above 1 the engine runs its workers in separate processes,
    each bound to its own core (the CPU backend needs that binding)."""
    attention_backend: str | None = None
    """vLLM's attention backend by name (e.g. ``CPU_MLA``); None lets vLLM choose."""
    imports: list[str] = field(default_factory=list)
    """Modules the engine process imports before it starts the engine (tests register
    backends with them, or break ucm on purpose for a negative control)."""


@dataclass
class PhaseResult:
    """What one phase produced, per prompt."""

    outputs: list[list[int]]
    """Generated token ids."""
    cached_tokens: list[int]
    """Prompt tokens served from a cache (vLLM's own or ucm's)."""
    ttft_s: list[float]
    """Seconds from submitting the prompt to its first token."""
    wall_s: float = 0.0
    """Seconds the whole phase took."""
    prompt_tokens: list[int] = field(default_factory=list)
    """Prompt length of each request (follow-ups include the conversation so far)."""
    finish_reasons: list[str] = field(default_factory=list)
    """Why each request ended (``length`` normally; ``error`` for a failed request)."""
    ucm_totals: dict[str, float] = field(default_factory=dict)
    """ucm's Prometheus counters and latency sums at the end of the phase, since the
    engine started, by name (``tier_save_bytes_total|1:posix``, ``save_seconds_sum|…``)."""


def run_engine(spec: EngineSpec, workdir: Path, timeout: float = 600) -> list[PhaseResult]:
    """Run the spec in a fresh process and return its results.

    Args:
        spec: What to run.
        workdir: A directory for the spec and result files.
        timeout: Seconds before the process is killed.

    Returns:
        One result per phase.

    Raises:
        RuntimeError: The engine process failed; the message holds its output's tail.
    """
    proc = start_engine(spec, workdir)
    return finish_engine(proc, workdir, timeout)


def start_engine(spec: EngineSpec, workdir: Path) -> subprocess.Popen[str]:
    """Start the spec in a fresh process without waiting for it (see :func:`run_engine`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(asdict(spec)))
    env = {**os.environ, **ENGINE_ENV, **spec.env}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if _in_process(spec) else "1"
    if spec.tensor_parallel_size > 1:
        cores = os.cpu_count() or 1
        bind = "|".join(str(rank % cores) for rank in range(spec.tensor_parallel_size))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    command = [sys.executable, "-m", "ucm.testing.engine", str(workdir)]
    log = (workdir / "engine.log").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish_engine(
    proc: subprocess.Popen[str], workdir: Path, timeout: float = 600
) -> list[PhaseResult]:
    """Wait for a process from :func:`start_engine` and return its results."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    if code != 0:
        tail = (workdir / "engine.log").read_text()[-6000:]
        raise RuntimeError(f"engine process exited with {code}:\n{tail}")
    raw = json.loads((workdir / "result.json").read_text())
    return [PhaseResult(**phase) for phase in raw]


def _serve(workdir: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    raw = json.loads((workdir / "spec.json").read_text())
    phases = [Phase(**phase) for phase in raw.pop("phases")]
    spec = EngineSpec(phases=phases, **raw)
    for module in spec.imports:
        importlib.import_module(module)
    transfer = KVTransferConfig(**spec.kv_transfer_config) if spec.kv_transfer_config else None
    llm = LLM(
        model=spec.model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=spec.enable_prefix_caching,
        seed=0,
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        kv_cache_memory_bytes=spec.kv_cache_bytes,
        kv_transfer_config=transfer,
        disable_log_stats=False,
        tensor_parallel_size=spec.tensor_parallel_size,
        attention_backend=spec.attention_backend,
    )
    results = []
    conversations: list[list[int]] = []
    for phase in spec.phases:
        if phase.wait_for:
            while not Path(phase.wait_for).exists():
                time.sleep(0.05)
            time.sleep(phase.settle_seconds)
        params = SamplingParams(temperature=0, max_tokens=phase.max_tokens, ignore_eos=True)
        result = PhaseResult(outputs=[], cached_tokens=[], ttft_s=[])
        prompts = phase.prompts
        if phase.follow_up:
            prompts = [history + turn for history, turn in zip(conversations, prompts, strict=True)]
        batches = [prompts] if phase.batch else [[prompt] for prompt in prompts]
        phase_started = time.perf_counter()
        for batch in batches:
            if phase.reset_before_each:
                reset_prefix_cache(llm, in_process=_in_process(spec))
            requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in batch]
            started = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            for output in outputs:
                latency = getattr(output.metrics, "first_token_latency", 0.0)
                result.outputs.append(list(output.outputs[0].token_ids))
                result.cached_tokens.append(int(output.num_cached_tokens or 0))
                result.finish_reasons.append(str(output.outputs[0].finish_reason))
                result.ttft_s.append(float(latency) if latency else elapsed)
        result.wall_s = time.perf_counter() - phase_started
        result.prompt_tokens = [len(prompt) for prompt in prompts]
        conversations = [p + o for p, o in zip(prompts, result.outputs, strict=True)]
        _flush_connector()
        result.ucm_totals = ucm_totals()
        results.append(asdict(result))
        if phase.signal:
            Path(phase.signal).touch()
    (workdir / "result.json").write_text(json.dumps(results))


def ucm_totals() -> dict[str, float]:
    """Return ucm's counters and latency sums as this process's Prometheus registry
    holds them (vLLM's stat loggers feed it every step), summed over engines, keyed by
    sample name and, for per-tier ones, ``|<tier>``."""
    import prometheus_client

    totals: dict[str, float] = {}
    for metric in prometheus_client.REGISTRY.collect():
        if not metric.name.startswith("ucm:"):
            continue
        for sample in metric.samples:
            if sample.name.endswith(("_total", "_sum")):
                tier = sample.labels.get("tier")
                name = sample.name.removeprefix("ucm:") + (f"|{tier}" if tier else "")
                totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def _in_process(spec: EngineSpec) -> bool:
    """Whether vLLM's scheduler and worker run in the engine process itself."""
    return not spec.multiprocessing and spec.tensor_parallel_size == 1


def reset_prefix_cache(llm: Any, in_process: bool, timeout: float = 60.0) -> None:
    """Empty vLLM's prefix cache once no finished request holds blocks any more.

    With ``async_save`` ucm keeps a finished request's blocks until their writes are
    done, and vLLM resets its cache only when no block is in use.

    Args:
        llm: The ``vllm.LLM``.
        in_process: Whether its scheduler and worker run in this process (then this
            steps the engine itself; otherwise its own loop does).
        timeout: Seconds to wait before giving up.

    Raises:
        RuntimeError: Blocks stayed in use for ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset: blocks stay in use")
        if in_process:
            llm.llm_engine.step()  # Lets the connector report the finished writes.
        else:
            time.sleep(0.01)


def _flush_connector() -> None:
    """Wait for ucm's background writes, so that the next phase sees every saved block.

    Only possible where the worker runs in this process (single-process mode).
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        flush = getattr(get_kv_transfer_group(), "flush_saves", None)
        if flush is not None:
            flush()


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
