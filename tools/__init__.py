"""Everything that is not the product: the development stack (``python -m tools.devstack``), the demo
client and demo data, the chaos run and the bench, and the stand-ins for external systems the product
talks to (the reference ticket service, the django-helpdesk project, the fault proxy, the scripted
model server). Code here imports ``apps`` and ``config`` freely; nothing under ``apps/`` or
``config/`` imports ``tools``."""
