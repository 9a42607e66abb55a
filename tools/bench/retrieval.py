"""Phase 5, retrieval: the product's permission-aware hybrid retrieval
(:func:`apps.evidence.selectors.evidence_rank`) at 10k and 100k chunks, for a reader who may see
every chunk and for one whose scopes permit 1% of them: latency per query and recall@10 of the
vector ranking against exact search.

The corpus is one tenant (``bench-retrieval``) of synthetic chunks written straight into
``evidence_chunk`` with a binary ``COPY``: a few hundred real sentences of the project's knowledge
base (printers, UPSs, switches, firewalls, badge readers, ...) are embedded once with the real
model; each chunk's text is 1–3 of them and its vector the normalized weighted sum of theirs plus a
little Gaussian noise, so the full-text and vector rankings agree as they do on real chunks. Its
``search_vector`` is filled as :func:`apps.evidence.services.document_ingest` fills it. Documents
have 50 chunks each; one document in a hundred has scope ``security`` (the 1% filter), the rest
``public`` or ``tier2``.

The HNSW index is dropped for each load and recreated (same definition) afterwards, its build timed;
the table is then vacuumed and analyzed (what autovacuum does to an insert-only table).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np

from tools.bench.harness import Bench, percentile

TENANT_SLUG = "bench-retrieval"
CHUNKS_PER_DOCUMENT = 50
#: One document in this many has scope "security": the reader with only that scope sees 1%.
SECURITY_EVERY = 100
BASE_SENTENCES = 800
NOISE_SIGMA = 0.01  # per dimension: a noise vector of norm ~0.2 on a unit-length mix
EXACT_K = 10
WARMUP = 5
SEED = 9
#: Synthetic chunks made in one pass (see :meth:`_Corpus.chunks`).
CHUNK_BLOCK = 100_000

FILTERS = {"all": ["public", "tier2", "security"], "1pct": ["security"]}

#: Symptoms a requester reports; each is asked plainly and with a follow-up, so 2 × 50 queries.
SYMPTOMS = [
    "Printer shows a paper jam code PRN-JAM-13.2 from tray 2 every few pages",
    "Fuser error after warm-up and pages come out smeared",
    "Toner smears on every page and the drum unit warning is on",
    "MFP scan to email fails with an SMTP authentication error",
    "Label printer prints faded labels and the print head looks dirty",
    "Label printer says ribbon out although a new ribbon is loaded",
    "UPS switched to battery and keeps beeping although mains power is back",
    "UPS battery replacement alarm after the self-test failed",
    "UPS overload alarm and the load transferred to bypass",
    "PDU outlet overcurrent warning and the breaker tripped in the rack",
    "Switch port went err-disabled after a loop was detected",
    "PoE budget exceeded on the access switch and phones lost power",
    "Wireless access point offline and showing a red LED",
    "Laptops cannot authenticate to the corporate Wi-Fi, RADIUS rejects them",
    "Firewall CPU at 100 percent and the session table is full",
    "Site-to-site VPN tunnel to the branch office is down",
    "Firewall HA pair failed over and both units claim to be active",
    "NAS volume almost full and users hit their quota",
    "Disk array reports a predictive drive failure on one disk",
    "Server BMC shows a fan and power supply hardware health alert",
    "Thin client cannot connect to the VDI desktop pool",
    "USB headset and second monitor not redirected on the thin client",
    "Conference room display shows no signal from the HDMI input",
    "Echo on the conference room microphone during calls",
    "Barcode scanner does not read labels or sends wrong data",
    "Barcode scanner will not pair with its cradle and does not charge",
    "Temperature and humidity alarm in the server room",
    "Water leak sensor alarm under the raised floor",
    "HVAC zone too warm, occupants complain about temperature",
    "Badge access denied at the main door for a valid employee card",
    "Badge reader offline and reporting a tamper alarm",
    "Door forced open alarm and door held open alarm at the loading dock",
    "Door controller lost power and the locks failed open",
    "Electronic key cabinet alarm, a key was not returned",
    "IP camera video loss and tamper detection on the parking camera",
    "NVR has recording gaps and we need to export evidence footage",
    "Recovery key retrieval from escrow needs dual control approval",
    "Printer offline on the print server and jobs stuck as paused",
    "Duplex unit jams on heavy paper stock PRN-JAM-13.D",
    "Output bin full sensor and stapler jam on the finisher",
    "Pickup roller worn, repeated jams from the same tray",
    "Fuser temperature low 142 C alert PRN-FUSER-50.2",
    "Switch port flapping and CRC errors on the uplink",
    "Access point rebooting repeatedly after a firmware upgrade",
    "VPN users disconnected when the firewall failed over",
    "UPS runtime much shorter than expected on battery",
    "PDU reports high load on one phase of the rack",
    "Camera night mode not working and the image is dark",
    "Badge reader beeps red and the door does not unlock",
    "Storage quota warning emails for the shared team folder",
]
FOLLOW_UP = " - what should be checked first?"


def _label(size: int) -> str:
    return f"{size // 1000}k" if size % 1000 == 0 else str(size)


def _kb_sentences() -> list[tuple[str, str]]:
    """``(section, sentence)`` pairs from the project's knowledge base (every scope), 40–240
    characters, at least 6 words, no tables; deduplicated, in a stable order."""
    from apps.evidence.chunking import parse_document
    from apps.evidence.corpus import KB_DIR

    seen: dict[str, str] = {}
    for path in sorted(Path(KB_DIR).rglob("*.md")):
        if path.name.lower() == "readme.md":
            continue
        for chunk in parse_document(path.name, path.read_text()).chunks:
            for line in chunk.text.splitlines():
                line = re.sub(r"^\s*(?:[-*]|\d+\.)\s+", "", line).strip()
                if not line or line.startswith(("#", "|")):
                    continue
                for sentence in re.split(r"(?<=[.!?])\s+", line):
                    sentence = sentence.strip()
                    if 40 <= len(sentence) <= 240 and len(sentence.split()) >= 6:
                        seen.setdefault(sentence, chunk.section or path.stem)
    return [(section, sentence) for sentence, section in seen.items()]


class _Corpus:
    """The base sentences, their embeddings (``(n, 512)`` float32, unit length) and the generator
    of synthetic chunks."""

    def __init__(self, sentences: list[tuple[str, str]], vectors: np.ndarray):
        self.sections = [s for s, _ in sentences]
        self.texts = [t for _, t in sentences]
        self.vectors = vectors
        self.rng = np.random.default_rng(SEED)

    def chunks(self, n: int) -> tuple[list[str], list[str], np.ndarray]:
        """``n`` synthetic chunks: ``(sections, texts, vectors)`` with ``vectors`` ``(n, 512)``
        float32 of unit length. Made :data:`CHUNK_BLOCK` at a time, so a million chunks need about
        2 GiB for their vectors and not the 12 GiB of one pass (a load of at most one block draws
        exactly what one pass did)."""
        sections, texts, blocks = [], [], []
        for start in range(0, n, CHUNK_BLOCK):
            s, t, v = self._block(min(CHUNK_BLOCK, n - start))
            sections += s
            texts += t
            blocks.append(v)
        return sections, texts, np.concatenate(blocks) if blocks else np.zeros((0, self.vectors.shape[1]), np.float32)

    def _block(self, n: int) -> tuple[list[str], list[str], np.ndarray]:
        rng = self.rng
        picks = rng.integers(0, len(self.texts), size=(n, 3))
        used = rng.integers(1, 4, size=n)  # 1–3 sentences per chunk
        weights = rng.uniform(0.5, 1.0, size=(n, 3)).astype(np.float32)
        weights[np.arange(3)[None, :] >= used[:, None]] = 0.0
        vecs = np.einsum("nk,nkd->nd", weights, self.vectors[picks])
        vecs += rng.normal(0.0, NOISE_SIGMA, size=vecs.shape).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        texts = [" ".join(self.texts[j] for j in row[:m]) for row, m in zip(picks.tolist(), used.tolist(), strict=True)]
        sections = [self.sections[row[0]][:300] for row in picks.tolist()]
        return sections, texts, vecs.astype(np.float32)


def _index_definition() -> str:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'chunk_embedding_hnsw'")
        row = cur.fetchone()
    if row is None:
        raise SystemExit("index chunk_embedding_hnsw is missing: is the bench database migrated?")
    return row[0]


def _load(tenant, corpus: _Corpus, *, first_doc: int, n: int) -> tuple[int, float]:
    """Add ``n`` chunks to ``tenant`` (documents ``first_doc`` onwards) with the HNSW index dropped;
    returns ``(documents added, seconds)``. The index stays dropped (see :func:`_build_index`)."""
    from django.db import connection, transaction
    from pgvector.psycopg.vector import register_vector_info
    from psycopg.types import TypeInfo

    from apps.evidence.embedding import model_configured
    from apps.evidence.models import Document, DocumentVersion

    sections, texts, vecs = corpus.chunks(n)
    started = time.monotonic()
    n_docs = -(-n // CHUNKS_PER_DOCUMENT)
    scopes = ["security" if (first_doc + i) % SECURITY_EVERY == SECURITY_EVERY // 2
              else ("public" if (first_doc + i) % 5 < 3 else "tier2") for i in range(n_docs)]
    with transaction.atomic():
        docs = Document.objects.bulk_create([
            Document(tenant=tenant, source=f"bench/doc-{first_doc + i:05d}.md", title=f"Bench document {first_doc + i}",
                     scope=scope, current_version=1) for i, scope in enumerate(scopes)])
        content = "Synthetic bench document: knowledge-base sentences in chunks."
        versions = DocumentVersion.objects.bulk_create([
            DocumentVersion(document=d, version=1, content=content,
                            content_digest=hashlib.sha256(content.encode()).hexdigest()) for d in docs])
        with connection.cursor() as wrapper:
            cur = wrapper.cursor  # psycopg's own cursor: the vector dumper is registered on it alone
            register_vector_info(cur, TypeInfo.fetch(connection.connection, "vector"))
            cur.execute("SET LOCAL statement_timeout = 0")  # a million rows' tsvectors take minutes
            cur.execute("DROP INDEX IF EXISTS chunk_embedding_hnsw")
            cur.execute("CREATE TEMP TABLE bench_chunk_load ON COMMIT DROP AS SELECT document_version_id, tenant_id, "
                        "scope, is_current, ordinal, section, start_offset, end_offset, text, content_digest, "
                        "embedding FROM evidence_chunk WITH NO DATA")
            cur.execute("SELECT atttypid FROM pg_attribute WHERE attrelid = 'bench_chunk_load'::regclass "
                        "AND attnum > 0 AND NOT attisdropped ORDER BY attnum")
            types = [r[0] for r in cur.fetchall()]
            with cur.copy("COPY bench_chunk_load FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(types)
                offset = 0
                for i in range(n):
                    ordinal = i % CHUNKS_PER_DOCUMENT
                    if ordinal == 0:
                        offset = 0
                    text = texts[i]
                    copy.write_row((versions[i // CHUNKS_PER_DOCUMENT].pk, tenant.pk,
                                    scopes[i // CHUNKS_PER_DOCUMENT], True, ordinal, sections[i], offset,
                                    offset + len(text), text, hashlib.sha256(text.encode()).hexdigest(), vecs[i]))
                    offset += len(text) + 1
            # search_vector as document_ingest writes it: section weight A, text weight B, 'english' (the
            # bench's texts are English, so the 'simple' leg of Chinese words is empty). Every column the
            # model defaults in Python (not in the database) is written here as the product would write it
            # for a governed, always-in-force chunk embedded by the configured model, applicable to any
            # device: the product's own selectors must see these rows.
            cur.execute("""
                INSERT INTO evidence_chunk (document_version_id, tenant_id, scope, is_current, ordinal, section,
                    start_offset, end_offset, text, content_digest, embedding, embedding_model, search_vector,
                    locale, governed, effective_at, expires_at, device_kinds, alert_codes)
                SELECT document_version_id, tenant_id, scope, is_current, ordinal, section, start_offset,
                    end_offset, text, content_digest, embedding, %(model)s,
                    setweight(to_tsvector('english'::regconfig, COALESCE(section, '')), 'A')
                    || setweight(to_tsvector('english'::regconfig, COALESCE(text, '')), 'B'),
                    'en', true, NULL, NULL, '{}'::varchar[], '{}'::varchar[]
                FROM bench_chunk_load""", {"model": model_configured()})
    return n_docs, time.monotonic() - started


def _maintenance_mib(chunks: int) -> int:
    """Maintenance memory for building the HNSW index over ``chunks`` rows, in MiB: 1 GiB, or about
    4 KiB a row when more (a 512-dimension vector is 2 KiB, plus its neighbour lists), so the graph
    is built in memory: pgvector's build falls back to a much slower one once it no longer fits."""
    return max(1024, chunks * 4 // 1024)


def _build_index(definition: str, chunks: int) -> tuple[float, float]:
    """Recreate the HNSW index from ``definition`` (the migration's, read back from the catalog)
    over ``chunks`` rows with :func:`_maintenance_mib` of maintenance memory and 2 parallel
    workers, then VACUUM ANALYZE the table; returns ``(build seconds, index MiB)``."""
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL statement_timeout = 0")
        cur.execute(f"SET LOCAL maintenance_work_mem = '{_maintenance_mib(chunks)}MB'")
        cur.execute("SET LOCAL max_parallel_maintenance_workers = 2")
        started = time.monotonic()
        cur.execute(definition)
        took = time.monotonic() - started
    with connection.cursor() as cur:
        cur.execute("VACUUM (ANALYZE) evidence_chunk")
        cur.execute("SELECT pg_relation_size('chunk_embedding_hnsw')")
        size = cur.fetchone()[0] / 2**20
    return took, size


_EXACT_SQL = """
SELECT c.id FROM evidence_chunk c
WHERE c.tenant_id = %(tenant)s AND c.scope = ANY(%(scopes)s) AND c.is_current
ORDER BY c.embedding <=> %(qvec)s::vector, c.id LIMIT %(k)s
"""


def _exact_top(cur, params: dict) -> list[int]:
    """Brute force: the permitted rows' distances, no index scan (the HNSW index cannot answer)."""
    cur.execute("SET LOCAL enable_indexscan = off")
    cur.execute("SET LOCAL enable_indexonlyscan = off")
    cur.execute(_EXACT_SQL, {**params, "k": EXACT_K})
    return [r[0] for r in cur.fetchall()]


def _hnsw_plan(cur, params: dict) -> bool:
    """Whether the planner walks the HNSW index for the product's filtered HNSW query."""
    from apps.evidence import selectors

    cur.execute("EXPLAIN " + selectors._VEC_HNSW_SQL, params)
    return any("chunk_embedding_hnsw" in r[0] for r in cur.fetchall())


def _measure(bench: Bench, *, label: str, tenant_id: int, name: str, scopes: list[str],
             queries: list[str], qvecs: list[str], permitted: int, total: int) -> None:
    from django.db import connection, transaction

    from apps.evidence import selectors
    from apps.evidence.selectors import CANDIDATES, evidence_rank, text_candidates, vector_candidates

    ef_search = max(selectors.HNSW_EF_SEARCH, 2 * CANDIDATES)  # what vector_candidates sets for its HNSW scan
    stem = f"retrieval.{label}.{name}"
    share = f"{permitted:,} of {total:,} chunks permitted ({100 * permitted / total:.1f}%)"
    for query, qvec in zip(queries[:WARMUP], qvecs[:WARMUP], strict=True):
        evidence_rank(tenant_id=tenant_id, scopes=scopes, query=query, qvec=qvec, k=5)
    latency = []
    for query, qvec in zip(queries, qvecs, strict=True):
        started = time.perf_counter()
        evidence_rank(tenant_id=tenant_id, scopes=scopes, query=query, qvec=qvec, k=5)
        latency.append((time.perf_counter() - started) * 1000)

    strategies: Counter[str] = Counter()
    vec_ms, txt_ms, recall, hnsw_recall, hnsw_rows = [], [], [], [], []
    from django.utils import timezone

    from apps.evidence.embedding import model_configured

    params0 = {"tenant": tenant_id, "scopes": scopes, "cand": CANDIDATES, "now": timezone.now(),
               "emodel": model_configured()}
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT set_config('hnsw.ef_search', %s, true)", [str(ef_search)])
        planner_hnsw = _hnsw_plan(cur, {**params0, "qvec": qvecs[0]})
    for query, qvec in zip(queries, qvecs, strict=True):
        params = {**params0, "qvec": qvec}
        with transaction.atomic(), connection.cursor() as cur:
            started = time.perf_counter()
            ids, strategy = vector_candidates(cur, tenant_id=tenant_id, scopes=scopes, qvec=qvec, limit=CANDIDATES)
            vec_ms.append((time.perf_counter() - started) * 1000)
        strategies[strategy] += 1
        with transaction.atomic(), connection.cursor() as cur:
            started = time.perf_counter()
            text_candidates(cur, tenant_id=tenant_id, scopes=scopes, query=query, limit=CANDIDATES)
            txt_ms.append((time.perf_counter() - started) * 1000)
        with transaction.atomic(), connection.cursor() as cur:
            exact = _exact_top(cur, params)
        with transaction.atomic(), connection.cursor() as cur:
            # The product's HNSW query alone, without its exact fallback; the planner is made to walk
            # the index (on a selective filter it would rather sort the rows it filtered).
            cur.execute("SELECT set_config('hnsw.ef_search', %s, true)", [str(ef_search)])
            cur.execute("SET LOCAL enable_sort = off")
            cur.execute("SET LOCAL enable_bitmapscan = off")
            cur.execute(selectors._VEC_HNSW_SQL, params)
            hnsw = [r[0] for r in cur.fetchall()][:EXACT_K]
        if exact:
            recall.append(len(set(ids[:EXACT_K]) & set(exact)) / len(exact))
            hnsw_recall.append(len(set(hnsw) & set(exact)) / len(exact))
            hnsw_rows.append(len(hnsw))
    used = ", ".join(f"{s} ×{c}" for s, c in strategies.most_common())
    n = len(queries)
    bench.figure(f"{stem}.p50_ms", percentile(latency, 50), "ms",
                 f"evidence_rank k=5, {n} queries: count, vector and text candidates ({CANDIDATES} each), RRF, "
                 f"chunk fetch; {share}; vector strategy {used}")
    bench.figure(f"{stem}.p95_ms", percentile(latency, 95), "ms", f"max {max(latency):.1f} ms")
    bench.figure(f"{stem}.vector_p50_ms", percentile(vec_ms, 50), "ms",
                 f"vector_candidates alone (count included); p95 {percentile(vec_ms, 95):.1f} ms")
    bench.figure(f"{stem}.text_p50_ms", percentile(txt_ms, 50), "ms",
                 f"text_candidates alone; p95 {percentile(txt_ms, 95):.1f} ms")
    bench.figure(f"{stem}.recall_at_10", float(np.mean(recall)), "",
                 f"the product's vector top-10 against exact search (no index scan) over the permitted rows; "
                 f"strategy {used}")
    bench.figure(f"{stem}.hnsw_only_recall_at_10", float(np.mean(hnsw_recall)), "",
                 f"the filtered HNSW query alone, ef_search={ef_search}: {np.mean(hnsw_rows):.1f} rows of "
                 f"{EXACT_K} on average; the planner {'walks' if planner_hnsw else 'does not walk'} the index "
                 "by itself")


def run(bench: Bench, *, sizes=(10000, 100000)) -> None:
    """Grow tenant ``bench-retrieval`` to each of ``sizes`` chunks (ascending) and measure retrieval
    at each: figures ``retrieval.<size>.load_s`` and ``.index_build_s``, and per filter (``all``:
    every scope; ``1pct``: scope ``security`` only) ``retrieval.<size>.<filter>.p50_ms``,
    ``.p95_ms`` (milliseconds per query), ``.recall_at_10`` and ``.hnsw_only_recall_at_10``
    (0–1), ``.vector_p50_ms`` and ``.text_p50_ms``; ``<size>`` is written ``10k``, ``100k``.

    Runs in-process on the bench database (migrated; the tenant must not exist yet). Queries are
    embedded before timing; latency covers the ranking and the fetch, not the model. With
    ``bench.quick`` it asks 30 queries instead of 100. Raises SystemExit when the HNSW index is
    missing."""
    from django.db import connection

    from apps.accounts.models import Tenant
    from apps.evidence.embedding import embed_texts, model_configured
    from apps.evidence.selectors import vector_literal
    from apps.evidence.termstats import term_statistics_refresh

    phase_started = time.monotonic()
    sizes = sorted({int(s) for s in sizes})
    queries = [s + tail for tail in ("", FOLLOW_UP) for s in SYMPTOMS]
    if bench.quick:
        queries = queries[::3][:30]
    rng = np.random.default_rng(SEED)
    sentences = _kb_sentences()
    if len(sentences) > BASE_SENTENCES:
        sentences = [sentences[i] for i in sorted(rng.choice(len(sentences), BASE_SENTENCES, replace=False))]
    print(f"• retrieval: embedding {len(sentences)} knowledge-base sentences and {len(queries)} queries",
          flush=True)
    started = time.monotonic()
    base = np.asarray(embed_texts([t for _, t in sentences]), dtype=np.float32)
    qvecs = [vector_literal(v) for v in embed_texts(queries)]
    bench.figure("retrieval.embed_s", time.monotonic() - started, "s",
                 f"{model_configured()}, {len(sentences)} base sentences + {len(queries)} queries, once")
    corpus = _Corpus(sentences, base)
    definition = _index_definition()
    tenant = Tenant.objects.create(slug=TENANT_SLUG, name="Bench retrieval")
    have, docs = 0, 0
    for size in sizes:
        label = _label(size)
        print(f"• retrieval: loading {size - have:,} chunks (to {size:,})", flush=True)
        added, took = _load(tenant, corpus, first_doc=docs, n=size - have)
        docs += added
        bench.figure(f"retrieval.{label}.load_s", took, "s",
                     f"{size - have:,} chunks in {added:,} documents: binary COPY, search_vector filled in SQL; "
                     f"{(size - have) / took:,.0f} chunks/s; HNSW index dropped")
        have = size
        build, mib = _build_index(definition, size)
        params = re.search(r"WITH \((.*)\)", definition)
        bench.figure(f"retrieval.{label}.index_build_s", build, "s",
                     f"HNSW {params.group(1) if params else ''} over {size:,} chunks, "
                     f"maintenance_work_mem={_maintenance_mib(size)}MB, "
                     f"max_parallel_maintenance_workers=2; {mib:,.0f} MiB")
        started = time.monotonic()
        stored = term_statistics_refresh(tenant.pk)
        bench.figure(f"retrieval.{label}.term_statistics_s", time.monotonic() - started, "s",
                     f"term_statistics_refresh (what the beat job runs after a change): {stored:,} rows")
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FILTER (WHERE scope = 'security'), count(*) FROM evidence_chunk "
                        "WHERE tenant_id = %s AND is_current", [tenant.pk])
            security, total = cur.fetchone()
        for name, scopes in FILTERS.items():
            print(f"• retrieval: {label} {name}", flush=True)
            _measure(bench, label=label, tenant_id=tenant.pk, name=name, scopes=scopes, queries=queries,
                     qvecs=qvecs, permitted=total if name == "all" else security, total=total)
    bench.figure("retrieval.elapsed_s", time.monotonic() - phase_started, "s", "the whole retrieval phase")
