"""The ``ucm`` command line: ``ucm demo`` runs vLLM twice and shows what ucm saves."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from ucm.config import default_settings

MODEL_PRESETS = {
    "tiny": "TINY",
    "small": "SMALL",
    "medium": "MEDIUM",
    "large": "LARGE",
    "kv-heavy": "KV_HEAVY",
}
"""``--model`` names of :mod:`ucm.testing.model`'s presets."""


def main(argv: list[str] | None = None) -> int:
    """Run the ``ucm`` command line.

    Args:
        argv: Arguments (without the program name); ``None`` reads ``sys.argv``.

    Returns:
        The process exit status.
    """
    parser = argparse.ArgumentParser(prog="ucm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run vLLM cold and warm on a small local model")
    demo.add_argument("--workdir", type=Path, default=Path(".demo"), help="models and store")
    demo.add_argument("--documents", type=int, default=3, help="documents to ask about")
    demo.add_argument("--document-tokens", type=int, default=1536, help="tokens per document")
    bench = commands.add_parser("bench", help="measure ucm next to the machine's limits")
    bench.add_argument("suite", choices=["datapath", "e2e"], help="which benchmark to run")
    bench.add_argument("--model", choices=list(MODEL_PRESETS), default="medium", help="e2e model")
    bench.add_argument("--documents", type=int, default=4, help="e2e: documents")
    bench.add_argument("--document-tokens", type=int, default=2048, help="e2e: tokens each")
    bench.add_argument(
        "--scratch",
        type=Path,
        default=Path(".bench"),
        help="models and stores (on the disk to test)",
    )
    bench.add_argument("--results", type=Path, default=Path("bench-results"), help="output")
    bench.add_argument("--block-kib", type=int, default=1024, help="stored block size")
    bench.add_argument("--blocks", type=int, default=256, help="blocks per batch")
    args = parser.parse_args(argv)
    if args.command == "bench" and args.suite == "datapath":
        store = args.scratch / "store"
        return run_datapath_bench(store, args.results, args.block_kib << 10, args.blocks)
    if args.command == "bench":
        return run_e2e_bench(args.scratch / "e2e", args.results, args)
    return run_demo(args.workdir, args.documents, args.document_tokens)


def run_e2e_bench(workdir: Path, results: Path, args: argparse.Namespace) -> int:
    """Run the end-to-end benchmark; write ``e2e.json`` and ``e2e.md``.

    Returns:
        0 (the benchmark reports; it does not judge).
    """
    from ucm.bench import e2e
    from ucm.testing import model

    preset = getattr(model, MODEL_PRESETS[args.model])
    workload = e2e.Workload(documents=args.documents, document_tokens=args.document_tokens)
    measured = e2e.run(preset, workload, workdir.absolute())
    _write_report(results, "e2e", measured, e2e.markdown(measured))
    if e2e.plot(measured, results / "e2e-ttft.png"):
        print(f"plot: {results / 'e2e-ttft.png'}")
    else:
        print("plot skipped: install matplotlib (pip install 'ucm[bench]') for e2e-ttft.png")
    return 0


def run_datapath_bench(store_dir: Path, results: Path, block_bytes: int, blocks: int) -> int:
    """Run the data-path micro-benchmark; write ``datapath.json`` and ``datapath.md``.

    Returns:
        0 (the benchmark reports; it does not judge).
    """
    from ucm.bench import datapath

    measured = datapath.run(store_dir, block_bytes, blocks)
    _write_report(results, "datapath", measured, datapath.markdown(measured))
    return 0


def _write_report(results: Path, name: str, measured: dict[str, object], report: str) -> None:
    """Write ``name.json`` and ``name.md`` into ``results`` and print the report."""
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(measured, indent=2))
    (results / f"{name}.md").write_text(report)
    print(report)


def run_demo(workdir: Path, documents: int, document_tokens: int) -> int:
    """Ask questions about documents in two fresh vLLM processes sharing one ucm store.

    The first process computes every document (cold) and ucm saves its KV; the
    second, a new process, asks new questions about the same documents and loads
    the documents' KV from ucm instead of computing it (warm). A third run without
    ucm gives the reference outputs, which both must match token for token.

    Returns:
        0 when the outputs match and the warm run loaded KV from ucm, else 1.
    """
    from ucm.testing.engine import EngineSpec, Phase, PhaseResult, run_engine
    from ucm.testing.model import SMALL, build_model, make_prompt_token_ids

    workdir = workdir.absolute()
    store = workdir / "store"
    shutil.rmtree(store, ignore_errors=True)
    print(f"building a small random-weight model under {workdir / 'models'} ...", flush=True)
    model = build_model(SMALL, workdir / "models")
    settings = default_settings()
    settings["tiers"][1]["path"] = str(store)
    transfer = {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": settings,
    }

    def prompts(question_seed: int) -> list[list[int]]:
        return [
            make_prompt_token_ids(document_tokens, seed=doc, vocab_size=SMALL.vocab_size)
            + make_prompt_token_ids(48, seed=question_seed + doc, vocab_size=SMALL.vocab_size)
            for doc in range(documents)
        ]

    cold, warm = prompts(1000), prompts(2000)
    with tempfile.TemporaryDirectory(prefix="ucm-demo-") as scratch:
        runs: dict[str, PhaseResult] = {}
        for name, phase_prompts, config in (
            ("reference (no ucm)", warm, None),
            ("cold (ucm saves)", cold, transfer),
            ("warm (new process, ucm loads)", warm, transfer),
        ):
            print(f"running vLLM: {name} ...", flush=True)
            spec = EngineSpec(
                model=str(model),
                phases=[Phase(prompts=phase_prompts, max_tokens=16, reset_before_each=True)],
                block_size=32,
                kv_transfer_config=config,
                max_model_len=document_tokens + 256,
            )
            runs[name] = run_engine(spec, Path(scratch) / str(len(runs)))[0]
    reference, cold_run, warm_run = runs.values()
    print()
    print(f"{'run':34} {'TTFT p50 (ms)':>14} {'prompt tokens loaded':>22}")
    for name, result in runs.items():
        ttft = statistics.median(result.ttft_s) * 1000
        print(f"{name:34} {ttft:14.1f} {sum(result.cached_tokens):22d}")
    matches = warm_run.outputs == reference.outputs
    loaded = sum(warm_run.cached_tokens)
    speedup = statistics.median(cold_run.ttft_s) / statistics.median(warm_run.ttft_s)
    print()
    print(f"warm TTFT is {speedup:.1f}x faster than cold; {loaded} prompt tokens came from ucm")
    print(f"warm outputs identical to the reference run without ucm: {matches}")
    return 0 if matches and loaded > 0 else 1
