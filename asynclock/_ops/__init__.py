"""Operations beside the core: the stats endpoint a process opts into (``serve_stats``),
read by the operator CLI (``asynclock stats``/``advise --from``)."""
