"""Prefill/decode disaggregation on real ``vllm serve`` instances (2 prefill, 2 decode)
behind ``ucm pd-proxy``, the KV travelling through a Valkey server on loopback.

An ordinary OpenAI client talks to the proxy. Outputs must equal an engine's without
ucm, the decode instances must load every full block of each prompt instead of
computing it (their Prometheus counters say where prompt tokens came from), and the
proxy must spread requests over both instances of each pool.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.integration.conftest import WORKLOAD
from ucm.testing.servers import ValkeyServer
from ucm.testing.serving import Service, pd_proxy, prometheus_values, vllm_server

pytestmark = pytest.mark.engine

BLOCK_SIZE = 32
SOURCES = "vllm:prompt_tokens_by_source_total"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


def transfer(role: str, url: str) -> dict[str, Any]:
    tier = {"backend": "redis", "url": url, "capacity": "1GiB", "key_prefix": "pd:"}
    return {
        "kv_connector": "UCMConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": [tier]},
    }


@pytest.fixture(scope="module")
def deployment(
    tiny_model: str, valkey_server: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, list[Service]]]:
    logs = tmp_path_factory.mktemp("pd")
    services: dict[str, list[Service]] = {"prefill": [], "decode": [], "proxy": []}
    try:
        for index in range(2):
            for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
                config = transfer(role, valkey_server.url)
                server = vllm_server(f"{name}{index}", tiny_model, logs, config, core=index)
                services[name].append(server)
        services["proxy"].append(pd_proxy(services["prefill"], services["decode"], logs))
        for group in services.values():
            for service in group:
                service.wait_ready()
        yield services
    finally:
        for group in reversed(services.values()):
            for service in group:
                service.stop()


def by_source(service: Service) -> dict[str, float]:
    values = prometheus_values(service.get("/metrics"), SOURCES)
    return {
        source: sum(v for labels, v in values.items() if f'source="{source}"' in labels)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def client(deployment: dict[str, list[Service]]) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment["proxy"][0].url + "/v1", api_key="unused")


def complete(deployment: dict[str, list[Service]], model: str, prompt: list[int]) -> list[int]:
    reply = client(deployment).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    extra = reply.choices[0].model_extra or {}
    return list(extra["token_ids"])


def metric_total(services: list[Service], name: str, label: str = "") -> float:
    """Sum a metric over instances and over the samples whose labels contain ``label``."""
    total = 0.0
    for service in services:
        values = prometheus_values(service.get("/metrics"), name)
        total += sum(value for labels, value in values.items() if label in labels)
    return total


def ucm_metrics(deployment: dict[str, list[Service]]) -> dict[str, float]:
    decode, prefill = deployment["decode"], deployment["prefill"]
    return {
        "hits": metric_total(decode, "ucm:hit_tokens_total"),
        "remote": metric_total(decode, CACHED_BY_SOURCE, 'source="external_unspecified"'),
        "loaded": metric_total(decode, "ucm:tier_load_bytes_total", 'tier="0:redis"'),
        "load_batches": metric_total(decode, "ucm:load_seconds_count", 'tier="0:redis"'),
        "saved": metric_total(prefill, "ucm:tier_save_blocks_total", 'tier="0:redis"'),
    }


def test_decode_loads_the_prompt_and_answers_exactly(
    deployment: dict[str, list[Service]], tiny_model: str, reference: Any
) -> None:
    decode, prefill = deployment["decode"], deployment["prefill"]
    before = [by_source(service) for service in decode]
    prefilled = [by_source(service) for service in prefill]
    ucm_before = ucm_metrics(deployment)
    outputs = [complete(deployment, tiny_model, prompt) for prompt in WORKLOAD.warm]
    assert outputs == reference(BLOCK_SIZE)
    after = [by_source(service) for service in decode]
    delta = {
        source: sum(a[source] - b[source] for a, b in zip(after, before, strict=True))
        for source in after[0]
    }
    # Every full block of every prompt came from ucm, or from the decode instance's own
    # prefix cache where it had served the same document before; none was computed.
    full_blocks = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in WORKLOAD.warm)
    assert delta["external_kv_transfer"] + delta["local_cache_hit"] == full_blocks
    assert delta["local_compute"] == sum(len(p) for p in WORKLOAD.warm) - full_blocks
    assert delta["external_kv_transfer"] >= full_blocks // 2
    # Both instances of each pool served requests.
    pairs = zip(after, before, strict=True)
    assert all(a["external_kv_transfer"] > b["external_kv_transfer"] for a, b in pairs)
    done = [by_source(service) for service in prefill]
    pairs = zip(done, prefilled, strict=True)
    assert all(d["local_compute"] > p["local_compute"] for d, p in pairs)
    # ucm's own metrics, and vLLM's count of cached tokens by source, agree.
    ucm_after = ucm_metrics(deployment)
    change = {name: ucm_after[name] - ucm_before[name] for name in ucm_after}
    assert change["hits"] == change["remote"] == delta["external_kv_transfer"]
    assert change["loaded"] > 0 and change["load_batches"] > 0
    assert change["saved"] > 0


def test_vllm_log_line_shows_ucm_stats(deployment: dict[str, list[Service]]) -> None:
    deadline = time.monotonic() + 30  # vLLM logs its stats every 10 s while busy.
    pattern = re.compile(r"KV Transfer metrics: .*ucm_hit_tokens=(\d+)")
    while time.monotonic() < deadline:
        logs = [service.log.read_text() for service in deployment["decode"]]
        if any(int(m.group(1)) > 0 for log in logs for m in pattern.finditer(log)):
            return
        time.sleep(1)
    raise AssertionError("no 'KV Transfer metrics' line with ucm's hits in the decode logs")


def test_streamed_answer_equals_the_whole_answer(
    deployment: dict[str, list[Service]], tiny_model: str
) -> None:
    prompt = WORKLOAD.cold[0]
    settings: dict[str, Any] = {"model": tiny_model, "prompt": prompt, "max_tokens": 8}
    settings.update(temperature=0, extra_body={"ignore_eos": True})
    whole = client(deployment).completions.create(**settings).choices[0].text
    chunks = client(deployment).completions.create(stream=True, **settings)
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole
    assert whole


def test_proxy_forwards_other_paths_to_decode(deployment: dict[str, list[Service]]) -> None:
    models = client(deployment).models.list()
    assert [model.id for model in models]
