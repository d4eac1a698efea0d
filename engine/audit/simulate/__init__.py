"""Stage 2b, the simulated prefix caches: the serving engines (``caches``), hosted providers (``hosted``), fleets of
replicas (``fleet``), the one step that feeds a request to all of them (``step``), and what servers reported set
beside them (``observed``, ``metrics``)."""
