"""The ``ucm`` command line: ``ucm demo`` runs vLLM twice and shows what ucm saves;
``ucm bench`` measures; ``ucm fsck``, ``ucm du`` and ``ucm gc`` check, size and trim
``posix`` stores; ``ucm serve`` is ``vllm serve`` (on any vLLM build) and ``ucm vllm``
any other ``vllm`` command; ``ucm pd-proxy`` fronts prefill and decode instances."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
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
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("serve", "vllm"):  # Everything else is vLLM's to parse.
        from ucm.serving.vllm_cli import run_vllm

        return run_vllm(argv if argv[0] == "serve" else argv[1:])
    parser = argparse.ArgumentParser(prog="ucm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="vllm serve ARGS (works on vLLM's CPU build too)")
    commands.add_parser("vllm", help="any vllm command: ucm vllm bench serve ARGS")
    proxy = commands.add_parser("pd-proxy", help="front prefill and decode vllm instances")
    proxy.add_argument("--prefill", nargs="+", required=True, help="prefill instance URLs")
    proxy.add_argument("--decode", nargs="+", required=True, help="decode instance URLs")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on")
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
        "--systems",
        nargs="+",
        metavar="NAME",
        help="e2e: run only these systems (names as in the report, e.g. 'ucm posix')",
    )
    bench.add_argument(
        "--scratch",
        type=Path,
        default=Path(".bench"),
        help="models and stores (on the disk to test)",
    )
    bench.add_argument("--results", type=Path, default=Path("bench-results"), help="output")
    bench.add_argument("--block-kib", type=int, default=1024, help="stored block size")
    bench.add_argument("--blocks", type=int, default=256, help="blocks per batch")
    check = commands.add_parser("fsck", help="verify every block of a posix store")
    check.add_argument("path", type=Path, help="the posix tier's path")
    check.add_argument("--repair", action="store_true", help="remove damaged and stale files")
    check.add_argument("--secret-file", help="file holding the store's signing secret")
    check.add_argument("--secret-env", help="environment variable holding the secret")
    usage = commands.add_parser("du", help="show the size of posix stores")
    usage.add_argument("paths", type=Path, nargs="+", help="posix tiers' paths")
    collect = commands.add_parser("gc", help="trim a posix store to a size (LRU first)")
    collect.add_argument("path", type=Path, help="the posix tier's path")
    collect.add_argument("--size", required=True, help="bytes to keep, e.g. 10GiB")
    args = parser.parse_args(argv)
    if args.command == "pd-proxy":
        from ucm.serving import pd_proxy

        pd_proxy.serve(args.prefill, args.decode, args.host, args.port)
        return 0
    if args.command == "gc":
        return run_gc(args.path, args.size)
    if args.command == "fsck":
        return run_fsck(args.path, args.repair, args.secret_file, args.secret_env)
    if args.command == "du":
        return run_du(args.paths)
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
    systems: tuple[e2e.System, ...] = e2e.SYSTEMS
    if args.systems:
        known = {system.name: system for system in e2e.SYSTEMS}
        unknown = [name for name in args.systems if name not in known]
        if unknown:
            print(f"--systems: unknown {unknown[0]!r}; known: {sorted(known)}", file=sys.stderr)
            return 2
        systems = tuple(known[name] for name in args.systems)
    measured = e2e.run(preset, workload, workdir.absolute(), systems)
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


def run_fsck(path: Path, repair: bool, secret_file: str | None, secret_env: str | None) -> int:
    """Verify a posix store and print what was found.

    Returns:
        0 when the store is clean, 1 when problems were repaired, 2 when problems remain.
    """
    from ucm.store.blockfile import read_secret
    from ucm.store.posix_fsck import fsck

    options = {"secret_file": secret_file, "secret_env": secret_env}
    try:
        report = fsck(
            path,
            secret=read_secret({k: v for k, v in options.items() if v}, "posix"),
            repair=repair,
        )
    except ValueError as exc:
        print(f"ucm fsck: {exc}")
        return 2
    print(f"{report.blocks} blocks verified, {report.payload_bytes / 2**20:.1f} MiB of KV")
    for label, paths in [
        ("damaged block", report.damaged),
        ("stale temporary file", report.stale_tmp),
        ("stray file (left alone)", report.stray),
        ("other format version (never read; remove by hand)", report.other_versions),
    ]:
        for found in paths:
            print(f"{label}: {found}")
    if report.clean:
        return 0
    if repair:
        print(f"repaired: removed {report.removed} files")
        return 1
    print("problems found; run again with --repair to remove them")
    return 2


def run_gc(path: Path, size: str) -> int:
    """Trim a posix store to ``size`` payload bytes, least recently used blocks first.

    Returns:
        0, or 2 when the path or the size is bad.
    """
    from ucm.config import parse_size
    from ucm.store.posix_fsck import trim

    try:
        removed, left = trim(path, parse_size(size, "--size"))
    except ValueError as exc:
        print(f"ucm gc: {exc}")
        return 2
    print(f"{path}: removed {removed} blocks, {left / 2**20:.1f} MiB of KV left")
    return 0


def run_du(paths: list[Path]) -> int:
    """Print the blocks and bytes of each posix store.

    Returns:
        0, or 2 when a path is not a directory.
    """
    from ucm.store.posix_fsck import disk_usage

    status = 0
    for path in paths:
        try:
            usage = disk_usage(path)
        except ValueError as exc:
            print(f"ucm du: {exc}")
            status = 2
            continue
        mib = usage.file_bytes / 2**20
        print(f"{path}: {usage.blocks} blocks, {mib:.1f} MiB, {usage.tmp_files} temporary files")
    return status


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
