"""``make bench-model``: ticket drafts from the real local model, through the product's own provider.

It starts the llama.cpp server of :mod:`tools.modelserver` (SmolLM2-135M-Instruct; ``make model``
builds it) on a free port, then sends ``--n`` ticket-draft calls (120 by default) one after the
other through :meth:`apps.llm.providers.OpenAICompatibleProvider.complete`, each with the messages
:func:`apps.llm.drafter.render_prompt` renders for a report of the retrieval evaluation set
(``apps/evidence/eval/reports_{en,zh}.json``: English and Chinese reports on every kind of
device, with the device's state and alert). The evidence is the knowledge base's own chunks of the
documents that answer the report (``apps/evidence/kb``, at most five excerpts of 400 characters,
as retrieval gives them), none for the reports nothing covers; printer reports attach the demo's
panel log, as ``make demo`` does.

It prints the model and server version, per-call latency p50/p95/max in ms (all, English,
Chinese), tokens, and the rate of replies the product could not use (outcome other than ``ok``)
with the count of each outcome and the most frequent problems; all of it also goes to
``var/bench/model-<UTC time>.json``. Nothing is asserted.

No database is needed: the prompt and the provider read only settings (``config.settings.local``).

``python -m tools.bench.model [--n 120] [--seed 7] [--response-format json_object|json_schema]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import statistics
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
EVAL = ROOT / "apps" / "evidence" / "eval"
KB = ROOT / "apps" / "evidence" / "kb"
#: excerpt length and number of excerpts, as the product's retrieval gives them (selectors, TOP_K)
EXCERPT_CHARS, TOP_K = 400, 5
URGENCIES = ("normal", "high", "normal", "low", "critical", "normal")
CRITICALITY = ("medium", "high", "low")
SITES = ("HQ-1", "HQ-2W", "HQ-3E", "DC-1", "WH-1", "HQ-B1")
#: groups whose reports the knowledge base answers (the others get no evidence: nothing covers them)
ANSWERED = ("answerable", "answerable_other_alert", "answerable_zh", "answerable_zh_other_alert", "stale_only")


def _chunks(relative: str) -> list[dict]:
    """The chunks of knowledge-base file ``relative`` (e.g. ``public/ups-on-battery….md``) as the
    evidence refs retrieval records: chunk id, document title, version, section, excerpt."""
    from apps.evidence.chunking import parse_document

    path = KB / relative
    parsed = parse_document(path.name, path.read_text(encoding="utf-8"))
    # a stable, distinct id per chunk (the product's are database ids)
    base = 1000 + (sum(relative.encode()) * 7919) % 90000
    return [{"chunk_id": base + c.ordinal, "document_title": parsed.title, "version": 1, "section": c.section,
             "excerpt": c.text[:EXCERPT_CHARS]} for c in parsed.chunks]


def cases(n: int, seed: int = 7) -> list[dict]:
    """``n`` ticket-draft inputs ``{"id", "language", "request", "device", "evidence"}``, English
    and Chinese reports interleaved (shuffled by ``seed``; the sets repeat when ``n`` is larger)."""
    from tools.demo_client import DEMO_LOG, DEMO_LOG_NAME

    rng = random.Random(seed)  # noqa: S311 - a reproducible sample, not a secret
    sets = []
    for name in ("reports_en.json", "reports_zh.json"):
        reports = json.loads((EVAL / name).read_text(encoding="utf-8"))
        rng.shuffle(reports)
        sets.append(itertools.cycle(reports))
    out = []
    for i in range(n):
        report = next(sets[i % 2])
        d = report["device"]
        prefix = "".join(part[0] for part in d["kind"].split("_")).upper()
        device = {"asset_tag": f"{prefix}-{100 + i:04d}", "kind": d["kind"], "site": SITES[i % len(SITES)],
                  "state": d.get("state") or "ok", "criticality": CRITICALITY[i % len(CRITICALITY)],
                  "alert_code": d.get("alert_code") or "", "alert_message": d.get("alert_message") or "",
                  "version": 1 + i % 40}
        evidence = []
        if report["group"] in ANSWERED:
            for relative in report["relevant"]:
                evidence += _chunks(relative)
            evidence = evidence[:TOP_K]
        request = {"symptom": report["report"], "urgency": URGENCIES[i % len(URGENCIES)]}
        if d["kind"] == "printer":
            request["attachments"] = [{"name": DEMO_LOG_NAME, "content_type": "text/plain", "size": len(DEMO_LOG),
                                       "text": DEMO_LOG.decode()}]
        out.append({"id": report["id"], "language": report["language"], "group": report["group"],
                    "request": request, "device": device, "evidence": evidence})
    return out


def _stats(values: list[float]) -> dict:
    from tools.bench.harness import percentile

    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 50)), "p95": round(percentile(values, 95)),
            "max": round(max(values)), "mean": round(statistics.fmean(values))}


def run(*, n: int, seed: int, response_format: str, timeout: float, threads: int | None, out_dir: Path,
        verbose: bool = False) -> dict | None:
    """Start the model server, send ``n`` calls, print and return the figures (None when stopped
    before the first call). Stopped early (Ctrl-C, SIGTERM, SIGHUP), it still reports and writes the
    calls made so far, marked ``"complete": false``."""
    from django.conf import settings

    from tools import modelserver

    conf = settings.FAULTDESK
    inputs = cases(n, seed)
    # a log of its own per run: two benches (or a bench and the model tests) may run side by side
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_path = out_dir / "logs" / f"model-server-{stamp}-{os.getpid()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    threads = threads or modelserver.default_threads()
    print(f"• model {modelserver.MODEL_ALIAS} ({modelserver.gguf_path().name}), llama-cpp-python "
          f"{modelserver.server_version()}, {threads} threads, n_ctx {modelserver.N_CTX}; {n} calls, response_format "
          f"{response_format}, max_tokens {conf['MODEL_MAX_OUTPUT_TOKENS']}, timeout {timeout:.0f} s; server log "
          f"{log_path}", flush=True)
    started = time.monotonic()
    calls: list[dict] = []
    used: dict = {}
    complete = False
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stopped)
    try:
        _run_calls(inputs, calls, used, log_path=log_path, threads=threads, timeout=timeout, verbose=verbose,
                   response_format=response_format, started=started)
        complete = True
    finally:  # a stopped run still reports what it measured, then stops
        figures = _report(calls, response_format=response_format, threads=threads, out_dir=out_dir,
                          elapsed=time.monotonic() - started, output_parser=used.get("output_parser"),
                          complete=complete) if calls else None
    return figures


def _stopped(signum, _frame):
    raise SystemExit(f"bench-model stopped by signal {signal.Signals(signum).name}")


def _run_calls(inputs: list[dict], calls: list[dict], used: dict, *, log_path: Path, threads: int, timeout: float,
               verbose: bool, response_format: str, started: float) -> None:
    """Start the server, make the warm-up call, then one call per input, appending each to ``calls``
    as it ends; ``used`` gets the provider's output parser."""
    from django.conf import settings
    from django.test import override_settings

    from apps.llm.drafter import render_prompt
    from apps.llm.providers import OpenAICompatibleProvider, output_schema_for
    from tools import modelserver

    conf = settings.FAULTDESK
    n = len(inputs)
    with modelserver.ModelServer(log_path=log_path, n_threads=threads) as server, \
            override_settings(FAULTDESK={**conf, "MODEL_BASE_URL": server.base_url, "MODEL_API_KEY": server.api_key}):
        # the tool gateway reaches the server it was configured with, and injects its key
        print(f"• server up on {server.base_url} in {time.monotonic() - started:.1f} s", flush=True)
        provider = OpenAICompatibleProvider(
            base_url=server.base_url, model=modelserver.MODEL_ALIAS,
            max_output_tokens=conf["MODEL_MAX_OUTPUT_TOKENS"], units_per_1k=conf["MODEL_UNITS_PER_1K_TOKENS"],
            response_format=response_format)
        used["output_parser"] = provider.output_parser
        print(f"• output parser {provider.output_parser}", flush=True)
        warm = provider.complete(render_prompt(request=inputs[0]["request"], device=inputs[0]["device"],
                                               evidence=inputs[0]["evidence"]), timeout=timeout,
                                 schema=output_schema_for([str(e["chunk_id"]) for e in inputs[0]["evidence"]]))
        print(f"• warm-up call (not counted): {warm.outcome}, {warm.latency_ms} ms", flush=True)
        for i, case in enumerate(inputs, 1):
            messages = render_prompt(request=case["request"], device=case["device"], evidence=case["evidence"])
            # as controller/2 calls it: the schema narrowed to the evidence ids the prompt shows
            result = provider.complete(messages, timeout=timeout,
                                       schema=output_schema_for([str(e["chunk_id"]) for e in case["evidence"]]))
            calls.append({"id": case["id"], "language": case["language"], "evidence": len(case["evidence"]),
                          "outcome": result.outcome, "http_status": result.http_status,
                          "latency_ms": result.latency_ms, "usage": result.usage,
                          "problems": result.problems, "error": _error_text(result),
                          "cited_known": _cited_known(result.output, case["evidence"]),
                          "content": (result.content or "")[:2000]})
            if verbose or i % 10 == 0 or i == n:
                ok = sum(c["outcome"] == "ok" for c in calls)
                print(f"  {i:>4}/{n}  last {result.outcome:<9} {result.latency_ms:>6} ms · ok so far {ok}/{i}",
                      flush=True)

def _error_text(result) -> str | None:
    """A failed call's error in one line: for an HTTP error, its status and the server's own
    message (llama.cpp's server wraps a validation error in a long JSON body)."""
    if not result.error:
        return None
    found = re.search(r"'msg': \\?[\"'](.+?)\\?[\"'], '", result.error)
    text = found.group(1) if found else " ".join(result.error.split())
    return (f"HTTP {result.http_status}: " if result.http_status else "") + text[:160]


def _problem_kind(call: dict) -> str:
    """A failed call's first problem with what varies between replies taken out (positions, the
    offending value), so that the same failure is counted once."""
    problem = (call["problems"] or [call["error"] or call["outcome"]])[0]
    problem = re.sub(r"^(evidence|missing_information)/\d+: .* is not of type", r"\1/N: <a value> is not of type",
                     problem)
    return re.sub(r"\d+", "N", problem)[:110]


def _cited_known(output: dict | None, evidence: list[dict]) -> bool | None:
    """Whether an ok reply cites only chunk ids the prompt showed (None for no usable reply). The
    product's business rules refuse a draft citing anything else, so this is the share of ok replies
    that would pass that rule."""
    if output is None:
        return None
    shown = {str(e["chunk_id"]) for e in evidence}
    return all(str(ref) in shown for ref in output.get("evidence") or [])


def _report(calls: list[dict], *, response_format: str, threads: int, out_dir: Path | None, elapsed: float,
            output_parser: str | None = None, complete: bool = True) -> dict:
    """Print the figures of ``calls`` and, unless ``out_dir`` is None, write them with every call to
    ``out_dir/model-<UTC time>.json``."""
    from tools import modelserver

    n = len(calls)
    outcomes = Counter(c["outcome"] for c in calls)
    bad = n - outcomes.get("ok", 0)
    latency = {"all": _stats([c["latency_ms"] for c in calls])}
    for lang in ("en", "zh"):
        latency[lang] = _stats([c["latency_ms"] for c in calls if c["language"] == lang])
    latency["ok"] = _stats([c["latency_ms"] for c in calls if c["outcome"] == "ok"])
    with_usage = [c["usage"] for c in calls if c["usage"]]
    prompt = [u["prompt_tokens"] for u in with_usage]
    completion = [u["completion_tokens"] for u in with_usage]
    gen_ms = sum(c["latency_ms"] for c in calls if c["usage"])
    problems = Counter(_problem_kind(c) for c in calls if c["outcome"] != "ok")
    ok_calls = [c for c in calls if c["outcome"] == "ok"]
    cited_known = sum(1 for c in ok_calls if c["cited_known"])
    figures = {
        "model": modelserver.MODEL_ALIAS, "gguf": modelserver.gguf_path().name,
        "server": f"llama-cpp-python {modelserver.server_version()}", "threads": threads,
        "response_format": response_format, "output_parser": output_parser, "calls": n, "complete": complete,
        "outcomes": dict(outcomes), "malformed_rate": bad / n,
        "latency_ms": latency,
        "tokens": {"prompt_mean": round(statistics.fmean(prompt)) if prompt else None,
                   "prompt_max": max(prompt, default=None),
                   "completion_mean": round(statistics.fmean(completion)) if completion else None,
                   "completion_max": max(completion, default=None),
                   "total": sum(prompt) + sum(completion),
                   "per_second": round((sum(prompt) + sum(completion)) / (gen_ms / 1000), 1) if gen_ms else None},
        "ok_citing_only_shown_evidence": {"count": cited_known, "of_ok": len(ok_calls)},
        "problems": problems.most_common(8), "elapsed_s": round(elapsed, 1),
    }
    lines = ["", "model bench" + ("" if complete else f" (stopped early: {n} calls made)"),
             f"  model      {figures['model']} ({figures['gguf']}), {figures['server']}, {threads} threads",
             f"  calls      {n} ticket drafts through OpenAICompatibleProvider.complete "
             f"(response_format: {response_format}, output parser: {output_parser or 'not recorded'})"]
    for key in ("all", "en", "zh", "ok"):
        s = latency[key]
        if s["n"]:
            lines.append(f"  latency    {key:<3} n={s['n']:<4} p50 {s['p50']:>6} ms  p95 {s['p95']:>6} ms  "
                         f"max {s['max']:>6} ms")
    t = figures["tokens"]
    if with_usage:
        lines.append(f"  tokens     prompt mean {t['prompt_mean']} (max {t['prompt_max']}), completion mean "
                     f"{t['completion_mean']} (max {t['completion_max']}), {t['total']:,} in all, "
                     f"{t['per_second']} tokens/s (prompt and completion over the calls' wall time)")
    else:
        lines.append("  tokens     none reported (no call reached the model)")
    lines.append(f"  malformed  {bad}/{n} = {bad / n:.1%} not ok (" +
                 ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + ")")
    lines.append(f"  citations  {cited_known}/{len(ok_calls)} ok replies cite only evidence ids the prompt showed")
    for problem, count in figures["problems"]:
        lines.append(f"  problem    {count:>4} × {problem}")
    lines.append(f"  elapsed    {elapsed:,.0f} s")
    print("\n".join(lines), flush=True)
    if out_dir is None:
        return figures
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"model-{stamp}.json"
    path.write_text(json.dumps({"figures": figures, "calls": calls}, indent=2, ensure_ascii=False))
    print(f"• figures and every reply written to {path}", flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.bench.model``: see the module docstring. Exits 2 when ``make model`` has not run."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=120, help="calls to send (default 120)")
    parser.add_argument("--seed", type=int, default=7, help="shuffles the reports (default 7)")
    parser.add_argument("--response-format", choices=("json_object", "json_schema"), default="json_object",
                        help="how the provider asks for the schema (FAULTDESK_MODEL_RESPONSE_FORMAT): json_object, "
                             "the form llama-cpp-python's server applies as a grammar (default, what make up sets), "
                             "or json_schema, OpenAI's, which this server refuses with a 500")
    parser.add_argument("--timeout", type=float, default=120.0, help="per call, in seconds (default 120)")
    parser.add_argument("--threads", type=int, default=None, help="server threads (default: every core)")
    parser.add_argument("--verbose", action="store_true", help="a line per call")
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="print the figures of an earlier run's var/bench/model-*.json again (no server)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
    import django

    django.setup()
    from tools import modelserver
    from tools.bench.harness import BENCH_DIR

    if args.report:
        saved = json.loads(args.report.read_text(encoding="utf-8"))
        figures = saved["figures"]
        _report(saved["calls"], response_format=figures["response_format"], threads=figures["threads"], out_dir=None,
                elapsed=figures["elapsed_s"], output_parser=figures.get("output_parser"),
                complete=figures.get("complete", True))
        return 0
    try:
        modelserver.gguf_path()
    except modelserver.ModelNotBuilt as exc:
        print(exc, file=sys.stderr)
        return 2
    run(n=max(1, args.n), seed=args.seed, response_format=args.response_format, timeout=args.timeout,
        threads=args.threads, out_dir=BENCH_DIR, verbose=args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
