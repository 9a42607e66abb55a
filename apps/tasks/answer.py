"""Compose the task's answer from recorded state only (DESIGN.md §1 steps 8–9; spec table 16.5
"receipt recorded, before the answer: rebuild the answer from the receipt").

The three results stay apart: ``knowledge`` (the sourced answer), ``proposal`` (what was proposed
for review) and ``change`` (what the ticket system confirmed with a receipt). ``change`` is only
ever filled from a receipt.
"""

from __future__ import annotations

from apps.evidence.chunking import excerpt_body


def citations_from_evidence(evidence: list[dict]) -> list[dict]:
    """Citations ``{n, chunk_id, document_title, version, section, source}`` in retrieval order."""
    return [
        {
            "n": i,
            "chunk_id": ref["chunk_id"],
            "document_id": ref["document_id"],
            "document_title": ref["document_title"],
            "version": ref["version"],
            "section": ref["section"],
            "source": ref["source"],
        }
        for i, ref in enumerate(evidence, start=1)
    ]


def answer_compose(state: dict) -> dict:
    """Build ``{"knowledge": {"text", "citations"}, "proposal": {...}|None, "change": {...}|None,
    "status_note": str}`` from a reducer state. Pure: same state, same answer."""
    evidence = state.get("evidence") or []
    device = state.get("device") or {}
    citations = citations_from_evidence(evidence)
    lines = []
    if device:
        lines.append(
            f"{device.get('asset_tag')} was {device.get('state')} at object version {device.get('version')}"
            + (f" with alert {device['alert_code']}" if device.get("alert_code") else "")
            + "."
        )
    for c, ref in zip(citations, evidence, strict=False):
        excerpt = " ".join(excerpt_body(ref["excerpt"]).split())
        lines.append(f"[{c['n']}] {c['document_title']} (v{c['version']}, §{c['section']}): {excerpt[:220]}")
    proposal = state.get("proposal")
    receipt = state.get("receipt")
    if receipt and receipt.get("kind") == "comment":
        change = {"ticket_id": receipt["ticket_id"], "ticket_version": receipt["version"], "comment_id":
                  receipt["external_id"], "connector": receipt.get("connector", "reference"), "status": "commented"}
        note = (f"Your report was added to the open ticket {receipt['ticket_id']} as comment {receipt['external_id']} "
                f"(receipt recorded, ticket version {receipt['version']}); no second ticket was created.")
    elif receipt:
        change = {"ticket_id": receipt["external_id"], "ticket_version": receipt["version"],
                  "connector": receipt.get("connector", "reference"), "status": receipt.get("status")}
        note = f"Ticket {receipt['external_id']} was created (receipt recorded, version {receipt['version']})."
    else:
        change = None
        reason = state.get("termination_reason") or ""
        if reason == "proposal_rejected":
            note = "No ticket was created: the approver rejected the proposed ticket."
        else:
            note = "No ticket has been created."
    return {
        "knowledge": {"text": "\n".join(lines), "citations": citations},
        "proposal": (
            {"tool": proposal["tool"], "params": proposal["params"], "digest": proposal["digest"]}
            if proposal else None
        ),
        "change": change,
        "status_note": note,
    }
