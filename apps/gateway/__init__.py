"""The tool gateway (spec agent-execution-system.md §16.6, §16.10; DESIGN.md §9, §11; ADR 0022): every
call faultdesk makes out of its process goes through here — the ticket systems, the hosted model, the
remote embedding model and the SMTP relay. Per tool it knows the destinations it may reach, the
credential it injects and the caps on what comes back, and it records each call's outcome class."""
