"""A child process of the ledger concurrency test: ``python -m tests.ledger_worker TASK_ID N SEED
GO_FILE`` makes ``N`` reservations against one task — each settled at a random cost ``c ≤ r`` or
released — as soon as ``GO_FILE`` exists, and prints a JSON summary on its last line."""

from __future__ import annotations

import json
import os
import random
import sys
import time
import uuid
from pathlib import Path


def main() -> None:
    task_id, n, seed, go = uuid.UUID(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
    import django

    django.setup()
    from apps.tasks.budget import budget_release, budget_reserve, budget_settle
    from apps.tasks.usage import BudgetExceeded

    rng = random.Random(seed)
    actor = f"ledger-worker:{seed}"
    summary = {"admitted": 0, "refused": 0, "settled_money": 0, "settled_tokens": 0, "released": 0}
    while not go.exists():
        time.sleep(0.01)
    for _ in range(n):
        amounts = {"money": rng.randint(1, 15), "tokens": rng.randint(0, 400)}
        try:
            _, res = budget_reserve(task_id=task_id, activity="probe", amounts=amounts, actor=actor)
        except BudgetExceeded:
            summary["refused"] += 1
            time.sleep(rng.uniform(0, 0.005))
            continue
        summary["admitted"] += 1
        time.sleep(rng.uniform(0, 0.01))  # the activity runs while others reserve
        if rng.random() < 0.2:
            budget_release(task_id=task_id, reservation_ids=[res.id], reason="probe: not needed", actor=actor)
            summary["released"] += 1
            continue
        used = {"money": rng.randint(0, amounts["money"]), "tokens": rng.randint(0, amounts["tokens"])}
        budget_settle(task_id=task_id, reservation_id=res.id, used=used, actor=actor)
        summary["settled_money"] += used["money"]
        summary["settled_tokens"] += used["tokens"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
