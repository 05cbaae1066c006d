"""The Parca and Alloy configurations of docs/heap-profiles.md, read from
the page and checked field by field against the fields their projects'
sources define (neither project is packaged here, so their own parsers
cannot read them), and against what serve answers.

Sources, as read for this check:
- Parca: pkg/config/config.go (ScrapeConfig, ProfilingConfig,
  PprofProfilingConfig, SampleType, the timeout's check in UnmarshalYAML),
  with Prometheus' common HTTPClientConfig inlined and its static_configs;
- Alloy: internal/component/pyroscope/scrape/scrape.go (Arguments,
  ProfilingConfig, ProfilingTarget), with Alloy's HTTPClientConfig
  squashed in (internal/component/common/config)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml
from mtrace_live.exporters.heap_profiles import MAX_SECONDS, PREFIX, PROFILES, parse_query

DOC = Path(__file__).resolve().parents[2] / "docs" / "heap-profiles.md"
SERVED = {PREFIX + name for name in PROFILES}

# Parca's ScrapeConfig yaml fields, HTTPClientConfig's (inline) and the static discovery's
PARCA_JOB = {"job_name", "params", "scrape_interval", "scrape_timeout", "scheme",
             "normalized_addresses", "profiling_config", "relabel_configs", "static_configs",
             "basic_auth", "authorization", "oauth2", "bearer_token", "bearer_token_file",
             "tls_config", "proxy_url", "follow_redirects", "enable_http2"}  # fmt: skip
PARCA_BLOCKS = {
    "basic_auth": {"username", "username_file", "password", "password_file"},
    "tls_config": {
        "ca",
        "ca_file",
        "cert",
        "cert_file",
        "key",
        "key_file",
        "server_name",
        "insecure_skip_verify",
        "min_version",
        "max_version",
    },
    "profiling_config": {"pprof_config", "path_prefix"},
}
PARCA_PROFILE = {"enabled", "path", "delta", "keep_sample_type"}  # PprofProfilingConfig
PARCA_SAMPLE_TYPE = {"type", "unit"}  # SampleType

# Alloy's pyroscope.scrape Arguments (attributes and blocks), and its HTTPClientConfig's
ALLOY_ATTRIBUTES = {"targets", "forward_to", "job_name", "params", "scrape_interval",
                    "scrape_timeout", "scheme", "delta_profiling_duration", "bearer_token",
                    "bearer_token_file", "proxy_url", "follow_redirects",
                    "enable_http2"}  # fmt: skip
ALLOY_BLOCKS = {
    "basic_auth": {"username", "password", "password_file"},
    "tls_config": {
        "ca_pem",
        "ca_file",
        "cert_pem",
        "cert_file",
        "key_pem",
        "key_file",
        "server_name",
        "insecure_skip_verify",
        "min_version",
    },
    "profiling_config": {"path_prefix"},
}
ALLOY_PROFILES = {"profile." + name for name in (
    "memory", "block", "goroutine", "mutex", "process_cpu", "fgprof", "godeltaprof_memory",
    "godeltaprof_mutex", "godeltaprof_block")}  # fmt: skip
ALLOY_PROFILE = {"enabled", "path", "delta"}  # ProfilingTarget


def block(language: str, after: str) -> str:
    """The first fenced block of ``language`` after the heading ``after``."""
    text = DOC.read_text()
    found = re.search(rf"```{language}\n(.*?)```", text[text.index(after) :], re.DOTALL)
    assert found, (language, after)
    return found[1]


def seconds_of(duration: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()  # type: ignore[union-attr]
    return int(number) * {"s": 1, "m": 60, "h": 3600}[unit]


def parca_jobs() -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = yaml.safe_load(block("yaml", "### Parca"))["scrape_configs"]
    return jobs


@pytest.mark.parametrize("job", parca_jobs(), ids=lambda job: job["job_name"])
def test_each_parca_job_has_only_fields_parca_defines(job: dict[str, Any]) -> None:
    assert set(job) <= PARCA_JOB, set(job) - PARCA_JOB
    for name, fields in PARCA_BLOCKS.items():
        assert set(job.get(name, {})) <= fields, (name, job.get(name))
    for profile in job["profiling_config"]["pprof_config"].values():
        assert set(profile) <= PARCA_PROFILE, profile
        for kept in profile.get("keep_sample_type", []):
            assert set(kept) <= PARCA_SAMPLE_TYPE, kept
    assert all(isinstance(values, list) for values in job.get("params", {}).values())


@pytest.mark.parametrize("job", parca_jobs(), ids=lambda job: job["job_name"])
def test_each_parca_job_is_one_parca_takes_and_serve_answers(job: dict[str, Any]) -> None:
    interval = seconds_of(job["scrape_interval"])
    # Parca refuses a job whose timeout is not longer than its interval
    assert seconds_of(job["scrape_timeout"]) > interval
    for profile in job["profiling_config"]["pprof_config"].values():
        if not profile.get("enabled", True):
            continue
        # an enabled profile is one serve serves, its sample types serve's
        assert profile["path"] in SERVED, profile
        for kept in profile.get("keep_sample_type", []):
            assert kept["type"] in {"inuse_space", "inuse_objects", "alloc_space",
                                    "alloc_objects"}  # fmt: skip
            assert kept["unit"] == ("bytes" if kept["type"].endswith("_space") else "count")
        # the query Parca sends (params, and seconds once per target for a delta) is read
        params = {key: list(values) for key, values in job.get("params", {}).items()}
        if profile.get("delta"):
            assert interval <= MAX_SECONDS
            targets = sum(len(group["targets"]) for group in job["static_configs"])
            params.setdefault("seconds", []).extend([str(interval)] * targets)
        query = parse_query(profile["path"][len(PREFIX) :], urlencode(sorted(params.items()),
                                                                     doseq=True))  # fmt: skip
        assert query.seconds == (interval if profile.get("delta") else 0)
        assert query.comm == job["params"]["comm"][0]


def alloy_blocks(text: str) -> list[tuple[str, dict[str, str], list[Any]]]:
    """Alloy's syntax as the example uses it: blocks (a name, a label,
    braces) holding ``key = value`` lines and blocks, as (name, attributes,
    blocks) trees."""
    stack: list[tuple[str, dict[str, str], list[Any]]] = [("", {}, [])]
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.endswith("{"):
            opened: tuple[str, dict[str, str], list[Any]] = (line[:-1].split()[0], {}, [])
            stack[-1][2].append(opened)
            stack.append(opened)
        elif line == "}":
            stack.pop()
        else:
            key, equals, value = line.partition("=")
            assert equals, line
            stack[-1][1][key.strip()] = value.strip()
    assert len(stack) == 1, "unbalanced braces"
    return stack[0][2]


def test_the_alloy_component_has_only_fields_alloy_defines_and_reads_serve_right() -> None:
    top = alloy_blocks(block("alloy", "### Grafana Alloy and Pyroscope"))
    scrape = next(b for b in top if b[0] == "pyroscope.scrape")
    assert set(scrape[1]) <= ALLOY_ATTRIBUTES, set(scrape[1]) - ALLOY_ATTRIBUTES
    profiles = []
    for name, attributes, inner in scrape[2]:
        assert name in ALLOY_BLOCKS, name
        assert set(attributes) <= ALLOY_BLOCKS[name], (name, attributes)
        if name == "profiling_config":
            profiles = inner
    assert profiles
    for name, attributes, inner in profiles:
        assert name in ALLOY_PROFILES and not inner, name
        assert set(attributes) <= ALLOY_PROFILE, (name, attributes)
    enabled = {name: attributes for name, attributes, _ in profiles
               if attributes.get("enabled") == "true"}  # fmt: skip
    # only the memory profile, whole (Alloy differences it itself), on a path serve serves
    assert set(enabled) == {"profile.memory"}
    memory = enabled["profile.memory"]
    assert memory.get("delta", "false") == "false"
    assert memory["path"].strip('"') in SERVED
